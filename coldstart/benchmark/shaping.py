"""Link shaping for ``coldstart bench --link RATE,RTT``: a TCP proxy that makes loopback look
like the network path to a cloud registry.

The module holds :class:`Link` (a rate and a round-trip time, parsed from tc-like text such as
``1gbit,2ms``), :class:`TokenBucket` (the rate limiter, with an injectable clock) and
:func:`shaping_proxy`, a context manager that runs a shaping TCP proxy in a background thread::

    with shaping_proxy(registry.host, Link.parse("200mbit,20ms")) as proxy:
        pull(f"{proxy.host}/app:latest")        # every byte crosses the shaped link
        print(proxy.stats())                    # {"bytes_down": ..., "connections": ...}

How the link is modelled, per direction (downstream = upstream server to client):

- one :class:`TokenBucket` per direction, shared by every connection, like one NIC: all
  connections together move at most ``rate`` (plus a small burst);
- a delay line of ``rtt / 2``: bytes that finish serialising at ``t`` are delivered at
  ``t + rtt/2``, in order, so a request/response exchange costs one RTT plus its serialisation;
- a new connection's bytes start to move one RTT after it is accepted, as they would after
  TCP's three-way handshake;
- reads are sized to about a millisecond of the link (16 KiB to 256 KiB) and a connection stops
  reading while its last read is still serialising, so connections share the link fairly and
  the proxy holds about one bandwidth-delay product per connection in memory.

Not modelled: loss, jitter, TCP slow start and receive windows. ``Link(math.inf, 0)`` passes
bytes through untouched and only counts them.

The proxy is one asyncio event loop in one thread, with large buffers and no per-byte work in
Python; it waits on epoll with microsecond precision (``epoll_wait`` alone rounds timeouts up to
whole milliseconds, which would add up to a millisecond to each direction of a 2 ms link).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import re
import select
import selectors
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from coldstart.errors import DeadlineExceeded, InvalidArgument, Unavailable

__all__ = ["Link", "ShapingProxy", "TokenBucket", "shaping_proxy"]

log = logging.getLogger(__name__)

# -- the link --------------------------------------------------------------------------------

# Rate units as tc(8) spells them: "bit" units are bits per second, "bps" units bytes per second.
_RATE_UNITS: dict[str, float] = {
    "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "bps": 8.0, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
}
_RTT_UNITS: dict[str, float] = {
    "s": 1.0, "sec": 1.0, "secs": 1.0,
    "ms": 1e-3, "msec": 1e-3, "msecs": 1e-3,
    "us": 1e-6, "usec": 1e-6, "usecs": 1e-6,
}
_UNLIMITED = ("unlimited", "inf")
_QUANTITY = re.compile(r"(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?P<unit>[a-z]+)")
_EXPECTED = ("expected RATE,RTT such as '1gbit,2ms' or '200mbit,20ms': RATE in "
             "bit|kbit|mbit|gbit (bits/s) or bps|kbps|mbps|gbps (bytes/s), or 'unlimited'; "
             "RTT in s|ms|us")


def _number(value: float) -> str:
    return format(value, ".12g")


@dataclass(frozen=True)
class Link:
    """A network path: ``rate_bps`` bits per second each way, ``rtt_s`` seconds round trip.

    >>> link = Link.parse("200mbit,20ms")
    >>> link.rate_bps, link.rtt_s, str(link)
    (200000000.0, 0.02, '200mbit,20ms')
    >>> round(link.transfer_seconds(25_000_000), 3)
    1.0
    """

    rate_bps: float  # bits per second; math.inf: no rate limit
    rtt_s: float     # round-trip time in seconds; half of it is added each way

    def __post_init__(self) -> None:
        if not self.rate_bps > 0:
            raise InvalidArgument(f"link rate must be > 0 bits/s, got {self.rate_bps!r}")
        if not (0 <= self.rtt_s < math.inf):
            raise InvalidArgument(f"link RTT must be >= 0 and finite, got {self.rtt_s!r}")

    @classmethod
    def parse(cls, text: str) -> Link:
        """``"1gbit,2ms"`` -> ``Link(1e9, 0.002)``; units as tc(8) means them (SI, 1k = 1000)."""
        parts = text.strip().lower().split(",")
        if len(parts) != 2:
            raise InvalidArgument(f"bad link {text!r}: {_EXPECTED}")
        rate_text, rtt_text = (part.strip() for part in parts)
        if rate_text in _UNLIMITED:
            rate = math.inf
        else:
            rate = cls._quantity(text, rate_text, _RATE_UNITS, "rate")
        rtt = cls._quantity(text, rtt_text, _RTT_UNITS, "RTT")
        try:
            return cls(rate_bps=rate, rtt_s=rtt)
        except InvalidArgument as exc:
            raise InvalidArgument(f"bad link {text!r}: {exc}; {_EXPECTED}") from None

    @staticmethod
    def _quantity(text: str, part: str, units: dict[str, float], what: str) -> float:
        match = _QUANTITY.fullmatch(part)
        if match is None or match["unit"] not in units:
            raise InvalidArgument(f"bad link {text!r}: {what} {part!r} not understood; "
                                  f"{_EXPECTED}")
        return float(match["num"]) * units[match["unit"]]

    @property
    def rate_bytes_per_s(self) -> float:
        return self.rate_bps / 8

    @property
    def one_way_s(self) -> float:
        return self.rtt_s / 2

    @property
    def unlimited(self) -> bool:
        """True when the link neither limits the rate nor adds delay: a byte counter."""
        return math.isinf(self.rate_bps) and self.rtt_s == 0

    def transfer_seconds(self, nbytes: int, *, round_trips: int = 0) -> float:
        """Seconds to serialise ``nbytes`` at the link's rate, plus ``round_trips`` RTTs.

        ``transfer_seconds(n, round_trips=1)`` is what one request for an ``n``-byte response
        costs on an open connection.
        """
        return nbytes * 8 / self.rate_bps + round_trips * self.rtt_s

    def __str__(self) -> str:
        if math.isinf(self.rate_bps):
            rate = "unlimited"
        else:
            unit, scale = "bit", 1.0
            for name, factor in (("kbit", 1e3), ("mbit", 1e6), ("gbit", 1e9), ("tbit", 1e12)):
                if self.rate_bps >= factor:
                    unit, scale = name, factor
            rate = f"{_number(self.rate_bps / scale)}{unit}"
        if self.rtt_s >= 1:
            rtt = f"{_number(self.rtt_s)}s"
        elif self.rtt_s >= 1e-3 or self.rtt_s == 0:
            rtt = f"{_number(self.rtt_s * 1e3)}ms"
        else:
            rtt = f"{_number(self.rtt_s * 1e6)}us"
        return f"{rate},{rtt}"


# -- the rate limiter ------------------------------------------------------------------------

class TokenBucket:
    """A token bucket in bytes that tells how long to wait instead of sleeping.

    Tokens accrue at ``rate_bytes_per_s`` up to ``burst_bytes``. :meth:`take` always takes the
    tokens, going into debt when there are too few, and returns the seconds until the debt is
    paid: the time at which the bytes would have left a link of that rate. Thread-safe; the
    clock is injectable so tests need not sleep.

    >>> now = [0.0]
    >>> bucket = TokenBucket(1000, 500, clock=lambda: now[0])
    >>> bucket.take(500), bucket.take(250)
    (0.0, 0.25)
    """

    def __init__(self, rate_bytes_per_s: float, burst_bytes: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not rate_bytes_per_s > 0:
            raise InvalidArgument(f"token bucket rate must be > 0, got {rate_bytes_per_s!r}")
        if not 0 < burst_bytes < math.inf:
            raise InvalidArgument(f"token bucket burst must be > 0 and finite, "
                                  f"got {burst_bytes!r}")
        self.rate = float(rate_bytes_per_s)
        self.burst = float(burst_bytes)
        self._clock = clock
        self._tokens = self.burst
        self._stamp = clock()
        self._lock = threading.Lock()

    def take(self, n: int) -> float:
        """Take ``n`` bytes' tokens now; return the seconds to wait before sending them."""
        if math.isinf(self.rate):
            return 0.0
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= n
            return 0.0 if self._tokens >= 0 else -self._tokens / self.rate


