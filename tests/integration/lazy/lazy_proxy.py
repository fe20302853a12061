"""A small, real HTTP proxy on loopback in front of the registry, that can misbehave on purpose.

Targeted faults, for one test's one chunk:

- ``flip`` = (start, end): bytes of the blob in that absolute range are inverted in responses
  (in the next ``flip_times`` answers that hold some of them, or in every one when it is None);
- ``hang`` = True: blob range requests that start at or before ``hang_below`` are held open
  without an answer until the proxy stops.

A seeded fault mix (:class:`FaultMix`, set with :meth:`Proxy.inject`) for fault-injection tests
and ``bench/bench_faults.py``: each blob range GET draws one number from the mix's random
generator and, at each kind's rate, gets

- ``5xx``: a 500 or 503 answer, never forwarded;
- ``reset``: the connection closed with a TCP RST (``SO_LINGER`` 0), no answer;
- ``stall``: no answer for ``stall_seconds`` (longer than the client's deadline), then a close;
- ``truncate``: the status and the full ``Content-Length``, then part of the body, then a close;
- ``corrupt``: the right answer with one byte of the body flipped at a random position.

:meth:`Proxy.inject_next` queues faults for the next blob range GETs, one each, in order,
before any mix (a test that wants one fault exactly where it looks).

Every request is counted (:meth:`Proxy.blob_gets`); :meth:`Proxy.fault_counts` says how many
blob range GETs the mix saw and how many faults of each kind were injected, and each fault is
logged (logger ``tests.lazy_proxy``, level INFO) with its request.
"""

from __future__ import annotations

import logging
import random
import re
import socket
import struct
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from coldstart.stack.procs import free_port

__all__ = ["FAULT_KINDS", "FaultMix", "Proxy", "proxy_for"]

log = logging.getLogger("tests.lazy_proxy")

_RANGE = re.compile(r"bytes=(\d+)-(\d+)")

#: the kinds of fault a :class:`FaultMix` injects, in the order a draw is mapped to them
FAULT_KINDS = ("5xx", "reset", "stall", "truncate", "corrupt")


@dataclass(frozen=True)
class FaultMix:
    """Per kind of :data:`FAULT_KINDS` the share of blob range GETs that get it (the rates add
    up to at most 1); ``seed`` seeds the draws; a stalled request is held ``stall_seconds``.

    >>> FaultMix.parse("5xx=0.1,corrupt=0.05").rates
    {'5xx': 0.1, 'corrupt': 0.05}
    """

    rates: Mapping[str, float] = field(default_factory=dict)
    seed: int = 0
    stall_seconds: float = 3.0

    def __post_init__(self) -> None:
        unknown = set(self.rates) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {FAULT_KINDS}")
        if any(r < 0 for r in self.rates.values()) or sum(self.rates.values()) > 1.0 + 1e-9:
            raise ValueError(f"fault rates must be >= 0 and add up to at most 1: {self.rates}")

    @classmethod
    def parse(cls, text: str, *, seed: int = 0, stall_seconds: float = 3.0) -> FaultMix:
        """``"kind=rate,kind=rate"`` (``"none"`` or ``""``: no faults; ``"all=r"``: every
        kind at rate ``r``)."""
        rates: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            if part == "none":
                continue
            kind, _, rate = part.partition("=")
            kinds = FAULT_KINDS if kind == "all" else (kind,)
            for k in kinds:
                rates[k] = float(rate)
        return cls(rates, seed=seed, stall_seconds=stall_seconds)

    def draw(self, rng: random.Random) -> str | None:
        """The fault for one request (None: none), from one number drawn from ``rng``."""
        x = rng.random()
        for kind in FAULT_KINDS:
            x -= self.rates.get(kind, 0.0)
            if x < 0:
                return kind
        return None


