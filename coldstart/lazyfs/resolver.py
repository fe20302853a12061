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

It knows nothing of FUSE, sockets or mountpoints. Every method blocks on the network: call it
from a worker thread, never from the trio loop.
"""

from __future__ import annotations

import logging

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
from coldstart.oci.manifest import parse_manifest
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

    def annotations(self, spec: LayerSpec) -> dict[str, str]:
        """The layer's annotations: the spec's, or its manifest's (fetched, verified)."""
        ref = Reference.parse(spec.reference)
        annotations = dict(spec.annotations)
        if not any(k in annotations for k in TOC_KEYS) and spec.manifest_digest:
            body, media, _ = self.client.get_manifest(ref.with_digest(spec.manifest_digest))
            manifest = parse_manifest(body, media or None)
            for desc in manifest.layers:
                if desc.digest == spec.digest:
                    annotations = {**desc.annotations, **annotations}
                    break
            else:
                raise NotFound(f"manifest {spec.manifest_digest} has no layer {spec.digest}")
        return annotations

    def open(self, spec: LayerSpec) -> LayerReader:
        """Resolve a spec: blob source, annotations (from the manifest if needed), TOC."""
        ref = Reference.parse(spec.reference)
        annotations = self.annotations(spec)
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
        reader = LayerReader(spec.digest, layer, source, self.fetcher,
                             read_deadline=self.read_deadline,
                             background_rate=self.background_rate,
                             neighbor_bytes=self.neighbor_bytes,
                             neighbor_max_bytes=self.neighbor_max_bytes)
        # the spec's or the manifest's: which chunks the recorded start-up touched (a layer
        # read through a gzip index has none: its index may name them, the reader took those)
        reader.prefetch_ranges = (_prefetch_ranges(spec.digest, annotations)
                                  or reader.prefetch_ranges)
        return reader

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

    def check_same_toc(self, spec: LayerSpec, toc_digest: str, *, indexed: bool = False) -> None:
        """Raise unless ``spec`` vouches for the TOC ``toc_digest`` of the layer served already.
        A layer served through a gzip index (``indexed``: trusted when it was mounted; the blob
        is the same by its digest) is served again unless its index proved wrong since."""
        if indexed:
            why = self.indexes.bad(spec.digest) if self.indexes is not None else None
            if why is not None:
                raise FailedPrecondition(f"layer {spec.digest}: its gzip index proved wrong "
                                         f"({why})")
            return
        check_same_toc(self.annotations(spec), toc_digest, self.allow_unverified, spec.digest)


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
                   digest: str) -> None:
    """IntegrityError if ``annotations`` claim another TOC than ``toc_digest``; with no claim,
    FailedPrecondition unless ``allow_unverified``."""
    claimed = [annotations[k] for k in TOC_KEYS if k in annotations]
    if not claimed:
        if allow_unverified:
            return
        raise FailedPrecondition(f"layer {digest}: no TOC digest annotation: cannot verify it")
    if any(c != toc_digest for c in claimed):
        raise IntegrityError(f"layer {digest}: annotated TOC digest {claimed[0]} does not "
                             f"match the served layer's TOC {toc_digest}")
