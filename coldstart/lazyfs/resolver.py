"""The layer resolver: a :class:`~coldstart.lazyfs.spec.LayerSpec` in, a verified layer out.

stargz's ``layer.Resolver``. Resolving a spec means: its annotations (the spec's own, or, when
they lack the TOC digest and the manifest digest is known, the layer descriptor's in that
manifest, fetched by digest and so verified); a :class:`coldstart.remote.RegistryBlob` for the
blob; its footer and TOC read with range requests and checked against the annotated TOC digest
(:func:`coldstart.format.layer.open_layer`: IntegrityError on a mismatch, FailedPrecondition
with no digest unless unverified layers are allowed; a footer or TOC that fails to parse or
verify is read once more, a byte flipped on the wire being transient); and the
:class:`~coldstart.lazyfs.reader.LayerReader` that serves its chunks through the shared fetcher.

A layer served already is not opened again: :meth:`LayerResolver.check_same_toc` only makes sure
that the new spec vouches for the same TOC.

Opening ahead (stargz resolves an image's neighbouring layers the same way): containerd prepares
an image's layers one after another, each after its parent, so each layer's footer and TOC would
be fetched and parsed only once the layer below is mounted. :meth:`LayerResolver.open_ahead`,
told the image's later layers when the first is mounted (the CRI's ``cri.image-layers`` label,
which ``coldstart pull`` sets too), opens those with a TOC digest in the image's manifest
(fetched by digest) in worker threads meanwhile; :meth:`LayerResolver.open` takes such a layer
only when its own spec vouches for the same TOC, and opens it itself when the open ahead failed.

It knows nothing of FUSE, sockets or mountpoints. Every method blocks on the network: call it
from a worker thread, never from the trio loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future

from coldstart.config import FetchConfig
from coldstart.errors import (
    ColdstartError,
    FailedPrecondition,
    FormatError,
    IntegrityError,
    NotFound,
)
from coldstart.format.gzindex import IndexedLayer, open_indexed_layer
from coldstart.format.layer import (
    ESTARGZ_TOC_DIGEST,
    MEDIA_TYPE_GZIP,
    ZSTD_CHUNKED_MANIFEST_CHECKSUM,
    SeekableLayer,
    open_layer,
)
from coldstart.lazyfs.fetcher import ChunkFetcher
from coldstart.lazyfs.indexes import IndexFinder
from coldstart.lazyfs.reader import LayerReader
from coldstart.lazyfs.spec import NO_INDEX, LayerSpec
from coldstart.oci.manifest import Manifest, parse_manifest
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from coldstart.prefetch.ranges import PREFETCH_RANGES_ANNOTATION, decode_ranges
from coldstart.remote import RegistryBlob

__all__ = ["TOC_KEYS", "LayerResolver", "check_same_toc"]

log = logging.getLogger(__name__)

#: the neighbour-window defaults, from the one config tree
_FETCH = FetchConfig()

#: layer media types that may be plain gzip (the CRI's labels name none: "")
_GZIP_MEDIA = (MEDIA_TYPE_GZIP, "application/vnd.docker.image.rootfs.diff.tar.gzip", "")

_Opened = tuple[RegistryBlob, SeekableLayer]

#: how many of an image's later layers a mount opens ahead (each holds its whole TOC until
#: it is mounted; the next mounts open the ones after)
AHEAD_LAYERS = 3
#: layers opened ahead at once, at most
AHEAD_THREADS = 2
#: a layer opened ahead and not mounted within this many seconds (its pull was given up) is
#: dropped
AHEAD_KEEP = 120.0
#: image manifests remembered (by digest: they cannot change)
MANIFESTS_KEPT = 16

#: annotations that carry a layer's TOC digest (eStargz; zstd:chunked, both spellings)
TOC_KEYS = (ESTARGZ_TOC_DIGEST, ZSTD_CHUNKED_MANIFEST_CHECKSUM,
            "io.containers.zstd-chunked.manifest-checksum")


class LayerResolver:
    """Resolve specs against one registry client, into readers on one fetcher.

    >>> f = config.fetch                                                  # doctest: +SKIP
    >>> resolver = LayerResolver(client, fetcher, request_timeout=f.request_timeout,
    ...                          read_deadline=f.read_deadline, background_rate=0,
    ...                          allow_unverified=False)                  # doctest: +SKIP
    >>> reader = resolver.open(spec)                                      # doctest: +SKIP
    """

    def __init__(self, client: RegistryClient, fetcher: ChunkFetcher, *,
                 request_timeout: float, read_deadline: float, background_rate: int,
                 allow_unverified: bool, neighbor_bytes: int = _FETCH.neighbor_bytes,
                 neighbor_max_bytes: int = _FETCH.neighbor_max_bytes,
                 indexes: IndexFinder | None = None) -> None:
        # every value from the one config tree (FetchConfig, Config.allow_unverified)
        self.client = client
        self.fetcher = fetcher
        self.request_timeout = request_timeout
        self.read_deadline = read_deadline
        self.background_rate = background_rate
        self.neighbor_bytes = neighbor_bytes
        self.neighbor_max_bytes = neighbor_max_bytes
        self.allow_unverified = allow_unverified
        #: gzip indexes for layers without a TOC (None: such layers are pulled in full)
        self.indexes = indexes
        #: layers opened ahead: (reference, digest) -> (when asked, the open's future)
        self._ahead: dict[tuple[str, str], tuple[float, Future[_Opened]]] = {}
        self._ahead_lock = threading.Lock()
        self._ahead_slots = threading.Semaphore(AHEAD_THREADS)
        self._manifest_lock = threading.Lock()
        self._closed = False
        #: the image manifests last fetched: (reference, manifest digest) -> manifest
        self._manifests: dict[tuple[str, str], Manifest] = {}

    def _manifest(self, spec: LayerSpec) -> Manifest:
        """``spec``'s image manifest, fetched by its digest (so verified) or remembered: an
        image's layers are mounted one after another, each asking for the same one."""
        key = (spec.reference, spec.manifest_digest)
        # one fetch at a time: the open ahead and the mount asking at once get one request
        with self._manifest_lock:
            known = self._manifests.get(key)
            if known is not None:
                return known
            ref = Reference.parse(spec.reference)
            body, media, _ = self.client.get_manifest(ref.with_digest(spec.manifest_digest),
                                                      timeout=self.request_timeout)
            manifest = parse_manifest(body, media or None)
            while len(self._manifests) >= MANIFESTS_KEPT:
                del self._manifests[next(iter(self._manifests))]
            self._manifests[key] = manifest
        return manifest

    def annotations(self, spec: LayerSpec) -> dict[str, str]:
        """The layer's annotations: the spec's, or its manifest's (fetched, verified)."""
        annotations = dict(spec.annotations)
        if not any(k in annotations for k in TOC_KEYS) and spec.manifest_digest:
            manifest = self._manifest(spec)
            for desc in manifest.layers:
                if desc.digest == spec.digest:
                    annotations = {**desc.annotations, **annotations}
                    break
            else:
                raise NotFound(f"manifest {spec.manifest_digest} has no layer {spec.digest}")
        return annotations

    def open_ahead(self, spec: LayerSpec, digests: Sequence[str]) -> int:
        """Start opening the next :data:`AHEAD_LAYERS` of the layers ``digests`` of ``spec``'s
        image (its later layers) in threads, each as its descriptor in the image's manifest
        says (fetched by ``spec.manifest_digest``); layers without a TOC digest there are left
        to :meth:`open`. Never raises: a failure here is only a layer :meth:`open` opens
        itself. Returns how many it started."""
        if not digests or not spec.manifest_digest:
            return 0
        try:
            manifest = self._manifest(spec)
        except Exception as exc:   # only a missed head start
            log.debug("layer %s: not opening the image's later layers ahead: %s",
                      spec.digest, exc)
            return 0
        wanted = set(digests[:AHEAD_LAYERS])
        todo: list[tuple[Future[_Opened], LayerSpec]] = []
        with self._ahead_lock:
            if self._closed:
                return 0
            self._expire()
            for desc in manifest.layers:
                key = (spec.reference, desc.digest)
                if (desc.digest not in wanted or key in self._ahead
                        or not any(k in desc.annotations for k in TOC_KEYS)):
                    continue
                ahead = LayerSpec(reference=spec.reference, digest=desc.digest,
                                  size=desc.size, media_type=desc.media_type,
                                  manifest_digest=spec.manifest_digest,
                                  annotations=dict(desc.annotations))
                future: Future[_Opened] = Future()
                self._ahead[key] = (time.monotonic(), future)
                todo.append((future, ahead))
        for future, ahead in todo:
            # daemon threads: an open under way never holds up the server's exit
            threading.Thread(target=self._run_ahead, args=(future, ahead), daemon=True,
                             name=f"open-ahead-{ahead.digest.rpartition(':')[2][:12]}").start()
        if todo:
            log.debug("layer %s: opening %d later layer(s) of the image ahead", spec.digest,
                      len(todo))
        return len(todo)

    def _run_ahead(self, future: Future[_Opened], spec: LayerSpec) -> None:
        with self._ahead_slots:
            if not future.set_running_or_notify_cancel():
                return                  # its mount came first and opened it itself
            try:
                future.set_result(self._open_layer(spec, spec.annotations))
            except BaseException as exc:
                future.set_exception(exc)

    def _expire(self) -> None:
        """Drop layers opened ahead and never mounted within AHEAD_KEEP (a pull given up);
        under ``_ahead_lock``."""
        now = time.monotonic()
        for key in [k for k, (t, _) in self._ahead.items() if now - t > AHEAD_KEEP]:
            self._ahead.pop(key)[1].cancel()

    def _take_ahead(self, spec: LayerSpec, annotations: dict[str, str]) -> _Opened | None:
        """The layer :meth:`open_ahead` opened for ``spec`` (waiting for it if it is under
        way), if the spec vouches for the TOC it verified; None: open it here (none was
        opened, the open had not started, it failed, or the spec claims another TOC)."""
        with self._ahead_lock:
            entry = self._ahead.pop((spec.reference, spec.digest), None)
            self._expire()
        if entry is None or entry[1].cancel():
            return None
        try:
            source, layer = entry[1].result(timeout=self.read_deadline)
        except Exception as exc:     # opened here, where an error is the mount's
            log.debug("layer %s: the open ahead failed (%s); opening it now", spec.digest, exc)
            return None
        if spec.size >= 0 and source.size() != spec.size:
            return None
        try:
            # the manifest vouched for this TOC; the spec must vouch for the same one
            check_same_toc(annotations, layer.toc_digest, self.allow_unverified, spec.digest,
                           claims=layer.toc_claims)
        except ColdstartError as exc:
            log.debug("layer %s: not the layer opened ahead: %s", spec.digest, exc)
            return None
        return source, layer

    def close(self) -> None:
        """No more opens ahead; those not started are dropped (those running finish)."""
        with self._ahead_lock:
            self._closed = True
            for _, future in self._ahead.values():
                future.cancel()
            self._ahead.clear()

    def open(self, spec: LayerSpec) -> LayerReader:
        """Resolve a spec: blob source, annotations (from the manifest if needed), TOC."""
        annotations = self.annotations(spec)
        opened = self._take_ahead(spec, annotations)
        source, layer = opened if opened is not None else self._open_layer(spec, annotations)
        reader = LayerReader(spec.digest, layer, source, self.fetcher,
                             read_deadline=self.read_deadline,
                             background_rate=self.background_rate,
                             neighbor_bytes=self.neighbor_bytes,
                             neighbor_max_bytes=self.neighbor_max_bytes)
        # the spec's or the manifest's: which chunks the recorded start-up touched (a layer
        # read through a gzip index has none: its index may name them, the reader took those)
        reader.prefetcher.ranges = (_prefetch_ranges(spec.digest, annotations)
                                    or reader.prefetcher.ranges)
        return reader

    def _open_layer(self, spec: LayerSpec, annotations: dict[str, str]) -> _Opened:
        """The blob's source and its layer: footer and TOC read and verified (or its index)."""
        ref = Reference.parse(spec.reference)
        source = RegistryBlob(self.client, ref, spec.digest, spec.size if spec.size >= 0 else None,
                              timeout=self.request_timeout)
        layer: SeekableLayer
        if (self.indexes is not None and spec.media_type in _GZIP_MEDIA
                and not any(k in annotations for k in TOC_KEYS)):
            try:
                layer = self._open_indexed(spec, source)
            except FailedPrecondition as exc:
                if not self.allow_unverified or NO_INDEX not in str(exc):
                    raise
                # no index: an eStargz layer that lost its annotations, mounted unverified
                layer = self._open_seekable(spec, source, annotations)
        else:
            layer = self._open_seekable(spec, source, annotations)
        return source, layer

    def _open_indexed(self, spec: LayerSpec, source: RegistryBlob) -> IndexedLayer:
        """A plain gzip layer through its (trusted) index; FailedPrecondition without one."""
        assert self.indexes is not None
        finder = self.indexes
        blob, artifact = finder.find(spec)
        try:
            layer = open_indexed_layer(source, blob, layer=spec.digest)
        except FormatError as exc:
            finder.mark_bad(spec.digest, artifact, str(exc))
            raise
        layer.on_bad = lambda why: finder.mark_bad(spec.digest, artifact, why)
        log.info("layer %s: mounting through gzip index %s (artifact %s, %d checkpoints)",
                 spec.digest, layer.toc_digest, artifact, len(layer.index.checkpoints))
        return layer

    def _open_seekable(self, spec: LayerSpec, source: RegistryBlob,
                       annotations: dict[str, str]) -> SeekableLayer:
        try:
            layer = open_layer(source, annotations=annotations,
                               allow_unverified=self.allow_unverified)
        except (IntegrityError, FormatError) as exc:
            if not source.requests:     # refused before reading anything: reading cannot help
                raise
            # a byte flipped on the wire fails like a lying TOC: read it once more (the
            # registry's own wrong bytes fail again, and the mount is refused with that error)
            log.warning("layer %s: %s; reading its footer and TOC once more (a byte changed "
                        "on the way fails so)", spec.digest, exc)
            layer = open_layer(source, annotations=annotations,
                               allow_unverified=self.allow_unverified)
        return layer

    def check_same_toc(self, spec: LayerSpec, toc_digest: str, *, indexed: bool = False,
                       claims: Mapping[str, str] | None = None) -> None:
        """Raise unless ``spec`` vouches for the TOC ``toc_digest`` of the layer served already.
        A layer served through a gzip index (``indexed``: trusted when it was mounted; the blob
        is the same by its digest) is served again unless its index proved wrong since."""
        if indexed:
            why = self.indexes.bad(spec.digest) if self.indexes is not None else None
            if why is not None:
                raise FailedPrecondition(f"layer {spec.digest}: its gzip index proved wrong "
                                         f"({why})")
            return
        check_same_toc(self.annotations(spec), toc_digest, self.allow_unverified, spec.digest,
                       claims=claims)


