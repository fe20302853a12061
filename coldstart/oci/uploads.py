"""Blob uploads to a registry: monolithic or chunked sessions, cross-repository mounts.

An upload session is not idempotent (``PATCH``/``PUT`` on a session URL the registry gave), so no
single request of it is retried; a failed attempt starts a fresh session, with the registry
client's backoff, within the call's deadline (:func:`coldstart.remote.retry.retry`). Functions
here send through the request engine (:class:`~coldstart.oci.transport.Transport`) and ask the
blob reader (:class:`~coldstart.oci.blobs.BlobReader`) whether a blob is there already;
:class:`~coldstart.oci.registry.RegistryClient`'s ``push_blob`` and ``mount_blob`` call them.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlencode, urljoin, urlsplit

import httpx

from coldstart.errors import ColdstartError, DeadlineExceeded, IntegrityError, Unavailable
from coldstart.oci.blobs import BlobReader
from coldstart.oci.hosts import Endpoint
from coldstart.oci.reference import Reference, validate_digest
from coldstart.oci.transport import BodyFactory, Transport
from coldstart.remote.retry import Again, Deadline, retry

__all__ = ["UploadSource", "mount_blob", "push_blob"]

_CHUNK = 1 << 20


def _start(transport: Transport, ref: Reference, *, params: Sequence[tuple[str, str]] = (),
           scope: str | None = None, deadline: Deadline) -> httpx.Response:
    return transport.request(ref, "POST", "/blobs/uploads/", capability="push",
                           scope=scope or f"repository:{ref.repository}:pull,push",
                           params=params, ok=(201, 202), deadline=deadline,
                           headers={"Content-Length": "0"},
                           what=f"start upload to {ref.name}")


def _session_url(ref: Reference, resp: httpx.Response) -> str:
    location = resp.headers.get("Location")
    if not location:
        raise Unavailable(f"upload to {ref.name}: registry gave no Location")
    return str(urljoin(str(resp.request.url), location))


def _raw(transport: Transport, ref: Reference, method: str, url: str, *,
         headers: Mapping[str, str], body: BodyFactory | None, ok: Iterable[int],
         deadline: Deadline, what: str,
         extra: Sequence[tuple[str, str]] = ()) -> httpx.Response:
    """A request to an absolute URL given by the registry (upload sessions); no retries,
    since PATCH/PUT on a session are not idempotent: the caller restarts the upload."""
    if extra:
        url += ("&" if "?" in url else "?") + urlencode(extra)
    ep = _endpoint_for_url(transport, ref, url)
    return transport.attempts(ep, method, url, scope=f"repository:{ref.repository}:pull,push",
                            headers=headers, body=body, ok=frozenset(ok), deadline=deadline,
                            stream=False, retry=False, what=what)


def _endpoint_for_url(transport: Transport, ref: Reference, url: str) -> Endpoint:
    netloc = urlsplit(url).netloc
    eps = transport.endpoints(ref.registry, "push")
    for ep in eps:
        if ep.host == netloc:
            return ep
    return eps[-1]


def _restartable(exc: BaseException) -> Again | None:
    # a failed session is started over; a spent deadline is not
    if isinstance(exc, Unavailable) and not isinstance(exc, DeadlineExceeded):
        return Again(exc)
    return None


def push_blob(transport: Transport, blobs: BlobReader, ref: Reference,
              data: bytes | Path | BinaryIO, digest: str | None = None, *,
              chunk_size: int | None = None, timeout: float | None = None) -> str:
    """:meth:`~coldstart.oci.registry.RegistryClient.push_blob`: upload unless ``blobs``
    finds the blob there already; return its digest."""
    src = UploadSource.of(data)
    try:
        if digest is None:
            digest = src.digest()
        validate_digest(digest)
        if blobs.exists(ref, digest, timeout=timeout):
            return digest
        what = f"push blob {digest[:19]} to {ref.name}"
        deadline = Deadline(timeout if timeout is not None else transport.blob_timeout, what)
        pinned = digest
        retry(lambda _: _upload_once(transport, ref, src, pinned, chunk_size, deadline, what),
              what=what, deadline=deadline, retries=transport.retries, backoff=transport.backoff,
              classify=_restartable)
        return digest
    finally:
        src.close()


def _upload_once(transport: Transport, ref: Reference, src: UploadSource, digest: str,
                 chunk_size: int | None, deadline: Deadline, what: str) -> None:
    start = _start(transport, ref, deadline=deadline)
    url = _session_url(ref, start)
    size = src.size()
    octet = {"Content-Type": "application/octet-stream"}
    if chunk_size is None or size <= chunk_size:
        resp = _raw(transport, ref, "PUT", url, headers={**octet, "Content-Length": str(size)},
                    body=lambda: src.iter_range(0, size), ok=(201, 204),
                    deadline=deadline, what=what, extra=[("digest", digest)])
    else:
        pos = 0
        while pos < size:
            n = min(chunk_size, size - pos)
            start_at = pos
            resp = _raw(transport, ref, "PATCH", url, headers={
                **octet, "Content-Length": str(n),
                "Content-Range": f"{start_at}-{start_at + n - 1}"},
                body=lambda s=start_at, k=n: src.iter_range(s, k),  # type: ignore[misc]
                ok=(202, 204), deadline=deadline, what=what)
            url = _session_url(ref, resp)
            pos += n
        resp = _raw(transport, ref, "PUT", url, headers={"Content-Length": "0"}, body=None,
                    ok=(201, 204), deadline=deadline, what=what, extra=[("digest", digest)])
    echoed = resp.headers.get("Docker-Content-Digest")
    if echoed and echoed != digest:
        raise IntegrityError(f"{what}: registry stored {echoed}")


def mount_blob(transport: Transport, ref: Reference, digest: str, from_repository: str, *,
               timeout: float | None = None) -> bool:
    """:meth:`~coldstart.oci.registry.RegistryClient.mount_blob`: True if mounted, False if
    the registry declined."""
    validate_digest(digest)
    what = f"mount blob {digest[:19]} from {from_repository} into {ref.name}"
    deadline = Deadline(timeout if timeout is not None else transport.timeout, what)
    scope = (f"repository:{ref.repository}:pull,push "
             f"repository:{from_repository}:pull")
    resp = _start(transport, ref, params=[("mount", digest), ("from", from_repository)],
                  scope=scope, deadline=deadline)
    if resp.status_code == 201:
        return True
    # 202: the registry opened an ordinary upload session instead; do not leave it dangling
    with contextlib.suppress(ColdstartError):
        _raw(transport, ref, "DELETE", _session_url(ref, resp), headers={}, body=None,
             ok=(200, 202, 204, 404), deadline=deadline, what=what)
    return False


class UploadSource:
    """A re-readable upload source: bytes in memory, or a seekable file read with pread."""

    def __init__(self, data: bytes | None, fd: int | None, owned: bool, size: int) -> None:
        self._data = data
        self._fd = fd
        self._owned = owned
        self._size = size

    @classmethod
    def of(cls, data: bytes | Path | BinaryIO) -> UploadSource:
        if isinstance(data, bytes | bytearray | memoryview):
            b = bytes(data)
            return cls(b, None, False, len(b))
        if isinstance(data, Path | str):
            fd = os.open(data, os.O_RDONLY)
            return cls(None, fd, True, os.fstat(fd).st_size)
        try:
            fd = data.fileno()
        except (AttributeError, OSError, io.UnsupportedOperation):
            data.seek(0)
            b = data.read()
            return cls(b, None, False, len(b))
        return cls(None, fd, False, os.fstat(fd).st_size)

    def size(self) -> int:
        return self._size

    def iter_range(self, offset: int, length: int) -> Iterator[bytes]:
        if self._data is not None:
            yield self._data[offset: offset + length]
            return
        assert self._fd is not None
        end = offset + length
        while offset < end:
            chunk = os.pread(self._fd, min(_CHUNK, end - offset), offset)
            if not chunk:
                raise IntegrityError("upload source shrank while uploading")
            offset += len(chunk)
            yield chunk

    def digest(self) -> str:
        h = hashlib.sha256()
        for chunk in self.iter_range(0, self._size):
            h.update(chunk)
        return f"sha256:{h.hexdigest()}"

    def close(self) -> None:
        if self._owned and self._fd is not None:
            os.close(self._fd)
            self._fd = None
