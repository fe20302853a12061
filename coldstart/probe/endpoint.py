"""The sidecar's own HTTP endpoint, for the pod's kubelet ``readinessProbe``.

``GET /status`` answers the JSON status document; any other path answers 200 ``READY`` only while
the target is READY, 503 with the state otherwise (a kubelet probe on ``/ready`` or ``/healthz``).
HTTP/1.1 keep-alive, so a kubelet (or a router's own poller) costs one read and one write a try.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from coldstart.errors import Unavailable
from coldstart.probe.states import State, Status

__all__ = ["ReadyEndpoint"]

MAX_HEADER = 16 * 1024


class ReadyEndpoint:
    """Serve readiness on ``host:port`` from ``current()`` (called per request).

    >>> # ep = ReadyEndpoint(lambda: prober.status, "0.0.0.0", 9091, "llama", "pod-a")
    >>> # await ep.start(); ...; await ep.close()
    """

    def __init__(
        self, current: Callable[[], Status], host: str, port: int, service: str, target: str,
    ) -> None:
        self._current = current
        self.host, self.port, self.service, self.target = host, port, service, target
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._serve, self.host, self.port)
        except OSError as exc:
            raise Unavailable(f"cannot listen on {self.host}:{self.port}: {exc}") from exc
        sock = self._server.sockets[0]
        self.port = sock.getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                async with asyncio.timeout(60):  # an idle kubelet connection is dropped
                    head = await reader.readuntil(b"\r\n\r\n")
                if len(head) > MAX_HEADER:
                    break
                request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
                parts = request_line.split()
                path = parts[1] if len(parts) >= 2 else "/"
                close = b"connection: close" in head.lower()
                status = self._current()
                if path.split("?")[0] == "/status":
                    code = 200
                    body = json.dumps(status.to_json(self.target, self.service)).encode()
                    kind = "application/json"
                else:
                    ready = status.state is State.READY
                    code = 200 if ready else 503
                    body = (status.state.value + "\n").encode()
                    kind = "text/plain"
                reason = "OK" if code == 200 else "Service Unavailable"
                writer.write(
                    f"HTTP/1.1 {code} {reason}\r\nContent-Type: {kind}\r\n"
                    f"Content-Length: {len(body)}\r\n"
                    f"Connection: {'close' if close else 'keep-alive'}\r\n\r\n".encode() + body
                )
                await writer.drain()
                if close:
                    break
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
