"""The files socket: the bytes of lazily mounted files for loaders inside containers.

A weights loader that reads a multi-GB safetensors file through the FUSE mount gets it page by
page (or at the read-ahead's pace); through this socket it asks for whole ranges, which the FUSE
server fetches over the same get-or-fetch path as a FUSE read (:meth:`LayerReader.read_pieces`:
cache, single flight, coalesced range requests in the fetch pool, every chunk verified against
its digest, cached for the next container) and writes straight into the caller's memory, a
``memfd`` it passes with each request. Many connections at once (one per loader thread) keep
many requests in flight. The protocol and the trust boundary (file tokens, issued through
``getxattr`` to whoever may read the file) are in :mod:`.filewire`.

The socket is meant to be mounted into containers (its directory holds nothing else), so it is
world-connectable: a token is what grants access, and a token is only worth the bytes of the
one file it names. What a caller can make the node spend is bounded: a request reads at most
:data:`~coldstart.lazyfs.filewire.MAX_READ` bytes, into memory the caller has already
allocated (only a memfd, whose pages in the range must exist: the node allocates nothing for
it); connections are bounded in all (:data:`MAX_CONNECTIONS`) and per container (its cgroup,
:data:`PER_PEER`), and one that says nothing for :data:`IDLE_SECONDS` is closed. Threads, not
the trio loop: every request blocks on fetches and ``pwrite``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hmac
import json
import logging
import os
import secrets
import signal
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coldstart.errors import (
    ColdstartError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from coldstart.format.toc import Entry
from coldstart.lazyfs import control, filewire
from coldstart.lazyfs.filewire import FileToken
from coldstart.lazyfs.reader import LayerReader
from coldstart.lazyfs.residency import PAGE, resident
from coldstart.unixsock import listen_unix, socket_answers, unlink_own

__all__ = ["IDLE_SECONDS", "MAX_CONNECTIONS", "PER_PEER", "FileShare", "sees_file",
           "shows_layer"]

log = logging.getLogger(__name__)

#: connections served at once (each is a thread); one more is answered and closed
MAX_CONNECTIONS = 1024
#: connections of one container (its cgroup; a process outside any: its pid) at once
PER_PEER = 256
#: a connection with no complete request for this long is closed
IDLE_SECONDS = 60.0
#: bytes all requests in flight may hold at once (each waits for its share): four of the
#: largest; with 512 MiB the server image's fast path held the FUSE server at 530 MB, with
#: this at 337 MB, loading as fast (issue 49)
BUDGET_BYTES = 64 << 20
#: beside an error reply: worth sending again (:data:`filewire.RETRY`)
_RETRY = {filewire.RETRY: True}
#: a request line longer than this ends the connection (requests are a few hundred bytes)
_MAX_LINE = 64 << 10

#: finds the layer a token names: digest -> (reader, entry of that slot) or None
Layers = Callable[[str, int], "tuple[LayerReader, Entry] | None"]
#: how a served layer shows in a mount table: digest -> (the ``major:minor`` device of the FUSE
#: connection it is served on, the layer's directory there: ``/<key>``), or None
Shown = Callable[[str], "tuple[str, str] | None"]


class FileShare:
    """Serve :mod:`.filewire` on the unix socket ``path`` (``start``/``close``).

    ``layers(digest, slot)`` looks up a mounted layer's file; :meth:`token` is what the FUSE
    file system answers to ``getxattr(FILE_XATTR)`` (the secret is this process's own: a
    restarted server issues new tokens, and a loader asks again). ``shown(digest)``: how the
    layer shows in a mount table; a token is served only to a caller that can see its file
    itself (:func:`sees_file`): a token handed to, or stolen by, a process of another
    container reads nothing."""

    def __init__(self, path: str, layers: Layers, *, shown: Shown) -> None:
        self.path = path
        self._layers = layers
        self._shown = shown
        self._secret = secrets.token_bytes(32)
        self._sock: socket.socket | None = None
        self._ino: int | None = None
        self._conns: dict[socket.socket, str] = {}      # connection -> its peer's key
        self._lock = threading.Lock()
        self._budget = threading.Condition(self._lock)
        self._holding = 0                   # bytes the requests in flight hold
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def token(self, digest: str, slot: int, size: int) -> bytes:
        return FileToken.issue(self._secret, digest, slot, size).encode()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Listen (FailedPrecondition if the path is taken by a live socket or cannot be
        bound) and serve in a thread."""
        path = Path(self.path)
        if socket_answers(self.path):
            raise FailedPrecondition(f"something already answers on the files socket {path}")
        try:
            # world-searchable: the directory is what containers mount; world-connectable: a
            # token, not the uid, is what grants access
            sock, self._ino = listen_unix(self.path, mode=0o666, dir_mode=0o755)
        except OSError as exc:
            raise FailedPrecondition(f"cannot listen on the files socket {path}: "
                                     f"{exc}") from exc
        self._sock = sock
        self._thread = threading.Thread(target=self._accept, name="files-socket", daemon=True)
        self._thread.start()
        log.info("files socket %s: lazily mounted files served to loaders", path)

    def close(self) -> None:
        """Stop listening, close every connection (their requests in flight end with their
        fetches), remove our socket (never a successor's)."""
        self._closed.set()
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        unlink_own(self.path, self._ino)
        self._ino = None
        if self._thread is not None:
            self._thread.join(5.0)

    def _accept(self) -> None:
        while not self._closed.is_set():
            sock = self._sock
            if sock is None:
                return
            try:
                conn, _ = sock.accept()
            except OSError:
                if self._closed.is_set():
                    return
                time.sleep(0.1)     # out of descriptors, say: not a busy loop
                continue
            peer = _peer(conn)[0]
            with self._lock:
                total = len(self._conns)
                mine = sum(1 for p in self._conns.values() if p == peer)
                refused = total >= MAX_CONNECTIONS or mine >= PER_PEER
                if not refused:
                    self._conns[conn] = peer
            if refused:
                with contextlib.suppress(OSError):
                    conn.settimeout(1.0)
                    conn.sendall(control.error_reply(Unavailable(
                        f"the files socket serves {MAX_CONNECTIONS} connections at most, "
                        f"{PER_PEER} per container"), **_RETRY))
                conn.close()
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), name="files-conn",
                                 daemon=True).start()
            except RuntimeError as exc:     # no thread to be had (a process limit): refuse
                log.warning("files socket: connection refused: %s", exc)
                with self._lock:
                    self._conns.pop(conn, None)
                conn.close()

    # -- one connection --------------------------------------------------------------------

    def _serve(self, conn: socket.socket) -> None:
        lines = control.LineBuffer(_MAX_LINE)
        fds: list[int] = []
        caller = _Caller.of(conn)
        seen: dict[str, bool] = {}     # token -> whether this caller sees its file itself
        try:
            conn.settimeout(IDLE_SECONDS)
            while not self._closed.is_set():
                try:
                    data, got, _flags, _addr = socket.recv_fds(conn, 65536, 4)
                except OSError:     # the peer went, or said nothing for IDLE_SECONDS
                    return
                fds += got
                if not data:
                    return
                try:
                    requests = lines.feed(data)
                except InvalidArgument as exc:
                    conn.sendall(control.error_reply(exc))
                    return
                for line in requests:
                    fd = fds.pop(0) if fds else None    # a request's descriptor came with it
                    try:
                        reply = self._answer(line, fd, caller, seen)
                    finally:
                        if fd is not None:
                            os.close(fd)
                    conn.sendall(reply)
                # sent without a request to take them (one may wait for the rest of its line)
                while len(fds) > (1 if lines.pending else 0):
                    os.close(fds.pop(0))
        except OSError:
            return
        finally:
            for fd in fds:
                os.close(fd)
            caller.close()
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _answer(self, line: bytes, fd: int | None, caller: _Caller,
                seen: dict[str, bool]) -> bytes:
        """One request's reply (``seen``: the connection's answers of :func:`sees_file` so
        far, by token)."""
        try:
            req = json.loads(line)
            if not isinstance(req, dict):
                raise InvalidArgument("request must be a JSON object")
            op = req.get("op")
            if op not in (filewire.STAT, filewire.READ):
                raise InvalidArgument(f"unknown op {op!r}")
            try:
                reader, entry = self._file(req)
            except (FailedPrecondition, NotFound) as exc:   # a token or mount of another time
                return control.error_reply(exc, **_RETRY)
            token = str(req["token"])
            if token not in seen:
                seen[token] = caller.sees(self._shown(reader.digest), entry.name, token)
            if not seen[token]:
                raise FailedPrecondition(
                    f"layer {reader.digest}: {entry.name!r} is not a file the caller (pid "
                    f"{caller.pid}) can see itself, through a mount of the layer or at that "
                    "path of its root: a file token serves only such a process")
            if op == filewire.STAT:
                return control.ok_reply({"size": entry.size, "name": entry.name})
            if fd is None:
                raise InvalidArgument("read takes one descriptor: a memfd to fill")
            return control.ok_reply(self._read(reader, entry, req, fd))
        except ColdstartError as exc:
            return control.error_reply(exc)
        except (ValueError, RecursionError) as exc:
            return control.error_reply(InvalidArgument(f"bad request: {exc}"))
        except Exception as exc:
            log.exception("files socket request failed")
            return control.error_reply(ColdstartError(f"internal error: {exc}"))

    def _file(self, req: dict[str, Any]) -> tuple[LayerReader, Entry]:
        """The file a request's token names (FailedPrecondition, NotFound, InvalidArgument)."""
        text = req.get("token")
        if not isinstance(text, str):
            raise InvalidArgument(f"a request needs a token (the file's {filewire.FILE_XATTR} "
                                  "attribute)")
        token = FileToken.parse(text)
        token.check(self._secret)
        found = self._layers(token.digest, token.slot)
        if found is None:
            raise NotFound(f"layer {token.digest} is not mounted on this node any more")
        reader, entry = found
        if entry.type != "reg" or entry.size != token.size:
            raise FailedPrecondition(f"layer {token.digest}: slot {token.slot} is not the file "
                                     "the token was issued for")
        return reader, entry

    def _read(self, reader: LayerReader, entry: Entry, req: dict[str, Any], fd: int) -> int:
        offset, length, at = req.get("offset"), req.get("length"), req.get("at")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                   for v in (offset, length, at)):
            raise InvalidArgument("read needs offset, length and at: integers >= 0")
        assert isinstance(offset, int) and isinstance(length, int) and isinstance(at, int)
        if length > filewire.MAX_READ:
            raise InvalidArgument(f"a read asks for {filewire.MAX_READ} bytes at most, "
                                  f"not {length}")
        length = max(0, min(length, entry.size - offset))
        _check_memory(fd, at, length)
        with self._budget:
            self._budget.wait_for(lambda: self._holding + length <= BUDGET_BYTES
                                  or self._holding == 0)
            self._holding += length
        try:
            pieces = reader.read_pieces(entry, offset, length, follow=False)
            pos = at
            for p in pieces:
                view = memoryview(p)
                # again just before writing: pages dropped meanwhile must not be ours to make
                _check_memory(fd, pos, view.nbytes)
                while view.nbytes:
                    try:
                        n = os.pwrite(fd, view, pos)
                    except OSError as exc:
                        raise Unavailable(f"cannot write the caller's memory: {exc}") from exc
                    pos += n
                    view = view[n:]
            return pos - at
        finally:
            with self._budget:
                self._holding -= length
                self._budget.notify_all()


