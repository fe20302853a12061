"""Unix-socket helpers shared by the gRPC server and the FUSE server (neither imports the other),
and systemd's readiness notification (``sd_notify``: a datagram on a unix socket)."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

__all__ = ["listen_unix", "sd_notify", "socket_answers", "unlink_own"]


def socket_answers(path: str, timeout: float = 1.0) -> bool:
    """Whether something accepts connections on the unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(path)
        except OSError:
            return False
        return True


def listen_unix(path: str, *, mode: int, dir_mode: int,
                backlog: int = 64) -> tuple[socket.socket, int]:
    """Listen on a unix stream socket at ``path``, with permissions ``mode``, in a directory
    made ``dir_mode`` if missing; whatever was at ``path`` is removed first (the caller made
    sure nothing answers there). Returns the socket and its inode (for :func:`unlink_own`);
    raises OSError."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        Path(path).parent.mkdir(mode=dir_mode, parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        sock.bind(path)
        ino = os.stat(path).st_ino
        os.chmod(path, mode)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock, ino


def unlink_own(path: str, ino: int | None) -> None:
    """Remove the socket at ``path`` if it is still ours (inode ``ino``), never a successor's
    that replaced it."""
    if ino is None:
        return
    with contextlib.suppress(OSError):
        if os.stat(path).st_ino == ino:
            os.unlink(path)


def sd_notify(state: str, path: str | None = None) -> bool:
    """Tell systemd ``state`` (``"READY=1"``) on ``$NOTIFY_SOCKET`` (a ``Type=notify`` unit's);
    an ``@name`` is an abstract socket. False when there is no such socket or it failed (a
    daemon not under systemd carries on)."""
    path = os.environ.get("NOTIFY_SOCKET", "") if path is None else path
    if not path or path[0] not in "/@":   # vsock addresses: not ours to speak
        return False
    address = "\0" + path[1:] if path[0] == "@" else path
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        try:
            s.connect(address)
            s.sendall(state.encode())
        except OSError:
            return False
    return True
