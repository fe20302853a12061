"""Range GETs whose body goes straight from the socket into the caller's buffer.

The lazy data path reads blobs in range requests of 1 to 64 MiB. Through httpx (httpcore + h11)
every 64 KiB of body is received into a new object, appended to h11's buffer, cut out of it
and handed on: measured here, 2.9 to 4.5 s of CPU per GB of compressed bytes, a third of a FUSE
server's whole budget for a cold read. :class:`RangeConnections` sends the same request over a
kept-alive ``http.client`` connection and reads the body with ``readinto`` (``recv_into`` on
the socket): 0.4 s per GB.

It serves the plain case only: a ``206 Partial Content`` whose ``Content-Range`` starts where
asked, from the URL itself or after redirects (blob storage behind a CDN, presigned URLs).
Anything else (401, 404, 5xx, a ``200`` with the whole blob, a connection that fails before the
body starts) is a :class:`Declined` answer: the caller sends the request again through its
general client, which authenticates, maps errors and retries. A failure inside the body raises
:class:`~coldstart.errors.Unavailable` (or :class:`~coldstart.errors.DeadlineExceeded`), like
the general path; the connection is then dropped, never reused.

No wait outlasts the call's deadline: each socket operation times out by then, and at the
deadline a watchdog shuts the socket down under a read that a dribbling server keeps alive.
With ``stall``, no single wait for the server (for its answer, for more of its body) outlasts
that many seconds either, as httpx's read timeout: a stalled attempt fails with
:class:`~coldstart.errors.Unavailable` early enough for the caller to try again within the
deadline.
Connections idle for more than ``IDLE_SECONDS`` are closed, not reused; a redirect to another
origin carries the range and nothing else (no credentials, no endpoint headers).
"""

from __future__ import annotations

import bisect
import contextlib
import http.client
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from coldstart.errors import DeadlineExceeded, Unavailable

__all__ = ["Declined", "RangeConnections"]

#: bytes asked of the socket per ``readinto`` (the deadline is checked between two)
READ_STEP = 1 << 20
#: redirects followed before declining
MAX_REDIRECTS = 5
#: a kept-alive connection idle longer than this is closed, not reused (as httpx does)
IDLE_SECONDS = 5.0
#: longest wait for a new connection's TCP (and TLS) handshake
CONNECT_TIMEOUT = 10.0
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})


@dataclass(frozen=True, slots=True)
class Declined:
    """Not served here: ``reason`` says why; the caller asks its general client instead."""

    reason: str
    status: int = 0


_Key = tuple[str, str, int, object]
_Idle = tuple[http.client.HTTPConnection, float]


