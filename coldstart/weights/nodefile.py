"""A file of a lazily mounted layer, read through the node's files socket: the loader's fast path.

Inside a container whose image coldstart pulled lazily, a safetensors file read through the
mount arrives page by page (or at the read-ahead's pace). When the file carries the node's file
token (``getxattr`` of :data:`~coldstart.lazyfs.filewire.FILE_XATTR`: only files of a lazily
mounted layer have one) and the node's files socket is mounted into the container
(``$COLDSTART_FILES_SOCKET``, else ``/run/coldstart/files/files.sock``),
:func:`node_source` opens it as a :class:`NodeFileSource` instead: each read asks the node for
the whole range, which it fetches in parallel, verifies chunk by chunk, caches for the next
container and writes into this process's staging memory (a ``memfd`` shared with the node);
one copy then puts the bytes into the tensors. One connection per loader thread keeps many
requests in flight. Anywhere else (a local disk, no socket, a node that refuses the token) the
loader reads the file as before; a wrong byte is an error, never a reason to fall back.
Protocol and trust boundary: :mod:`coldstart.lazyfs.filewire`.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from coldstart.config import SourceConfig, WeightsConfig
from coldstart.errors import (
    ColdstartError,
    DeadlineExceeded,
    FailedPrecondition,
    FormatError,
    IntegrityError,
    NotFound,
    Unavailable,
)
from coldstart.format.readat import check_range
from coldstart.lazyfs import control, filewire
from coldstart.remote.source import bytes_view, read_at_into

__all__ = ["NodeFileSource", "node_source"]

log = logging.getLogger(__name__)

_SOURCE = SourceConfig()
_MADV_POPULATE_WRITE = 23    # Linux 5.14 (the map is shared and writable: no copy)
#: pause between attempts to reach a FUSE server that restarts
_RECONNECT_PAUSE = 0.2
#: staging memory per connection (a read asks for at most this much at once)
STAGING_BYTES = WeightsConfig().chunk_bytes


class _Conn:
    """One connection to the files socket, with the file opened and its staging memfd: its
    own ``staging`` bytes, or (``shared``) the source's memfd of the whole file, which the
    node then fills in place."""

    def __init__(self, socket_path: str, token: str, staging: int, timeout: float,
                 shared: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.fd = -1
        self.map: mmap.mmap | None = None
        self.shared = shared is not None
        self._buf = b""
        try:
            self.sock.settimeout(timeout)
            self.sock.connect(socket_path)
            if shared is None:
                self.fd = os.memfd_create("coldstart-staging", os.MFD_CLOEXEC)
                os.ftruncate(self.fd, staging)
                self.map = mmap.mmap(self.fd, staging)
            self.staging = staging
            socket.send_fds(self.sock, [control.encode(filewire.open_request(token))],
                            [self.fd if shared is None else shared])
            result = self._reply()
            self.size = int(result["size"])
        except BaseException:
            self.close()
            raise

    def read(self, offset: int, length: int, timeout: float, at: int = 0) -> int:
        self.sock.settimeout(timeout)
        self.sock.sendall(control.encode(filewire.read_request(offset, length, at)))
        return int(self._reply())

    def _reply(self) -> Any:
        while b"\n" not in self._buf:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionResetError("the files socket closed the connection")
            self._buf += data
        line, _, self._buf = self._buf.partition(b"\n")
        return control.decode_reply(line)

    def close(self) -> None:
        if self.map is not None:
            with contextlib.suppress(BufferError):  # a view still out: freed with it
                self.map.close()
            self.map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.sock.close()


class NodeFileSource:
    """A :class:`~coldstart.remote.Source` over one lazily mounted file, through the node.

    Two ways to read, as :class:`~coldstart.remote.local.LocalFileBlob` has: ``read_into``
    (the node writes into a connection's staging memory, then one copy into the caller's
    buffers), and :meth:`mapping` + :meth:`populate` (a ``memfd`` of the whole file that the
    node fills in place, range by range: tensors view it, no copy in this process; the
    loader's default for CPU loads). ``token``: the file's token (as read from its
    attribute); a connection that breaks (the FUSE server restarted) is opened again with a
    fresh one, once per read."""

    direct = False
    #: what the header read asks for first (a second request is cheap here)
    head_guess = 64 << 10
    #: how the loader's stats name this data path
    via = "the node's files socket: chunks fetched in parallel, verified, cached"

    def __init__(self, path: str | os.PathLike[str], socket_path: str, token: str, *,
                 timeout: float = _SOURCE.timeout, staging: int = STAGING_BYTES) -> None:
        self.name = os.fspath(path)
        self.socket_path = socket_path
        self.timeout = timeout
        self._staging = max(4096, staging)
        self._token = token
        self._lock = threading.Lock()
        self._idle: list[_Conn] = []
        self._all: set[_Conn] = set()
        self._closed = False
        self._map: mmap.mmap | None = None
        self._map_fd: int | None = None    # the whole file's memfd, once mapped
        first = self._connect()
        self._size = first.size
        self._give_back(first)

    def size(self) -> int:
        return self._size

    def read_at(self, offset: int, length: int, *, timeout: float | None = None) -> bytes:
        return read_at_into(self, offset, length, timeout)

    def mapping(self) -> mmap.mmap:
        """A shared memory map of the whole file (a ``memfd``), made once; :meth:`populate`
        fills it. Tensors viewing it keep it alive after :meth:`close`."""
        with self._lock:
            if self._map is None:
                if self._closed:
                    raise Unavailable(f"{self.name}: the source is closed")
                fd = os.memfd_create("coldstart-file", os.MFD_CLOEXEC)
                try:
                    os.ftruncate(fd, max(1, self._size))
                    self._map = mmap.mmap(fd, max(1, self._size))
                except OSError as exc:
                    os.close(fd)
                    raise Unavailable(f"{self.name}: cannot make {self._size} bytes of "
                                      f"memory for it: {exc}") from exc
                self._map_fd = fd
                staging, self._idle = self._idle, []    # their memory is not needed now
                for conn in staging:
                    self._all.discard(conn)
            else:
                staging = []
        for conn in staging:
            conn.close()
        return self._map

    def populate(self, offset: int, length: int, *, timeout: float | None = None) -> None:
        """Have the node put the file's ``[offset, offset+length)`` into :meth:`mapping`."""
        self.mapping()
        check_range(offset, length, self._size)
        wait = self.timeout if timeout is None else timeout
        done = 0
        while done < length:
            n = min(length - done, self._staging)
            self._give_back(self._read(offset + done, n, wait, mapped=True))
            done += n
        # map the pages the node filled into this process now (as a local file's populate
        # does), not at the tensors' first touch
        start = offset - offset % mmap.PAGESIZE
        with contextlib.suppress(OSError, ValueError):
            assert self._map is not None
            self._map.madvise(_MADV_POPULATE_WRITE, start, offset + length - start)

    def read_into(self, offset: int, buffers: Sequence[memoryview], *,
                  timeout: float | None = None) -> None:
        views = [bytes_view(b) for b in buffers]
        total = sum(v.nbytes for v in views)
        check_range(offset, total, self._size)
        wait = self.timeout if timeout is None else timeout
        mapped = self._map is not None
        idx, pos, done = 0, 0, 0
        while done < total:
            n = min(total - done, self._staging)
            conn = self._read(offset + done, n, wait, mapped=mapped)
            try:
                staging = self._map if mapped else conn.map
                at = offset + done if mapped else 0
                assert staging is not None
                with memoryview(staging) as staged:
                    got = 0
                    while got < n:
                        while pos == views[idx].nbytes:
                            idx, pos = idx + 1, 0
                        take = min(n - got, views[idx].nbytes - pos)
                        views[idx][pos : pos + take] = staged[at + got : at + got + take]
                        got += take
                        pos += take
            finally:
                self._give_back(conn)
            done += n

    def _read(self, offset: int, length: int, wait: float, *, mapped: bool = False) -> _Conn:
        """A connection whose staging (``mapped``: the whole file's map, at ``offset``) holds
        the file's ``[offset, offset+length)``.

        A FUSE server that restarts (an upgrade, a crash and its successor) closes the
        connections and its successor issues new tokens: until ``wait`` seconds have passed,
        the request is sent again on a new connection, with the token read again."""
        deadline = time.monotonic() + wait
        while True:
            try:
                conn = self._take(mapped)
            except (Unavailable, FailedPrecondition, NotFound):
                # no server yet, a token of the last one, or its mounts not restored yet
                if time.monotonic() >= deadline:
                    raise
                time.sleep(_RECONNECT_PAUSE)
                self._refresh_token()
                continue
            try:
                got = conn.read(offset, length, max(0.001, deadline - time.monotonic()),
                                offset if mapped else 0)
            except TimeoutError as exc:
                self._drop(conn)
                raise DeadlineExceeded(f"{self.name}: the node did not serve {length} bytes at "
                                       f"{offset} within {wait:g} s") from exc
            except OSError as exc:
                self._drop(conn)
                if time.monotonic() >= deadline:
                    raise Unavailable(f"{self.name}: the node's files socket "
                                      f"{self.socket_path} failed: {exc}") from exc
                self._refresh_token()
                continue
            except ColdstartError as exc:
                self._give_back(conn)   # an error reply: the connection is fine
                named = type(exc)(f"{self.name}: {exc}")
                raise named from exc
            except ValueError as exc:   # not a reply at all
                self._drop(conn)
                raise Unavailable(f"{self.name}: the node's files socket answered "
                                  f"nonsense: {exc}") from exc
            except BaseException:       # interrupted mid-request: its reply is unread
                self._drop(conn)
                raise
            if got != length:
                self._give_back(conn)
                raise FormatError(f"{self.name}: the node served {got} of {length} bytes at "
                                  f"{offset} (the file is {self._size} bytes)")
            return conn

    def _refresh_token(self) -> None:
        """A restarted FUSE server issues new tokens: read the attribute again."""
        with contextlib.suppress(OSError):
            self._token = os.getxattr(self.name, filewire.FILE_XATTR).decode()

    def _connect(self, mapped: bool = False) -> _Conn:
        shared = self._map_fd if mapped else None
        try:
            conn = _Conn(self.socket_path, self._token, self._staging, self.timeout,
                         shared=shared)
        except TimeoutError as exc:
            raise DeadlineExceeded(f"{self.name}: the node's files socket {self.socket_path} "
                                   f"did not answer within {self.timeout:g} s") from exc
        except (OSError, ValueError) as exc:
            raise Unavailable(f"{self.name}: cannot use the node's files socket "
                              f"{self.socket_path}: {exc}") from exc
        with self._lock:
            self._all.add(conn)
        return conn

    def _take(self, mapped: bool = False) -> _Conn:
        with self._lock:
            if self._closed:
                raise Unavailable(f"{self.name}: the source is closed")
            for i in range(len(self._idle) - 1, -1, -1):
                if self._idle[i].shared == mapped:
                    return self._idle.pop(i)
        return self._connect(mapped)

    def _give_back(self, conn: _Conn) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(conn)
                return
        self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        with self._lock:
            self._all.discard(conn)
        conn.close()

    def close(self) -> None:
        """Close the connections (the node drops its copies of the memory) and the file's
        memfd; a :meth:`mapping` lives on while tensors view it."""
        with self._lock:
            self._closed = True
            conns = list(self._all)
            self._all.clear()
            self._idle.clear()
            fd, self._map_fd = self._map_fd, None
        for c in conns:
            c.close()
        if fd is not None:
            os.close(fd)


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
