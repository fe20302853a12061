"""Checks: one try each, with a deadline, answering a :class:`CheckResult`.

* :class:`HttpCheck` — GET over one kept-alive connection (raw asyncio streams: a try costs one
  write and one read, not a client object). 200-399 is ready, as for Knative and kubelet. A JSON
  body ``{"phase": "loading", "progress": 0.42}`` is passed on whatever the status.
* :class:`TcpCheck` — a connection opens.
* :class:`GrpcHealthCheck` — ``grpc.health.v1.Health``: ``Watch`` when the server offers it (the
  server pushes each change), ``Check`` per try otherwise.
* :class:`ExecCheck` — a command exits 0.

:func:`parse_target` turns ``http://…``, ``tcp://host:port``, ``grpc://host:port[/service]`` and
``exec:command args`` into a check.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import time
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from coldstart.errors import InvalidArgument
from coldstart.probe.states import CheckResult

__all__ = [
    "Check",
    "ExecCheck",
    "GrpcHealthCheck",
    "HttpCheck",
    "TcpCheck",
    "WatchableCheck",
    "parse_target",
]

MAX_BODY = 64 * 1024
_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)


@runtime_checkable
class Check(Protocol):
    """One kind of probe. ``run`` never raises for a failed try; it answers ``ok=False``."""

    async def run(self, timeout: float) -> CheckResult: ...

    async def close(self) -> None: ...


@runtime_checkable
class WatchableCheck(Check, Protocol):
    """A check whose server can push changes (gRPC Watch). ``watch`` ends when it cannot."""

    def watch(self) -> AsyncIterator[CheckResult]: ...


def _report_from_body(body: bytes) -> tuple[str | None, float | None]:
    if not body or body.lstrip()[:1] != b"{":
        return None, None
    try:
        doc = json.loads(body)
    except ValueError:
        return None, None
    if not isinstance(doc, dict):
        return None, None
    phase = doc.get("phase")
    progress = doc.get("progress")
    return (
        phase if isinstance(phase, str) else None,
        float(progress) if isinstance(progress, int | float) and not isinstance(progress, bool)
        else None,
    )


class HttpCheck:
    """GET ``url`` over a persistent HTTP/1.1 connection.

    >>> check = HttpCheck("http://127.0.0.1:8000/health")
    >>> # result = await check.run(timeout=0.1)
    """

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise InvalidArgument(f"HTTP check needs an http://host[:port]/path URL, got {url!r}")
        self.url = url
        self.host = parts.hostname
        self.port = parts.port or 80
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._request = (
            f"GET {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nUser-Agent: coldstart-probe\r\n"
            f"Accept: application/json\r\n{extra}\r\n"
        ).encode()
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._sock: Any = None

    async def _exchange(self) -> tuple[int, bytes]:
        if self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
            self._sock = self._writer.get_extra_info("socket")
            with contextlib.suppress(OSError, AttributeError):
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        assert self._reader is not None
        self._writer.write(self._request)
        self._quickack()
        status_line = await self._reader.readline()
        if not status_line:
            raise ConnectionResetError("connection closed by the server")
        try:
            status = int(status_line.split(None, 2)[1])
        except (IndexError, ValueError) as exc:
            raise ConnectionError(f"bad status line {status_line[:80]!r}") from exc
        self._quickack()
        length: int | None = None
        keep, chunked = True, False
        while True:
            line = await self._reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            name = name.strip().lower()
            value = value.strip()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding" and "chunked" in value.lower():
                chunked = True
            elif name == "connection" and value.lower() == "close":
                keep = False
        body = b""
        if chunked:
            parts: list[bytes] = []
            while True:
                size = int((await self._reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await self._reader.readline()
                    break
                parts.append(await self._reader.readexactly(size + 2))
            body = b"".join(p[:-2] for p in parts)[:MAX_BODY]
        elif length is not None:
            body = await self._reader.readexactly(min(length, MAX_BODY))
            if length > MAX_BODY:
                keep = False
        else:
            body = await self._reader.read(MAX_BODY)
            keep = False
        if not keep:
            await self._drop()
        return status, body

    def _quickack(self) -> None:
        # Many app servers write the status line and headers, then the body, in two segments;
        # with Nagle on their side and a delayed ACK on ours, the body waits ~40 ms. An
        # immediate ACK (Linux TCP_QUICKACK, which the kernel clears again) avoids that stall.
        if _QUICKACK is not None and self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)

    async def _drop(self) -> None:
        writer, self._writer, self._reader, self._sock = self._writer, None, None, None
        if writer is not None:
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), 0.1)
            except (OSError, TimeoutError):
                pass

    async def run(self, timeout: float) -> CheckResult:
        start = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                status, body = await self._exchange()
        except TimeoutError:
            await self._drop()  # a late answer would be read as the next try's
            return CheckResult(False, time.monotonic() - start, f"no answer in {timeout:g} s")
        except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
            await self._drop()
            return CheckResult(False, time.monotonic() - start, f"{type(exc).__name__}: {exc}")
        phase, progress = _report_from_body(body)
        return CheckResult(
            200 <= status < 400, time.monotonic() - start, f"HTTP {status}", phase, progress
        )

    async def close(self) -> None:
        await self._drop()


class TcpCheck:
    """A TCP connection to ``host:port`` opens within the deadline.

    >>> check = TcpCheck("127.0.0.1", 8000)
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port

    async def run(self, timeout: float) -> CheckResult:
        start = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                _, writer = await asyncio.open_connection(self.host, self.port)
        except TimeoutError:
            return CheckResult(False, time.monotonic() - start, f"no connection in {timeout:g} s")
        except OSError as exc:
            return CheckResult(False, time.monotonic() - start, f"{type(exc).__name__}: {exc}")
        writer.close()
        return CheckResult(True, time.monotonic() - start, "connected")

    async def close(self) -> None:
        return None


