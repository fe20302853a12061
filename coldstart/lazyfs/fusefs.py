"""The FUSE file system of the FUSE server: one mount per node, one top directory per layer.

pyfuse3 serves one mount per process, so the server mounts this file system once at
``<root>/fuse`` (like a shared-mode Nydus daemon); each lazily mounted layer is a directory
``<root>/fuse/<key>`` that the server bind-mounts onto the snapshot's mountpoint.

Everything but file contents is answered from the layer's verified TOC, in memory, without the
network: lookup (including cached negative lookups), getattr, readdirplus, readlink, getxattr,
listxattr, statfs. Layers are immutable, so the kernel may cache entries, attributes and pages
for long (``entry_timeout``, ``attr_timeout``, ``keep_cache``). Whiteouts are shown the way
overlayfs expects in a lower directory: ``.wh.<name>`` is a 0/0 character device ``<name>``,
``.wh..wh..opq`` sets ``trusted.overlay.opaque=y`` on its directory; both ``.wh.`` entries and
the prefetch landmarks are hidden.

A read is first tried on the loop against the chunk cache's in-memory index (a ``pread`` per
chunk, nothing else that can block); what that cannot serve runs the blocking
:class:`LayerReader` in one worker thread call (bounded by a limiter), so a slow fetch never
blocks metadata requests. Errors become the errno of their ColdstartError kind.
Every handler answers with an errno, whatever it meets: pyfuse3 re-raises anything but a
``FUSEError`` out of ``pyfuse3.main()``, which would end the server and every mount of the node.
An unexpected exception is logged with the layer digest and path, counted (``on_error``) and
answered ``EIO``; on the read fast path it first falls back to the slow path.
This is the only module that imports pyfuse3 (CONVENTIONS §2).
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
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar

import pyfuse3
import trio

from coldstart.errors import ColdstartError, FailedPrecondition
from coldstart.format.toc import NO_PREFETCH_LANDMARK, PREFETCH_LANDMARK, Entry
from coldstart.lazyfs.reader import LayerReader, PartialRead

__all__ = ["FuseFS", "LayerTree", "build_tree", "mount_options", "set_read_ahead"]

log = logging.getLogger(__name__)

_TYPE_BITS = {
    "dir": stat.S_IFDIR,
    "reg": stat.S_IFREG,
    "symlink": stat.S_IFLNK,
    "char": stat.S_IFCHR,
    "block": stat.S_IFBLK,
    "fifo": stat.S_IFIFO,
}
_WHITEOUT = ".wh."
_OPAQUE = ".wh..wh..opq"
_OPAQUE_XATTR = b"trusted.overlay.opaque"
_HIDDEN = {PREFETCH_LANDMARK, NO_PREFETCH_LANDMARK}
#: Top-level (per layer) names come and go; the kernel re-checks them after this long.
_TOP_ENTRY_TIMEOUT = 1.0
_BLKSIZE = 128 << 10
_DEBUG = os.environ.get("COLDSTART_FUSE_DEBUG") == "1"
#: the ``kind`` an unexpected handler exception is counted under
INTERNAL_ERROR = "internal"

_P = ParamSpec("_P")
_R = TypeVar("_R")


def mount_options(fsname: str = "coldstart-lazy") -> set[str]:
    """pyfuse3 mount options: read-only, shared with every user, suid/dev allowed (images
    carry setuid binaries and device nodes), kernel permission checks."""
    return {f"fsname={fsname}", "subtype=coldstart", "ro", "default_permissions",
            "allow_other", "suid", "dev", "noatime"}


@dataclass
class LayerTree:
    """The in-memory inode table of one mounted layer (inodes ``base .. base+len-1``)."""

    key: str
    base: int
    reader: LayerReader
    entries: list[Entry]                       # index = inode - base
    parents: list[int]                         # parent inode of each (root: ROOT_INODE)
    children: dict[int, dict[bytes, int]]      # dir inode -> name -> inode
    listing: dict[int, list[tuple[bytes, int]]]  # dir inode -> sorted (name, inode)
    xattrs: dict[int, dict[bytes, bytes]]
    nlink: list[int]
    total_size: int
    attrs: dict[int, pyfuse3.EntryAttributes] = field(default_factory=dict)

    @property
    def root(self) -> int:
        return self.base

    @property
    def end(self) -> int:
        return self.base + len(self.entries)


def build_tree(key: str, base: int, reader: LayerReader) -> LayerTree:
    """Index a layer's TOC as inodes (pure; runs in a worker thread for big layers)."""
    toc = reader.layer.toc
    entries: list[Entry] = [toc.entries[""]]
    index: dict[str, int] = {"": 0}
    hardlinks: list[Entry] = []
    opaque: list[str] = []
    whiteouts: list[Entry] = []
    for name in sorted(toc.entries):
        if not name:
            continue
        e = toc.entries[name]
        bn = e.basename
        if bn == _OPAQUE:
            opaque.append(e.parent)
            continue
        if bn.startswith(_WHITEOUT):
            whiteouts.append(e)
            continue
        if not e.parent and bn in _HIDDEN:
            continue
        if e.type == "hardlink":
            hardlinks.append(e)
            continue
        index[name] = len(entries)
        entries.append(e)
    for w in whiteouts:
        real = (w.parent + "/" if w.parent else "") + w.basename[len(_WHITEOUT):]
        if real in index or not w.basename[len(_WHITEOUT):]:
            continue  # the layer both deletes and adds the name: the added one wins
        index[real] = len(entries)
        entries.append(Entry(name=real, type="char", mode=0, uid=0, gid=0,
                             mtime_ns=w.mtime_ns, dev_major=0, dev_minor=0))
    nlink = [1] * len(entries)
    link_index: dict[str, int] = {}
    for h in hardlinks:
        try:
            target = reader.layer.resolve(h.name)
        except ColdstartError as exc:
            log.warning("layer %s: hardlink %r skipped: %s", reader.digest, h.name, exc)
            continue
        i = index.get(target.name)
        if i is None:
            continue
        link_index[h.name] = i
        nlink[i] += 1
    parents = [pyfuse3.ROOT_INODE] * len(entries)
    children: dict[int, dict[bytes, int]] = {}
    total = 0
    for i, e in enumerate(entries):
        if e.type == "dir":
            children.setdefault(base + i, {})
            nlink[i] = 2
        total += e.size if e.type == "reg" else 0
    all_names = list(index.items()) + list(link_index.items())
    for name, i in all_names:
        if not name:
            continue
        parent, _, bn = name.rpartition("/")
        p = index.get(parent)
        if p is None or entries[p].type != "dir":
            continue
        children[base + p][os.fsencode(bn)] = base + i
        if name in index:
            parents[i] = base + p
        if entries[i].type == "dir" and name in index:
            nlink[p] += 1
    xattrs: dict[int, dict[bytes, bytes]] = {}
    for i, e in enumerate(entries):
        if e.xattrs:
            xattrs[base + i] = {os.fsencode(k): v for k, v in e.xattrs.items()}
    for d in opaque:
        i = index.get(d)
        if i is not None and entries[i].type == "dir":
            xattrs.setdefault(base + i, {})[_OPAQUE_XATTR] = b"y"
    listing = {ino: sorted(kids.items()) for ino, kids in children.items()}
    return LayerTree(key=key, base=base, reader=reader, entries=entries, parents=parents,
                     children=children, listing=listing, xattrs=xattrs, nlink=nlink,
                     total_size=total)


