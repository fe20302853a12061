"""Reading blobs from a registry: whole and verified, streamed with resume, byte ranges.

- :meth:`BlobReader.download` streams a blob into a file, hashing it on the way; a body that
  breaks off is resumed with a range request where it stopped; bytes that do not match the
  digest are an :class:`IntegrityError`.
- :meth:`BlobReader.read_range` reads one byte range. Once the general request path
  (:class:`~coldstart.oci.transport.Transport`) has read a range of a repository with no
  credentials or a bearer token, later ranges of it go *direct*: over
  :class:`~coldstart.remote.rangeconn.RangeConnections` straight into a buffer, with the same
  ``Authorization``. A direct read the registry declines (auth, an error status, a whole-blob
  answer) goes back through the general path, which says what is wrong; an endpoint that does
  not answer direct reads at all is left alone for a minute.
- :meth:`BlobReader.read_ranges` asks several ranges in one multi-range request where the
  registry answers those, else one request each.
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO
from urllib.parse import urlencode

import httpx

from coldstart.errors import (
    DeadlineExceeded,
    IntegrityError,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from coldstart.oci.hosts import Endpoint
from coldstart.oci.reference import Reference, validate_digest
from coldstart.oci.transport import Transport
from coldstart.remote.errors import BODY_ERRORS, map_http_error
from coldstart.remote.rangeconn import Declined
from coldstart.remote.retry import Again, Deadline, only_again, retry

__all__ = ["BlobReader"]

log = logging.getLogger(__name__)

#: seconds an endpoint whose direct range read got no answer goes through the general client
_DIRECT_BACKOFF = 60.0


def _content_range_starts(resp: httpx.Response, offset: int) -> bool:
    m = re.match(r"bytes (\d+)-(\d+)/(\d+|\*)", resp.headers.get("Content-Range", ""))
    return m is not None and int(m.group(1)) == offset


class BlobReader:
    """Blob reads through ``transport``; thread-safe. See the module docstring."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._lock = threading.Lock()
        # (endpoint, repository) whose range reads go direct, with the Authorization they go
        # with: set once the general client read a range there with no credentials or a
        # bearer token (Basic credentials, which the CRI keychain rotates, stay with it)
        self._direct_ok: dict[tuple[str, str], str] = {}
        self._direct_off: dict[str, float] = {}     # endpoint -> monotonic time to retry
        self._multi_off: set[str] = set()   # endpoints that do not answer multi-range requests

    def exists(self, ref: Reference, digest: str, *, timeout: float | None = None) -> bool:
        """Whether the repository holds blob ``digest``."""
        try:
            self.size(ref, digest, timeout=timeout)
        except NotFound:
            return False
        return True

    def size(self, ref: Reference, digest: str, *, timeout: float | None = None) -> int:
        """The size of blob ``digest`` (HEAD)."""
        validate_digest(digest)
        resp = self._transport.request(ref, "HEAD", f"/blobs/{digest}", capability="pull",
                                       timeout=timeout,
                                       what=f"head blob {digest[:19]} in {ref.name}")
        length = resp.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise Unavailable(f"head blob {digest}: no Content-Length from registry")
        return int(length)

    def get(self, ref: Reference, digest: str, *, max_size: int,
            timeout: float | None = None) -> bytes:
        """A whole (small) blob in memory, verified against ``digest``."""
        buf = io.BytesIO()
        self.download(ref, digest, buf, max_size=max_size, timeout=timeout)
        return buf.getvalue()

    def download(self, ref: Reference, digest: str, dst: IO[bytes], *,
                 size: int | None = None, max_size: int | None = None,
                 timeout: float | None = None,
                 progress: Callable[[int], None] | None = None) -> int:
        """Stream blob ``digest`` into ``dst``, verifying it; resume with ranges after errors.
        Returns the byte count; ``dst`` holds unverified bytes if this raises."""
        transport = self._transport
        validate_digest(digest)
        algo = digest.split(":", 1)[0]
        hasher = hashlib.new(algo)
        what = f"get blob {digest[:19]} from {ref.name}"
        deadline = Deadline(timeout if timeout is not None else transport.blob_timeout, what)
        written = 0

        def once(_: float) -> None:
            nonlocal written
            headers = {"Range": f"bytes={written}-"} if written else {}
            resp = transport.request(ref, "GET", f"/blobs/{digest}", capability="pull",
                                     headers=headers, ok=(200, 206), stream=True, what=what,
                                     deadline=deadline)
            skip = written if (written and resp.status_code == 200) else 0
            if resp.status_code == 206 and not _content_range_starts(resp, written):
                resp.close()
                raise Unavailable(f"{what}: resumed at {written}, registry answered "
                                  f"Content-Range {resp.headers.get('Content-Range')!r}")
            try:
                for chunk in resp.iter_bytes():
                    if skip:
                        if len(chunk) <= skip:
                            skip -= len(chunk)
                            continue
                        chunk, skip = chunk[skip:], 0
                    written += len(chunk)
                    if (max_size is not None and written > max_size) or \
                            (size is not None and written > size):
                        raise IntegrityError(f"{what}: larger than expected "
                                             f"({max_size if size is None else size} bytes)")
                    hasher.update(chunk)
                    dst.write(chunk)
                    if progress is not None:
                        progress(len(chunk))
                    if deadline.remaining() <= 0:
                        raise DeadlineExceeded(f"{what}: not done within {deadline.seconds:g} s")
            except BODY_ERRORS as exc:
                # the body broke off: resume where it stopped
                raise Again(map_http_error(exc, f"{what}: connection lost")) from exc
            finally:
                resp.close()

        retry(once, what=what, deadline=deadline, retries=transport.retries,
              backoff=transport.backoff, classify=only_again)
        got = f"{algo}:{hasher.hexdigest()}"
        if got != digest:
            raise IntegrityError(f"{what}: content is {got}")
        if size is not None and written != size:
            raise IntegrityError(f"{what}: {written} bytes, descriptor says {size}")
        return written

    def read_range(self, ref: Reference, digest: str, offset: int, length: int, *,
                   timeout: float | None = None) -> bytes | bytearray:
        """Bytes ``[offset, offset+length)`` of a blob via an HTTP range request.

        Shorter only if the blob ends first. A registry that ignores ``Range`` and sends the whole
        blob (200) still yields exactly the requested bytes (the rest is not kept in memory).
        """
        transport = self._transport
        if offset < 0 or length < 0:
            raise InvalidArgument(f"bad range offset={offset} length={length}")
        if length == 0:
            return b""
        what = f"read {digest[:19]}[{offset}:+{length}] from {ref.name}"
        deadline = Deadline(timeout if timeout is not None else transport.timeout, what)

        direct = True
        eps = transport.endpoints(ref.registry, "pull")

        def once(_: float) -> bytes | bytearray:
            nonlocal direct
            if direct:
                try:
                    got = self._direct_range(eps[0], ref, digest, offset, length, deadline,
                                             what)
                except DeadlineExceeded:
                    raise
                except Unavailable as exc:      # the body broke off: another try
                    raise Again(exc) from exc
                if got is not None:
                    return got      # (a bytearray read into in place: not copied again)
                # declined (auth, an error status, a whole-blob answer): this call's tries go
                # through the general client, which says what is wrong
                direct = False
            resp = transport.request(ref, "GET", f"/blobs/{digest}", capability="pull",
                                     headers={"Range": f"bytes={offset}-{offset + length - 1}"},
                                     ok=(200, 206), stream=True, what=what, deadline=deadline)
            try:
                body = self._range_body(resp, offset, length, deadline, what)
                used = resp.request.headers.get("Authorization", "")
                if (resp.status_code == 206 and str(resp.url).startswith(eps[0].base + "/")
                        and (not used or used.startswith("Bearer "))):
                    with self._lock:
                        self._direct_ok[(eps[0].base, ref.repository)] = used
                return body
            except BODY_ERRORS as exc:
                raise Again(map_http_error(exc, f"{what}: connection lost")) from exc
            finally:
                resp.close()

        return retry(once, what=what, deadline=deadline, retries=transport.retries,
                     backoff=transport.backoff, classify=only_again)

    def read_ranges(self, ref: Reference, digest: str, ranges: Sequence[tuple[int, int]], *,
                    timeout: float | None = None) -> tuple[list[bytes | bytearray], int]:
        """Several ranges ``(offset, length)`` of a blob, each exactly as asked, and the number
        of requests it took (see
        :meth:`~coldstart.oci.registry.RegistryClient.read_blob_ranges`)."""
        ranges = list(ranges)
        what = f"read {digest[:19]}[{len(ranges)} ranges] from {ref.name}"
        deadline = Deadline(timeout if timeout is not None else self._transport.timeout, what)
        if len(ranges) > 1:
            eps = self._transport.endpoints(ref.registry, "pull")
            try:
                got = self._direct_ranges(eps[0], ref, digest, ranges, deadline, what)
            except DeadlineExceeded:
                raise
            except Unavailable as exc:      # the body broke off: range by range, with retries
                log.debug("%s: %s; one range at a time", what, exc)
                got = None
            if got is not None:
                return list(got), 1
        out = [self.read_range(ref, digest, off, n, timeout=deadline.remaining())
               for off, n in ranges]
        return out, len(ranges)

    def reads_many(self, ref: Reference) -> bool:
        """Whether :meth:`read_ranges` would ask ``ref``'s registry several ranges in one
        request now: its range reads go direct and it has not declined a multi-range
        request."""
        ep = self._transport.endpoints(ref.registry, "pull")[0]
        with self._lock:
            return ep.base not in self._multi_off and self._goes_direct(ep, ref)

    def _goes_direct(self, ep: Endpoint, ref: Reference) -> bool:
        """(With the lock held.) Whether range reads of ``ref`` from ``ep`` go direct now."""
        return (not self._transport.conns.closed
                and (ep.base, ref.repository) in self._direct_ok
                and time.monotonic() >= self._direct_off.get(ep.base, 0.0))

    def _direct_target(self, ep: Endpoint, ref: Reference, digest: str
                       ) -> tuple[str, dict[str, str]] | None:
        """URL and headers of a direct range read of ``digest`` from the registry's first
        endpoint ``ep`` (with the credentials already known for the repository); None where
        range reads do not go direct (yet)."""
        with self._lock:    # before the credential look-up: most repositories decline here
            if not self._goes_direct(ep, ref):
                return None
        auth = self._transport.auth.header(ep, f"repository:{ref.repository}:pull") or ""
        with self._lock:
            if self._direct_ok.get((ep.base, ref.repository)) != auth:
                return None
        url = f"{ep.base}/{ref.repository}/blobs/{digest}"
        if ep.mirror_of:
            url += "?" + urlencode([("ns", ep.mirror_of)])
        headers = dict(ep.headers)
        if auth:
            headers["Authorization"] = auth
        return url, headers

    def _direct_ranges(self, ep: Endpoint, ref: Reference, digest: str,
                       ranges: list[tuple[int, int]], deadline: Deadline,
                       what: str) -> list[bytes | bytearray] | None:
        """The ranges in one multi-range request over :class:`RangeConnections`; None when
        range reads do not go direct or the registry declines (then not asked again)."""
        with self._lock:
            if ep.base in self._multi_off:
                return None
        target = self._direct_target(ep, ref, digest)
        if target is None:
            return None
        url, headers = target
        conns = self._transport.conns
        got = conns.ranges.get_ranges(url, ranges, headers=headers, deadline=deadline.end,
                                      what=what, tls=lambda u: conns.tls_context(ep, u),
                                      stall=conns.timeout)
        if isinstance(got, Declined):
            if got.status in (200, 206):
                # the whole blob (an object store behind it), or parts that are not the
                # ranges asked: this endpoint is not asked several ranges at once again
                log.info("%s: the registry does not answer multi-range requests (%s): one "
                         "range per request from now on", what, got.reason)
                with self._lock:
                    self._multi_off.add(ep.base)
            else:
                self._direct_declined(ep, ref, what, got)
            return None
        return got

    def _direct_range(self, ep: Endpoint, ref: Reference, digest: str, offset: int,
                      length: int, deadline: Deadline, what: str) -> bytes | bytearray | None:
        """The range from the registry's first endpoint ``ep`` over
        :class:`RangeConnections` (with the credentials already known for the repository);
        None when it declines."""
        target = self._direct_target(ep, ref, digest)
        if target is None:
            return None
        url, headers = target
        conns = self._transport.conns
        # a stall is cut off after ``timeout`` as on the general path (httpx's read
        # timeout), so that the call's retries get the rest of its deadline
        got = conns.ranges.get(url, offset, length, headers=headers,
                               deadline=deadline.end, what=what,
                               tls=lambda u: conns.tls_context(ep, u), stall=conns.timeout)
        if isinstance(got, Declined):
            self._direct_declined(ep, ref, what, got)
            return None
        return got

    def _direct_declined(self, ep: Endpoint, ref: Reference, what: str,
                         got: Declined) -> None:
        log.debug("%s: direct range read declined (%s); through the general client",
                  what, got.reason)
        with self._lock:
            if got.status in (200, 401, 403):
                # the registry ignores Range, or wants other credentials: the general
                # client serves the repository until one of its range reads succeeds
                self._direct_ok.pop((ep.base, ref.repository), None)
            elif got.status == 0:
                # no answer at all (connect or TLS failure) where the general client gets
                # one: the endpoint goes through it for a while
                self._direct_off[ep.base] = time.monotonic() + _DIRECT_BACKOFF

    @staticmethod
    def _range_body(resp: httpx.Response, offset: int, length: int, deadline: Deadline,
                    what: str) -> bytes:
        skip = 0
        # a 206 body is read to its end so the connection goes back to the pool
        skip_whole = resp.status_code != 206
        if resp.status_code == 206:
            if not _content_range_starts(resp, offset):
                raise Unavailable(
                    f"{what}: bad Content-Range {resp.headers.get('Content-Range')!r}")
        else:
            skip = offset
        out = bytearray()
        for chunk in resp.iter_bytes():
            if skip:
                if len(chunk) <= skip:
                    skip -= len(chunk)
                    continue
                chunk, skip = chunk[skip:], 0
            out += chunk[: length - len(out)]
            if len(out) >= length and skip_whole:
                # the rest of a whole-blob answer is not wanted: drop the connection
                break
            if deadline.remaining() <= 0:
                raise DeadlineExceeded(f"{what}: not done within {deadline.seconds:g} s")
        return bytes(out)
