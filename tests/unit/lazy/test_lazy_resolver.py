"""The layer resolver over an in-memory registry: annotations, TOC verification, the reader."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import pytest

from coldstart.errors import FailedPrecondition, IntegrityError, NotFound
from coldstart.lazyfs.fetcher import ChunkFetcher
from coldstart.lazyfs.resolver import AHEAD_LAYERS, TOC_KEYS, LayerResolver, check_same_toc
from coldstart.lazyfs.spec import LayerSpec
from coldstart.oci.manifest import OCI_CONFIG, Descriptor, build_manifest
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from tests.integration.lazy.lazy_helpers import convert, metadata_tar

FORMATS = ["zstd:chunked", "estargz"]
OTHER_TOC = "sha256:" + "0" * 64


class MemoryRegistry:
    """The three calls the resolver makes of a RegistryClient, on one blob and one manifest."""

    def __init__(self, blob: bytes, manifest: bytes = b"", media_type: str = "") -> None:
        self.blob = blob
        self.manifest = manifest
        self.media_type = media_type
        self.manifests: list[str] = []
        self.ranges: list[tuple[int, int, float | None]] = []

    def read_blob_range(self, ref: Reference, digest: str, offset: int, length: int, *,
                        timeout: float | None = None) -> bytes:
        self.ranges.append((offset, length, timeout))
        return self.blob[offset:offset + length]

    def blob_size(self, ref: Reference, digest: str, *, timeout: float | None = None) -> int:
        return len(self.blob)

    def get_manifest(self, ref: Reference, accept: Sequence[str] = (), *,
                     timeout: float | None = None) -> tuple[bytes, str, str]:
        assert self.manifest, "the resolver asked for a manifest it did not need"
        self.manifests.append(ref.reference)
        return self.manifest, self.media_type, ref.reference


def layer(fmt: str, *, in_manifest: bool = True, with_annotations: bool = True
          ) -> tuple[LayerSpec, MemoryRegistry, str]:
    """A converted layer, its registry and its TOC digest; the spec carries its annotations
    (or only the manifest does)."""
    blob, res = convert(metadata_tar(big_size=100_000, seed=3).tar, fmt)
    other = Descriptor(media_type=res.media_type, digest="sha256:" + "1" * 64, size=1)
    layers = [other, Descriptor(media_type=res.media_type, digest=res.digest, size=res.size,
                                annotations=dict(res.annotations))]
    manifest = build_manifest(Descriptor(media_type=OCI_CONFIG, digest="sha256:" + "2" * 64,
                                         size=2), layers if in_manifest else [other])
    body = manifest.to_bytes()
    reg = MemoryRegistry(blob, body, manifest.media_type)
    spec = LayerSpec(reference="registry.test/lazy/x:v1", digest=res.digest, size=res.size,
                     media_type=res.media_type, manifest_digest="sha256:" + "3" * 64,
                     annotations=dict(res.annotations) if with_annotations else {})
    return spec, reg, res.toc_digest


def resolver(reg: MemoryRegistry, **kw: Any) -> LayerResolver:
    values: dict[str, Any] = {"request_timeout": 7.5, "read_deadline": 30.0,
                              "background_rate": 0, "allow_unverified": False, **kw}
    return LayerResolver(cast(RegistryClient, reg), ChunkFetcher(None), **values)


@pytest.mark.parametrize("fmt", FORMATS)
def test_annotations_come_from_the_spec_without_a_manifest(fmt: str) -> None:
    spec, reg, _ = layer(fmt)
    reg.manifest = b""          # asking for it fails the test
    assert resolver(reg).annotations(spec) == spec.annotations


@pytest.mark.parametrize("fmt", FORMATS)
def test_annotations_come_from_the_manifest_when_the_spec_lacks_them(fmt: str) -> None:
    spec, reg, _ = layer(fmt, with_annotations=False)
    spec = LayerSpec(**{**spec.__dict__, "annotations": {"x.extra": "spec's"}})
    got = resolver(reg).annotations(spec)
    assert any(k in got for k in TOC_KEYS) and got["x.extra"] == "spec's"
    assert reg.manifests == [spec.manifest_digest]   # fetched by digest: verified


def test_a_manifest_without_the_layer_is_not_found() -> None:
    spec, reg, _ = layer("zstd:chunked", in_manifest=False, with_annotations=False)
    with pytest.raises(NotFound, match="has no layer"):
        resolver(reg).annotations(spec)


@pytest.mark.parametrize("fmt", FORMATS)
def test_open_verifies_the_toc_and_reads_through_the_registry(fmt: str) -> None:
    spec, reg, toc = layer(fmt, with_annotations=False)
    reader = resolver(reg, read_deadline=3.0, background_rate=5).open(spec)
    assert reader.digest == spec.digest and reader.layer.toc_digest == toc
    assert reader.layer.format == ("estargz" if fmt == "estargz" else "zstd:chunked")
    assert reader.fill.rate == 5
    # footer and TOC by range requests, each with the configured request deadline
    assert reg.ranges and all(t == 7.5 for _, _, t in reg.ranges)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_toc_that_does_not_match_its_annotation_is_an_integrity_error(fmt: str) -> None:
    spec, reg, _ = layer(fmt)
    forged = {k: (OTHER_TOC if k in TOC_KEYS else v) for k, v in spec.annotations.items()}
    with pytest.raises(IntegrityError):
        resolver(reg).open(LayerSpec(**{**spec.__dict__, "annotations": forged}))


def test_a_layer_without_a_toc_digest_needs_allow_unverified() -> None:
    spec, reg, _ = layer("zstd:chunked")
    bare = LayerSpec(**{**spec.__dict__, "annotations": {}, "manifest_digest": ""})
    with pytest.raises(FailedPrecondition, match="no TOC digest"):
        resolver(reg).open(bare)
    assert resolver(reg, allow_unverified=True).open(bare).layer.toc.entries


def test_a_second_spec_must_vouch_for_the_served_toc() -> None:
    spec, reg, toc = layer("zstd:chunked")
    resolver(reg).check_same_toc(spec, toc)
    with pytest.raises(IntegrityError, match="does not match"):
        resolver(reg).check_same_toc(spec, OTHER_TOC)
    bare = LayerSpec(**{**spec.__dict__, "annotations": {}, "manifest_digest": ""})
    with pytest.raises(FailedPrecondition, match="cannot verify"):
        resolver(reg).check_same_toc(bare, toc)
    resolver(reg, allow_unverified=True).check_same_toc(bare, toc)


def _first_layer(spec: LayerSpec) -> LayerSpec:
    """The spec of the image's first layer (the manifest's other one), naming the later one."""
    first = "sha256:" + "1" * 64
    return LayerSpec(reference=spec.reference, digest=first, size=1,
                     manifest_digest=spec.manifest_digest, image_layers=[first, spec.digest])


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_later_layer_opened_ahead_is_taken_without_reading_it_again(fmt: str) -> None:
    spec, reg, toc = layer(fmt)
    alone, reg_alone, _ = layer(fmt)
    resolver(reg_alone).open(alone)
    r = resolver(reg)
    assert r.open_ahead(_first_layer(spec), [spec.digest]) == 1
    # asked again before it is mounted (the next layer's mount names it too): not opened
    # twice, and the manifest is not fetched again
    assert r.open_ahead(_first_layer(spec), [spec.digest]) == 0
    assert reg.manifests == [spec.manifest_digest]
    reader = r.open(spec)
    assert reader.layer.toc_digest == toc and reader.layer.toc.entries
    # its footer and TOC were read once (ahead), as an open of its own reads them
    assert sorted(o for o, _, _ in reg.ranges) == sorted(o for o, _, _ in reg_alone.ranges)
    r.close()


def test_a_layer_opened_ahead_is_taken_only_if_its_spec_vouches_for_that_toc() -> None:
    spec, reg, _ = layer("zstd:chunked")
    r = resolver(reg)
    assert r.open_ahead(_first_layer(spec), [spec.digest]) == 1
    with r._ahead_lock:
        pending = [f for _, f in r._ahead.values()]
    pending[0].result(timeout=30)
    reads = len(reg.ranges)
    forged = {k: (OTHER_TOC if k in TOC_KEYS else v) for k, v in spec.annotations.items()}
    # not taken: the mount opens the layer itself, and its own check refuses it
    with pytest.raises(IntegrityError, match="does not match the annotation"):
        r.open(LayerSpec(**{**spec.__dict__, "annotations": forged}))
    assert len(reg.ranges) > reads
    r.close()


def test_only_the_next_few_layers_are_opened_ahead_and_none_after_close() -> None:
    spec, reg, _ = layer("zstd:chunked")
    r = resolver(reg)
    later = ["sha256:" + f"{i:064x}" for i in range(1, AHEAD_LAYERS + 1)] + [spec.digest]
    # the layer is further up than the next AHEAD_LAYERS: left to its own mount
    assert r.open_ahead(_first_layer(spec), later) == 0
    r.close()
    assert r.open_ahead(_first_layer(spec), [spec.digest]) == 0
    assert r.open(spec).layer.toc.entries     # opened by itself


def test_a_layer_with_both_toc_digests_is_served_again_to_a_spec_naming_both() -> None:
    """stargz's zstd:chunked output carries the TOC JSON's digest (eStargz key) and the
    compressed TOC's (the older zstd key): a second mount of such a layer compares each
    claim with what the open verified for that key."""
    spec, reg, _ = layer("zstd:chunked")
    reader = resolver(reg).open(spec)
    claims = reader.layer.toc_claims
    checksum = claims["io.github.containers.zstd-chunked.manifest-checksum"]
    json_digest = "sha256:" + "5" * 64     # as if the open had verified this for the JSON
    both = {"io.containers.zstd-chunked.manifest-checksum": checksum,
            "containerd.io/snapshot/stargz/toc.digest": json_digest}
    served = {**claims, "containerd.io/snapshot/stargz/toc.digest": json_digest}
    check_same_toc(both, json_digest, False, spec.digest, claims=served)
    with pytest.raises(IntegrityError, match="does not match"):
        check_same_toc({**both, "containerd.io/snapshot/stargz/toc.digest": OTHER_TOC},
                       json_digest, False, spec.digest, claims=served)
    # without the claims, the one digest stood for every key: the pair was refused
    with pytest.raises(IntegrityError):
        check_same_toc(both, json_digest, False, spec.digest)


def test_a_failed_open_ahead_leaves_the_layer_to_its_own_open() -> None:
    spec, reg, toc = layer("zstd:chunked")
    good = reg.blob
    reg.blob = good[:100]            # the open ahead reads a truncated blob and fails
    r = resolver(reg)
    assert r.open_ahead(_first_layer(spec), [spec.digest]) == 1
    with r._ahead_lock:
        pending = [f for _, f in r._ahead.values()]
    with pytest.raises(Exception):   # noqa: B017  (the open ahead's own failure, whatever it is)
        pending[0].result(timeout=30)
    reg.blob = good
    assert r.open(spec).layer.toc_digest == toc
    r.close()


def test_nothing_is_opened_ahead_without_a_toc_digest_or_a_manifest() -> None:
    spec, reg, _ = layer("zstd:chunked", in_manifest=False)
    r = resolver(reg)
    # the manifest does not hold the layer with its TOC digest: left to its own open
    assert r.open_ahead(_first_layer(spec), [spec.digest]) == 0
    assert r.open_ahead(LayerSpec(**{**_first_layer(spec).__dict__, "manifest_digest": ""}),
                        [spec.digest]) == 0
    reg.manifest = b""               # a manifest that cannot be fetched: no error, nothing opened
    other = LayerSpec(**{**_first_layer(spec).__dict__, "manifest_digest": "sha256:" + "4" * 64})
    assert r.open_ahead(other, [spec.digest]) == 0
    r.close()
