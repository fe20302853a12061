"""A real redis-server (Debian's, Redis 7) on loopback, no persistence, in a directory."""

from __future__ import annotations

import contextlib
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

from coldstart.errors import FailedPrecondition
from coldstart.stack.procs import daemon, free_port

REDIS_BIN = shutil.which("redis-server") or "/usr/bin/redis-server"


def answers_ping(port: int) -> Callable[[], bool]:
    """A readiness check: the server on ``port`` answers ``PING`` (not only accepts)."""
    def check() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    return check


@contextlib.contextmanager
def start_redis(tmp: Path) -> Iterator[str]:
    """Run redis-server in ``tmp`` until the block ends; yields its ``redis://…/0`` URL."""
    if not Path(REDIS_BIN).exists():
        raise FailedPrecondition("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    argv = [
        REDIS_BIN, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(tmp),
        "--save", "", "--appendonly", "no", "--protected-mode", "yes", "--daemonize", "no",
        "--logfile", "",
    ]
    with daemon(argv, log=tmp / "redis.log", ready=answers_ping(port), what="redis-server"):
        yield f"redis://127.0.0.1:{port}/0"
