"""A FUSE server that takes over its dead predecessor's kernel connection.

The server's ``/dev/fuse`` descriptor is also kept by a holder process
(:mod:`coldstart.lazyfs.holder`), so the connection outlives the server. A new server gets it
back (:func:`fetch`) and serves it: every container keeps its mounts, and its reads wait in
the kernel while no server runs instead of failing.

libfuse (through pyfuse3) cannot be given a connection whose ``FUSE_INIT`` is long done: it
answers every request before an INIT with EIO. So (:class:`Takeover`) the session is started
on one end of a socket pair and fed an INIT of our own, like the one the kernel sent (its
answer is dropped: the kernel keeps what it negotiated with the first server); then the
descriptor number libfuse reads is pointed (``dup2``) at the real connection, the requests the
dead server had read but not answered are queued again (``FUSE_NOTIFY_RESEND``, Linux 6.9),
and libfuse's reader is woken once the connection has a request for it.

The new server must answer for the same inode numbers as its predecessor (the kernel caches
them): each layer is restored under its recorded name and inode range before the connection
is served (:mod:`coldstart.lazyfs.mountstate` keeps both).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import trio

from coldstart.errors import FailedPrecondition
from coldstart.lazyfs.fusefs import FuseFS, fuse_init

__all__ = ["HOLDER_SOCKET", "Takeover", "fetch", "find_fuse_fd", "hold", "release"]

log = logging.getLogger(__name__)

#: the holder's socket, in the FUSE server's root
HOLDER_SOCKET = "fuse-holder.sock"

# linux/fuse.h
_FUSE_INIT = 26
_FUSE_NOTIFY_RESEND = 7
_IN_HEADER = struct.Struct("<IIQQIIIHH")
_OUT_HEADER = struct.Struct("<IiQ")
#: protocol 7.38; every capability a current kernel offers in FUSE_INIT (libfuse picks from
#: them as it did with the first server; what matters to it is the buffer size that
#: FUSE_MAX_PAGES allows: the kernel refuses reads into a smaller buffer than it negotiated)
_INIT_MINOR = 38
_INIT_FLAGS = sum(1 << b for b in (0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17,
                                   18, 19, 20, 21, 22, 23, 24, 25, 30))
_TIMEOUT = 5.0


def find_fuse_fd() -> int | None:
    """This process's ``/dev/fuse`` descriptor (pyfuse3 does not say which it is)."""
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}") == "/dev/fuse":
                return int(name)
    return None


def _ask(path: str, request: bytes, fd: int | None = None) -> tuple[bytes, list[int]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(_TIMEOUT)
        conn.connect(path)
        socket.send_fds(conn, [request], [fd] if fd is not None else [])
        msg, fds, _flags, _addr = socket.recv_fds(conn, 16, 1)
    return msg, fds


def hold(fd: int, root: Path) -> None:
    """Give a copy of ``fd`` to the root's holder, starting one if none answers."""
    path = str(root / HOLDER_SOCKET)
    try:
        msg, _ = _ask(path, b"PUT", fd)
    except OSError:
        # its own session: a kill of the server's process group leaves it alone
        proc = subprocess.Popen([sys.executable, "-m", "coldstart.lazyfs.holder", path],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, start_new_session=True,
                                close_fds=True)
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        proc.stdout.close()
        if ready.strip() != b"ready":
            raise FailedPrecondition(f"the FUSE descriptor holder did not start ({path})") \
                from None
        msg, _ = _ask(path, b"PUT", fd)
    if msg != b"OK":
        raise FailedPrecondition(f"the FUSE descriptor holder at {path} refused the "
                                 f"descriptor ({msg!r})")
    log.info("FUSE connection held by the holder at %s", path)


def fetch(root: Path) -> int | None:
    """The connection a dead predecessor left with the holder, or None (no holder, or it
    holds nothing)."""
    path = root / HOLDER_SOCKET
    if not path.exists():
        return None
    try:
        msg, fds = _ask(str(path), b"GET")
    except OSError:
        return None
    if msg != b"FD" or not fds:
        return None
    return fds[0]


def release(root: Path) -> None:
    """Tell the holder to let go (the server unmounted: nothing to keep)."""
    with contextlib.suppress(OSError):
        _ask(str(root / HOLDER_SOCKET), b"DROP")


def _init_request() -> bytes:
    body = struct.pack("<IIIII44x", 7, _INIT_MINOR, 128 << 10, _INIT_FLAGS, 0)
    return _IN_HEADER.pack(_IN_HEADER.size + len(body), _FUSE_INIT, 0, 0, 0, 0, 0, 0, 0) + body


class Takeover:
    """Serve ``fs`` on the connection ``fd``: construct (this calls ``pyfuse3.init``), start
    the FUSE main loop, then ``await switch()``."""

    def __init__(self, fs: FuseFS, fd: int) -> None:
        self.fd = fd
        ours, self._peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._session = ours.detach()
        # libfuse takes "/dev/fd/N" for a connection opened (and mounted) by someone else
        fuse_init(fs, f"/dev/fd/{self._session}")
        self._peer.setblocking(False)

    async def switch(self) -> None:
        """Once the main loop runs: INIT it, then hand it the real connection."""
        peer = self._peer
        peer.send(_init_request())
        with trio.fail_after(_TIMEOUT):
            await trio.lowlevel.wait_readable(peer)
        reply = peer.recv(4096)
        _, error, _ = _OUT_HEADER.unpack_from(reply)
        if error != 0:
            raise FailedPrecondition(f"libfuse refused the takeover's INIT ({error})")
        # libfuse waits on its descriptor number in trio's epoll; that registration is for
        # the socket, which must stay open until the waiter is woken through it
        keep = os.dup(self._session)
        os.dup2(self.fd, self._session, inheritable=False)
        try:
            os.write(self.fd, _OUT_HEADER.pack(_OUT_HEADER.size, _FUSE_NOTIFY_RESEND, 0))
        except OSError as exc:      # before Linux 6.9: those reads wait until interrupted
            log.warning("the kernel cannot resend the requests the dead server had taken "
                        "(FUSE_NOTIFY_RESEND: %s); their readers wait until interrupted", exc)
        log.info("took over the FUSE connection")
        spare = os.dup(self.fd)
        try:
            # wake libfuse's reader only when a request waits: its descriptor blocks, and a
            # read with nothing queued would stall the whole loop
            await trio.lowlevel.wait_readable(spare)
            peer.send(b"!")
            await trio.sleep(0.1)
        finally:
            trio.lowlevel.notify_closing(spare)
            os.close(spare)
            os.close(keep)
            peer.close()