def _executable(command: str) -> str:
    """The file ``command`` runs (a path, or found on ``$PATH`` as ``shutil.which`` does);
    InvalidArgument if there is none: such a check could never pass."""
    if os.sep not in command:
        found = shutil.which(command)
        if found is None:
            raise InvalidArgument(
                f"exec target: {command!r} is not an executable on PATH; give its full path "
                "or install it"
            )
        return found
    if not os.path.exists(command):
        raise InvalidArgument(
            f"exec target: {command} does not exist; give the path of an executable or a "
            "command on PATH"
        )
    if not os.path.isfile(command) or not os.access(command, os.X_OK):
        raise InvalidArgument(
            f"exec target: {command} is not an executable file; make it one (chmod +x) or give "
            "another command"
        )
    return command


class ExecCheck:
    """A command exits 0 within the deadline; its last line of output becomes the detail.

    The command must exist and be executable when the check is made (``InvalidArgument``
    otherwise): a check that can never pass would leave the target "not ready" until start-up
    times out.

    >>> check = ExecCheck(["test", "-e", "/run/app/ready"])
    """

    def __init__(self, argv: list[str]) -> None:
        if not argv:
            raise InvalidArgument("exec check needs a command")
        _executable(argv[0])
        self.argv = argv

    async def run(self, timeout: float) -> CheckResult:
        start = time.monotonic()
        try:
            # its own process group, so that a timeout kills the command's children too
            # (a grandchild holding the output pipe would otherwise hold up the wait)
            proc = await asyncio.create_subprocess_exec(
                *self.argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL, start_new_session=True,
            )
        except OSError as exc:
            return CheckResult(False, time.monotonic() - start, f"cannot run {self.argv[0]}: {exc}")
        try:
            async with asyncio.timeout(timeout):
                out, _ = await proc.communicate()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await proc.wait()
            return CheckResult(False, time.monotonic() - start, f"no exit in {timeout:g} s")
        lines = out.decode(errors="replace").strip().splitlines()
        phase, progress = _report_from_body(lines[-1].encode() if lines else b"")
        return CheckResult(
            proc.returncode == 0, time.monotonic() - start,
            f"exit {proc.returncode}" + (f": {lines[-1][:200]}" if lines else ""), phase, progress,
        )

    async def close(self) -> None:
        return None


# grpc.health.v1 messages are one field each; encoding them by hand keeps the probe free of
# generated code: HealthCheckRequest{string service = 1}, HealthCheckResponse{enum status = 1}.
_SERVING_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _encode_request(service: str) -> bytes:
    data = service.encode()
    if not data:
        return b""
    length, out = len(data), bytearray(b"\x0a")
    while length >= 0x80:
        out.append((length & 0x7F) | 0x80)
        length >>= 7
    out.append(length)
    return bytes(out) + data


