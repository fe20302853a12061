"""Unix-socket helpers shared by the gRPC server and the FUSE server (neither imports the other),
and systemd's readiness notification (``sd_notify``: a datagram on a unix socket)."""

from __future__ import annotations

import os
import socket

__all__ = ["sd_notify", "socket_answers"]


def socket_answers(path: str, timeout: float = 1.0) -> bool:
    """Whether something accepts connections on the unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(path)
        except OSError:
            return False
        return True


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
