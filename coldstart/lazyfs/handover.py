"""A FUSE server that takes over its dead predecessor's kernel connection.

The server's ``/dev/fuse`` descriptor is also kept by a holder process
(:mod:`coldstart.lazyfs.holder`), so the connection outlives the server. A new server gets it
back (:func:`fetch`) and serves it (:meth:`coldstart.lazyfs.fusewire.FuseSession.adopt`: no
``FUSE_INIT`` again, the kernel keeps what it negotiated with the first server; the requests
the dead server had read but not answered are queued again): every container keeps its
mounts, and its reads wait in the kernel while no server runs instead of failing.

Each of the server's two connections (:mod:`coldstart.lazyfs.fusefs`) has a holder of its own:
:data:`HOLDER_SOCKET` and :data:`PLAIN_HOLDER_SOCKET`.

The new server must answer for the same inode numbers as its predecessor (the kernel caches
them): each layer is restored under its recorded name and inode range before the connection
is served (:mod:`coldstart.lazyfs.mountstate` keeps both).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import sys
from pathlib import Path

from coldstart.errors import FailedPrecondition

__all__ = ["HOLDER_SOCKET", "PLAIN_HOLDER_SOCKET", "fetch", "hold", "release"]

log = logging.getLogger(__name__)

#: the holder's socket, in the FUSE server's root
HOLDER_SOCKET = "fuse-holder.sock"
#: the holder of the connection that answers no extended attributes (``<root>/fuse-plain``)
PLAIN_HOLDER_SOCKET = "fuse-plain-holder.sock"

_TIMEOUT = 5.0


def _ask(path: str, request: bytes, fd: int | None = None) -> tuple[bytes, list[int]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(_TIMEOUT)
        conn.connect(path)
        socket.send_fds(conn, [request], [fd] if fd is not None else [])
        msg, fds, _flags, _addr = socket.recv_fds(conn, 16, 1)
    return msg, fds


def hold(fd: int, root: Path, *, name: str = HOLDER_SOCKET) -> None:
    """Give a copy of ``fd`` to the root's holder ``name``, starting one if none answers."""
    path = str(root / name)
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


def fetch(root: Path, *, name: str = HOLDER_SOCKET) -> int | None:
    """The connection a dead predecessor left with the holder ``name``, or None (no holder,
    or it holds nothing)."""
    path = root / name
    if not path.exists():
        return None
    try:
        msg, fds = _ask(str(path), b"GET")
    except OSError:
        return None
    if msg != b"FD" or not fds:
        return None
    return fds[0]


def release(root: Path, *, name: str = HOLDER_SOCKET) -> None:
    """Tell the holder ``name`` to let go (the server unmounted: nothing to keep)."""
    with contextlib.suppress(OSError):
        _ask(str(root / name), b"DROP")
