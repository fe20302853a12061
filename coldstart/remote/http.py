"""An ``http(s)://`` URL as a :class:`~coldstart.remote.source.Source`: ``Range`` GETs over one
pooled httpx client.

Each range attempt has its own deadline (the call's ``timeout``), checked between network reads,
so a server that dribbles bytes is cut off; a failed or stalled attempt is retried with jittered
backoff within twice that (:func:`coldstart.remote.retry.retry`). Redirects are followed (blob
storage behind a CDN or a presigned URL). A server that answers a range request with ``200`` and
the whole file is refused with :class:`~coldstart.errors.FailedPrecondition`: it would send
gigabytes for every range.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx

from coldstart.config import SourceConfig
from coldstart.errors import DeadlineExceeded, FailedPrecondition, Unavailable
from coldstart.remote.errors import map_http_error, map_status
from coldstart.remote.retry import Backoff, Deadline, retry, until
from coldstart.remote.source import bytes_view, fill_from_chunks, read_at_into

__all__ = ["HttpSource", "http_client"]

_DEFAULTS = SourceConfig()


def http_client(*, timeout: float = _DEFAULTS.timeout,
                concurrency: int = _DEFAULTS.concurrency) -> httpx.Client:
    """A pooled client for range reads: ``concurrency`` connections, redirects followed.

    >>> http_client(timeout=5.0).close()
    """
    return httpx.Client(
        timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
        limits=httpx.Limits(max_connections=concurrency,
                            max_keepalive_connections=concurrency),
        follow_redirects=True,
    )


class HttpSource:
    """An ``http(s)://`` URL read with parallel ``Range`` GETs.

    ``client`` (optional) is a shared :func:`http_client`; ``timeout`` the default deadline of
    one range attempt (a read's retries share twice it).

    >>> src = HttpSource("https://example.com/model.safetensors", timeout=30.0)  # doctest: +SKIP
    """

    def __init__(self, url: str, *, timeout: float = _DEFAULTS.timeout,
                 concurrency: int = _DEFAULTS.concurrency, client: httpx.Client | None = None,
                 retries: int = _DEFAULTS.retries,
                 max_backoff: float = _DEFAULTS.max_backoff) -> None:
        self.name = url
        self._timeout = timeout
        self._retries = retries
        self._backoff = Backoff(cap=max_backoff)
        self._own = client is None
        self._client = client or http_client(timeout=timeout, concurrency=concurrency)
        self._size: int | None = None
        self._lock = threading.Lock()

    def _check(self, status: int, what: str) -> None:
        err = map_status(status, f"{self.name}: {what}")
        if err is not None:
            raise err

    def size(self) -> int:
        with self._lock:
            if self._size is None:
                self._size = self._probe_size()
            return self._size

    def _probe_size(self) -> int:
        resp: Any
        try:
            resp = self._client.head(self.name)
            if resp.status_code in (403, 405):
                # Presigned URLs sign one method: ask for the first byte and read Content-Range.
                with self._client.stream("GET", self.name, headers={"Range": "bytes=0-0"}) as r:
                    self._check(r.status_code, "GET bytes=0-0")
                    total = r.headers.get("content-range", "").rpartition("/")[2]
                    if r.status_code == 206 and total.isdigit():
                        return int(total)
                    resp = r
        except httpx.HTTPError as exc:
            raise map_http_error(exc, f"{self.name}: HEAD") from exc
        self._check(resp.status_code, "HEAD")
        length = resp.headers.get("content-length")
        if length is None or not length.isdigit():
            raise Unavailable(f"{self.name}: server gave no Content-Length")
        return int(length)

    def read_at(self, offset: int, length: int, *, timeout: float | None = None) -> bytes:
        return read_at_into(self, offset, length, timeout)

    def read_into(self, offset: int, buffers: Sequence[memoryview], *,
                  timeout: float | None = None) -> None:
        total = sum(b.nbytes for b in buffers)
        if total == 0:
            return
        headers = {"Range": f"bytes={offset}-{offset + total - 1}",
                   "Accept-Encoding": "identity"}
        views = [bytes_view(b) for b in buffers]
        per_attempt = self._timeout if timeout is None else timeout
        what = f"{self.name}: range GET at {offset}"

        def attempt(deadline: float) -> None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(f"{what}: no time left")
            # No socket wait may outlast the attempt's deadline either.
            limits = httpx.Timeout(min(per_attempt, left), connect=min(left, 10.0))
            try:
                with self._client.stream("GET", self.name, headers=headers,
                                         timeout=limits) as resp:
                    self._check(resp.status_code, "range GET")
                    if resp.status_code != 206:
                        raise FailedPrecondition(
                            f"{self.name}: server ignored Range (HTTP {resp.status_code}, "
                            "expected 206)")
                    # iter_raw() without a size hands over each network read as it arrives,
                    # so the deadline is checked between reads.
                    fill_from_chunks(self.name, offset, views,
                                     until(deadline, what, resp.iter_raw()))
            except httpx.HTTPError as exc:
                raise map_http_error(exc, what) from exc

        retry(attempt, what=what, deadline=Deadline(per_attempt * 2, what),
              retries=self._retries, backoff=self._backoff, per_attempt=per_attempt)

    def close(self) -> None:
        if self._own:
            self._client.close()