class RangeConnections:
    """Kept-alive ``http.client`` connections, per (scheme, host, port, TLS settings).

    ``ssl_context(url)`` gives the TLS context for an ``https`` URL (the caller's CA and
    client-certificate settings; called once per distinct return value's key, see
    :meth:`get`). Thread-safe: a connection is used by one call at a time.
    """

    def __init__(self, *, max_idle: int = 16, user_agent: str = "coldstart") -> None:
        self.max_idle = max(0, max_idle)
        self.user_agent = user_agent
        self._idle: dict[_Key, list[_Idle]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = [c for cs in self._idle.values() for c, _ in cs]
            self._idle.clear()
        for c in conns:
            c.close()

    # -- the one call ----------------------------------------------------------------------

    def get(self, url: str, offset: int, length: int, *, headers: Mapping[str, str],
            deadline: float, what: str,
            tls: Callable[[str], ssl.SSLContext | None] | None = None,
            stall: float | None = None) -> bytes | bytearray | Declined:
        """Bytes ``[offset, offset+length)`` of ``url`` (fewer only if the resource ends
        first), by monotonic ``deadline``, or :class:`Declined`.

        ``stall``: the longest wait for the answer or for more of the body, seconds (None:
        until the deadline); a server silent for longer fails the call with
        :class:`Unavailable`.

        ``headers`` go with the request to ``url`` only: a redirect to another origin (scheme,
        host or port) sends nothing but the range (no credentials, no endpoint headers).
        ``tls(url)``: the TLS context for an ``https`` URL, None for the default verification.
        """
        got = self._get(url, [(offset, length)], headers, deadline, what, tls, stall)
        return got if isinstance(got, Declined) else got[0]

    def get_ranges(self, url: str, ranges: Sequence[tuple[int, int]], *,
                   headers: Mapping[str, str], deadline: float, what: str,
                   tls: Callable[[str], ssl.SSLContext | None] | None = None,
                   stall: float | None = None) -> list[bytes | bytearray] | Declined:
        """Several ranges ``(offset, length)`` of ``url`` in one request (a multi-range
        ``Range`` header, answered as ``multipart/byteranges``), each exactly as asked; or
        :class:`Declined`, as :meth:`get`, and also for a server that answers with the whole
        resource (``200``: object stores do; its body is not read) or with parts that do not
        hold every range asked. Ranges must be non-empty, in increasing order and apart (as
        RFC 9110 lets a server merge ranges that touch into one part, which is taken too).
        """
        if not ranges:
            return []
        return self._get(url, list(ranges), headers, deadline, what, tls, stall)

    def _get(self, url: str, ranges: list[tuple[int, int]], headers: Mapping[str, str],
             deadline: float, what: str,
             tls: Callable[[str], ssl.SSLContext | None] | None,
             stall: float | None) -> list[bytes | bytearray] | Declined:
        spec = ",".join(f"{off}-{off + n - 1}" for off, n in ranges)
        rng = {"User-Agent": self.user_agent, "Accept-Encoding": "identity",
               "Range": f"bytes={spec}"}
        hdrs = {**headers, **rng}
        try:
            origin = _origin(url)
            for _hop in range(MAX_REDIRECTS + 1):
                answer = self._one(url, hdrs, ranges, deadline, what, tls, stall)
                if not isinstance(answer, str):
                    return answer
                url = urljoin(url, answer)
                if _origin(url) != origin:
                    hdrs = dict(rng)
        except ValueError as exc:       # a malformed URL or Location (bad port, bad host)
            return Declined(f"bad URL: {exc}")
        return Declined(f"more than {MAX_REDIRECTS} redirects")

    def _one(self, url: str, headers: Mapping[str, str], ranges: list[tuple[int, int]],
             deadline: float, what: str,
             tls: Callable[[str], ssl.SSLContext | None] | None,
             stall: float | None = None) -> list[bytes | bytearray] | Declined | str:
        """One request: the bytes of each range, Declined, or the ``Location`` of a
        redirect."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return Declined(f"not an http(s) URL: {url}")
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        ctx = tls(url) if (tls is not None and parts.scheme == "https") else None
        port = parts.port or (443 if parts.scheme == "https" else 80)
        key: _Key = (parts.scheme, parts.hostname, port, id(ctx) if ctx is not None else None)
        conn, reused = self._take(key, parts.scheme, parts.hostname, port, ctx)
        keep = False
        # the deadline holds for every wait, however the server dribbles: at the deadline the
        # socket is shut down under the blocked read
        watchdog = _Watchdog(conn, deadline)
        try:
            try:
                resp = self._send(conn, target, headers, deadline, what, stall)
            except (OSError, http.client.HTTPException) as exc:
                if watchdog.expired:
                    raise DeadlineExceeded(f"{what}: no answer within the deadline") from exc
                if not reused:
                    return Declined(f"{type(exc).__name__}: {exc}")
                # a kept-alive connection the server closed meanwhile: once more, fresh
                watchdog.cancel()
                conn.close()
                conn, reused = self._take(key, parts.scheme, parts.hostname, port, ctx,
                                          fresh=True)
                watchdog = _Watchdog(conn, deadline)
                try:
                    resp = self._send(conn, target, headers, deadline, what, stall)
                except (OSError, http.client.HTTPException) as exc2:
                    if watchdog.expired:
                        raise DeadlineExceeded(f"{what}: no answer within the deadline") \
                            from exc2
                    return Declined(f"{type(exc2).__name__}: {exc2}")
            status = resp.status
            if status in REDIRECT_STATUSES:
                location = resp.getheader("Location") or ""
                keep = self._drain(resp)
                return location if location else Declined("redirect without Location", status)
            if status != 206:
                return Declined(f"HTTP {status}", status)
            size = resp.length
            boundary = _boundary(resp.getheader("Content-Type", ""))
            if len(ranges) > 1 and boundary is not None:
                bad = "" if size is not None and size <= _most(ranges) else \
                    f"multipart answer of {size} bytes for {len(ranges)} ranges"
            elif len(ranges) > 1:
                # one part for them all: a server may merge ranges that are close (not one
                # that sends much more than asked: ranges spread over a large blob)
                first, last = ranges[0][0], ranges[-1][0] + ranges[-1][1]
                bad = _check_partial(resp.getheader("Content-Range"), size, first,
                                     last - first)
                if not bad and size != last - first:
                    bad = f"{size} bytes for ranges up to {last}"
                if not bad and last - first > 2 * _most(ranges):
                    bad = f"one part of {last - first} bytes for {len(ranges)} ranges"
            else:
                bad = _check_partial(resp.getheader("Content-Range"), size, *ranges[0])
            if resp.getheader("Content-Encoding", "identity").lower() != "identity":
                bad = f"Content-Encoding {resp.getheader('Content-Encoding')!r}"
            if bad or size is None:
                return Declined(bad or "no Content-Length", status)
            buf = bytearray(size)
            try:
                self._read_body(resp, memoryview(buf), what)
            except Unavailable as exc:
                if watchdog.expired:
                    raise DeadlineExceeded(f"{what}: body not received within the deadline "
                                           f"({exc})") from exc
                raise
            keep = not resp.will_close
            if len(ranges) == 1:
                return [buf]
            if boundary is None:
                first = ranges[0][0]
                return [buf[off - first: off - first + n] for off, n in ranges]
            got = _split_byteranges(buf, boundary, ranges)
            if isinstance(got, str):
                keep = False
                return Declined(got, status)
            return got
        finally:
            watchdog.cancel()
            if keep and not watchdog.fired:
                self._give(key, conn)
            else:
                conn.close()

    @staticmethod
    def _send(conn: http.client.HTTPConnection, target: str, headers: Mapping[str, str],
              deadline: float, what: str, stall: float | None = None
              ) -> http.client.HTTPResponse:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"{what}: no time left")
        conn.timeout = min(left, CONNECT_TIMEOUT)      # a fresh connection's connect
        if conn.sock is not None:
            conn.sock.settimeout(left)
        conn.request("GET", target, headers=dict(headers))
        if conn.sock is not None:
            # every later wait on the socket (the answer, the body's reads) is cut off here
            left = max(deadline - time.monotonic(), 0.001)
            conn.sock.settimeout(left if stall is None else min(left, stall))
        try:
            return conn.getresponse()
        except TimeoutError as exc:
            if stall is not None and time.monotonic() < deadline:
                # a stalled server, not a lost connection: another attempt may be answered
                raise Unavailable(f"{what}: no answer within {stall:g} s") from exc
            raise

    @staticmethod
    def _read_body(resp: http.client.HTTPResponse, view: memoryview, what: str) -> None:
        pos, size = 0, len(view)
        try:
            while pos < size:
                n = resp.readinto(view[pos: pos + READ_STEP])
                if not n:
                    raise Unavailable(f"{what}: connection closed after {pos} of {size} bytes")
                pos += n
        except (OSError, http.client.HTTPException) as exc:
            raise Unavailable(f"{what}: connection lost after {pos} of {size} bytes: "
                              f"{type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _drain(resp: http.client.HTTPResponse) -> bool:
        """Read a small body to its end so the connection can be reused; False if not."""
        if resp.length is None or resp.length > (64 << 10) or resp.will_close:
            return False
        try:
            resp.read()
        except (OSError, http.client.HTTPException):
            return False
        return True

    # -- the pool --------------------------------------------------------------------------

    def _take(self, key: _Key, scheme: str, host: str, port: int, ctx: ssl.SSLContext | None,
              *, fresh: bool = False) -> tuple[http.client.HTTPConnection, bool]:
        if not fresh:
            now = time.monotonic()
            stale: list[http.client.HTTPConnection] = []
            got = None
            with self._lock:
                idle = self._idle.get(key)
                while idle:
                    old, since = idle.pop()
                    if now - since <= IDLE_SECONDS:
                        got = old
                        break
                    stale.append(old)
            for c in stale:             # idle too long: a NAT may have dropped it silently
                c.close()
            if got is not None:
                return got, True
        conn: http.client.HTTPConnection
        if scheme == "https":
            conn = http.client.HTTPSConnection(host, port, context=ctx
                                               or _default_context())
        else:
            conn = http.client.HTTPConnection(host, port)
        return conn, False

    def _give(self, key: _Key, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if not self._closed and len(idle) < self.max_idle:
                # no Nagle delay for the next request on it
                if conn.sock is not None:
                    with contextlib.suppress(OSError):
                        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                idle.append((conn, time.monotonic()))
                return
        conn.close()


class _Watchdog:
    """Shuts ``conn``'s socket down at monotonic ``deadline`` unless cancelled first: a read
    blocked in it returns at once, whatever each ``recv``'s own timeout."""

    __slots__ = ("_conn", "_deadline", "_timer", "fired")

    def __init__(self, conn: http.client.HTTPConnection, deadline: float) -> None:
        self._conn = conn
        self._deadline = deadline
        self.fired = False
        self._timer = threading.Timer(max(deadline - time.monotonic(), 0.0), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        self.fired = True
        sock = self._conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def cancel(self) -> None:
        self._timer.cancel()

    @property
    def expired(self) -> bool:
        """The deadline has passed: fired, or about to (the socket's own timeout, set to the
        time left, may end a blocked read first on a busy machine)."""
        return self.fired or time.monotonic() >= self._deadline


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme.lower(), (parts.hostname or "").lower(), parts.port


def _check_partial(content_range: str | None, size: int | None, offset: int,
                   length: int) -> str:
    """Why a 206 for ``length`` bytes at ``offset`` is not one this path takes ('' if it is):
    ``Content-Range`` must start at ``offset``, end where ``Content-Length`` says, and end
    short of the range only at the resource's end.

    >>> _check_partial("bytes 10-19/100", 10, 10, 10), _check_partial("bytes 10-14/15", 5, 10, 10)
    ('', '')
    >>> _check_partial("bytes 10-14/100", 5, 10, 10)
    "Content-Range 'bytes 10-14/100' with Content-Length 5 for 10 bytes at 10"
    """
    bad = f"Content-Range {content_range!r} with Content-Length {size} for {length} bytes " \
          f"at {offset}"
    parsed = _content_range(content_range or "")
    if parsed is None or size is None:
        return bad
    a, b, total = parsed
    if a != offset or b - a + 1 != size or size > length or size <= 0:
        return bad
    if size < length and b + 1 != total:
        return bad
    return ""


def _content_range(value: str | bytes) -> tuple[int, int, int | None] | None:
    """First byte, last byte and total (None for ``*``) of a ``Content-Range: bytes a-b/n``
    value; None if it is not one.

    >>> _content_range("bytes 10-19/100"), _content_range(b"bytes 0-0/*"), _content_range("x")
    ((10, 19, 100), (0, 0, None), None)
    """
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    unit, _, rest = text.strip().partition(" ")
    span, _, total = rest.partition("/")
    first, _, last = span.partition("-")
    if unit.lower() != "bytes" or not first.isdigit() or not last.isdigit():
        return None
    return int(first), int(last), int(total) if total.isdigit() else None


_DEFAULT_CTX: ssl.SSLContext | None = None
_DEFAULT_CTX_LOCK = threading.Lock()


def _default_context() -> ssl.SSLContext:
    """One default-verification TLS context (building one costs ~0.5 s of CPU)."""
    global _DEFAULT_CTX
    with _DEFAULT_CTX_LOCK:
        if _DEFAULT_CTX is None:
            _DEFAULT_CTX = ssl.create_default_context()
        return _DEFAULT_CTX


#: bytes a multipart answer may hold beyond its ranges' own, per part (boundary and headers)
#: and in all (preamble and epilogue): a larger answer is declined before its body is read
PART_OVERHEAD = 512
ANSWER_OVERHEAD = 4096


def _most(ranges: Sequence[tuple[int, int]]) -> int:
    return sum(n for _, n in ranges) + PART_OVERHEAD * len(ranges) + ANSWER_OVERHEAD


def _boundary(content_type: str) -> bytes | None:
    """The boundary of a ``multipart/byteranges`` Content-Type, None for any other type.

    >>> _boundary('multipart/byteranges; boundary="a b"'), _boundary("application/octet-stream")
    (b'a b', None)
    """
    kind, _, params = content_type.partition(";")
    if kind.strip().lower() != "multipart/byteranges":
        return None
    for param in params.split(";"):
        key, _, value = param.strip().partition("=")
        if key.strip().lower() == "boundary":
            value = value.strip().strip('"')
            if 0 < len(value) <= 70 and value.isascii():
                return value.encode("ascii")
    return None


def _split_byteranges(body: bytearray, boundary: bytes,
                      ranges: Sequence[tuple[int, int]]) -> list[bytes | bytearray] | str:
    """The bytes of each range asked, from a ``multipart/byteranges`` body; a string saying
    what is wrong if the body is malformed or its parts do not hold every range. Each part's
    length comes from its ``Content-Range``: its bytes are never searched for the boundary
    (they may hold it)."""
    delim = b"--" + boundary
    view = memoryview(body)
    parts: list[tuple[int, memoryview]] = []
    pos = body.find(delim)                      # after a preamble, if any
    while True:
        if pos < 0:
            return "multipart answer: a boundary is missing"
        pos += len(delim)
        if body[pos:pos + 2] == b"--":
            break                               # the close delimiter
        eol = body.find(b"\r\n", pos)
        end = body.find(b"\r\n\r\n", eol) if eol >= 0 else -1
        if end < 0:
            return "multipart answer: a part's headers do not end"
        first = last = -1
        for line in bytes(body[eol + 2:end]).split(b"\r\n"):
            key, _, value = line.partition(b":")
            parsed = _content_range(value) if key.strip().lower() == b"content-range" else None
            if parsed is not None:
                first, last, _ = parsed
        if first < 0 or last < first:
            return "multipart answer: a part without a valid Content-Range"
        start = end + 4
        stop = start + last - first + 1
        if stop > len(body):
            return "multipart answer: a part is cut short"
        parts.append((first, view[start:stop]))
        if body[stop:stop + 2] != b"\r\n" or body[stop + 2:stop + 2 + len(delim)] != delim:
            return "multipart answer: a part is not followed by a boundary"
        pos = stop + 2
    parts.sort(key=lambda p: p[0])
    starts = [p[0] for p in parts]
    out: list[bytes | bytearray] = []
    for off, n in ranges:
        i = bisect.bisect_right(starts, off) - 1
        if i < 0 or off + n > parts[i][0] + len(parts[i][1]):
            return f"multipart answer holds no part for bytes {off}-{off + n - 1}"
        a = off - parts[i][0]
        out.append(bytes(parts[i][1][a:a + n]))
    return out
