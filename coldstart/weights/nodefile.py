"""A file of a lazily mounted layer, read through the node's files socket: the loader's fast path.

Inside a container whose image coldstart pulled lazily, a safetensors file read through the
mount arrives page by page (or at the read-ahead's pace). When the file carries the node's file
token (``getxattr`` of :data:`~coldstart.lazyfs.filewire.FILE_XATTR`: only files of a lazily
mounted layer have one) and the node's files socket is mounted into the container
(``$COLDSTART_FILES_SOCKET``, else ``/run/coldstart/files/files.sock``),
:func:`node_source` opens it as a :class:`NodeFileSource` instead: each read asks the node for
the whole range, which it fetches in parallel, verifies chunk by chunk, caches for the next
container and writes into this process's memory (a ``memfd`` passed with the request: the
whole file's, which tensors then view, or a thread's staging buffer). Connections are the
process's, shared by every file it reads (at most :data:`MAX_CONNECTIONS` at once; a thread
beyond that waits for one). Anywhere else (a local disk, no socket, a node that refuses the
token) the loader reads the file as before; a wrong byte is an error, never a reason to fall
back. Protocol and trust boundary: :mod:`coldstart.lazyfs.filewire`.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from coldstart.config import SourceConfig, WeightsConfig
from coldstart.errors import (
    ColdstartError,
    DeadlineExceeded,
    FormatError,
    IntegrityError,
    Unavailable,
)
from coldstart.format.readat import check_range
from coldstart.lazyfs import control, filewire
from coldstart.remote.source import bytes_view, fill_from_chunks, read_at_into

__all__ = ["MAX_CONNECTIONS", "NodeFileSource", "node_source"]

log = logging.getLogger(__name__)

_SOURCE = SourceConfig()
#: connections to the files socket one process holds at once (requests in flight)
MAX_CONNECTIONS = 16
#: bytes one request asks for (a loader's read is cut into pieces of this size)
REQUEST_BYTES = min(WeightsConfig().chunk_bytes, filewire.MAX_READ)
#: pause between attempts to reach a FUSE server that restarts
_RECONNECT_PAUSE = 0.2
_MADV_POPULATE_WRITE = 23    # Linux 5.14
#: a pooled connection unused this long is not reused (the server closes them at 60 s)
_IDLE_SECONDS = 30.0
#: how long opening a file waits for the node (then it is read through the mount)
_STAT_SECONDS = 5.0


def _fault_in(m: mmap.mmap, offset: int, length: int) -> None:
    """Make the pages of ``m[offset:offset+length]`` exist (ours, charged to our cgroup) and
    mapped here: the node writes only into pages its caller has."""
    start = offset - offset % mmap.PAGESIZE
    try:
        m.madvise(_MADV_POPULATE_WRITE, start, offset + length - start)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS):   # out of memory: say so
            raise Unavailable(f"cannot allocate {length} bytes to load into: {exc}") from exc
        with memoryview(m) as view:     # before Linux 5.14: touch one byte of every page
            for pos in range(start, offset + length, mmap.PAGESIZE):
                view[pos] = view[pos]


class _Memory:
    """A memfd and a shared map of it."""

    def __init__(self, size: int, name: str) -> None:
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, max(1, size))
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, filewire.SEALS)    # the node asks it
            self.map = mmap.mmap(self.fd, max(1, size))
        except OSError:
            os.close(self.fd)
            raise
        self._closer = weakref.finalize(self, os.close, self.fd)

    def close_fd(self) -> None:
        """Close the descriptor (the map lives on while anything views it)."""
        self._closer()


class _Retry(Exception):
    """An error reply worth sending again (:data:`~coldstart.lazyfs.filewire.RETRY`)."""

    def __init__(self, error: ColdstartError) -> None:
        super().__init__(str(error))
        self.error = error


class _Conn:
    """One connection to the files socket."""

    def __init__(self, path: str, timeout: float) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._buf = b""
        self.used = time.monotonic()
        try:
            self.sock.settimeout(timeout)
            self.sock.connect(path)
        except BaseException:
            self.sock.close()
            raise

    def ask(self, request: dict[str, Any], timeout: float, fd: int | None = None) -> Any:
        """Send ``request`` (with ``fd``), return its reply's result (raises its error;
        :class:`_Retry` around one worth sending again)."""
        self.sock.settimeout(timeout)
        line = control.encode(request)
        # MSG_NOSIGNAL: a server gone is an error here, never a SIGPIPE for the process
        if fd is None:
            self.sock.sendall(line, socket.MSG_NOSIGNAL)
        else:
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
            sent = self.sock.sendmsg([line], rights, socket.MSG_NOSIGNAL)
            if sent < len(line):
                self.sock.sendall(line[sent:], socket.MSG_NOSIGNAL)
        while b"\n" not in self._buf:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionResetError("the files socket closed the connection")
            self._buf += data
        reply, _, self._buf = self._buf.partition(b"\n")
        self.used = time.monotonic()
        try:
            return control.decode_reply(reply)
        except ColdstartError as exc:
            if filewire.RETRY.encode() in reply and json.loads(reply).get(filewire.RETRY):
                raise _Retry(exc) from exc
            raise

    def close(self) -> None:
        self.sock.close()


class _Connections:
    """This process's connections to one files socket: at most :data:`MAX_CONNECTIONS`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._idle: list[_Conn] = []
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()

    def take(self, timeout: float) -> _Conn:
        if not self._slots.acquire(timeout=max(0.001, timeout)):
            raise DeadlineExceeded(f"no connection to the node's files socket {self.path} "
                                   f"came free within {timeout:g} s")
        stale: list[_Conn] = []
        conn = None
        with self._lock:
            while self._idle and conn is None:
                c = self._idle.pop()
                if time.monotonic() - c.used < _IDLE_SECONDS:
                    conn = c
                else:
                    stale.append(c)     # the server closes idle ones: not worth a try
        for c in stale:
            c.close()
        if conn is not None:
            return conn
        try:
            return _Conn(self.path, timeout)
        except TimeoutError as exc:
            self._slots.release()
            raise DeadlineExceeded(f"the node's files socket {self.path} did not answer "
                                   f"within {timeout:g} s") from exc
        except OSError as exc:
            self._slots.release()
            raise Unavailable(f"cannot reach the node's files socket {self.path}: "
                              f"{exc}") from exc
        except BaseException:
            self._slots.release()
            raise

    def give(self, conn: _Conn, *, broken: bool = False) -> None:
        if broken:
            conn.close()
        else:
            with self._lock:
                self._idle.append(conn)
        self._slots.release()


