"""Unix-socket helpers shared by the gRPC server and the FUSE server (neither imports the other)."""

from __future__ import annotations

import socket

__all__ = ["socket_answers"]


def socket_answers(path: str, timeout: float = 1.0) -> bool:
    """Whether something accepts connections on the unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(path)
        except OSError:
            return False
        return True