def _check_memory(fd: int, at: int, length: int) -> None:
    """InvalidArgument unless ``fd`` is a memfd whose pages ``[at, at+length)`` exist: the node
    writes into memory the caller allocated (and is charged for), never a file on a disk,
    never pages it would have to allocate."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
        st = os.fstat(fd)
    except OSError as exc:
        raise InvalidArgument(f"the descriptor is unusable: {exc}") from exc
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if (not target.startswith("/memfd:") or not stat.S_ISREG(st.st_mode)
            or seals & filewire.SEALS != filewire.SEALS):
        raise InvalidArgument("the descriptor must be a memfd (memfd_create) sealed against "
                              "growing and shrinking (F_SEAL_GROW, F_SEAL_SHRINK)")
    if not length:
        return
    if at + length > st.st_size:
        raise InvalidArgument(f"{length} bytes at {at} do not fit the memfd "
                              f"({st.st_size} bytes)")
    missing = _first_missing_page(fd, at, length)
    if missing is not None:
        raise InvalidArgument(f"the memfd has no pages at {missing} (fault {at}..{at + length} "
                              "in before asking: the memory must be the caller's)")


def _first_missing_page(fd: int, at: int, length: int) -> int | None:
    """The offset of the first page of ``[at, at+length)`` the memfd ``fd`` has no page for
    (None: every page is there), by ``mincore`` of a mapping of just that range: its cost
    follows the range, where ``SEEK_HOLE`` walks every page from ``at`` to the first hole
    (to the end of a memfd filled whole: a load's every request paid for the file). A page
    ``mincore`` finds missing is asked of ``SEEK_HOLE`` (from there): one swapped out is
    the caller's all the same."""
    lo = at - at % PAGE
    try:
        i = resident(fd, lo, at + length - lo).find(0)
    except OSError as exc:
        raise InvalidArgument(f"cannot check the memfd's pages: {exc}") from exc
    if i < 0:
        return None
    # not resident: a hole, or a page swapped out (the caller's still: the kernel says so)
    try:
        hole = os.lseek(fd, max(at, lo + i * PAGE), os.SEEK_HOLE)
    except OSError as exc:
        raise InvalidArgument(f"cannot check the memfd's pages: {exc}") from exc
    return hole if hole < at + length else None


def _peer(conn: socket.socket) -> tuple[str, int]:
    """Whose connection this is: the peer's cgroup (a container: cgroup v2's line, else the
    first v1 hierarchy that places it somewhere other than the root), else its pid; and its
    pid (0: unknown)."""
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid = struct.unpack("3i", creds)[0]
    except OSError:
        pid = 0
    if pid <= 0:
        return f"connection {id(conn)}", 0
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = [line.strip() for line in f]
    except OSError:
        lines = []
    paths = [line.split(":", 2)[2] for line in lines if line.count(":") >= 2]
    v2 = [line.split(":", 2)[2] for line in lines if line.startswith("0::")]
    for path in v2 + paths:
        if path not in ("", "/"):
            return path, pid
    return f"pid {pid}", pid


#: SO_PEERPIDFD (Linux 6.5): a pidfd of the peer, which outlives a reuse of its pid
_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)


