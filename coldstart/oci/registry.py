"""A thin, thread-safe client for the OCI distribution API (v2): :class:`RegistryClient`.

The client is a facade over the pieces a containerd engineer knows from ``remotes/docker``:

- :mod:`.connections`: the pooled httpx clients, TLS contexts and raw range connections;
- :mod:`.auth`: 401 challenges, bearer tokens, which credentials to send (the authorizer);
- :mod:`.transport`: one request to each endpoint in turn (``hosts.toml`` mirrors), with
  authentication, redirects, retries within a deadline and the mapping of registry statuses to
  :mod:`coldstart.errors`;
- :mod:`.blobs`: blob reads, whole and verified, resumed, by range (the fetcher);
- :mod:`.uploads`: blob uploads and cross-repository mounts (the pusher);

and this module resolves references and reads and writes manifests (the resolver). Errors, as
:mod:`.transport` maps them: 404 → :class:`NotFound`; 401/403 →
:class:`~coldstart.oci.auth.AuthError`; 416 → :class:`InvalidArgument`; 5xx, 429, connection
errors → retried with exponential backoff and full jitter inside the call's deadline, then
:class:`Unavailable`; an exhausted deadline → :class:`DeadlineExceeded`; a downloaded blob or
manifest whose bytes do not match its digest → :class:`IntegrityError`.

Every public call takes ``timeout`` (seconds, covering all its retries); the client's default is
``RegistryConfig.timeout`` (30 s). One client may be shared by many threads (httpx's pool is
thread-safe; our token cache is locked).

>>> with RegistryClient() as client:                                  # doctest: +SKIP
...     resolved = client.resolve(Reference.parse("127.0.0.1:5000/app:v1"))
...     layer = resolved.manifest.layers[0]
...     head = client.read_blob_range(resolved.ref, layer.digest, 0, 512)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO

from coldstart.config import RegistryConfig
from coldstart.errors import IntegrityError, InvalidArgument, NotFound
from coldstart.oci import uploads
from coldstart.oci.auth import Authorizer
from coldstart.oci.blobs import BlobReader
from coldstart.oci.connections import Connections
from coldstart.oci.credentials import Credentials, DockerConfig, default_docker_config
from coldstart.oci.hosts import HostsConfig
from coldstart.oci.keychain import Keychain
from coldstart.oci.manifest import (
    ALL_MANIFEST_TYPES,
    OCI_INDEX,
    Descriptor,
    Index,
    Manifest,
    Platform,
    digest_of,
    is_index,
    parse_index,
    parse_manifest,
    select_platform,
)
from coldstart.oci.reference import Reference, validate_digest
from coldstart.oci.transport import Transport
from coldstart.remote.retry import Backoff

__all__ = ["RegistryClient", "Resolved"]

MAX_MANIFEST_BYTES = 4 << 20
_USER_AGENT = "coldstart/0.1"
_REGISTRY = RegistryConfig()  # the defaults, written once in coldstart.config


@dataclass(frozen=True)
class Resolved:
    """An image reference resolved to one platform's manifest."""

    ref: Reference                  # pinned to the manifest's digest
    manifest: Manifest
    manifest_bytes: bytes
    media_type: str
    digest: str
    index: Index | None = None      # set when the reference named an index
    index_digest: str | None = None


