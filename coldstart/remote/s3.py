"""An S3 object as a :class:`~coldstart.remote.source.Source`, and the one mapping of
botocore/urllib3 errors to coldstart's tree (:func:`map_s3_error`).

botocore retries failed requests itself (``standard`` mode); what it cannot see is a body that
breaks off or dribbles after the headers came, because the body is read here, one network read at
a time from the raw urllib3 stream with each socket wait bounded by what is left of the attempt's
deadline. Those attempts are retried by :func:`coldstart.remote.retry.retry` within twice the
timeout. boto3 is imported on first use: importing this module is cheap.

::

    ClientError NoSuchKey/NoSuchBucket/404/NotFound  -> NotFound
    other ClientError                                -> Unavailable
    ConnectTimeoutError, ReadTimeoutError (botocore) -> DeadlineExceeded
    NoCredentialsError                               -> InvalidArgument
    any other BotoCoreError                          -> Unavailable
    urllib3 ReadTimeoutError on the body             -> DeadlineExceeded
    urllib3 ProtocolError on the body                -> Unavailable
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

from coldstart.config import SourceConfig
from coldstart.errors import (
    ColdstartError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from coldstart.remote.retry import Backoff, Deadline, retry, until
from coldstart.remote.source import bytes_view, fill_from_chunks, read_at_into

__all__ = ["S3Source", "map_s3_error", "s3_client", "s3_errors", "split_s3_url"]

_DEFAULTS = SourceConfig()
_NET_PIECE = 1 << 20


def s3_client(*, concurrency: int = _DEFAULTS.concurrency, timeout: float = _DEFAULTS.timeout,
              endpoint_url: str | None = None) -> Any:
    """A boto3 S3 client for parallel ranged GETs: pool sized to ``concurrency``, deadlines set.

    Credentials come from the standard chain; ``AWS_ENDPOINT_URL`` (or ``endpoint_url``) points it
    at an S3-compatible store.

    >>> client = s3_client(concurrency=8)  # doctest: +SKIP
    """
    import boto3
    from botocore.config import Config

    config = Config(
        max_pool_connections=max(concurrency, 10),
        connect_timeout=min(timeout, 10.0),
        read_timeout=timeout,
        retries={"max_attempts": 4, "mode": "standard"},
        tcp_keepalive=True,
    )
    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
        "AWS_ENDPOINT_URL")
    return boto3.session.Session().client("s3", endpoint_url=endpoint or None, config=config)


def s3_errors() -> tuple[type[Exception], ...]:
    """What a boto3 S3 call raises (catch these, then :func:`map_s3_error`)."""
    from botocore.exceptions import BotoCoreError, ClientError

    return (BotoCoreError, ClientError)


def map_s3_error(exc: Exception, what: str) -> ColdstartError:
    """Translate a botocore error to the coldstart tree (the one place that knows botocore)."""
    from botocore.exceptions import (
        ClientError,
        ConnectTimeoutError,
        NoCredentialsError,
        ReadTimeoutError,
    )

    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in ("NoSuchKey", "404", "NoSuchBucket", "NotFound"):
            return NotFound(f"{what}: not found ({code})")
        return Unavailable(f"{what}: S3 error {code}: {exc}")
    if isinstance(exc, ConnectTimeoutError | ReadTimeoutError):
        return DeadlineExceeded(f"{what}: S3 request timed out")
    if isinstance(exc, NoCredentialsError):
        return InvalidArgument(f"{what}: no AWS credentials found in the standard chain")
    return Unavailable(f"{what}: S3 request failed: {exc}")


def split_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` -> ``("bucket", "key")``.

    >>> split_s3_url("s3://models/llama/1/model.safetensors")
    ('models', 'llama/1/model.safetensors')
    """
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc:
        raise InvalidArgument(f"{url}: not an s3://bucket/key URL")
    return parts.netloc, parts.path.lstrip("/")


