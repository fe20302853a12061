"""What the snapshotter hands the FUSE server to mount one lazily pulled layer, and the labels it
comes from.

The labels are interface facts (see shared/reference/containerd-snapshotter.md): containerd passes
every layer annotation whose key starts with ``containerd.io/snapshot/`` plus
``containerd.io/snapshot.ref``; the CRI plugin adds ``cri.*``; our own ``coldstart pull`` adds
``containerd.io/snapshot/remote/coldstart.*``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from coldstart.errors import InvalidArgument

#: the FUSE server's two mounts of its file system under its root (the snapshotter's root):
#: each shows every layer as ``<mount>/<key>``; a layer's snapshot ``fs`` is a bind of one of
#: them. The first answers getxattr; the second answers none (``fuse.split_xattrs``: the
#: kernel stops asking, see :mod:`coldstart.lazyfs.fusewire`).
FUSE_DIR = "fuse"
PLAIN_FUSE_DIR = "fuse-plain"

SNAPSHOT_PREFIX = "containerd.io/snapshot/"
TARGET_SNAPSHOT_REF = "containerd.io/snapshot.ref"
# set on every snapshot we commit as a lazily mounted layer (stargz uses the same key)
REMOTE_SNAPSHOT = "containerd.io/snapshot/remote"
REMOTE_SNAPSHOT_VALUE = "remote snapshot"

CRI_IMAGE_REF = "containerd.io/snapshot/cri.image-ref"
CRI_MANIFEST_DIGEST = "containerd.io/snapshot/cri.manifest-digest"
CRI_LAYER_DIGEST = "containerd.io/snapshot/cri.layer-digest"
CRI_IMAGE_LAYERS = "containerd.io/snapshot/cri.image-layers"

_OURS = "containerd.io/snapshot/remote/coldstart."
REMOTE_REFERENCE = _OURS + "reference"      # registry/repo[:tag][@digest] the blob is fetched from
REMOTE_DIGEST = _OURS + "digest"            # layer (blob) digest
REMOTE_SIZE = _OURS + "size"                # blob size in bytes
REMOTE_MEDIA_TYPE = _OURS + "media-type"    # layer media type
REMOTE_MANIFEST_DIGEST = _OURS + "manifest-digest"
# JSON object: the layer descriptor's annotations that do not already travel under
# SNAPSHOT_PREFIX (the zstd:chunked ones, io.github.containers.zstd-chunked.*)
REMOTE_ANNOTATIONS = _OURS + "annotations"

# words in the FUSE server's refusal of a plain gzip layer, which the snapshotter's fallback
# reasons look for (snapshotter.fallback_reason): no index, an untrusted one, a bad one
NO_INDEX = "no gzip index"
UNTRUSTED = "gzip index not trusted"
BAD_INDEX = "gzip index proved wrong"

# labels the snapshotter sets on a layer it did not mount lazily: why, and "full" when it
# pulled the layer in full itself (``coldstart pull`` reads them back)
REASON_LABEL = "coldstart.io/reason"
PULLED_LABEL = "coldstart.io/pulled"

# containerd limits one label's key + value to this many bytes
LABEL_LIMIT = 4096

#: LayerSpec's fields but ``annotations``, and their types (checked by ``from_json``)
_FIELD_TYPES: dict[str, type] = {"reference": str, "digest": str, "size": int, "media_type": str,
                                 "manifest_digest": str}


@dataclass(frozen=True)
class LayerSpec:
    """Where a layer's blob lives and what its manifest said about it.

    ``annotations`` are the layer descriptor's annotations (TOC digest and friends); when they
    lack the format's TOC digest and ``manifest_digest`` is known, the mounter may fetch that
    manifest (verified by its digest) to find them.
    """

    reference: str
    digest: str
    size: int = -1
    media_type: str = ""
    manifest_digest: str = ""
    annotations: dict[str, str] = field(default_factory=dict)
    #: the image's layers from this one up, as far as the label holds them (the CRI's
    #: ``cri.image-layers``): the mounter may open the later ones ahead. Not part of the
    #: spec's JSON (whose form older peers read): the mount request carries it beside it.
    image_layers: list[str] = field(default_factory=list, compare=False)

    def to_json(self) -> str:
        data = {k: v for k, v in self.__dict__.items() if k != "image_layers"}
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> LayerSpec:
        """The spec that :meth:`to_json` wrote; InvalidArgument unless each field has its type
        (it comes from a control request or a state file: the mounter trusts the types)."""
        try:
            data: dict[str, Any] = json.loads(text)
            if not isinstance(data, dict):
                raise TypeError("not a JSON object")
            # a newer peer's fields are left out, as an older peer leaves out ours
            spec = cls(**{k: v for k, v in data.items() if k in _SPEC_FIELDS})
        except (ValueError, TypeError, RecursionError) as exc:
            raise InvalidArgument(f"bad layer spec: {exc}") from exc
        for name, kind in _FIELD_TYPES.items():
            value = getattr(spec, name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise InvalidArgument(f"bad layer spec: {name} is not a {kind.__name__}: "
                                      f"{value!r:.40}")
        if not isinstance(spec.annotations, dict) or not all(
                isinstance(v, str) for v in spec.annotations.values()):
            raise InvalidArgument("bad layer spec: annotations must map strings to strings")
        return spec


def digest_list(value: Any, what: str) -> list[str]:
    """``value`` as a list of strings (a request's ``image_layers``); InvalidArgument if not."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidArgument(f"{what} must be a list of strings")
    return list(value)


_SPEC_FIELDS = {*_FIELD_TYPES, "annotations"}


def layer_spec_from_labels(labels: Mapping[str, str]) -> LayerSpec | None:
    """The layer to mount lazily, from a Prepare's labels; ``None`` when they do not name one."""
    reference = labels.get(REMOTE_REFERENCE) or labels.get(CRI_IMAGE_REF)
    digest = labels.get(REMOTE_DIGEST) or labels.get(CRI_LAYER_DIGEST)
    if not reference or not digest:
        return None
    annotations = {
        k: v for k, v in labels.items()
        if k.startswith(SNAPSHOT_PREFIX)
        and not k.startswith(("containerd.io/snapshot/cri.", "containerd.io/snapshot/remote"))
    }
    extra = labels.get(REMOTE_ANNOTATIONS)
    if extra:
        try:
            parsed = json.loads(extra)
        except ValueError as exc:
            raise InvalidArgument(f"label {REMOTE_ANNOTATIONS} is not JSON: {exc}") from exc
        if isinstance(parsed, dict):
            annotations.update({str(k): str(v) for k, v in parsed.items()})
    try:
        size = int(labels.get(REMOTE_SIZE, "-1"))
    except ValueError:
        size = -1
    return LayerSpec(
        reference=reference,
        digest=digest,
        size=size,
        media_type=labels.get(REMOTE_MEDIA_TYPE, ""),
        manifest_digest=labels.get(REMOTE_MANIFEST_DIGEST) or labels.get(CRI_MANIFEST_DIGEST, ""),
        annotations=annotations,
        image_layers=[d for d in labels.get(CRI_IMAGE_LAYERS, "").split(",") if d],
    )


def image_layers_label(digests: Sequence[str]) -> str:
    """The ``cri.image-layers`` value for a layer: ``digests`` (the image's layers from this
    one up), comma-separated, as many as fit in one label (containerd's own rule: the rest are
    only a missed head start).

    >>> image_layers_label(["sha256:a", "sha256:b"])
    'sha256:a,sha256:b'
    """
    room = LABEL_LIMIT - len(CRI_IMAGE_LAYERS)
    out: list[str] = []
    used = 0
    for d in digests:
        add = len(d) + (1 if out else 0)
        if used + add > room:
            break
        out.append(d)
        used += add
    return ",".join(out)