# -- the proxy -------------------------------------------------------------------------------

_MIN_READ = 16 * 1024
_MAX_READ = 256 * 1024
_WRITE_HIGH = 1024 * 1024          # a destination holding more than this pauses its source
_WRITE_LOW = 256 * 1024
_EPSILON = 50e-6                   # deliver this early rather than arm a timer for it
_CONNECT_TIMEOUT = 10.0
_STOP_TIMEOUT = 5.0
_START_TIMEOUT = 5.0
_FD_SETSIZE = 1024


class _FineEpollSelector(selectors.EpollSelector):
    """epoll that sleeps with microsecond precision.

    ``epoll_wait`` takes whole milliseconds and Python rounds up; ``select(2)`` on the epoll
    descriptor itself (readable when any registered descriptor is ready) takes microseconds,
    so the wait happens there and epoll is then asked, without waiting, what is ready.
    """

    def select(self, timeout: float | None = None
               ) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout > 0 and self.fileno() < _FD_SETSIZE:
            select.select([self.fileno()], [], [], timeout)
            timeout = 0
        return super().select(timeout)


def _burst(rate_bytes: float) -> float:
    return max(64 * 1024, rate_bytes * 1e-3)


def _read_size(rate_bytes: float) -> int:
    if math.isinf(rate_bytes):
        return _MAX_READ
    return int(min(_MAX_READ, max(_MIN_READ, rate_bytes * 1e-3)))