class RegistryClient:
    """Client for OCI registries: manifests, blobs (ranges too), uploads, mounts.

    ``insecure_hosts`` are spoken to over plain HTTP (loopback always is; a host without a port
    means every port of it); ``tls_verify=False`` trusts any certificate; ``hosts_dir`` is a
    containerd ``certs.d`` directory (mirrors, TLS); ``docker_config`` the Docker ``config.json``
    with credentials (default ``~/.docker/config.json``); ``credentials`` overrides per host.
    ``keychain``: credentials kubelet handed over in CRI ``PullImage``, by repository, looked up
    before the docker config and read again on every lookup (a rotated token is used as soon as
    the CRI proxy wrote it).
    ``timeout`` is the default deadline of every call, ``retries`` how many times a failed
    attempt is retried inside it.
    """

    @classmethod
    def from_config(cls, r: RegistryConfig, *, keychain_dir: str | Path,
                    timeout: float | None = None) -> RegistryClient:
        """The client a node's daemons use: ``r``'s hosts, credentials, deadline and retries,
        and kubelet's pull credentials as the CRI proxy keeps them in ``keychain_dir``."""
        return cls(insecure_hosts=r.insecure_hosts,
                   docker_config=Path(r.docker_config) if r.docker_config else None,
                   hosts_dir=Path(r.hosts_dir) if r.hosts_dir else None,
                   timeout=r.timeout if timeout is None else timeout, retries=r.retries,
                   keychain=Keychain(keychain_dir))

    def __init__(self, *, insecure_hosts: Iterable[str] = (), docker_config: Path | None = None,
                 hosts_dir: Path | None = None, tls_verify: bool = True,
                 timeout: float = _REGISTRY.timeout,
                 retries: int = _REGISTRY.retries,
                 backoff: float = 0.2, max_backoff: float = 5.0,
                 credentials: Mapping[str, Credentials | tuple[str, str]] | None = None,
                 max_connections: int = 64, blob_timeout: float = 3600.0,
                 user_agent: str = _USER_AGENT, keychain: Keychain | None = None) -> None:
        if timeout <= 0 or retries < 0:
            raise InvalidArgument("timeout must be > 0 and retries >= 0")
        self.timeout = timeout
        self.blob_timeout = blob_timeout
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.hosts = HostsConfig.create(hosts_dir, insecure_hosts, tls_verify=tls_verify)
        static = {h: c if isinstance(c, Credentials) else Credentials(*c)
                  for h, c in (credentials or {}).items()}
        self.creds = DockerConfig(docker_config or default_docker_config(), static=static)
        self.keychain = keychain
        # the wiring: connections <- authorizer <- transport <- blob reader (uploads use both)
        pace = Backoff(backoff, max_backoff)
        self._conns = Connections(timeout=timeout, max_connections=max_connections,
                                  user_agent=user_agent)
        self._auth = Authorizer(self._conns, self.creds, keychain, retries=retries,
                                backoff=pace)
        self._transport = Transport(self.hosts, self._conns, self._auth, timeout=timeout,
                                    blob_timeout=blob_timeout, retries=retries, backoff=pace,
                                    max_backoff=max_backoff)
        self._blobs = BlobReader(self._transport)

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Close every pooled connection."""
        self._conns.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- manifests -------------------------------------------------------------------------

    def get_manifest(self, ref: Reference, accept: Sequence[str] = ALL_MANIFEST_TYPES, *,
                     timeout: float | None = None) -> tuple[bytes, str, str]:
        """Fetch a manifest or index: ``(body, media_type, digest)``; verified when pinned."""
        capability = "pull" if ref.digest else "resolve"
        resp = self._transport.request(ref, "GET", f"/manifests/{ref.reference}",
                                       capability=capability,
                                       headers={"Accept": ", ".join(accept)}, timeout=timeout,
                                       what=f"get manifest {ref}")
        body = resp.content
        if len(body) > MAX_MANIFEST_BYTES:
            raise InvalidArgument(f"manifest {ref} is larger than {MAX_MANIFEST_BYTES} bytes")
        digest = digest_of(body)
        if ref.digest and ref.digest != digest and not ref.digest.startswith("sha512:"):
            raise IntegrityError(f"manifest {ref}: registry sent {digest}")
        header = resp.headers.get("Docker-Content-Digest")
        if not ref.digest and header and header.startswith("sha256:") and header != digest:
            raise IntegrityError(f"manifest {ref}: body is {digest}, registry says {header}")
        media = resp.headers.get("Content-Type", "").split(";")[0].strip()
        return body, media, ref.digest or digest

    def head_manifest(self, ref: Reference, accept: Sequence[str] = ALL_MANIFEST_TYPES, *,
                      timeout: float | None = None) -> Descriptor:
        """HEAD a manifest: its descriptor (media type, digest, size) without the body."""
        resp = self._transport.request(ref, "HEAD", f"/manifests/{ref.reference}",
                                       capability="pull" if ref.digest else "resolve",
                                       headers={"Accept": ", ".join(accept)}, timeout=timeout,
                                       what=f"head manifest {ref}")
        digest = resp.headers.get("Docker-Content-Digest") or ref.digest
        if not digest:
            body, media, digest = self.get_manifest(ref, accept, timeout=timeout)
            return Descriptor(media_type=media, digest=digest, size=len(body))
        return Descriptor(media_type=resp.headers.get("Content-Type", "").split(";")[0],
                          digest=validate_digest(digest),
                          size=int(resp.headers.get("Content-Length", "0")))

    def resolve(self, ref: Reference, platform: Platform | None = None, *,
                timeout: float | None = None) -> Resolved:
        """Resolve ``ref`` to one image manifest (choosing ``platform`` from an index)."""
        body, media, digest = self.get_manifest(ref, timeout=timeout)
        index: Index | None = None
        index_digest: str | None = None
        if is_index(media) or (not media and b'"manifests"' in body):
            index, index_digest = parse_index(body, media or None), digest
            desc = select_platform(index, platform)
            pinned = ref.with_digest(desc.digest)
            body, media, digest = self.get_manifest(pinned, timeout=timeout)
        manifest = parse_manifest(body, media or None)
        return Resolved(ref=ref.with_digest(digest), manifest=manifest, manifest_bytes=body,
                        media_type=manifest.media_type, digest=digest, index=index,
                        index_digest=index_digest)

    def push_manifest(self, ref: Reference, body: bytes, media_type: str, *,
                      timeout: float | None = None) -> str:
        """PUT a manifest or index under ``ref``'s tag (or digest); return its digest."""
        return self._put_manifest(ref, body, media_type, timeout=timeout)[0]

    def push_artifact(self, ref: Reference, body: bytes, media_type: str, *,
                      timeout: float | None = None) -> tuple[str, bool]:
        """PUT a manifest that names a ``subject``: its digest, and whether the registry took
        the subject (OCI 1.1: the ``OCI-Subject`` header; else the caller keeps the fallback
        tag up to date, see :mod:`coldstart.oci.referrers`)."""
        return self._put_manifest(ref, body, media_type, timeout=timeout)

    def _put_manifest(self, ref: Reference, body: bytes, media_type: str, *,
                      timeout: float | None = None) -> tuple[str, bool]:
        digest = digest_of(body)
        target = ref.tag if ref.tag and not ref.digest else digest
        if ref.digest and ref.digest != digest:
            raise InvalidArgument(f"push_manifest: body is {digest}, reference says {ref.digest}")
        resp = self._transport.request(ref, "PUT", f"/manifests/{target}", capability="push",
                                       scope=f"repository:{ref.repository}:pull,push",
                                       headers={"Content-Type": media_type}, body=lambda: body,
                                       ok=(200, 201, 202), timeout=timeout,
                                       what=f"push manifest {ref}")
        echoed = resp.headers.get("Docker-Content-Digest")
        if echoed and echoed != digest:
            raise IntegrityError(f"push manifest {ref}: registry stored {echoed}, sent {digest}")
        return digest, "OCI-Subject" in resp.headers

    def get_referrers(self, ref: Reference, subject: str, artifact_type: str = "", *,
                      timeout: float | None = None) -> bytes:
        """The referrers API (OCI distribution 1.1): the index of manifests whose ``subject``
        is ``subject``. NotFound where the registry has no such API (the caller then reads the
        fallback tag, ``sha256-<hex>``)."""
        validate_digest(subject)
        params = [("artifactType", artifact_type)] if artifact_type else []
        resp = self._transport.request(ref, "GET", f"/referrers/{subject}", capability="pull",
                                       params=params, headers={"Accept": OCI_INDEX},
                                       timeout=timeout,
                                       what=f"referrers of {subject[:19]} in {ref.name}")
        if not resp.headers.get("Content-Type", "").startswith(OCI_INDEX):
            # a registry (or a proxy in front of it) that answers an unknown route with a page
            raise NotFound(f"{ref.name}: the registry has no referrers API")
        if len(resp.content) > MAX_MANIFEST_BYTES:
            raise InvalidArgument(f"referrers of {subject} are over {MAX_MANIFEST_BYTES} bytes")
        return resp.content

    # -- blobs: reading (coldstart.oci.blobs) ----------------------------------------------

    def blob_exists(self, ref: Reference, digest: str, *, timeout: float | None = None) -> bool:
        """Whether the repository holds blob ``digest``."""
        return self._blobs.exists(ref, digest, timeout=timeout)

    def blob_size(self, ref: Reference, digest: str, *, timeout: float | None = None) -> int:
        """The size of blob ``digest`` (HEAD)."""
        return self._blobs.size(ref, digest, timeout=timeout)

    def get_blob(self, ref: Reference, digest: str, *, max_size: int = 64 << 20,
                 timeout: float | None = None) -> bytes:
        """A whole (small) blob in memory, verified against ``digest``: configs, TOCs."""
        return self._blobs.get(ref, digest, max_size=max_size, timeout=timeout)

    def download_blob(self, ref: Reference, digest: str, dst: IO[bytes], *,
                      size: int | None = None, max_size: int | None = None,
                      timeout: float | None = None,
                      progress: Callable[[int], None] | None = None) -> int:
        """Stream blob ``digest`` into ``dst``, verifying it; resume with ranges after errors.

        Returns the byte count. ``dst`` holds unverified bytes if this raises: write into a
        temporary file and move it into place after success.
        """
        return self._blobs.download(ref, digest, dst, size=size, max_size=max_size,
                                    timeout=timeout, progress=progress)

    def read_blob_range(self, ref: Reference, digest: str, offset: int, length: int, *,
                        timeout: float | None = None) -> bytes | bytearray:
        """Bytes ``[offset, offset+length)`` of a blob via an HTTP range request.

        Shorter only if the blob ends first. A registry that ignores ``Range`` and sends the whole
        blob (200) still yields exactly the requested bytes (the rest is not kept in memory).
        """
        return self._blobs.read_range(ref, digest, offset, length, timeout=timeout)

    def read_blob_ranges(self, ref: Reference, digest: str,
                         ranges: Sequence[tuple[int, int]], *,
                         timeout: float | None = None) -> tuple[list[bytes | bytearray], int]:
        """Several ranges ``(offset, length)`` of a blob, each exactly as asked (shorter only
        where the blob ends first), and the number of requests it took: one multi-range
        request where the registry answers those (distribution does; stargz-snapshotter asks
        them too), else one range request each (:meth:`read_blob_range`). A registry that
        answers a multi-range request with the whole blob (an object store behind a redirect:
        S3 does) or with parts that do not hold the ranges is not asked one again.

        Ranges must be non-empty, in increasing order and apart.
        """
        return self._blobs.read_ranges(ref, digest, ranges, timeout=timeout)

    def reads_many(self, ref: Reference) -> bool:
        """Whether :meth:`read_blob_ranges` would ask ``ref``'s registry several ranges in
        one request now: its range reads go direct (see :mod:`coldstart.oci.blobs`) and it has
        not declined a multi-range request. Otherwise that call costs a request per range, one
        after another: a caller then rather joins close ranges into one itself."""
        return self._blobs.reads_many(ref)

    # -- blobs: writing (coldstart.oci.uploads) --------------------------------------------

    def push_blob(self, ref: Reference, data: bytes | Path | BinaryIO, digest: str | None = None,
                  *, chunk_size: int | None = None, timeout: float | None = None) -> str:
        """Upload a blob (bytes, a file path or a seekable file); return its digest.

        Skips the upload if the blob exists. ``chunk_size`` switches to a chunked upload
        (``POST``, ``PATCH``…, ``PUT ?digest=``); otherwise one monolithic ``PUT``. A failed
        attempt restarts the whole upload session, within the call's deadline.
        """
        return uploads.push_blob(self._transport, self._blobs, ref, data, digest,
                                 chunk_size=chunk_size, timeout=timeout)

    def mount_blob(self, ref: Reference, digest: str, from_repository: str, *,
                   timeout: float | None = None) -> bool:
        """Cross-repository mount of ``digest`` from ``from_repository`` (same registry).

        Returns ``True`` if mounted, ``False`` if the registry declined (then upload instead).
        """
        return uploads.mount_blob(self._transport, ref, digest, from_repository,
                                  timeout=timeout)

    def delete_manifest(self, ref: Reference, *, timeout: float | None = None) -> None:
        """Delete a manifest by digest (registries refuse deletes by tag)."""
        if not ref.digest:
            raise InvalidArgument("delete_manifest needs a reference pinned to a digest")
        self._transport.request(ref, "DELETE", f"/manifests/{ref.digest}", capability="push",
                                scope=f"repository:{ref.repository}:pull,push,delete",
                                ok=(200, 202), timeout=timeout, what=f"delete manifest {ref}")
