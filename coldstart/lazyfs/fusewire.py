"""The FUSE kernel protocol, spoken on ``/dev/fuse`` directly: mount, session loop, replies.

The FUSE server used to serve through pyfuse3 (libfuse's low-level API under a trio loop). A
metadata request then cost ~70-90 µs of server CPU, four fifths of it in the binding and the
event loop; a PyTorch start-up sends ~8,000 of them (overlayfs looks every path up, and asks
for ``trusted.overlay.*`` on each). This module is the whole transport instead: one thread
reads a request (one ``read``), decodes its header with one ``struct`` call, calls the
operation and writes the answer (one ``writev``). Reads that need the network are handed to a
pool of threads, which answer themselves; everything else is answered in the loop.

What it negotiates and why:

- ``OPEN`` is answered ``ENOSYS``: the kernel then opens files without asking (``no_open``:
  no OPEN, no RELEASE, page cache kept) and reads carry the inode. OPENDIR is answered, so
  the top directory (layers come and go) is not cached while a layer's listings are
  (``FOPEN_CACHE_DIR``). FLUSH is ``ENOSYS`` too (no request per close).
- ``READDIRPLUS`` (entries come with their attributes), parallel directory operations,
  symlinks cached in the page cache, requests of up to 1 MiB, asynchronous reads.
- Nothing is written through the mount (it is mounted read-only): the write operations are
  answered ``ENOSYS`` should one ever arrive.
- A session made with ``xattrs=False`` answers ``GETXATTR`` ``ENOSYS``: the kernel then answers
  every later one itself (``EOPNOTSUPP``, no request). overlayfs asks each lower file for
  ``trusted.overlay.metacopy`` and each lower directory for three more; on a layer that has no
  attribute to show, that is a third of a start-up's requests. ``LISTXATTR`` is still
  answered (an empty list, as a local disk's file without attributes), so tools that list
  before they ask (``cp -a``, ``tar --xattrs``, copy-up) see what they would on a local disk.

The session can be taken over: :meth:`FuseSession.adopt` serves a connection whose ``INIT`` a
predecessor answered (the kernel keeps what was negotiated then) and asks the kernel to queue
again what the dead server had read but not answered (``FUSE_NOTIFY_RESEND``, Linux 6.9).

Layout of the structures: ``include/uapi/linux/fuse.h`` (protocol 7.38).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import mmap
import os
import select
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from coldstart.errors import ColdstartError
from coldstart.lazyfs import mountsys

__all__ = ["Attr", "FuseError", "FuseOperations", "FuseSession", "Later", "StatFs"]

log = logging.getLogger(__name__)

ROOT_INODE = 1
#: pieces of a read's answer written as they are (one ``writev`` takes up to IOV_MAX, 1024,
#: with the header); more are joined first
_MAX_PARTS = 512
ENOATTR = errno.ENODATA

# opcodes
LOOKUP, FORGET, GETATTR, READLINK = 1, 2, 3, 5
OPEN, READ, STATFS, RELEASE = 14, 15, 17, 18
GETXATTR, LISTXATTR, FLUSH, INIT = 22, 23, 25, 26
OPENDIR, READDIR, RELEASEDIR, ACCESS = 27, 28, 29, 34
INTERRUPT, DESTROY, BATCH_FORGET, READDIRPLUS = 36, 38, 42, 44
#: no answer is expected to these
_NO_REPLY = frozenset({FORGET, BATCH_FORGET, INTERRUPT})

# notifications (written with unique 0, the code in ``error``)
NOTIFY_INVAL_ENTRY, NOTIFY_STORE, NOTIFY_RESEND = 3, 4, 7

# FUSE_INIT flags we take when the kernel offers them
_ASYNC_READ = 1 << 0
_EXPORT_SUPPORT = 1 << 4        # lookups of "." and ".." (file handles)
_BIG_WRITES = 1 << 5
_DO_READDIRPLUS = 1 << 13
_READDIRPLUS_AUTO = 1 << 14
_PARALLEL_DIROPS = 1 << 18
_MAX_PAGES = 1 << 22
_CACHE_SYMLINKS = 1 << 23
_INIT_EXT = 1 << 30
_WANTED = (_ASYNC_READ | _EXPORT_SUPPORT | _BIG_WRITES | _DO_READDIRPLUS | _READDIRPLUS_AUTO
           | _PARALLEL_DIROPS | _MAX_PAGES | _CACHE_SYMLINKS | _INIT_EXT)
# open flags
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_CACHE_DIR = 1 << 3

_MAJOR = 7
_MINOR = 38
#: a request's largest answer (reads of up to 1 MiB: a cold sequential read through the
#: mount is a quarter of the requests of 256 KiB ones), and the largest write we accept
MAX_IO = 1 << 20
_PAGE = mmap.PAGESIZE
#: the request buffer: the kernel refuses to read a request into a buffer that could not hold
#: a write of the ``max_write`` negotiated at INIT, and a connection taken over was negotiated
#: by a predecessor (libfuse, so pyfuse3-based servers, asks for 256 pages)
_BUFSIZE = max(MAX_IO, 256 * _PAGE) + 2 * _PAGE
#: a buffer the kernel still refuses (EINVAL: a predecessor negotiated more) doubles up to this
_MAX_BUFSIZE = 256 << 20

_IN = struct.Struct("<IIQQIIIHH")          # fuse_in_header (40)
_OUT = struct.Struct("<IiQ")               # fuse_out_header (16)
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr (88)
_ENTRY = struct.Struct("<QQQQII")          # fuse_entry_out without its attr (40)
_ENTRY_OUT = struct.Struct("<QQQQII" "QQQQQQIIIIIIIIII")  # fuse_entry_out with its attr (128)
_ATTR_OUT = struct.Struct("<QII")          # fuse_attr_out without its attr (16)
_OPEN_OUT = struct.Struct("<QIi")          # fuse_open_out (16)
_READ_IN = struct.Struct("<QQI")           # fuse_read_in: fh, offset, size
_GETXATTR_IN = struct.Struct("<II")        # size, padding
_XATTR_OUT = struct.Struct("<II")          # fuse_getxattr_out
_DIRENT = struct.Struct("<QQII")           # fuse_dirent without its name (24)
_STATFS = struct.Struct("<QQQQQIII4x24x")  # fuse_kstatfs (80)
_INIT_IN = struct.Struct("<IIII")          # major, minor, max_readahead, flags
_INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")  # fuse_init_out (64)
_STORE = struct.Struct("<QQII")            # fuse_notify_store_out (24)
_INVAL_ENTRY = struct.Struct("<QII")       # fuse_notify_inval_entry_out (16)



class FuseError(Exception):
    """Answer the request with ``errno``."""

    def __init__(self, err: int) -> None:
        super().__init__(err)
        self.errno = err


class Attr:
    """What the kernel is told about an inode (``fuse_attr``) and for how long it may keep
    the answer. Packed once, on first use: attributes of immutable layers never change."""

    __slots__ = (
        "_packed",
        "attr_timeout",
        "entry_timeout",
        "generation",
        "st_atime_ns",
        "st_blksize",
        "st_blocks",
        "st_ctime_ns",
        "st_gid",
        "st_ino",
        "st_mode",
        "st_mtime_ns",
        "st_nlink",
        "st_rdev",
        "st_size",
        "st_uid",
    )

    def __init__(self) -> None:
        self.st_ino = 0
        self.generation = 0
        self.st_mode = 0
        self.st_nlink = 1
        self.st_uid = 0
        self.st_gid = 0
        self.st_rdev = 0
        self.st_size = 0
        self.st_blksize = 4096
        self.st_blocks = 0
        self.st_atime_ns = 0
        self.st_mtime_ns = 0
        self.st_ctime_ns = 0
        self.entry_timeout = 0.0
        self.attr_timeout = 0.0
        self._packed: bytes | None = None

    def _attr(self) -> bytes:
        a, m, c = self.st_atime_ns, self.st_mtime_ns, self.st_ctime_ns
        return _ATTR.pack(self.st_ino, self.st_size, self.st_blocks,
                          a // 10**9, m // 10**9, c // 10**9, a % 10**9, m % 10**9, c % 10**9,
                          self.st_mode, self.st_nlink, self.st_uid, self.st_gid,
                          _encode_dev(self.st_rdev), self.st_blksize, 0)

    def entry(self) -> bytes:
        """``fuse_entry_out`` (an inode of 0: a negative entry, cached as long as said)."""
        p = self._packed
        if p is None:
            e_s, e_ns = _split(self.entry_timeout)
            a_s, a_ns = _split(self.attr_timeout)
            p = self._packed = (_ENTRY.pack(self.st_ino, self.generation, e_s, a_s, e_ns, a_ns)
                                + self._attr())
        return p

    def attr_out(self) -> bytes:
        """``fuse_attr_out``."""
        a_s, a_ns = _split(self.attr_timeout)
        return _ATTR_OUT.pack(a_s, a_ns, 0) + self.entry()[_ENTRY.size:]


#: an entry's and its attributes' timeouts as ``fuse_entry_out`` carries them
EntryTimes = tuple[int, int, int, int]


def entry_times(entry_timeout: float, attr_timeout: float) -> EntryTimes:
    """(entry seconds, attr seconds, entry nanoseconds, attr nanoseconds), for
    :func:`pack_entry`."""
    e_s, e_ns = _split(entry_timeout)
    a_s, a_ns = _split(attr_timeout)
    return e_s, a_s, e_ns, a_ns


def pack_entry(ino: int, times: EntryTimes, mode: int, nlink: int, uid: int, gid: int,
               rdev: int, size: int, mtime_ns: int, blksize: int) -> bytes:
    """``fuse_entry_out`` of an inode whose three times are ``mtime_ns`` (generation 0): what
    :meth:`Attr.entry` packs, made without an :class:`Attr` (a listing makes one for each
    entry it shows)."""
    e_s, a_s, e_ns, a_ns = times
    t, t_ns = divmod(mtime_ns, 10**9)
    return _ENTRY_OUT.pack(ino, 0, e_s, a_s, e_ns, a_ns,
                           ino, size, (size + 511) // 512, t, t, t, t_ns, t_ns, t_ns,
                           mode, nlink, uid, gid, _encode_dev(rdev) if rdev else 0, blksize, 0)


#: an entry of a listing: name, inode, type (``DT_*``), its ``fuse_entry_out`` (a listing
#: with attributes; else empty), the position after it
Listed = tuple[bytes, int, int, bytes, int]


def listed(name: bytes, attr: Attr, next_off: int, plus: bool) -> Listed:
    """What :meth:`FuseOperations.readdir` yields for ``attr`` named ``name``."""
    return name, attr.st_ino, (attr.st_mode & 0o170000) >> 12, attr.entry() if plus else b"", \
        next_off


class StatFs:
    __slots__ = ("bavail", "bfree", "blocks", "bsize", "ffree", "files", "frsize", "namelen")

    def __init__(self, *, blocks: int = 0, bfree: int = 0, bavail: int = 0, files: int = 0,
                 ffree: int = 0, bsize: int = 4096, namelen: int = 255,
                 frsize: int = 4096) -> None:
        self.blocks, self.bfree, self.bavail = blocks, bfree, bavail
        self.files, self.ffree = files, ffree
        self.bsize, self.namelen, self.frsize = bsize, namelen, frsize


class Later:
    """A read's answer that needs a worker thread: :class:`FuseSession` runs ``work`` in its
    pool and answers with what it returns, the bytes or their pieces in order (written as
    they are, not joined first), or the errno of the :class:`FuseError` it raises; anything
    else it raises becomes ``on_error(exc)``'s errno."""

    __slots__ = ("work",)

    def __init__(self, work: Callable[[], bytes | memoryview | Sequence[bytes | memoryview]]
                 ) -> None:
        self.work = work