def _split_hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"bad upstream {text!r}: expected HOST:PORT such as "
                              f"'127.0.0.1:5000'")
    return host, int(port)


class _Pipe:
    """One direction of one connection: source transport -> bucket -> delay line -> dest."""

    def __init__(self, proxy: ShapingProxy, conn: _Conn, bucket: TokenBucket,
                 downstream: bool) -> None:
        self.proxy = proxy
        self.conn = conn
        self.bucket = bucket
        self.downstream = downstream
        self.loop = proxy._loop
        self.delay = proxy.link.one_way_s
        self.read_size = _read_size(bucket.rate)
        if math.isinf(bucket.rate):
            self.cap = 32 * 1024 * 1024
        else:
            bdp = bucket.rate * self.delay
            self.cap = int(min(64 * 1024 * 1024, max(1024 * 1024, 2 * bdp + 4 * self.read_size)))
        self.src: asyncio.Transport | None = None
        self.dst: asyncio.Transport | None = None
        self.queue: collections.deque[tuple[float, memoryview | None]] = collections.deque()
        self.pending = 0
        self.last_at = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.blocked: set[str] = set()
        self.buf = bytearray()
        self.done = False  # EOF delivered to dst

    # reading

    def block(self, reason: str) -> None:
        if not self.blocked and self.src is not None:
            self.src.pause_reading()
        self.blocked.add(reason)

    def unblock(self, reason: str) -> None:
        if reason not in self.blocked:
            return
        self.blocked.discard(reason)
        if not self.blocked and self.src is not None and not self.conn.closed:
            self.src.resume_reading()

    def get_buffer(self) -> bytearray:
        # A fresh buffer each read: the destination transport may keep a view of the last one.
        self.buf = bytearray(self.read_size)
        return self.buf

    def received(self, nbytes: int) -> None:
        data = memoryview(self.buf)[:nbytes]
        self.buf = bytearray()
        now = self.loop.time()
        wait = self.bucket.take(nbytes)
        at = max(now + wait + self.delay, self.last_at)
        self.last_at = at
        if wait > 0:
            # This connection reads again once its bytes have left the link: one read in
            # serialisation per connection keeps the shared link fair.
            self.block("rate")
            self.loop.call_at(now + wait, self.unblock, "rate")
        if at <= now + _EPSILON and not self.queue:
            self._write(data)
            return
        self.queue.append((at, data))
        self.pending += nbytes
        if self.pending > self.cap:
            self.block("queue")
        self._arm()

    def eof(self) -> None:
        at = max(self.loop.time() + self.delay, self.last_at)
        self.last_at = at
        self.queue.append((at, None))
        self._arm()

    # delivering

    def _arm(self) -> None:
        if self.timer is None and self.queue:
            self.timer = self.loop.call_at(self.queue[0][0], self._fire)

    def _fire(self) -> None:
        self.timer = None
        if self.conn.closed:
            return
        horizon = self.loop.time() + _EPSILON
        while self.queue and self.queue[0][0] <= horizon:
            _, data = self.queue.popleft()
            if data is None:
                self._write_eof()
                return
            self.pending -= len(data)
            self._write(data)
        if self.pending <= self.cap // 2:
            self.unblock("queue")
        self._arm()

    def _write(self, data: memoryview) -> None:
        assert self.dst is not None
        if self.downstream:
            self.proxy._bytes_down += len(data)
        else:
            self.proxy._bytes_up += len(data)
        self.dst.write(data)

    def _write_eof(self) -> None:
        assert self.dst is not None
        self.done = True
        if self.conn.other(self).done:
            self.conn.close()
        elif self.dst.can_write_eof():
            self.dst.write_eof()
        else:
            self.conn.close()

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.queue.clear()