_POOLS: dict[str, _Connections] = {}
_POOLS_LOCK = threading.Lock()
_STAGING = threading.local()


def _after_fork() -> None:
    """A child shares nothing of its parent's: connections (their replies would cross), locks
    (maybe held by threads it does not have), staging memory (shared with the parent)."""
    global _POOLS_LOCK, _STAGING
    _POOLS.clear()
    _POOLS_LOCK = threading.Lock()
    _STAGING = threading.local()


os.register_at_fork(after_in_child=_after_fork)


def _pool(path: str) -> _Connections:
    with _POOLS_LOCK:
        pool = _POOLS.get(path)
        if pool is None:
            pool = _POOLS[path] = _Connections(path)
        return pool


def _staging() -> _Memory:
    """This thread's staging memory (:data:`REQUEST_BYTES`, faulted in once)."""
    mem: _Memory | None = getattr(_STAGING, "memory", None)
    if mem is None:
        mem = _STAGING.memory = _Memory(REQUEST_BYTES, "coldstart-staging")
        _fault_in(mem.map, 0, REQUEST_BYTES)
    return mem


class NodeFileSource:
    """A :class:`~coldstart.remote.Source` over one lazily mounted file, through the node.

    Two ways to read, as :class:`~coldstart.remote.local.LocalFileBlob` has: ``read_into``
    (the node writes into the thread's staging memory, then one copy into the caller's
    buffers), and :meth:`mapping` + :meth:`populate` (a ``memfd`` of the whole file that the
    node fills in place, range by range: tensors view it, no copy in this process; the
    loader's default for CPU loads). ``token``: the file's token (as read from its attribute);
    when the FUSE server restarts, the token is read again and the request sent again, until
    the read's deadline."""

    direct = False
    #: what the header read asks for first (a second request is cheap here)
    head_guess = 64 << 10
    #: how the loader's stats name this data path
    via = "the node's files socket: chunks fetched in parallel, verified, cached"

    def __init__(self, path: str | os.PathLike[str], socket_path: str, token: str, *,
                 timeout: float = _SOURCE.timeout) -> None:
        self.name = os.fspath(path)
        self.socket_path = socket_path
        self.timeout = timeout
        self._token = token
        self._pool = _pool(socket_path)
        self._lock = threading.Lock()
        self._closed = False
        self._memory: _Memory | None = None     # the whole file's, once mapped
        # a node that does not answer soon is not waited for: the file is read through the
        # mount instead (node_source)
        result = self._ask(filewire.stat_request, None, min(timeout, _STAT_SECONDS))
        self._size = int(result["size"])

    def size(self) -> int:
        return self._size

    def read_at(self, offset: int, length: int, *, timeout: float | None = None) -> bytes:
        return read_at_into(self, offset, length, timeout)

    def mapping(self) -> mmap.mmap:
        """A shared memory map of the whole file (a ``memfd``), made once; :meth:`populate`
        fills it. Tensors viewing it keep it alive after :meth:`close`."""
        with self._lock:
            if self._closed:
                raise Unavailable(f"{self.name}: the source is closed")
            if self._memory is None:
                try:
                    self._memory = _Memory(self._size, "coldstart-file")
                except OSError as exc:
                    raise Unavailable(f"{self.name}: cannot make {self._size} bytes of "
                                      f"memory for it: {exc}") from exc
            return self._memory.map

    def populate(self, offset: int, length: int, *, timeout: float | None = None) -> None:
        """Have the node put the file's ``[offset, offset+length)`` into :meth:`mapping`."""
        m = self.mapping()
        check_range(offset, length, self._size)
        if not length:
            return
        _fault_in(m, offset, length)
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        done = 0
        while done < length:
            n = min(length - done, REQUEST_BYTES)
            self._fill(offset + done, n, offset + done, deadline, wait)
            done += n

    def read_into(self, offset: int, buffers: Sequence[memoryview], *,
                  timeout: float | None = None) -> None:
        views = [bytes_view(b) for b in buffers]
        total = sum(v.nbytes for v in views)
        check_range(offset, total, self._size)
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait

        def pieces() -> Iterator[memoryview]:
            """Each request's bytes, once the node put them in memory."""
            done = 0
            while done < total:
                n = min(total - done, REQUEST_BYTES)
                if self._memory is not None:    # mapped: fill the file's own memory
                    self.populate(offset + done, n,
                                  timeout=max(0.001, deadline - time.monotonic()))
                    source, at = self._memory.map, offset + done
                else:
                    source, at = _staging().map, 0
                    self._fill(offset + done, n, None, deadline, wait)
                yield memoryview(source)[at : at + n]
                done += n

        fill_from_chunks(self.name, offset, views, pieces())

    def _fill(self, offset: int, length: int, at: int | None, deadline: float,
              wait: float) -> None:
        """The node writes the file's ``[offset, offset+length)`` into the file's memory at
        ``at``, or (None) into this thread's staging memory at 0."""
        with self._lock:
            if self._closed:
                raise Unavailable(f"{self.name}: the source is closed")
            memory = self._memory if at is not None else _staging()
            assert memory is not None
            fd = os.dup(memory.fd)      # ours until sent: never a number reused meanwhile
        try:
            got = self._ask(
                lambda token: filewire.read_request(token, offset, length, at or 0),
                fd, max(0.001, deadline - time.monotonic()), wait)
        finally:
            os.close(fd)
        if got != length:
            raise FormatError(f"{self.name}: the node served {got} of {length} bytes at "
                              f"{offset} (the file is {self._size} bytes)")

    def _ask(self, request: Any, fd: int | None, timeout: float,
             wait: float | None = None) -> Any:
        """``request(token)``'s result. A FUSE server that restarts (an upgrade, a crash and
        its successor) drops the connections and its successor issues new tokens: until
        ``timeout`` has passed, the request is sent again, with the token read again."""
        deadline = time.monotonic() + timeout
        shown = timeout if wait is None else wait
        while True:
            try:
                conn = self._pool.take(max(0.001, deadline - time.monotonic()))
            except Unavailable as exc:      # no server now (DeadlineExceeded: past the time)
                if isinstance(exc, DeadlineExceeded) or not self._retry(deadline):
                    raise type(exc)(f"{self.name}: {exc}") from exc
                continue
            try:
                result = conn.ask(request(self._token),
                                  max(0.001, deadline - time.monotonic()), fd)
            except TimeoutError as exc:
                self._pool.give(conn, broken=True)
                raise DeadlineExceeded(f"{self.name}: the node did not answer within "
                                       f"{shown:g} s") from exc
            except OSError as exc:          # the server went away
                self._pool.give(conn, broken=True)
                if not self._retry(deadline):
                    raise Unavailable(f"{self.name}: the node's files socket "
                                      f"{self.socket_path} failed: {exc}") from exc
                continue
            except _Retry as exc:
                # a token of the last server, its mounts not restored yet, the socket full
                self._pool.give(conn, broken=True)
                if not self._retry(deadline):
                    raise type(exc.error)(f"{self.name}: {exc.error}") from exc.error
                continue
            except ColdstartError as exc:   # an error reply: the connection is fine
                self._pool.give(conn)
                raise type(exc)(f"{self.name}: {exc}") from exc
            except ValueError as exc:       # not a reply at all
                self._pool.give(conn, broken=True)
                raise Unavailable(f"{self.name}: the node's files socket answered "
                                  f"nonsense: {exc}") from exc
            except BaseException:           # interrupted mid-request: its reply is unread
                self._pool.give(conn, broken=True)
                raise
            self._pool.give(conn)
            return result

    def _retry(self, deadline: float) -> bool:
        """Whether to try again (time is left, not closed); reads the token again first."""
        if self._closed or time.monotonic() + _RECONNECT_PAUSE >= deadline:
            return False
        time.sleep(_RECONNECT_PAUSE)
        with contextlib.suppress(OSError, UnicodeDecodeError):
            self._token = os.getxattr(self.name, filewire.FILE_XATTR).decode()
        return True

    def close(self) -> None:
        """No new requests; the file's memfd closed (requests in flight hold their own copy
        of the descriptor; a :meth:`mapping` lives on while tensors view it)."""
        with self._lock:
            self._closed = True
            memory = self._memory
        if memory is not None:
            memory.close_fd()


def node_source(path: str | os.PathLike[str], *,
                timeout: float = _SOURCE.timeout) -> NodeFileSource | None:
    """``path`` through the node's files socket, or None where that does not apply: no socket
    (:func:`~coldstart.lazyfs.filewire.socket_path`), a file without a token (not on a lazily
    mounted layer, or changed in the container), or a node that refuses it (logged; the file is
    then read through the mount). An :class:`IntegrityError` is raised, never fallen back from.
    """
    sock = filewire.socket_path()
    if sock is None:
        return None
    try:
        token = os.getxattr(path, filewire.FILE_XATTR).decode()
    except (OSError, UnicodeDecodeError):
        return None
    try:
        return NodeFileSource(path, sock, token, timeout=timeout)
    except IntegrityError:
        raise
    except ColdstartError as exc:
        log.warning("%s is on a lazily mounted layer, but the node's files socket refused it "
                    "(%s): reading it through the mount", os.fspath(path), exc)
        return None
