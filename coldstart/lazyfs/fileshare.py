"""The files socket: the bytes of lazily mounted files for loaders inside containers.

A weights loader that reads a multi-GB safetensors file through the FUSE mount gets it page by
page (or at the read-ahead's pace); through this socket it asks for whole ranges, which the FUSE
server fetches over the same get-or-fetch path as a FUSE read (:meth:`LayerReader.read_pieces`:
cache, single flight, coalesced range requests in the fetch pool, every chunk verified against
its digest, cached for the next container) and writes straight into the caller's staging file,
a ``memfd`` it passed with ``open``. Many connections at once (one per loader thread) keep many
requests in flight. The protocol and the trust boundary (file tokens, issued through
``getxattr`` to whoever may read the file) are in :mod:`.filewire`.

The socket is meant to be mounted into containers (its directory holds nothing else), so it is
world-connectable: a token is what grants access, and a token is only worth the bytes of the
one file it names. Threads, not the trio loop: every request blocks on fetches and ``pwrite``;
connections are bounded (:data:`MAX_CONNECTIONS`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coldstart.errors import ColdstartError, FailedPrecondition, InvalidArgument, NotFound
from coldstart.format.toc import Entry
from coldstart.lazyfs import control, filewire
from coldstart.lazyfs.filewire import FileToken
from coldstart.lazyfs.reader import LayerReader
from coldstart.unixsock import socket_answers

__all__ = ["MAX_CONNECTIONS", "MAX_STAGING", "FileShare"]

log = logging.getLogger(__name__)

#: connections served at once (each is a thread); one more is answered Unavailable and closed
MAX_CONNECTIONS = 64
#: largest staging file a connection may hand over (a whole file's memfd, filled in place)
MAX_STAGING = 1 << 40
#: a request line longer than this ends the connection (requests are a few hundred bytes)
_MAX_LINE = 64 << 10

#: finds the layer a token names: digest -> (reader, entry of that slot) or None
Layers = Callable[[str, int], "tuple[LayerReader, Entry] | None"]


@dataclass
class _Opened:
    reader: LayerReader
    entry: Entry
    fd: int
    staging: int


class FileShare:
    """Serve :mod:`.filewire` on the unix socket ``path`` (``start``/``close``).

    ``layers(digest, slot)`` looks up a mounted layer's file; :meth:`token` is what the FUSE
    file system answers to ``getxattr(FILE_XATTR)`` (the secret is this process's own: a
    restarted server issues new tokens, and a loader asks again)."""

    def __init__(self, path: str, layers: Layers) -> None:
        self.path = path
        self._layers = layers
        self._secret = secrets.token_bytes(32)
        self._sock: socket.socket | None = None
        self._ino: int | None = None
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
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
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            # world-searchable: the directory is what containers mount
            path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            sock.bind(self.path)
            self._ino = os.stat(self.path).st_ino
            os.chmod(self.path, 0o666)      # a token, not the uid, is what grants access
            sock.listen(64)
        except OSError as exc:
            sock.close()
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
        if self._ino is not None:
            with contextlib.suppress(OSError):
                if os.stat(self.path).st_ino == self._ino:
                    os.unlink(self.path)
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
                continue
            if not self._slots.acquire(blocking=False):
                with contextlib.suppress(OSError):
                    conn.sendall(control.error_reply(FailedPrecondition(
                        f"the files socket serves {MAX_CONNECTIONS} connections at most")))
                conn.close()
                continue
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="files-conn",
                             daemon=True).start()

    # -- one connection --------------------------------------------------------------------

    def _serve(self, conn: socket.socket) -> None:
        opened: _Opened | None = None
        lines = control.LineBuffer(_MAX_LINE)
        try:
            while not self._closed.is_set():
                try:
                    data, fds, _flags, _addr = socket.recv_fds(conn, 65536, 4)
                except OSError:
                    return
                if not data:
                    for fd in fds:
                        os.close(fd)
                    return
                try:
                    requests = lines.feed(data)
                except InvalidArgument as exc:
                    for fd in fds:
                        os.close(fd)
                    conn.sendall(control.error_reply(exc))
                    return
                for line in requests:
                    reply, opened = self._answer(line, fds, opened)
                    fds = []            # the descriptors came with the first line
                    conn.sendall(reply)
                for fd in fds:          # sent without a request to take them
                    os.close(fd)
        except OSError:
            return
        finally:
            if opened is not None:
                os.close(opened.fd)
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            self._slots.release()

    def _answer(self, line: bytes, fds: list[int], opened: _Opened | None,
                ) -> tuple[bytes, _Opened | None]:
        """One request's reply, and the connection's opened file after it."""
        try:
            req = json.loads(line)
            if not isinstance(req, dict):
                raise InvalidArgument("request must be a JSON object")
            op = req.get("op")
            if op == filewire.OPEN:
                if opened is not None:
                    raise InvalidArgument("this connection has opened a file already")
                if len(fds) != 1:
                    raise InvalidArgument("open takes exactly one descriptor (the staging "
                                          f"file), not {len(fds)}")
                new = self._open(req, fds.pop())
                return control.ok_reply({"size": new.entry.size, "name": new.entry.name}), new
            for fd in fds:
                os.close(fd)
            fds.clear()
            if op == filewire.READ:
                if opened is None:
                    raise InvalidArgument("read before open")
                return control.ok_reply(self._read(opened, req)), opened
            raise InvalidArgument(f"unknown op {op!r}")
        except ColdstartError as exc:
            reply = control.error_reply(exc)
        except (ValueError, RecursionError) as exc:
            reply = control.error_reply(InvalidArgument(f"bad request: {exc}"))
        except Exception as exc:
            log.exception("files socket request failed")
            reply = control.error_reply(ColdstartError(f"internal error: {exc}"))
        for fd in fds:
            os.close(fd)
        return reply, opened

    def _open(self, req: dict[str, Any], fd: int) -> _Opened:
        try:
            text = req.get("token")
            if not isinstance(text, str):
                raise InvalidArgument("open needs a token (the file's "
                                      f"{filewire.FILE_XATTR} attribute)")
            token = FileToken.parse(text)
            token.check(self._secret)
            found = self._layers(token.digest, token.slot)
            if found is None:
                raise NotFound(f"layer {token.digest} is not mounted on this node any more")
            reader, entry = found
            if entry.type != "reg" or entry.size != token.size:
                raise FailedPrecondition(f"layer {token.digest}: slot {token.slot} is not the "
                                         "file the token was issued for")
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or not 0 < st.st_size <= MAX_STAGING:
                raise InvalidArgument("the staging descriptor must be a regular file (a memfd) "
                                      f"of 1 byte to {MAX_STAGING} bytes")
            return _Opened(reader, entry, fd, st.st_size)
        except BaseException:
            os.close(fd)
            raise

    def _read(self, opened: _Opened, req: dict[str, Any]) -> int:
        offset, length, at = req.get("offset"), req.get("length"), req.get("at")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                   for v in (offset, length, at)):
            raise InvalidArgument("read needs offset, length and at: integers >= 0")
        assert isinstance(offset, int) and isinstance(length, int) and isinstance(at, int)
        if at + length > opened.staging:
            raise InvalidArgument(f"{length} bytes at {at} do not fit the staging file "
                                  f"({opened.staging} bytes)")
        pieces = opened.reader.read_pieces(opened.entry, offset, length, follow=False)
        pos = at
        for p in pieces:
            view = memoryview(p)
            while view.nbytes:
                try:
                    n = os.pwrite(opened.fd, view, pos)
                except OSError as exc:
                    raise InvalidArgument(f"cannot write the staging file: {exc}") from exc
                pos += n
                view = view[n:]
        return pos - at