class _Conn:
    """One client connection and its upstream connection."""

    def __init__(self, proxy: ShapingProxy) -> None:
        self.proxy = proxy
        self.up = _Pipe(proxy, self, proxy._up_bucket, downstream=False)
        self.down = _Pipe(proxy, self, proxy._down_bucket, downstream=True)
        self.client: asyncio.Transport | None = None
        self.upstream: asyncio.Transport | None = None
        self.closed = False
        self.accepted = 0.0
        self.task: asyncio.Task[None] | None = None

    def other(self, pipe: _Pipe) -> _Pipe:
        return self.down if pipe is self.up else self.up

    def client_made(self, transport: asyncio.Transport) -> None:
        self.client = transport
        self.up.src = self.down.dst = transport
        transport.set_write_buffer_limits(high=_WRITE_HIGH, low=_WRITE_LOW)
        self.up.block("connect")
        self.accepted = self.proxy._loop.time()
        self.proxy._conns.add(self)
        self.proxy._connections += 1
        self.task = self.proxy._loop.create_task(self._connect())

    async def _connect(self) -> None:
        loop = self.proxy._loop
        host, port = self.proxy._upstream_addr
        try:
            await asyncio.wait_for(
                loop.create_connection(lambda: _UpstreamSide(self), host, port),
                timeout=_CONNECT_TIMEOUT)
        except OSError as exc:  # TimeoutError included
            self.proxy._connect_failures += 1
            log.warning("shaping proxy: cannot connect to upstream %s: %s",
                        self.proxy.upstream, exc)
            self.abort()
            return
        if self.closed:
            self.abort()
            return
        # The first byte moves one RTT after the connection was accepted (the handshake).
        start = self.accepted + self.proxy.link.rtt_s
        loop.call_at(start, self.up.unblock, "connect")

    def upstream_made(self, transport: asyncio.Transport) -> None:
        self.upstream = transport
        self.down.src = self.up.dst = transport
        transport.set_write_buffer_limits(high=_WRITE_HIGH, low=_WRITE_LOW)
        if self.down.blocked:
            transport.pause_reading()

    def lost(self, exc: Exception | None) -> None:
        """A side went away before both directions were done: drop the other side too."""
        if not self.closed:
            if exc is not None:
                log.debug("shaping proxy: connection lost: %s", exc)
            self.abort()

    def close(self) -> None:
        """Both directions are done: flush and close both sides."""
        self._finish()
        for transport in (self.client, self.upstream):
            if transport is not None:
                transport.close()

    def abort(self) -> None:
        self._finish()
        for transport in (self.client, self.upstream):
            if transport is not None:
                transport.abort()

    def _finish(self) -> None:
        if not self.closed:
            self.closed = True
            self.proxy._conns.discard(self)
        self.up.cancel()
        self.down.cancel()
        if self.task is not None and not self.task.done():
            self.task.cancel()


class _Side(asyncio.BufferedProtocol):
    def __init__(self, conn: _Conn, reading: _Pipe, writing: _Pipe) -> None:
        self.conn = conn
        self.reading = reading  # the pipe this side's bytes enter
        self.writing = writing  # the pipe that delivers to this side

    def get_buffer(self, sizehint: int) -> bytearray:
        return self.reading.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.reading.received(nbytes)

    def eof_received(self) -> bool:
        self.reading.eof()
        return True  # keep the transport open for the other direction

    def pause_writing(self) -> None:
        self.writing.block("dst")

    def resume_writing(self) -> None:
        self.writing.unblock("dst")

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.lost(exc)


class _ClientSide(_Side):
    def __init__(self, proxy: ShapingProxy) -> None:
        conn = _Conn(proxy)
        super().__init__(conn, conn.up, conn.down)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.conn.client_made(transport)


