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

Every socket operation waits at most until the call's deadline, and the deadline is checked
between reads of at most ``READ_STEP`` bytes, so a server that dribbles is cut off.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from coldstart.errors import DeadlineExceeded, Unavailable

__all__ = ["Declined", "RangeConnections", "content_range_start"]

#: bytes asked of the socket per ``readinto`` (the deadline is checked between two)
READ_STEP = 1 << 20
#: redirects followed before declining
MAX_REDIRECTS = 5
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


@dataclass(frozen=True, slots=True)
class Declined:
    """Not served here: ``reason`` says why; the caller asks its general client instead."""

    reason: str
    status: int = 0


def content_range_start(value: str | None) -> int | None:
    """The first byte of a ``Content-Range: bytes FIRST-LAST/TOTAL`` header, or None.

    >>> content_range_start("bytes 100-199/1000"), content_range_start("bytes */1000")
    (100, None)
    """
    if not value:
        return None
    unit, _, rest = value.strip().partition(" ")
    first = rest.partition("-")[0]
    if unit.lower() != "bytes" or not first.isdigit():
        return None
    return int(first)


_Key = tuple[str, str, int, object]


class RangeConnections:
    """Kept-alive ``http.client`` connections, per (scheme, host, port, TLS settings).

    ``ssl_context(url)`` gives the TLS context for an ``https`` URL (the caller's CA and
    client-certificate settings; called once per distinct return value's key, see
    :meth:`get`). Thread-safe: a connection is used by one call at a time.
    """

    def __init__(self, *, max_idle: int = 16, user_agent: str = "coldstart") -> None:
        self.max_idle = max(0, max_idle)
        self.user_agent = user_agent
        self._idle: dict[_Key, list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = [c for cs in self._idle.values() for c in cs]
            self._idle.clear()
        for c in conns:
            c.close()

    # -- the one call ----------------------------------------------------------------------

    def get(self, url: str, offset: int, length: int, *, headers: Mapping[str, str],
            deadline: float, what: str,
            tls: Callable[[str], ssl.SSLContext | None] | None = None) -> bytearray | Declined:
        """Bytes ``[offset, offset+length)`` of ``url`` (fewer only if the resource ends
        first), by monotonic ``deadline``, or :class:`Declined`.

        ``headers`` go with the request to ``url`` (an ``Authorization`` header only to its
        own host: a redirect elsewhere drops it). ``tls(url)``: the TLS context for an
        ``https`` URL, None for the default verification.
        """
        hdrs = {"User-Agent": self.user_agent, "Accept-Encoding": "identity", **headers,
                "Range": f"bytes={offset}-{offset + length - 1}"}
        origin = urlsplit(url).netloc
        for _hop in range(MAX_REDIRECTS + 1):
            answer = self._one(url, hdrs, offset, length, deadline, what, tls)
            if not isinstance(answer, str):
                return answer
            target = urljoin(url, answer)
            if urlsplit(target).netloc != origin:
                hdrs = {k: v for k, v in hdrs.items() if k.lower() != "authorization"}
            url = target
        return Declined(f"more than {MAX_REDIRECTS} redirects")

    def _one(self, url: str, headers: Mapping[str, str], offset: int, length: int,
             deadline: float, what: str,
             tls: Callable[[str], ssl.SSLContext | None] | None) -> bytearray | Declined | str:
        """One request: the body, Declined, or the ``Location`` of a redirect."""
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
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(f"{what}: no time left")
            try:
                conn.timeout = left
                if conn.sock is not None:
                    conn.sock.settimeout(left)
                conn.request("GET", target, headers=dict(headers))
                resp = conn.getresponse()
            except TimeoutError as exc:
                raise DeadlineExceeded(f"{what}: no answer within the deadline") from exc
            except (OSError, http.client.HTTPException) as exc:
                if reused:
                    # a kept-alive connection the server closed meanwhile: once more, fresh
                    conn.close()
                    conn, reused = self._take(key, parts.scheme, parts.hostname, port, ctx,
                                              fresh=True)
                    try:
                        conn.timeout = max(deadline - time.monotonic(), 0.001)
                        conn.request("GET", target, headers=dict(headers))
                        resp = conn.getresponse()
                    except TimeoutError as exc2:
                        raise DeadlineExceeded(f"{what}: no answer within the deadline") \
                            from exc2
                    except (OSError, http.client.HTTPException) as exc2:
                        return Declined(f"{type(exc2).__name__}: {exc2}")
                else:
                    return Declined(f"{type(exc).__name__}: {exc}")
            status = resp.status
            if status in _REDIRECTS:
                location = resp.getheader("Location") or ""
                keep = self._drain(resp, deadline)
                return location if location else Declined("redirect without Location", status)
            if status != 206:
                return Declined(f"HTTP {status}", status)
            start = content_range_start(resp.getheader("Content-Range"))
            size = resp.length
            if start != offset or size is None or size > length:
                return Declined(f"Content-Range {resp.getheader('Content-Range')!r}, "
                                f"Content-Length {size}", status)
            buf = bytearray(size)
            self._read_body(conn, resp, memoryview(buf), deadline, what)
            keep = not resp.will_close
            return buf
        finally:
            if keep:
                self._give(key, conn)
            else:
                conn.close()

    @staticmethod
    def _read_body(conn: http.client.HTTPConnection, resp: http.client.HTTPResponse,
                   view: memoryview, deadline: float, what: str) -> None:
        pos, size = 0, len(view)
        try:
            while pos < size:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceeded(f"{what}: body not received within the deadline "
                                           f"({pos} of {size} bytes)")
                if conn.sock is not None:
                    conn.sock.settimeout(left)
                n = resp.readinto(view[pos: pos + READ_STEP])
                if not n:
                    raise Unavailable(f"{what}: connection closed after {pos} of {size} bytes")
                pos += n
        except TimeoutError as exc:
            raise DeadlineExceeded(f"{what}: body stalled ({pos} of {size} bytes)") from exc
        except (OSError, http.client.HTTPException) as exc:
            raise Unavailable(f"{what}: connection lost after {pos} of {size} bytes: "
                              f"{type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _drain(resp: http.client.HTTPResponse, deadline: float) -> bool:
        """Read a small body to its end so the connection can be reused; False if not."""
        if resp.length is None or resp.length > (64 << 10) or resp.will_close:
            return False
        try:
            resp.read()
        except (OSError, http.client.HTTPException):
            return False
        return time.monotonic() < deadline

    # -- the pool --------------------------------------------------------------------------

    def _take(self, key: _Key, scheme: str, host: str, port: int, ctx: ssl.SSLContext | None,
              *, fresh: bool = False) -> tuple[http.client.HTTPConnection, bool]:
        if not fresh:
            with self._lock:
                idle = self._idle.get(key)
                if idle:
                    return idle.pop(), True
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
                idle.append(conn)
                return
        conn.close()


_DEFAULT_CTX: ssl.SSLContext | None = None
_DEFAULT_CTX_LOCK = threading.Lock()


def _default_context() -> ssl.SSLContext:
    """One default-verification TLS context (building one costs ~0.5 s of CPU)."""
    global _DEFAULT_CTX
    with _DEFAULT_CTX_LOCK:
        if _DEFAULT_CTX is None:
            _DEFAULT_CTX = ssl.create_default_context()
        return _DEFAULT_CTX