class _Caller:
    """The process at the other end of a connection: its pid (SO_PEERCRED) and, where the
    kernel gives one, a pidfd taken at accept (SO_PEERPIDFD): what is read of ``/proc/PID``
    counts only if the pidfd still names a live process afterwards (the pid was not reused)."""

    def __init__(self, pid: int, pidfd: int | None) -> None:
        self.pid = pid
        self.pidfd = pidfd

    @classmethod
    def of(cls, conn: socket.socket) -> _Caller:
        pid = _peer(conn)[1]
        try:
            pidfd: int | None = conn.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
        except OSError:
            pidfd = None
        return cls(pid, pidfd)

    def alive(self) -> bool:
        """Whether the process the connection came from still runs (without a pidfd: its
        pid does)."""
        if self.pidfd is None:
            return os.path.exists(f"/proc/{self.pid}")
        try:
            signal.pidfd_send_signal(self.pidfd, 0)
        except OSError:
            return False
        return True

    def sees(self, shown: tuple[str, str] | None, name: str, token: str) -> bool:
        """:func:`sees_file` for this caller, counted only if it is still the same process."""
        if self.pid <= 0:
            return False
        ok = sees_file(self.pid, shown, name, token)
        return ok and self.alive()

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def shows_layer(mountinfo: str, shown: tuple[str, str]) -> bool:
    """Whether a mount table (``/proc/PID/mountinfo``) holds a mount of the FUSE connection
    that serves a layer (its ``major:minor`` device) whose root is the whole file system or
    the layer's directory (``/<key>``) or a directory in it: a mount only the node can make."""
    dev, root = shown
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if len(fields) > 4 and fields[2] == dev and (
                fields[3] in ("/", root) or fields[3].startswith(root + "/")):
            return True
    return False


