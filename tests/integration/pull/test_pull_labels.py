"""The labels ``coldstart pull`` sends with each Prepare, and chain IDs (pure; no daemons)."""

from __future__ import annotations

import hashlib
import json

from coldstart.containerd.pull import chain_ids, layer_labels
from coldstart.lazyfs.spec import (
    CRI_IMAGE_LAYERS,
    LABEL_LIMIT,
    REMOTE_ANNOTATIONS,
    TARGET_SNAPSHOT_REF,
    LayerSpec,
    image_layers_label,
    layer_spec_from_labels,
)
from coldstart.oci.manifest import Descriptor

D1, D2, D3 = ("sha256:" + c * 64 for c in "abc")


def test_chain_ids_follow_the_oci_definition() -> None:
    c2 = "sha256:" + hashlib.sha256(f"{D1} {D2}".encode()).hexdigest()
    c3 = "sha256:" + hashlib.sha256(f"{c2} {D3}".encode()).hexdigest()
    assert chain_ids([D1, D2, D3]) == [D1, c2, c3]
    assert chain_ids([]) == []


def test_labels_round_trip_through_the_snapshotters_parser() -> None:
    layer = Descriptor(
        media_type="application/vnd.oci.image.layer.v1.tar+zstd", digest=D2, size=1234,
        annotations={
            "containerd.io/snapshot/stargz/toc.digest": D3,
            "io.containers.zstd-chunked.manifest-checksum": D1,
            "io.containers.zstd-chunked.manifest-position": "10:20:30:1",
        })
    labels = layer_labels(layer, reference="127.0.0.1:5000/a/b:v1@" + D1, manifest_digest=D1,
                          chain_id=D3, image_layers=[D2, D3])
    assert labels[TARGET_SNAPSHOT_REF] == D3
    assert labels[CRI_IMAGE_LAYERS] == f"{D2},{D3}"     # the CRI's own label and spelling
    assert labels["containerd.io/snapshot/stargz/toc.digest"] == D3
    spec = layer_spec_from_labels(labels)
    assert spec is not None
    assert (spec.reference, spec.digest, spec.size, spec.media_type, spec.manifest_digest) == (
        "127.0.0.1:5000/a/b:v1@" + D1, D2, 1234, layer.media_type, D1)
    assert spec.annotations == dict(layer.annotations)
    assert spec.image_layers == [D2, D3]
    assert all(len(k) + len(v) <= LABEL_LIMIT for k, v in labels.items())
    # the spec travels to the FUSE server and into its state file as JSON
    assert LayerSpec.from_json(spec.to_json()) == spec
    assert layer_spec_from_labels({**labels, CRI_IMAGE_LAYERS: ""}).image_layers == []  # type: ignore[union-attr]


def test_the_image_layers_label_holds_as_many_layers_as_fit() -> None:
    digests = ["sha256:" + f"{i:064x}" for i in range(100)]
    value = image_layers_label(digests)
    assert len(CRI_IMAGE_LAYERS) + len(value) <= LABEL_LIMIT
    kept = value.split(",")
    assert 40 < len(kept) < 100 and kept == digests[:len(kept)]
    assert image_layers_label([]) == ""


def test_labels_that_do_not_fit_are_left_out_with_a_warning() -> None:
    huge = "x" * LABEL_LIMIT
    layer = Descriptor(media_type="m", digest=D1, size=1, annotations={
        "containerd.io/snapshot/too-long": huge,
        "org.example.big": huge,
        "org.example.small": "kept",
    })
    warnings: list[str] = []
    labels = layer_labels(layer, reference="r/x:y", manifest_digest=D2, chain_id=D1,
                          warn=warnings.append)
    assert "containerd.io/snapshot/too-long" not in labels
    assert json.loads(labels[REMOTE_ANNOTATIONS]) == {"org.example.small": "kept"}
    assert len(warnings) == 2
    assert all(len(k) + len(v) <= LABEL_LIMIT for k, v in labels.items())
