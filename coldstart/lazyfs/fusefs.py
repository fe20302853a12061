"""The FUSE file system of the FUSE server: one per node, one top directory per layer.

The server mounts this file system at ``<root>/fuse`` (like a shared-mode Nydus daemon), and
again at ``<root>/fuse-plain``: a second connection that answers no getxattr, so the kernel
stops asking (overlayfs asks every lower file and directory for its ``trusted.overlay.*``
attributes: a round trip each; listxattr is still answered). A layer that shows none (no
attribute in its TOC, no opaque directory, no file a loader asks a token of:
``*.safetensors``) is served from the second (:attr:`~coldstart.lazyfs.tree.LayerTree.plain`).
Each lazily mounted layer is a directory ``<mount>/<key>`` that the server bind-mounts onto the
snapshot's mountpoint; both mounts show every layer. :mod:`coldstart.lazyfs.fusewire` speaks the
kernel protocol and calls the operations here from its connections' threads.

Everything but file contents is answered from the layer's verified TOC, in memory, without the
network: lookup (including cached negative lookups), getattr, readdirplus, readlink, getxattr,
listxattr, statfs. Each layer's inode table, and the answers worked out from it (whiteouts,
hidden landmarks, hardlinks, bounded caches), is its :class:`~coldstart.lazyfs.tree.LayerTree`;
:class:`FuseFS` keeps the table of served layers (inode ranges, copy on write) and turns tree
entries into attributes. Layers are immutable, so the kernel may cache entries, attributes,
listings and pages for long (``entry_timeout``, ``attr_timeout``; files are opened without asking
the server, which keeps their pages).

A read is first tried in the session's loop against the chunk cache's in-memory index (a
``pread`` per chunk, nothing else that can block); what that cannot serve runs the blocking
:class:`~coldstart.lazyfs.reader.LayerReader` in one of the session's worker threads, so a slow
fetch never blocks metadata requests. Errors become the errno of their ColdstartError kind; an
unexpected exception is logged with the layer digest and path, counted (``on_error``) and
answered ``EIO`` (on the read fast path it first falls back to the slow path).
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import functools
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterator, Sequence

from coldstart.errors import ColdstartError, FailedPrecondition
from coldstart.format.toc import Entry
from coldstart.lazyfs.filewire import FILE_XATTR, NODE_XATTR
from coldstart.lazyfs.fusewire import (
    ENOATTR,
    ROOT_INODE,
    Attr,
    FuseError,
    FuseSession,
    Later,
    Listed,
    StatFs,
    entry_times,
    listed,
    pack_entry,
)
from coldstart.lazyfs.reader import LayerReader, PartialRead
from coldstart.lazyfs.tree import LayerTree

__all__ = ["FSNAME", "INTERNAL_ERROR", "FuseFS", "fuse_adopt", "fuse_mount"]

log = logging.getLogger(__name__)

_TYPE_BITS = {
    "dir": stat.S_IFDIR,
    "reg": stat.S_IFREG,
    "symlink": stat.S_IFLNK,
    "char": stat.S_IFCHR,
    "block": stat.S_IFBLK,
    "fifo": stat.S_IFIFO,
}
_FILE_XATTR = FILE_XATTR.encode()
_TOKEN_XATTRS = (_FILE_XATTR, NODE_XATTR.encode())
#: Top-level (per layer) names come and go; the kernel re-checks them after this long.
_TOP_ENTRY_TIMEOUT = 1.0
_BLKSIZE = 128 << 10
_DEBUG = os.environ.get("COLDSTART_FUSE_DEBUG") == "1"
#: the mount's source, as ``mount`` and ``/proc/self/mountinfo`` show it
FSNAME = "coldstart-lazy"
#: the ``kind`` an unexpected handler exception is counted under
INTERNAL_ERROR = "internal"


class FuseFS:
    """The operations :class:`~coldstart.lazyfs.fusewire.FuseSession` serves, over every
    mounted layer. The session's thread calls them; layers are added and removed from the
    server's trio loop: the layer table is replaced whole (copy on write), never changed in
    place under a reader."""

    def __init__(self, *, entry_timeout: float = 86400.0, attr_timeout: float = 86400.0,
                 read_threads: int = 16, on_error: Callable[[str], None] | None = None) -> None:
        self._on_error = on_error
        #: unexpected exceptions met by handlers (each answered EIO or served the slow way;
        #: counted from the loop and the read workers alike, under a lock of its own)
        self.internal_errors = 0
        self._errors_lock = threading.Lock()
        self.entry_timeout = entry_timeout
        self.attr_timeout = attr_timeout
        #: worker threads for reads that need the chunk cache's slow path or the network
        self.read_threads = max(1, read_threads)
        #: key -> tree, and (sorted bases, base -> tree): replaced whole under _table_lock
        self._layers: dict[str, LayerTree] = {}
        self._table: tuple[list[int], dict[int, LayerTree]] = ([], {})
        self._table_lock = threading.Lock()
        self._next_base = ROOT_INODE + 1
        self._alloc_lock = threading.Lock()
        self._root_attr = self._make_root_attr()
        #: (layer digest, slot, size) -> the file token ``getxattr(FILE_XATTR)`` answers with
        #: (the files socket's); None: the attribute does not exist
        self.file_token: Callable[[str, int, int], bytes] | None = None
        #: the connections served (None before their mount and after their end): the one
        #: that answers extended attributes, and the one that does not (plain layers')
        self.session: FuseSession | None = None
        self.plain_session: FuseSession | None = None

    # -- layer table -----------------------------------------------------------------------

    def reserve(self, end: int) -> None:
        """Never allocate below ``end`` (inode ranges a predecessor used)."""
        with self._alloc_lock:
            self._next_base = max(self._next_base, end)

    def allocate(self, count: int, base: int | None = None) -> int:
        """Reserve ``count`` inode numbers for a new layer (never reused): the next free ones,
        or from ``base`` (a layer a predecessor served there; later ones come after it)."""
        with self._alloc_lock:
            if base is None:
                base = self._next_base
            self._next_base = max(self._next_base, base + count + 1)
            return base

    def add(self, tree: LayerTree) -> None:
        """Make ``tree`` visible as ``<mount>/<tree.key>``."""
        with self._table_lock:
            if tree.key in self._layers:
                raise ColdstartError(f"layer key {tree.key!r} is taken")
            bases, by_base = self._table
            self._table = (sorted([*bases, tree.base]), {**by_base, tree.base: tree})
            self._layers = {**self._layers, tree.key: tree}

    def remove(self, key: str) -> LayerTree | None:
        """Drop a layer; the kernel is told to forget its top-level name."""
        with self._table_lock:
            tree = self._layers.get(key)
            if tree is None:
                return None
            bases, by_base = self._table
            self._table = ([b for b in bases if b != tree.base],
                           {b: t for b, t in by_base.items() if b != tree.base})
            self._layers = {k: t for k, t in self._layers.items() if k != key}
        tree.reader.close()
        for session in self.sessions():
            # in a thread of its own, like libfuse's: the kernel may hold the entry while a
            # request about it waits for the session's loop
            threading.Thread(target=_forget_name, args=(session, os.fsencode(key)),
                             daemon=True, name=f"invalidate-{key}").start()
        return tree

    def layers(self) -> list[LayerTree]:
        return list(self._layers.values())

    def sessions(self) -> list[FuseSession]:
        """The connections served now."""
        return [s for s in (self.session, self.plain_session) if s is not None]

    def file_at(self, digest: str, slot: int) -> tuple[LayerReader, Entry] | None:
        """The reader of the served layer ``digest`` and the entry shown at ``slot`` (None:
        no such layer or slot). Safe from any thread."""
        for tree in self._layers.values():
            if tree.reader.digest == digest:
                try:
                    return tree.reader, tree.entry(slot)
                except IndexError:
                    return None
        return None

    def store_pages(self, inode: int, offset: int, data: bytes | memoryview) -> None:
        """Put ``data`` into the kernel's page cache of ``inode`` at ``offset`` (FUSE
        ``NOTIFY_STORE``): reads of those pages then never reach this process. The kernel must
        know the inode (looked up); OSError otherwise, and while no connection is served.
        Never call it from the session's thread: it may wait for a page that a read in
        flight holds locked."""
        try:
            plain = self._tree(inode).plain
        except FuseError as exc:
            raise OSError(exc.errno, "no such inode served") from None
        session = self.plain_session if plain else self.session
        if session is None:
            raise OSError(errno.ENOTCONN, "no FUSE connection is served")
        session.notify_store(inode, offset, data)

    def internal_error(self, op: str, inode: int | None, exc: BaseException) -> None:
        """Log an unexpected exception with the layer digest and path, and count it."""
        digest, path = "-", "?"
        if inode == ROOT_INODE:
            path = "/"
        elif inode is not None:
            with contextlib.suppress(Exception):
                tree = self._tree(inode)
                digest = tree.reader.digest
                path = "/" + tree.entry(inode - tree.base).name
        log.error("layer %s: %s of %r (inode %s) failed unexpectedly: %s: %s", digest, op, path,
                  inode, type(exc).__name__, exc, exc_info=exc)
        with self._errors_lock:
            self.internal_errors += 1
        if self._on_error is not None:
            with contextlib.suppress(Exception):
                self._on_error(INTERNAL_ERROR)

    def unexpected(self, op: str, inode: int, exc: BaseException) -> int:
        """The errno a handler's exception is answered with: a ColdstartError's own (the
        reader already logged the reason, with the layer digest and chunk); anything else
        is logged with the layer and path, counted, and answered ``EIO``."""
        if isinstance(exc, ColdstartError):
            return exc.errno
        self.internal_error(op, inode, exc)
        return errno.EIO

    def _tree(self, inode: int) -> LayerTree:
        bases, by_base = self._table
        i = bisect.bisect_right(bases, inode) - 1
        if i >= 0:
            tree = by_base[bases[i]]
            if inode < tree.end:
                return tree
        raise FuseError(errno.ESTALE if inode > ROOT_INODE else errno.ENOENT)

    # -- attributes ------------------------------------------------------------------------

    def _make_root_attr(self) -> Attr:
        a = Attr()
        a.st_ino = ROOT_INODE
        a.st_mode = stat.S_IFDIR | 0o755
        a.st_nlink = 2
        a.st_blksize = _BLKSIZE
        a.entry_timeout = _TOP_ENTRY_TIMEOUT
        a.attr_timeout = _TOP_ENTRY_TIMEOUT
        return a

    def _fields(self, tree: LayerTree, inode: int) -> tuple[int, int, int, int, int, int, int]:
        """(mode, nlink, uid, gid, rdev, size, mtime in ns) of ``inode``, from the layer's
        TOC: one place for what an attribute answer and a listing's entry show."""
        i = inode - tree.base
        e = tree.stat(i)
        t = e.type
        if t == "reg":
            size = e.size
        elif t == "dir":
            size = 4096
        elif t == "symlink":
            size = len(os.fsencode(e.link_name))
        else:
            size = 0
        rdev = os.makedev(e.dev_major, e.dev_minor) if t in ("char", "block") else 0
        return (_TYPE_BITS[t] | (e.mode & 0o7777), tree.nlink_of(i), e.uid, e.gid, rdev, size,
                max(0, e.mtime_ns))

    def _attr(self, tree: LayerTree, inode: int) -> Attr:
        a = tree.attrs.get(inode)
        if a is not None:
            return a
        a = Attr()
        a.st_ino = inode
        a.generation = 0
        a.st_mode, a.st_nlink, a.st_uid, a.st_gid, a.st_rdev, a.st_size, mtime_ns = \
            self._fields(tree, inode)
        a.st_blksize = _BLKSIZE
        a.st_blocks = (a.st_size + 511) // 512
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = mtime_ns
        # the layer's root: its name at the top level may go away
        a.entry_timeout = _TOP_ENTRY_TIMEOUT if inode == tree.root else self.entry_timeout
        a.attr_timeout = self.attr_timeout
        return tree.remember(tree.attrs, inode, a)

    def _negative(self) -> Attr:
        a = Attr()
        a.st_ino = 0
        a.entry_timeout = self.entry_timeout
        return a

    # -- metadata operations ---------------------------------------------------------------

    def lookup(self, parent_inode: int, name: bytes) -> Attr:
        if parent_inode == ROOT_INODE:
            if name in (b".", b".."):
                return self._root_attr
            tree = self._layers.get(os.fsdecode(name))
            if tree is None:
                raise FuseError(errno.ENOENT)
            return self._attr(tree, tree.root)
        tree = self._tree(parent_inode)
        tree.reader.fetcher.note_read()     # busy: cache writes and the fill wait
        if name == b".":
            return self._attr(tree, parent_inode)
        if name == b"..":
            p = tree.parent_of(parent_inode - tree.base)
            return self._root_attr if p == ROOT_INODE else self._attr(tree, p)
        kids = tree.kids(parent_inode)
        if kids is None:
            raise FuseError(errno.ENOTDIR)
        ino = kids.get(name)
        if ino is None:
            return self._negative()
        return self._attr(tree, ino)

    def getattr(self, inode: int) -> Attr:
        if inode == ROOT_INODE:
            return self._root_attr
        tree = self._tree(inode)
        tree.reader.fetcher.note_read()     # busy: see lookup
        return self._attr(tree, inode)

    def readlink(self, inode: int) -> bytes:
        tree = self._tree(inode)
        e = tree.entry(inode - tree.base)
        if e.type != "symlink":
            raise FuseError(errno.EINVAL)
        return os.fsencode(e.link_name)

    def opendir(self, inode: int) -> bool:
        """Whether the kernel may cache the listing (a layer's never changes; the top
        directory's does)."""
        if inode == ROOT_INODE:
            return False
        tree = self._tree(inode)
        if tree.kids(inode) is None:
            raise FuseError(errno.ENOTDIR)
        return True

    def readdir(self, inode: int, start: int, plus: bool) -> Iterator[Listed]:
        """The entries of directory ``inode`` from position ``start`` on, with the position
        after each; ``plus``: with their attributes, packed as they are made (a ``find``
        lists every entry of the layer once: neither an :class:`Attr` nor a cached answer
        is made for each)."""
        if inode == ROOT_INODE:
            tops = sorted(self._layers.items())
            for i in range(start, len(tops)):
                key, tree = tops[i]
                yield listed(os.fsencode(key), self._attr(tree, tree.root), i + 1, plus)
            return
        tree = self._tree(inode)
        tree.reader.fetcher.note_read()     # busy: see lookup (a find lists, looks nothing up)
        items = tree.listing_of(inode)
        times = entry_times(self.entry_timeout, self.attr_timeout)
        fields = self._fields
        for i in range(start, len(items)):
            name, ino = items[i]
            if not plus:
                yield name, ino, _TYPE_BITS[tree.stat(ino - tree.base).type] >> 12, b"", i + 1
                continue
            mode, nlink, uid, gid, rdev, size, mtime_ns = fields(tree, ino)
            yield (name, ino, mode >> 12,
                   pack_entry(ino, times, mode, nlink, uid, gid, rdev, size, mtime_ns, _BLKSIZE),
                   i + 1)

    def getxattr(self, inode: int, name: bytes) -> bytes:
        if inode == ROOT_INODE:
            raise FuseError(ENOATTR)
        tree = self._tree(inode)
        if name in _TOKEN_XATTRS and self.file_token is not None:
            slot = inode - tree.base
            e = tree.entry(slot)
            if e.type == "reg":     # never listed: see coldstart.lazyfs.filewire
                return self.file_token(tree.reader.digest, slot, e.size)
        value = tree.xattrs_of(inode).get(name)
        if value is None:
            raise FuseError(ENOATTR)
        return value

    def listxattr(self, inode: int) -> Sequence[bytes]:
        if inode == ROOT_INODE:
            return []
        tree = self._tree(inode)
        return list(tree.xattrs_of(inode))

    def access(self, inode: int, mask: int) -> None:
        if mask & os.W_OK:
            raise FuseError(errno.EROFS)

    def statfs(self) -> StatFs:
        trees = list(self._layers.values())
        total = sum(t.total_size for t in trees)
        files = sum(len(t.entries) for t in trees)
        return StatFs(blocks=max(1, (total + 4095) // 4096), files=max(1, files),
                      bsize=4096, frsize=4096, namelen=255)

    # -- data ------------------------------------------------------------------------------

    def read(self, inode: int, off: int, size: int) -> bytes | Later:
        """File contents: answered in the session's loop when the chunk cache's in-memory
        index has every chunk (a ``pread`` each; a thread hop costs more than that); else a
        :class:`Later` that one worker finishes where the loop stopped (same chunk map, no
        chunk looked up twice): cache, single flight, fetch, deadline. Files are opened
        without the server (``OPEN`` is answered ENOSYS), so ``inode`` is the file's."""
        tree = self._tree(inode)
        entry = tree.entries[inode - tree.base]
        if entry.type != "reg":
            raise FuseError(errno.EISDIR if entry.type == "dir" else errno.EINVAL)
        tree.reader.stats.fuse_reads += 1   # this loop alone counts: no lock
        if off >= entry.size:
            return b""
        if _DEBUG:
            log.debug("read size %d at %d of %r", size, off, entry.name)
        partial: PartialRead | None = None
        try:
            got = tree.reader.read_cached(entry, off, size)
        except ColdstartError:
            got = None
        except Exception as exc:  # a broken cache must not fail a read the network can serve
            self.internal_error("read (cached)", inode, exc)
            got = None
        if isinstance(got, bytes):
            return got
        if isinstance(got, PartialRead):
            partial = got
        # a ColdstartError becomes its errno (the reader already logged the reason with the
        # layer digest and chunk); anything else is logged by unexpected() and answered EIO
        return Later(functools.partial(tree.reader.read_pieces, entry, off, size, partial))


def _forget_name(session: FuseSession, name: bytes) -> None:
    try:
        session.invalidate_entry(ROOT_INODE, name)
    except OSError as exc:  # best effort: the entry expires anyway
        log.debug("invalidate %r: %s", name, exc)


# -- session ---------------------------------------------------------------------------------

def fuse_mount(fs: FuseFS, mountpoint: str, *, plain: bool = False) -> FuseSession:
    """Mount ``fs`` at ``mountpoint`` (read-only, shared with every user, kernel permission
    checks, setuid and devices honoured: images carry both); ``plain``: as the connection
    that answers no extended attributes. FailedPrecondition if it cannot."""
    try:
        session = FuseSession.mount(fs, mountpoint, fsname=FSNAME, subtype="coldstart",
                                    options=("default_permissions", "allow_other"),
                                    read_threads=fs.read_threads, xattrs=not plain)
    except (OSError, ColdstartError) as exc:
        raise FailedPrecondition(f"cannot mount the FUSE file system at {mountpoint}: "
                                 f"{exc}") from exc
    _attach(fs, session, plain)
    return session


def fuse_adopt(fs: FuseFS, fd: int, *, plain: bool = False) -> FuseSession:
    """Serve ``fs`` on the connection ``fd`` a dead predecessor left (see
    :mod:`coldstart.lazyfs.handover`); ``plain`` as in :func:`fuse_mount`."""
    session = FuseSession.adopt(fd, fs, read_threads=fs.read_threads, xattrs=not plain)
    _attach(fs, session, plain)
    return session


def _attach(fs: FuseFS, session: FuseSession, plain: bool) -> None:
    if plain:
        fs.plain_session = session
    else:
        fs.session = session