class _UpstreamSide(_Side):
    def __init__(self, conn: _Conn) -> None:
        super().__init__(conn, conn.down, conn.up)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.conn.upstream_made(transport)


class ShapingProxy:
    """A running shaping proxy; made by :func:`shaping_proxy`.

    ``host`` is ``"127.0.0.1:PORT"``, usable as the registry host of an image reference.
    ``bytes_down`` counts bytes delivered from upstream to clients, ``bytes_up`` from clients to
    upstream, ``connections`` the client connections accepted.
    """

    def __init__(self, upstream: str, link: Link, listen: str) -> None:
        self.upstream = upstream
        self.link = link
        self.listen = listen
        self.host = ""
        self._upstream_addr = _split_hostport(upstream)
        rate = link.rate_bytes_per_s
        burst = 1.0 if math.isinf(rate) else _burst(rate)
        self._down_bucket = TokenBucket(rate, burst)
        self._up_bucket = TokenBucket(rate, burst)
        self._loop = asyncio.SelectorEventLoop(_FineEpollSelector())
        self._conns: set[_Conn] = set()
        self._bytes_down = 0
        self._bytes_up = 0
        self._connections = 0
        self._connect_failures = 0
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None

    @property
    def bytes_down(self) -> int:
        return self._bytes_down

    @property
    def bytes_up(self) -> int:
        return self._bytes_up

    @property
    def connections(self) -> int:
        return self._connections

    def stats(self) -> dict[str, object]:
        """The counters, as plain JSON-ready values."""
        return {
            "link": str(self.link),
            "upstream": self.upstream,
            "host": self.host,
            "bytes_down": self._bytes_down,
            "bytes_up": self._bytes_up,
            "connections": self._connections,
            "active": len(self._conns),
            "connect_failures": self._connect_failures,
        }

    # lifecycle

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="coldstart-shaping-proxy",
                                        daemon=True)
        self._thread.start()
        if not self._started.wait(_START_TIMEOUT):
            self._stop()
            raise DeadlineExceeded(f"shaping proxy did not start within {_START_TIMEOUT} s")
        if self._start_error is not None:
            self._thread.join(_STOP_TIMEOUT)
            raise Unavailable(f"shaping proxy cannot listen on {self.listen}: "
                              f"{self._start_error}") from self._start_error

    def _run(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            try:
                self._server = loop.run_until_complete(loop.create_server(
                    lambda: _ClientSide(self), host=self.listen, port=0, backlog=512))
            except OSError as exc:
                self._start_error = exc
                return
            port = self._server.sockets[0].getsockname()[1]
            host = f"[{self.listen}]" if ":" in self.listen else self.listen
            self.host = f"{host}:{port}"
            self._started.set()
            loop.run_forever()
            self._teardown()
        finally:
            self._started.set()
            loop.close()

    def _teardown(self) -> None:
        loop = self._loop
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.abort()
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        # Let the aborted transports run their connection_lost callbacks and close sockets.
        for _ in range(3):
            loop.run_until_complete(asyncio.sleep(0))

    def _stop(self) -> None:
        thread = self._thread
        if thread is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            self._loop.call_soon_threadsafe(self._loop.stop)
        thread.join(_STOP_TIMEOUT)
        if thread.is_alive():
            raise DeadlineExceeded(f"shaping proxy thread did not stop within {_STOP_TIMEOUT} s")


@contextlib.contextmanager
def shaping_proxy(upstream: str, link: Link, *, listen: str = "127.0.0.1"
                  ) -> Iterator[ShapingProxy]:
    """Run a shaping TCP proxy to ``upstream`` (``"HOST:PORT"``) for the block.

    The proxy listens on a free port of ``listen``; at the end of the block every connection is
    closed and the proxy's thread joined.

    >>> with shaping_proxy("127.0.0.1:5000", Link.parse("1gbit,2ms")) as proxy:
    ...     ref = f"{proxy.host}/library/app:1"
    """
    proxy = ShapingProxy(upstream, link, listen)
    proxy._start()
    try:
        yield proxy
    except BaseException:
        # the block's own error is the one to see; a proxy slow to stop must not replace it
        with contextlib.suppress(DeadlineExceeded):
            proxy._stop()
        raise
    proxy._stop()