class FuseOperations(Protocol):
    """What a file system served by :class:`FuseSession` answers (each may raise
    :class:`FuseError`; anything else becomes ``EIO`` through :meth:`unexpected`)."""

    def lookup(self, parent: int, name: bytes) -> Attr: ...
    def getattr(self, inode: int) -> Attr: ...
    def readlink(self, inode: int) -> bytes: ...
    def opendir(self, inode: int) -> bool: ...
    def readdir(self, inode: int, start: int, plus: bool) -> Iterable[Listed]: ...
    def read(self, inode: int, offset: int, size: int) -> bytes | Later: ...
    def getxattr(self, inode: int, name: bytes) -> bytes: ...
    def listxattr(self, inode: int) -> Sequence[bytes]: ...
    def access(self, inode: int, mask: int) -> None: ...
    def statfs(self) -> StatFs: ...
    def unexpected(self, op: str, inode: int, exc: BaseException) -> int: ...


def _split(seconds: float) -> tuple[int, int]:
    s = int(seconds)
    return s, int((seconds - s) * 1e9)


def _encode_dev(dev: int) -> int:
    # the kernel's new_encode_dev: minor's low byte, major, then minor's high bits
    major, minor = os.major(dev), os.minor(dev)
    return (minor & 0xFF) | (major << 8) | ((minor & ~0xFF) << 12)