def _decode_response(data: bytes) -> int:
    if not data:
        return 0  # proto3: a default (UNKNOWN) field is not on the wire
    if data[0] != 0x08:
        raise ValueError("unexpected HealthCheckResponse")
    value = shift = 0
    for byte in data[1:]:
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value
    raise ValueError("truncated HealthCheckResponse")


class GrpcHealthCheck:
    """``grpc.health.v1.Health`` on ``host:port`` for ``service`` ("" = the whole server).

    >>> check = GrpcHealthCheck("127.0.0.1:50051")
    """

    def __init__(self, address: str, service: str = "") -> None:
        self.address, self.service = address, service
        self.watch_unsupported = False
        self._channel: Any = None
        self._check: Any = None
        self._watch: Any = None

    def _connect(self) -> None:
        # grpc.aio binds a channel to the running loop, so it is made on first use
        import grpc.aio  # only a gRPC target pays for importing grpc

        if self._channel is None:
            # keepalive pings notice a dead server under a long Watch stream
            self._channel = grpc.aio.insecure_channel(self.address, options=[
                ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
            ])
            self._check = self._channel.unary_unary(
                "/grpc.health.v1.Health/Check",
                request_serializer=_encode_request, response_deserializer=_decode_response,
            )
            self._watch = self._channel.unary_stream(
                "/grpc.health.v1.Health/Watch",
                request_serializer=_encode_request, response_deserializer=_decode_response,
            )

    @staticmethod
    def _result(status: int, latency: float) -> CheckResult:
        name = _SERVING_STATUS.get(status, str(status))
        return CheckResult(status == 1, latency, f"gRPC {name}")

    async def run(self, timeout: float) -> CheckResult:
        import grpc

        self._connect()
        start = time.monotonic()
        try:
            status = await self._check(self.service, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            return CheckResult(
                False, time.monotonic() - start, f"gRPC {exc.code().name}: {exc.details()}"
            )
        return self._result(status, time.monotonic() - start)

    async def watch(self) -> AsyncIterator[CheckResult]:
        """Yield the server's status at once, then each change, until the stream breaks."""
        import grpc

        if self.watch_unsupported:
            return
        self._connect()
        call = self._watch(self.service)
        try:
            async for status in call:
                yield self._result(status, 0.0)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.watch_unsupported = True
            else:
                yield CheckResult(False, 0.0, f"gRPC {exc.code().name}: {exc.details()}")
        finally:
            call.cancel()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


def parse_target(target: str, headers: dict[str, str] | None = None) -> Check:
    """Build the check a ``--target`` names.

    >>> type(parse_target("tcp://127.0.0.1:6379")).__name__
    'TcpCheck'
    >>> parse_target("exec:test -e /run/app/ready").argv
    ['test', '-e', '/run/app/ready']

    An unparsable target, or an exec command that does not exist, is ``InvalidArgument``.
    """
    if target.startswith("exec:"):
        try:
            argv = shlex.split(target[5:])
        except ValueError as exc:  # "No closing quotation"
            raise InvalidArgument(
                f"bad exec target {target!r}: {exc}; quote as a shell would"
            ) from exc
        return ExecCheck(argv)
    try:
        parts = urllib.parse.urlsplit(target)
        port = parts.port  # a bad port raises here, not in the first try
    except ValueError as exc:
        raise InvalidArgument(
            f"bad target URL {target!r}: {exc}; use http://HOST:PORT/PATH, tcp://HOST:PORT, "
            "grpc://HOST:PORT[/SERVICE] or exec:COMMAND"
        ) from exc
    if parts.scheme == "http":
        return HttpCheck(target, headers)
    if parts.scheme in ("tcp", "grpc"):
        if not parts.hostname or port is None:
            raise InvalidArgument(f"{parts.scheme} target needs host:port, got {target!r}")
        if parts.scheme == "tcp":
            return TcpCheck(parts.hostname, port)
        return GrpcHealthCheck(f"{parts.hostname}:{port}", parts.path.lstrip("/"))
    raise InvalidArgument(
        f"unknown target {target!r}: use http://…, tcp://host:port, grpc://host:port[/service] "
        "or exec:COMMAND"
    )
