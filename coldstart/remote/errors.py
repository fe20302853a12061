"""httpx's errors and HTTP statuses in coldstart's tree: the one place that maps them.

::

    httpx.TimeoutException (connect, read, write, pool)  -> DeadlineExceeded
    httpx.TransportError with a failed certificate check -> Unavailable ("TLS verification ...")
    any other httpx.TransportError / StreamError         -> Unavailable
    HTTP 404                                             -> NotFound
    HTTP 416                                             -> InvalidArgument
    HTTP 408, 429, 5xx                                   -> Unavailable (retryable)

The registry client (``coldstart.oci``: its transport, authorizer and blob reader) and the HTTP
source (:mod:`.http`) both map through here; S3's botocore errors are mapped in :mod:`.s3`.

>>> import httpx
>>> type(map_http_error(httpx.ReadTimeout("slow"), "GET /x")).__name__
'DeadlineExceeded'
"""

from __future__ import annotations

import httpx

from coldstart.errors import (
    ColdstartError,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    Unavailable,
)

__all__ = ["BODY_ERRORS", "RETRY_STATUS", "is_tls_failure", "map_http_error", "map_status"]

# Statuses worth another attempt (the request itself was fine).
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# What a response body that breaks off mid-stream raises.
BODY_ERRORS: tuple[type[Exception], ...] = (httpx.TransportError, httpx.StreamError)


def is_tls_failure(exc: BaseException) -> bool:
    """A certificate that did not verify: retrying cannot fix it."""
    return "CERTIFICATE_VERIFY_FAILED" in str(exc)


def map_http_error(exc: BaseException, what: str) -> Unavailable:
    """The coldstart error for an httpx failure of ``what`` (raise it ``from exc``); anything
    that is not a timeout or a certificate failure is :class:`Unavailable`."""
    if isinstance(exc, httpx.TimeoutException):
        return DeadlineExceeded(f"{what}: timed out: {exc}")
    if is_tls_failure(exc):
        return Unavailable(f"{what}: TLS verification failed ({exc})")
    return Unavailable(f"{what}: {exc}")


def map_status(status: int, what: str) -> ColdstartError | None:
    """The coldstart error for an HTTP status of ``what``, None for a success (< 400)."""
    if status < 400:
        return None
    if status == 404:
        return NotFound(f"{what}: not found (HTTP 404)")
    if status == 416:
        return InvalidArgument(f"{what}: range not satisfiable (HTTP 416)")
    return Unavailable(f"{what}: answered HTTP {status}")