def _prefetch_ranges(digest: str, annotations: dict[str, str]) -> list[tuple[int, int]] | None:
    """The layer's prefetch-ranges annotation, decoded; None (the whole span) if absent or
    malformed (a warning: the prefetch only fetches more)."""
    text = annotations.get(PREFETCH_RANGES_ANNOTATION)
    if not text:
        return None
    try:
        return decode_ranges(text)
    except ColdstartError as exc:
        log.warning("layer %s: %s; prefetching the whole span", digest, exc)
        return None


def check_same_toc(annotations: dict[str, str], toc_digest: str, allow_unverified: bool,
                   digest: str, *, claims: Mapping[str, str] | None = None) -> None:
    """IntegrityError if ``annotations`` claim another TOC than the served layer's: each
    TOC key against ``claims`` (what the layer's open verified for that key: a layer may carry
    the TOC JSON's digest and the compressed TOC's), else against ``toc_digest``; with no
    claim, FailedPrecondition unless ``allow_unverified``."""
    claimed = [(k, annotations[k]) for k in TOC_KEYS if k in annotations]
    if not claimed:
        if allow_unverified:
            return
        raise FailedPrecondition(f"layer {digest}: no TOC digest annotation: cannot verify it")
    for key, value in claimed:
        served = (claims or {}).get(key, toc_digest)
        if value != served:
            raise IntegrityError(f"layer {digest}: annotated TOC digest {value} does not "
                                 f"match the served layer's TOC {served}")