class S3Source:
    """An S3 object read with parallel ranged GETs.

    ``client`` (optional) is a shared :func:`s3_client`; ``timeout`` the default deadline of one
    range attempt (a read's retries share twice it).

    >>> src = S3Source("s3://models/llama/model.safetensors")  # doctest: +SKIP
    """

    def __init__(self, url: str, *, client: Any = None,
                 concurrency: int = _DEFAULTS.concurrency, timeout: float = _DEFAULTS.timeout,
                 retries: int = _DEFAULTS.retries,
                 max_backoff: float = _DEFAULTS.max_backoff) -> None:
        import botocore.response

        self.name = url
        self.bucket, self.key = split_s3_url(url)
        self._errors = s3_errors()
        # What the raw urllib3 stream under a StreamingBody raises (botocore's own read()
        # translates exactly these two; _pieces reads the raw stream, so this module does).
        self._urllib3_timeout: type[Exception] = getattr(
            botocore.response, "URLLib3ReadTimeoutError", DeadlineExceeded)
        self._urllib3_errors: tuple[type[Exception], ...] = (
            self._urllib3_timeout,
            getattr(botocore.response, "URLLib3ProtocolError", Unavailable))
        self._client = client or s3_client(concurrency=concurrency, timeout=timeout)
        self._timeout = timeout
        self._retries = retries
        self._backoff = Backoff(cap=max_backoff)
        self._size: int | None = None
        self._lock = threading.Lock()

    def size(self) -> int:
        with self._lock:
            if self._size is None:
                try:
                    head = self._client.head_object(Bucket=self.bucket, Key=self.key)
                except self._errors as exc:
                    raise map_s3_error(exc, self.name) from exc
                self._size = int(head["ContentLength"])
            return self._size

    def read_at(self, offset: int, length: int, *, timeout: float | None = None) -> bytes:
        return read_at_into(self, offset, length, timeout)

    def read_into(self, offset: int, buffers: Sequence[memoryview], *,
                  timeout: float | None = None) -> None:
        total = sum(b.nbytes for b in buffers)
        if total == 0:
            return
        views = [bytes_view(b) for b in buffers]
        per_attempt = self._timeout if timeout is None else timeout
        what = f"{self.name}: range GET at {offset}"

        def attempt(deadline: float) -> None:
            try:
                resp = self._client.get_object(Bucket=self.bucket, Key=self.key,
                                               Range=f"bytes={offset}-{offset + total - 1}")
                body = resp["Body"]
                try:
                    status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
                    if status == 200 and not resp.get("ContentRange"):
                        raise FailedPrecondition(f"{self.name}: server ignored Range (HTTP "
                                                 "200, expected 206)")
                    fill_from_chunks(self.name, offset, views,
                                     until(deadline, what, self._pieces(body, deadline,
                                                                        per_attempt)))
                finally:
                    body.close()
            except self._errors as exc:
                raise map_s3_error(exc, f"{self.name} at {offset}") from exc
            except self._urllib3_errors as exc:  # raised by read1 on the raw stream
                if isinstance(exc, self._urllib3_timeout):
                    raise DeadlineExceeded(f"{what}: S3 read timed out") from exc
                raise Unavailable(f"{what}: S3 body failed: {exc}") from exc

        # botocore retries failed requests; this covers a body cut off mid-stream or too slow.
        retry(attempt, what=what, deadline=Deadline(per_attempt * 2, what),
              retries=self._retries, backoff=self._backoff, per_attempt=per_attempt)

    def _pieces(self, body: Any, deadline: float, per_read: float) -> Iterator[bytes]:
        """The body as it arrives: one network read at a time (``read1`` of the raw urllib3
        stream, where there is one), each socket wait bounded by what is left of ``deadline``.
        ``StreamingBody.read(n)`` would wait for all ``n`` bytes, however slowly they come."""
        from botocore.compat import set_socket_timeout

        raw = getattr(body, "_raw_stream", None)
        read1 = getattr(raw, "read1", None)

        def settimeout(seconds: float) -> None:
            try:
                set_socket_timeout(raw, seconds)
            except (AttributeError, OSError):  # not a plain socket underneath: reads still
                pass                           # time out after the client's read_timeout

        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceeded(f"{self.name}: range not received within its "
                                           "deadline (the server is sending too slowly)")
                settimeout(max(0.001, min(per_read, left)))
                chunk = read1(_NET_PIECE) if callable(read1) else body.read(_NET_PIECE)
                if not chunk:
                    return
                yield chunk
        finally:
            settimeout(self._timeout)  # the connection goes back to the pool

    def close(self) -> None:
        pass
