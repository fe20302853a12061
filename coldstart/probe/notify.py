"""sd_notify: the app pushes its readiness to a unix datagram socket named by ``$NOTIFY_SOCKET``.

The wire format is systemd's (``sd_notify(3)``): newline-separated ``KEY=VALUE`` assignments in one
datagram. We read ``READY=1``, ``STOPPING=1``, ``RELOADING=1`` and ``STATUS=…``, plus two
variables of our own, prefixed ``X_`` as systemd recommends for extensions: ``X_PHASE=…`` and
``X_PROGRESS=0.42``; ``coldstart warmup run`` adds ``X_WARMUP=hit|partial|miss`` to the app's
``READY=1``. An app that already calls ``sd_notify`` (or systemd's Python bindings) works
unchanged; one that does not needs two lines::

    from coldstart.probe import notify
    notify(ready=True)
"""

from __future__ import annotations

import math
import os
import socket
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING

from coldstart.errors import InvalidArgument, Unavailable
from coldstart.probe.states import Notice

if TYPE_CHECKING:       # a sender (an app, `coldstart warmup run`) needs no event loop
    import asyncio

__all__ = ["NotifyListener", "notify", "parse_notice"]

MAX_DATAGRAM = 4096


def notify(
    *assignments: str,
    ready: bool = False,
    stopping: bool = False,
    reloading: bool = False,
    status: str | None = None,
    phase: str | None = None,
    progress: float | None = None,
    socket_path: str | None = None,
) -> bool:
    """Send one sd_notify datagram; returns False (and does nothing) when no socket is set.

    >>> notify(status="loading weights", progress=0.42, socket_path="")
    False
    >>> # in an app started by `coldstart probe -- python server.py`:
    >>> # notify(ready=True)
    """
    path = os.environ.get("NOTIFY_SOCKET", "") if socket_path is None else socket_path
    if not path:
        return False
    lines = list(assignments)
    if ready:
        lines.append("READY=1")
    if stopping:
        lines.append("STOPPING=1")
    if reloading:
        lines.append("RELOADING=1")
    if status is not None:
        lines.append("STATUS=" + status.replace("\n", " "))
    if phase is not None:
        lines.append("X_PHASE=" + phase.replace("\n", " "))
    if progress is not None:
        lines.append(f"X_PROGRESS={progress:.4f}")
    if not lines:
        raise InvalidArgument("notify() needs at least one assignment")
    address = "\0" + path[1:] if path.startswith("@") else path  # '@' means abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.settimeout(1.0)  # a full receive buffer must not hang the app
        try:
            sock.sendto("\n".join(lines).encode(), address)
        except OSError as exc:
            raise Unavailable(f"cannot notify {path}: {exc}") from exc
    return True


def parse_notice(data: bytes) -> Notice:
    """Parse one datagram. Unknown variables are ignored, as systemd does.

    >>> parse_notice(b"STATUS=loading\\nX_PROGRESS=0.5").progress
    0.5
    """
    fields: dict[str, str] = {}
    for raw in data.decode("utf-8", errors="replace").split("\n"):
        key, sep, value = raw.partition("=")
        if sep:
            fields[key.strip()] = value
    progress: float | None = None
    if "X_PROGRESS" in fields:
        try:
            progress = float(fields["X_PROGRESS"])
        except ValueError:
            progress = None
        if progress is not None and not math.isfinite(progress):
            progress = None
    return Notice(
        ready=fields.get("READY") == "1",
        stopping=fields.get("STOPPING") == "1",
        reloading=fields.get("RELOADING") == "1",
        status=fields.get("STATUS"),
        phase=fields.get("X_PHASE"),
        progress=progress,
        warmup=fields.get("X_WARMUP") or None,
    )


def _protocol(deliver: Callable[[Notice], None]) -> asyncio.DatagramProtocol:
    import asyncio

    class Protocol(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: object) -> None:
            deliver(parse_notice(data))

    return Protocol()


class NotifyListener:
    """A ``$NOTIFY_SOCKET`` bound in the running event loop; each datagram calls ``deliver``.

    >>> # listener = NotifyListener("/run/app/notify", on_notice); await listener.start()
    """

    def __init__(self, path: str, deliver: Callable[[Notice], None]) -> None:
        self.path = path
        self._deliver = deliver
        self._transport: asyncio.DatagramTransport | None = None

    async def start(self) -> None:
        if not self.path.startswith("@") and os.path.lexists(self.path):
            if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
                raise InvalidArgument(f"notify socket path {self.path} exists and is not a socket")
            os.unlink(self.path)  # a socket left behind by a previous run of this prober
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind("\0" + self.path[1:] if self.path.startswith("@") else self.path)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        except OSError as exc:
            sock.close()
            raise Unavailable(f"cannot bind notify socket {self.path}: {exc}") from exc
        import asyncio

        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _protocol(self._deliver), sock=sock
        )
        self._transport = transport

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if not self.path.startswith("@"):
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