def sees_file(pid: int, shown: tuple[str, str] | None, name: str, token: str) -> bool:
    """Whether process ``pid`` can see the layer's file ``name`` (whose token is ``token``)
    itself: its mount namespace holds a mount of the layer (:func:`shows_layer`: the node's
    own processes), or its root holds, at ``name``, that very file (a container whose root is
    the image's overlay): reached without following a symlink, its ``NODE_XATTR`` attribute
    is ``token`` (the FUSE file system answers it, through the container's overlay, only for
    that file of that layer; a ``trusted.*`` attribute, which a container cannot set on a
    file of its own as it can a ``user.*`` one). A path in the caller's root is the caller's
    to make, a mount table's paths too (a volume at a node's path, an overlay naming one):
    neither counts, only the device and what the file system itself answers. False when
    nothing can be read (the process is gone)."""
    if shown is not None:
        try:
            with open(f"/proc/{pid}/mountinfo") as f:
                if shows_layer(f.read(), shown):
                    return True
        except OSError:
            return False
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        return False
    try:
        fd = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = os.O_PATH | os.O_NOFOLLOW | (0 if last else os.O_DIRECTORY)
            nxt = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = nxt
        got = os.getxattr(f"/proc/self/fd/{fd}", filewire.NODE_XATTR)
    except OSError:
        return False
    finally:
        os.close(fd)
    return hmac.compare_digest(got, token.encode())