class Proxy:
    """The proxy on ``127.0.0.1:port`` (``.host``) in front of ``upstream`` (``http://…``);
    see the module docstring for what it can do to requests."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.upstream_host = upstream.split("://", 1)[1]
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.flip: tuple[int, int] | None = None
        #: answers ``flip`` changes before it is dropped (None: every answer)
        self.flip_times: int | None = None
        self.hang = False
        self.hang_below = 1 << 62
        self.requests: list[tuple[str, str, str]] = []   # method, path, range
        # range GETs of blobs being answered now, and the most at once (set it to 0 to count
        # from a point on)
        self.in_flight = 0
        self.max_in_flight = 0
        self.mix: FaultMix | None = None
        #: how long a ``stall`` holds its request (the mix's, once one is injected)
        self.stall_seconds = 3.0
        self._next: list[str] = []
        self._rng = random.Random(0)
        self._counts: dict[str, int] = dict.fromkeys(("requests", *FAULT_KINDS), 0)
        self._stop = threading.Event()
        self._client = httpx.Client(timeout=30.0)
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self, method: str) -> None:
                ranged = (method == "GET" and "/blobs/" in self.path
                          and _RANGE.match(self.headers.get("Range", "")) is not None)
                if not ranged:
                    self._forward_one(method)
                    return
                with proxy._lock:
                    proxy.in_flight += 1
                    proxy.max_in_flight = max(proxy.max_in_flight, proxy.in_flight)
                try:
                    self._forward_one(method)
                finally:
                    with proxy._lock:
                        proxy.in_flight -= 1

            def _forward_one(self, method: str) -> None:
                rng = self.headers.get("Range", "")
                m = _RANGE.match(rng)
                ranged = method == "GET" and "/blobs/" in self.path and m is not None
                with proxy._lock:
                    proxy.requests.append((method, self.path, rng))
                fault = proxy._draw() if ranged else None
                start = int(m.group(1)) if m else 0
                if proxy.hang and "/blobs/" in self.path and m and start <= proxy.hang_below:
                    proxy._stop.wait(60)
                    return
                if fault is not None:
                    log.info("fault %s: %s %s %s", fault, method, self.path, rng)
                if fault == "5xx":
                    self._error(proxy._pick((500, 503)))
                    return
                if fault == "reset":
                    self._reset()
                    return
                if fault == "stall":
                    proxy._stop.wait(proxy.stall_seconds)
                    self.close_connection = True
                    return
                body = b""
                length = int(self.headers.get("Content-Length", "0") or 0)
                if length:
                    body = self.rfile.read(length)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "content-length", "connection")}
                resp = proxy._client.request(method, proxy.upstream + self.path,
                                             headers=headers, content=body)
                data = resp.content
                flip = proxy.flip
                if flip is not None and "/blobs/" in self.path and method == "GET":
                    a, b = flip
                    buf = bytearray(data)
                    for pos in range(max(a, start), min(b, start + len(buf))):
                        buf[pos - start] ^= 0xFF
                    data = bytes(buf)
                    with proxy._lock:
                        hit = max(a, start) < min(b, start + len(buf))
                        if proxy.flip_times is not None and hit:
                            proxy.flip_times -= 1
                            if proxy.flip_times <= 0:
                                proxy.flip = proxy.flip_times = None
                if fault == "corrupt" and data:
                    buf = bytearray(data)
                    buf[proxy._pick(range(len(buf)))] ^= 1 << proxy._pick(range(8))
                    data = bytes(buf)
                self.send_response(resp.status_code)
                for k, v in resp.headers.items():
                    if k.lower() in ("content-length", "transfer-encoding", "connection",
                                     "content-encoding"):
                        continue
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data) if method != "HEAD"
                                                       else resp.headers.get("Content-Length",
                                                                             "0")))
                self.end_headers()
                if method == "HEAD":
                    return
                if fault == "truncate":
                    # the full Content-Length went out; the body stops short, then the
                    # connection closes (at least one byte is missing)
                    self.wfile.write(data[: proxy._pick(range(max(1, len(data))))])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(data)

            def _error(self, status: int) -> None:
                body = b'{"errors":[{"code":"UNAVAILABLE","message":"injected fault"}]}'
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _reset(self) -> None:
                """Close with an RST: linger on, timeout 0, then close; nothing is sent."""
                self.close_connection = True
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                           struct.pack("ii", 1, 0))
                self.connection.close()

            def do_GET(self) -> None:
                self._forward("GET")

            def do_HEAD(self) -> None:
                self._forward("HEAD")

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: object, client_address: object) -> None:
                # a reset or truncated connection, or a client that gave up on a stall:
                # expected here, not worth a traceback on stderr
                pass

        self.server = Server(("127.0.0.1", self.port), Handler)
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    # -- the fault mix ---------------------------------------------------------------------

    def inject(self, mix: FaultMix | None) -> None:
        """Apply ``mix`` to the blob range GETs from now on (None: stop injecting); the draws
        start over from its seed, and :meth:`fault_counts` from zero."""
        with self._lock:
            self.mix = mix
            self._rng = random.Random(mix.seed if mix is not None else 0)
            self._counts = dict.fromkeys(("requests", *FAULT_KINDS), 0)
            if mix is not None:
                self.stall_seconds = mix.stall_seconds

    def inject_next(self, *kinds: str) -> None:
        """The next ``len(kinds)`` blob range GETs get these faults, in order (counted in
        :meth:`fault_counts` like the mix's)."""
        unknown = set(kinds) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {FAULT_KINDS}")
        with self._lock:
            self._next.extend(kinds)

    @contextmanager
    def faults(self, mix: FaultMix) -> Iterator[Proxy]:
        """:meth:`inject` ``mix`` for the block; healthy again after it."""
        self.inject(mix)
        try:
            yield self
        finally:
            self.heal()

    def heal(self) -> None:
        """No more faults: the mix is dropped, and the queued faults with it."""
        with self._lock:
            self.mix = None
            self._next.clear()

    def fault_counts(self) -> dict[str, int]:
        """``requests`` (blob range GETs under the mix) and the faults injected, per kind."""
        with self._lock:
            return dict(self._counts)

    def _draw(self) -> str | None:
        with self._lock:
            if self._next:
                fault: str | None = self._next.pop(0)
            elif self.mix is None:
                return None
            else:
                fault = self.mix.draw(self._rng)
            self._counts["requests"] += 1
            if fault is not None:
                self._counts[fault] += 1
            return fault

    def _pick(self, seq: range | tuple[int, ...]) -> int:
        with self._lock:
            return self._rng.choice(seq)

    # -- life ------------------------------------------------------------------------------

    def blob_gets(self) -> list[str]:
        with self._lock:
            return [r for m, p, r in self.requests if m == "GET" and "/blobs/" in p]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
        self._client.close()


@contextmanager
def proxy_for(upstream_url: str) -> Iterator[Proxy]:
    p = Proxy(upstream_url)
    p.start()
    try:
        yield p
    finally:
        p.stop()