_ZEROS = bytes(8)


def _pad8(n: int) -> int:
    return (n + 7) & ~7


class FuseSession:
    """One FUSE connection: :meth:`mount` a new one or :meth:`adopt` a held one, then
    :meth:`serve` (blocks this thread) until :meth:`terminate` or the unmount."""

    def __init__(self, fd: int, ops: FuseOperations, *, read_threads: int = 16,
                 xattrs: bool = True) -> None:
        self.fd = fd
        #: whether getxattr is answered (else ENOSYS: the kernel stops asking)
        self.xattrs = xattrs
        self.ops = ops
        self._stop = False
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, read_threads), thread_name_prefix="fuse-read")
        self._closed = False
        #: reads handed to the pool and not answered yet (stop() waits for them)
        self._pending: set[concurrent.futures.Future[None]] = set()
        self._stopping = False
        #: set while serve() runs (close() waits for it to return: it owns the descriptor)
        self._serving = threading.Event()
        self._dispatch: dict[int, Callable[[int, int, memoryview], None]] = {
            LOOKUP: self._lookup, GETATTR: self._getattr, READLINK: self._readlink,
            OPEN: self._enosys, READ: self._read, STATFS: self._statfs,
            RELEASE: self._ok, GETXATTR: self._getxattr, LISTXATTR: self._listxattr,
            FLUSH: self._enosys, INIT: self._init, OPENDIR: self._opendir,
            READDIR: self._readdir, RELEASEDIR: self._ok, ACCESS: self._access,
            READDIRPLUS: self._readdirplus, DESTROY: self._ok,
        }
        if not xattrs:
            self._dispatch[GETXATTR] = self._enosys

    # -- set-up ------------------------------------------------------------------------------

    @classmethod
    def mount(cls, ops: FuseOperations, mountpoint: str, *, fsname: str, subtype: str,
              options: Sequence[str] = (), read_threads: int = 16,
              xattrs: bool = True) -> FuseSession:
        """Open ``/dev/fuse`` and mount it read-only at ``mountpoint`` (needs CAP_SYS_ADMIN).
        ``options``: kernel FUSE options (``allow_other``, ``default_permissions``); ``suid``
        and ``dev`` are the default of mount(2); ``xattrs``: see the module's notes. OSError or
        ColdstartError if it cannot."""
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        data = ",".join([f"fd={fd}", f"rootmode={stat.S_IFDIR:o}", f"user_id={os.getuid()}",
                         f"group_id={os.getgid()}", *options])
        try:
            mountsys.mount(fsname, mountpoint, f"fuse.{subtype}",
                           mountsys.MS_RDONLY | mountsys.MS_NOATIME, data)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, ops, read_threads=read_threads, xattrs=xattrs)

    @classmethod
    def adopt(cls, fd: int, ops: FuseOperations, *, read_threads: int = 16,
              xattrs: bool = True) -> FuseSession:
        """Serve the connection ``fd`` a dead predecessor initialized; the requests it had
        taken and not answered are queued again (before Linux 6.9 they wait until their
        callers are interrupted)."""
        session = cls(fd, ops, read_threads=read_threads, xattrs=xattrs)
        try:
            os.write(fd, _OUT.pack(_OUT.size, NOTIFY_RESEND, 0))
        except OSError as exc:
            log.warning("the kernel cannot resend the requests the dead server had taken "
                        "(FUSE_NOTIFY_RESEND: %s); their readers wait until interrupted", exc)
        return session

    # -- the loop ----------------------------------------------------------------------------

    def serve(self) -> None:
        """Answer requests in this thread until :meth:`terminate`, the unmount, or the
        connection's abort."""
        if self._closed:
            return
        self._serving.set()
        try:
            self._loop()
        finally:
            self._serving.clear()

    def _loop(self) -> None:
        fd = self.fd
        os.set_blocking(fd, False)
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        buf = bytearray(_BUFSIZE)
        view = memoryview(buf)
        unpack = _IN.unpack_from
        dispatch = self._dispatch
        while not self._stop:
            try:
                n = os.readv(fd, [buf])
            except BlockingIOError:
                poller.poll()
                continue
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno == errno.ENOENT:      # the request was interrupted meanwhile
                    continue
                if exc.errno == errno.ENODEV:      # unmounted, or the connection aborted
                    log.info("FUSE connection ended (unmounted or aborted)")
                    return
                if exc.errno == errno.EINVAL and len(buf) < _MAX_BUFSIZE:
                    # the connection's max_write (a predecessor's) needs more: the kernel
                    # checks before it takes a request, so nothing is lost
                    buf = bytearray(2 * len(buf))
                    view = memoryview(buf)
                    log.info("FUSE request buffer grown to %d bytes", len(buf))
                    continue
                raise
            if n < _IN.size:
                continue
            _len, opcode, unique, nodeid, *_ = unpack(buf)
            if opcode in _NO_REPLY:
                continue
            handler = dispatch.get(opcode)
            if handler is None:
                self._error(unique, errno.ENOSYS)
                continue
            try:
                handler(unique, nodeid, view[_IN.size:n])
            except FuseError as exc:
                self._error(unique, exc.errno)
            except Exception as exc:
                self._error(unique, self.ops.unexpected(_NAMES.get(opcode, str(opcode)),
                                                        nodeid, exc))

    def terminate(self) -> None:
        """Make :meth:`serve` return (any thread); requests it has not read stay queued in
        the kernel."""
        self._stop = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"!")

    def stop(self, timeout: float) -> None:
        """End the loop and let every read it took answer (at most ``timeout`` seconds),
        before what they read from is closed. Requests the loop has not read stay queued in
        the kernel for a successor that takes the connection over."""
        self._stopping = True
        self.terminate()
        deadline = time.monotonic() + timeout
        while self._serving.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        # every read the loop took is answered (the fetcher is still open): one left queued
        # would wait for a successor's FUSE_NOTIFY_RESEND, which kernels before 6.9 lack
        concurrent.futures.wait(list(self._pending),
                                timeout=max(0.0, deadline - time.monotonic()))
        self._pool.shutdown(wait=False)

    def close(self, *, unmount: bool, mountpoint: str | None = None) -> None:
        """Release the connection (after :meth:`stop`; it is stopped here if not);
        ``unmount``: lazily unmount ``mountpoint`` first (else a process holding a copy of
        the descriptor keeps the mount alive for a successor). Answers and notifications
        after this are dropped."""
        if self._closed:
            return
        if not self._stopping:
            self.stop(5.0)
        self._closed = True
        if unmount and mountpoint is not None:
            try:
                mountsys.lazy_unmount(mountpoint)
            except ColdstartError as exc:
                log.warning("%s", exc)
        # the connection is let go, but its number stays taken (by /dev/null) until the
        # process ends: a writer that checked _closed just before (a page-cache warmer, a
        # read past the deadline, an abandoned loop) must not reach whatever opens next
        try:
            null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
            try:
                os.dup2(null, self.fd, inheritable=False)
            finally:
                os.close(null)
        except OSError:
            with contextlib.suppress(OSError):
                os.close(self.fd)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- notifications (any thread but the loop's: the kernel may wait for a read of ours) --

    def notify_store(self, inode: int, offset: int, data: bytes | memoryview) -> None:
        """Put ``data`` into the page cache of ``inode`` at ``offset`` (OSError if the kernel
        does not know the inode)."""
        if self._closed:
            raise OSError(errno.ENOTCONN, "the FUSE connection is closed")
        size = len(data)
        head = _OUT.pack(_OUT.size + _STORE.size + size, NOTIFY_STORE, 0)
        os.writev(self.fd, [head, _STORE.pack(inode, offset, size, 0), data])

    def invalidate_entry(self, parent: int, name: bytes) -> None:
        """Make the kernel forget the name ``name`` in ``parent`` (OSError ENOENT if it
        did not know it)."""
        if self._closed:
            raise OSError(errno.ENOTCONN, "the FUSE connection is closed")
        body = _INVAL_ENTRY.pack(parent, len(name), 0) + name + b"\0"
        os.write(self.fd, _OUT.pack(_OUT.size + len(body), NOTIFY_INVAL_ENTRY, 0) + body)

    # -- answers -----------------------------------------------------------------------------

    def _reply(self, unique: int, *parts: bytes | memoryview) -> None:
        if self._closed:
            return
        size = _OUT.size + sum(len(p) for p in parts)
        try:
            os.writev(self.fd, [_OUT.pack(size, 0, unique), *parts])
        except FileNotFoundError:
            pass            # the request was interrupted and is gone
        except OSError as exc:
            if exc.errno != errno.ENODEV:
                raise

    def _error(self, unique: int, err: int) -> None:
        if self._closed:
            return
        try:
            os.write(self.fd, _OUT.pack(_OUT.size, -err, unique))
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENODEV):
                log.warning("FUSE answer %d: %s", unique, exc)

    def _ok(self, unique: int, nodeid: int, body: memoryview) -> None:
        self._reply(unique)

    def _enosys(self, unique: int, nodeid: int, body: memoryview) -> None:
        self._error(unique, errno.ENOSYS)

    def _init(self, unique: int, nodeid: int, body: memoryview) -> None:
        major, minor, max_readahead, flags = _INIT_IN.unpack_from(body)
        if major > _MAJOR:      # the protocol's answer to a newer major (Linux sends 7)
            self._reply(unique, _INIT_OUT.pack(_MAJOR, _MINOR, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
            return
        if major < _MAJOR:
            log.error("FUSE protocol %d.%d: only %d is spoken here", major, minor, _MAJOR)
            self._error(unique, errno.EPROTO)
            return
        flags2 = 0
        if flags & _INIT_EXT and len(body) >= _INIT_IN.size + 4:
            (flags2,) = struct.unpack_from("<I", body, _INIT_IN.size)
        wanted = flags & _WANTED
        out = _INIT_OUT.pack(_MAJOR, min(minor, _MINOR), max_readahead, wanted, 64, 48, MAX_IO,
                             1, max(1, MAX_IO // _PAGE), 0, 0, 0)
        del flags2      # nothing of the second word is wanted
        self._reply(unique, out)

    def _lookup(self, unique: int, nodeid: int, body: memoryview) -> None:
        name = bytes(body[:-1]) if body[-1] == 0 else bytes(body)
        self._reply(unique, self.ops.lookup(nodeid, name).entry())

    def _getattr(self, unique: int, nodeid: int, body: memoryview) -> None:
        self._reply(unique, self.ops.getattr(nodeid).attr_out())

    def _readlink(self, unique: int, nodeid: int, body: memoryview) -> None:
        self._reply(unique, self.ops.readlink(nodeid))

    def _opendir(self, unique: int, nodeid: int, body: memoryview) -> None:
        cache = self.ops.opendir(nodeid)
        flags = FOPEN_KEEP_CACHE | FOPEN_CACHE_DIR if cache else 0
        self._reply(unique, _OPEN_OUT.pack(nodeid, flags, 0))

    def _readdir(self, unique: int, nodeid: int, body: memoryview) -> None:
        self._dir(unique, nodeid, body, plus=False)

    def _readdirplus(self, unique: int, nodeid: int, body: memoryview) -> None:
        self._dir(unique, nodeid, body, plus=True)

    def _dir(self, unique: int, nodeid: int, body: memoryview, *, plus: bool) -> None:
        _fh, offset, size = _READ_IN.unpack_from(body)
        out: list[bytes] = []
        used = 0
        for name, ino, kind, head, next_off in self.ops.readdir(nodeid, offset, plus):
            n = len(name)
            rec = _pad8(_DIRENT.size + n)
            used += len(head) + rec
            if used > size:
                break
            out.append(head)
            out.append(_DIRENT.pack(ino, next_off, n, kind))
            out.append(name + _ZEROS[:rec - _DIRENT.size - n])
        self._reply(unique, b"".join(out))

    def _read(self, unique: int, nodeid: int, body: memoryview) -> None:
        _fh, offset, size = _READ_IN.unpack_from(body)
        got = self.ops.read(nodeid, offset, size)
        if isinstance(got, Later):
            try:
                fut = self._pool.submit(self._answer_later, unique, nodeid, got)
            except RuntimeError:    # the pool is shut down: EIO rather than no answer
                self._error(unique, errno.EIO)
                return
            self._pending.add(fut)
            fut.add_done_callback(self._pending.discard)
        else:
            self._reply(unique, got)

    def _answer_later(self, unique: int, nodeid: int, later: Later) -> None:
        try:
            data = later.work()
        except FuseError as exc:
            self._error(unique, exc.errno)
        except Exception as exc:
            self._error(unique, self.ops.unexpected("read", nodeid, exc))
        else:
            try:
                if isinstance(data, (bytes, bytearray, memoryview)):
                    self._reply(unique, data)
                elif len(data) < _MAX_PARTS:
                    self._reply(unique, *data)
                else:       # past what one writev takes (IOV_MAX): joined
                    self._reply(unique, b"".join(data))
            except Exception as exc:    # this thread's Future is never looked at: say it
                self._error(unique, self.ops.unexpected("read (answer)", nodeid, exc))

    def _getxattr(self, unique: int, nodeid: int, body: memoryview) -> None:
        size, _pad = _GETXATTR_IN.unpack_from(body)
        raw = bytes(body[_GETXATTR_IN.size:])
        name = raw[:raw.index(b"\0")] if b"\0" in raw else raw
        self._sized(unique, self.ops.getxattr(nodeid, name), size)

    def _listxattr(self, unique: int, nodeid: int, body: memoryview) -> None:
        size, _pad = _GETXATTR_IN.unpack_from(body)
        names = self.ops.listxattr(nodeid)
        self._sized(unique, b"".join(n + b"\0" for n in names), size)

    def _sized(self, unique: int, value: bytes, size: int) -> None:
        # size 0 asks how big; a buffer too small is ERANGE
        if size == 0:
            self._reply(unique, _XATTR_OUT.pack(len(value), 0))
        elif len(value) > size:
            self._error(unique, errno.ERANGE)
        else:
            self._reply(unique, value)

    def _access(self, unique: int, nodeid: int, body: memoryview) -> None:
        (mask,) = struct.unpack_from("<I", body)
        self.ops.access(nodeid, mask)
        self._reply(unique)

    def _statfs(self, unique: int, nodeid: int, body: memoryview) -> None:
        s = self.ops.statfs()
        self._reply(unique, _STATFS.pack(s.blocks, s.bfree, s.bavail, s.files, s.ffree,
                                         s.bsize, s.namelen, s.frsize))


_NAMES = {LOOKUP: "lookup", GETATTR: "getattr", READLINK: "readlink", READ: "read",
          STATFS: "statfs", GETXATTR: "getxattr", LISTXATTR: "listxattr", OPENDIR: "opendir",
          READDIR: "readdir", READDIRPLUS: "readdirplus", ACCESS: "access", INIT: "init"}