def _guarded(op: Callable[Concatenate[FuseFS, _P], Awaitable[_R]]
             ) -> Callable[Concatenate[FuseFS, _P], Coroutine[Any, Any, _R]]:
    """Make a handler answer an errno whatever happens (see the module docstring)."""
    @functools.wraps(op)
    async def handler(self: FuseFS, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return await op(self, *args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except ColdstartError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        except Exception as exc:
            inode = args[0] if args and isinstance(args[0], int) else None
            self.internal_error(op.__name__, inode, exc)
            raise pyfuse3.FUSEError(errno.EIO) from None
    return handler


class FuseFS(pyfuse3.Operations):
    """pyfuse3 operations over every mounted layer; add/remove layers from the trio loop."""

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, *, entry_timeout: float = 86400.0, attr_timeout: float = 86400.0,
                 read_threads: int = 16, on_error: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self._on_error = on_error
        #: unexpected exceptions met by handlers (each answered EIO or served the slow way)
        self.internal_errors = 0
        self.entry_timeout = entry_timeout
        self.attr_timeout = attr_timeout
        self._limiter = trio.CapacityLimiter(max(1, read_threads))
        self._layers: dict[str, LayerTree] = {}
        self._bases: list[int] = []
        self._by_base: dict[int, LayerTree] = {}
        self._next_base = pyfuse3.ROOT_INODE + 1
        self._alloc_lock = threading.Lock()
        self._root_attr = self._make_root_attr()

    # -- layer table -----------------------------------------------------------------------

    def allocate(self, count: int) -> int:
        """Reserve ``count`` inode numbers for a new layer (never reused)."""
        with self._alloc_lock:
            base = self._next_base
            self._next_base += count + 1
            return base

    def add(self, tree: LayerTree) -> None:
        """Make ``tree`` visible as ``<mount>/<tree.key>``."""
        if tree.key in self._layers:
            raise ColdstartError(f"layer key {tree.key!r} is taken")
        self._layers[tree.key] = tree
        bisect.insort(self._bases, tree.base)
        self._by_base[tree.base] = tree

    def remove(self, key: str) -> LayerTree | None:
        """Drop a layer; the kernel is told to forget its top-level name."""
        tree = self._layers.pop(key, None)
        if tree is None:
            return None
        self._bases.remove(tree.base)
        del self._by_base[tree.base]
        tree.reader.close()
        try:
            pyfuse3.invalidate_entry_async(pyfuse3.ROOT_INODE, os.fsencode(key),
                                           ignore_enoent=True)
        except Exception as exc:  # best effort: the entry expires anyway
            log.debug("invalidate %s: %s", key, exc)
        return tree

    def layers(self) -> list[LayerTree]:
        return list(self._layers.values())

    def internal_error(self, op: str, inode: int | None, exc: BaseException) -> None:
        """Log an unexpected exception with the layer digest and path, and count it."""
        digest, path = "-", "?"
        if inode == pyfuse3.ROOT_INODE:
            path = "/"
        elif inode is not None:
            with contextlib.suppress(Exception):
                i = bisect.bisect_right(self._bases, inode) - 1
                tree = self._by_base[self._bases[i]] if i >= 0 else None
                if tree is not None and inode < tree.end:
                    digest = tree.reader.digest
                    path = "/" + tree.entries[inode - tree.base].name
        log.error("layer %s: %s of %r (inode %s) failed unexpectedly: %s: %s", digest, op, path,
                  inode, type(exc).__name__, exc, exc_info=exc)
        self.internal_errors += 1
        if self._on_error is not None:
            with contextlib.suppress(Exception):
                self._on_error(INTERNAL_ERROR)

    def _tree(self, inode: int) -> LayerTree:
        i = bisect.bisect_right(self._bases, inode) - 1
        if i >= 0:
            tree = self._by_base[self._bases[i]]
            if inode < tree.end:
                return tree
        raise pyfuse3.FUSEError(errno.ESTALE if inode > pyfuse3.ROOT_INODE else errno.ENOENT)

    # -- attributes ------------------------------------------------------------------------

    def _make_root_attr(self) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = pyfuse3.ROOT_INODE
        a.st_mode = stat.S_IFDIR | 0o755
        a.st_nlink = 2
        a.st_blksize = _BLKSIZE
        a.entry_timeout = _TOP_ENTRY_TIMEOUT
        a.attr_timeout = _TOP_ENTRY_TIMEOUT
        return a

    def _attr(self, tree: LayerTree, inode: int) -> pyfuse3.EntryAttributes:
        a = tree.attrs.get(inode)
        if a is not None:
            return a
        i = inode - tree.base
        e = tree.entries[i]
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode
        a.generation = 0
        a.st_mode = _TYPE_BITS[e.type] | (e.mode & 0o7777)
        a.st_nlink = tree.nlink[i]
        a.st_uid = e.uid
        a.st_gid = e.gid
        if e.type in ("char", "block"):
            a.st_rdev = os.makedev(e.dev_major, e.dev_minor)
        if e.type == "reg":
            size = e.size
        elif e.type == "symlink":
            size = len(os.fsencode(e.link_name))
        elif e.type == "dir":
            size = 4096
        else:
            size = 0
        a.st_size = size
        a.st_blksize = _BLKSIZE
        a.st_blocks = (size + 511) // 512
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = max(0, e.mtime_ns)
        if i == 0:  # the layer's root: its name at the top level may go away
            a.entry_timeout = _TOP_ENTRY_TIMEOUT
        else:
            a.entry_timeout = self.entry_timeout
        a.attr_timeout = self.attr_timeout
        tree.attrs[inode] = a
        return a

    def _negative(self) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = 0
        a.entry_timeout = self.entry_timeout
        return a

    # -- metadata operations ---------------------------------------------------------------

    @_guarded
    async def lookup(self, parent_inode: int, name: bytes,
                     ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if parent_inode == pyfuse3.ROOT_INODE:
            if name in (b".", b".."):
                return self._root_attr
            tree = self._layers.get(os.fsdecode(name))
            if tree is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self._attr(tree, tree.root)
        tree = self._tree(parent_inode)
        if name == b".":
            return self._attr(tree, parent_inode)
        if name == b"..":
            p = tree.parents[parent_inode - tree.base]
            return self._root_attr if p == pyfuse3.ROOT_INODE else self._attr(tree, p)
        kids = tree.children.get(parent_inode)
        if kids is None:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        ino = kids.get(name)
        if ino is None:
            return self._negative()
        return self._attr(tree, ino)

    @_guarded
    async def getattr(self, inode: int,
                      ctx: pyfuse3.RequestContext | None = None) -> pyfuse3.EntryAttributes:
        if inode == pyfuse3.ROOT_INODE:
            return self._root_attr
        tree = self._tree(inode)
        return self._attr(tree, inode)

    @_guarded
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        tree = self._tree(inode)
        e = tree.entries[inode - tree.base]
        if e.type != "symlink":
            raise pyfuse3.FUSEError(errno.EINVAL)
        return os.fsencode(e.link_name)

    @_guarded
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if inode != pyfuse3.ROOT_INODE:
            tree = self._tree(inode)
            if inode not in tree.children:
                raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    @_guarded
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        if fh == pyfuse3.ROOT_INODE:
            tops = sorted(self._layers.items())
            for i in range(start_id, len(tops)):
                key, tree = tops[i]
                if not pyfuse3.readdir_reply(token, os.fsencode(key),
                                             self._attr(tree, tree.root), i + 1):
                    return
            return
        tree = self._tree(fh)
        items = tree.listing.get(fh, [])
        for i in range(start_id, len(items)):
            name, ino = items[i]
            if not pyfuse3.readdir_reply(token, name, self._attr(tree, ino), i + 1):
                return

    @_guarded
    async def releasedir(self, fh: int) -> None:
        return None

    @_guarded
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if inode == pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        tree = self._tree(inode)
        value = tree.xattrs.get(inode, {}).get(name)
        if value is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return value

    @_guarded
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> Sequence[bytes]:
        if inode == pyfuse3.ROOT_INODE:
            return []
        tree = self._tree(inode)
        return list(tree.xattrs.get(inode, {}))

    @_guarded
    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        if mode & os.W_OK:
            raise pyfuse3.FUSEError(errno.EROFS)
        return True

    @_guarded
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        total = sum(t.total_size for t in self._layers.values())
        files = sum(len(t.entries) for t in self._layers.values())
        s.f_bsize = 4096
        s.f_frsize = 4096
        s.f_blocks = max(1, (total + 4095) // 4096)
        s.f_bfree = 0
        s.f_bavail = 0
        s.f_files = max(1, files)
        s.f_ffree = 0
        s.f_favail = 0
        s.f_namemax = 255
        return s

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        return None  # inodes live as long as their layer: nothing to count

    # -- data ------------------------------------------------------------------------------

    @_guarded
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise pyfuse3.FUSEError(errno.EROFS)
        tree = self._tree(inode)
        if tree.entries[inode - tree.base].type != "reg":
            raise pyfuse3.FUSEError(errno.EINVAL)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    @_guarded
    async def read(self, fh: int, off: int, size: int) -> bytes:
        tree = self._tree(fh)
        entry = tree.entries[fh - tree.base]
        if off >= entry.size:
            return b""
        if _DEBUG:
            log.debug("read size %d at %d of %r", size, off, entry.name)
        # Fast path, in the loop: every chunk is in the in-memory index of the chunk cache (a
        # pread each; no stat, no rescan, no planning). A thread hop costs more than that.
        # Anything else goes to one worker call that finishes the read where the loop stopped
        # (same chunk map, no chunk looked up twice): cache, single flight, fetch, deadline.
        partial: PartialRead | None = None
        try:
            got = tree.reader.read_cached(entry, off, size)
        except ColdstartError:
            got = None
        except Exception as exc:  # a broken cache must not fail a read the network can serve
            self.internal_error("read (cached)", fh, exc)
            got = None
        if isinstance(got, bytes):
            return got
        if isinstance(got, PartialRead):
            partial = got
        # a ColdstartError becomes its errno in _guarded (the reader already logged the reason
        # with the layer digest and chunk); anything else is logged there and answered EIO
        data: bytes = await trio.to_thread.run_sync(
            tree.reader.read, entry, off, size, partial, limiter=self._limiter)
        return data

    @_guarded
    async def flush(self, fh: int) -> None:
        # Read-only: nothing to flush. ENOSYS makes the kernel stop sending FLUSH on every
        # close (one request per file saved).
        raise pyfuse3.FUSEError(errno.ENOSYS)

    @_guarded
    async def release(self, fh: int) -> None:
        return None


def set_read_ahead(mountpoint: str, read_ahead_kb: int) -> bool:
    """Set the FUSE mount's bdi ``read_ahead_kb`` (found via /proc/self/mountinfo, no stat:
    a stat of our own mount from the serving thread would deadlock)."""
    target = os.path.abspath(mountpoint)
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    devs = []
    for line in lines:
        parts = line.split(" ")
        if len(parts) > 4 and _unescape(parts[4]) == target:
            devs.append(parts[2])
    if not devs:
        return False
    try:
        with open(f"/sys/class/bdi/{devs[-1]}/read_ahead_kb", "w") as f:
            f.write(str(read_ahead_kb))
    except OSError as exc:
        log.warning("could not set read_ahead_kb on %s: %s", mountpoint, exc)
        return False
    return True


def _unescape(path: str) -> str:
    return (path.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")
            .replace("\\134", "\\"))



# -- session (the server drives pyfuse3 only through these) --------------------------------------

def fuse_init(fs: FuseFS, mountpoint: str, options: set[str] | None = None) -> None:
    """Mount ``fs`` at ``mountpoint`` (one per process); FailedPrecondition if it cannot."""
    try:
        pyfuse3.init(fs, mountpoint, options or mount_options())
    except (RuntimeError, OSError) as exc:
        raise FailedPrecondition(f"cannot mount the FUSE file system at {mountpoint}: "
                                 f"{exc}") from exc


async def fuse_main() -> None:
    """Serve requests until :func:`fuse_terminate`."""
    await pyfuse3.main(min_tasks=4, max_tasks=64)


def fuse_terminate() -> None:
    pyfuse3.terminate()


def fuse_close(unmount: bool = True) -> None:
    pyfuse3.close(unmount=unmount)
