"""Snapshots as OCI artifacts that refer to their image.

One artifact per key (:class:`~coldstart.snapshot.keys.SnapshotKey`): its config is the key
(canonical JSON), its one layer the bundle (:mod:`coldstart.snapshot.bundle`, zstd:chunked),
its subject the image manifest, found through the referrers API or the ``sha256-<hex>``
fallback tag (:mod:`coldstart.oci.referrers`), as warm-up artifacts are. The manifest's
annotations carry the key's digest, so a node picks its snapshot from the referrers list
without reading the others, and what the snapshot holds (bytes of pages, rootfs changes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coldstart.errors import ColdstartError, FormatError, IntegrityError
from coldstart.oci.manifest import OCI_MANIFEST, canonical_json, digest_of, json_object
from coldstart.oci.reference import Reference
from coldstart.oci.referrers import find_referrers, push_referrer
from coldstart.oci.registry import RegistryClient
from coldstart.snapshot.bundle import Packed
from coldstart.snapshot.keys import SnapshotKey, differences

__all__ = ["ARTIFACT_TYPE", "Found", "find", "push"]

ARTIFACT_TYPE = "application/vnd.coldstart.snapshot.v1"
KEY_MEDIA_TYPE = "application/vnd.coldstart.snapshot.key.v1+json"
A_KEY = "dev.coldstart.snapshot.key"
A_PAGES = "dev.coldstart.snapshot.pages-bytes"
A_ROOTFS = "dev.coldstart.snapshot.rootfs-bytes"
A_CREATED = "org.opencontainers.image.created"
#: at most this many other snapshots' keys are read to say why none matched
EXPLAIN = 8


def _now() -> str:
    import datetime as dt

    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def push(client: RegistryClient, image: Reference, key: SnapshotKey, packed: Packed,
         blob: Path) -> str:
    """Push bundle ``blob`` (what :func:`~coldstart.snapshot.bundle.pack` wrote) as a snapshot
    of ``image`` under ``key``; the artifact's digest."""
    resolved = client.resolve(image)
    if resolved.digest != key.components["image"]:
        raise IntegrityError(f"{image} is now {resolved.digest}; the snapshot is of "
                             f"{key.components['image']}")
    config = key.canonical()
    client.push_blob(image, config, digest_of(config))
    client.push_blob(image, blob, packed.layer.digest)
    manifest = canonical_json({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": KEY_MEDIA_TYPE, "digest": digest_of(config),
                   "size": len(config)},
        "layers": [{"mediaType": packed.layer.media_type, "digest": packed.layer.digest,
                    "size": packed.layer.size, "annotations": packed.layer.annotations}],
        "subject": {"mediaType": resolved.media_type, "digest": resolved.digest,
                    "size": len(resolved.manifest_bytes)},
        "annotations": {A_KEY: key.digest, A_CREATED: _now(),
                        A_PAGES: str(packed.pages_bytes), A_ROOTFS: str(packed.rootfs_bytes)},
    })
    return push_referrer(client, image, manifest, artifact_type=ARTIFACT_TYPE)


@dataclass
class Found:
    """The snapshot matching a key, or why none does (``digest`` None)."""

    image: str                       # the image manifest's digest
    digest: str | None = None        # the artifact's
    layer: dict[str, Any] = field(default_factory=dict)    # its bundle's descriptor
    reasons: list[str] = field(default_factory=list)       # why no snapshot matched


def _ann(d: Mapping[str, Any]) -> Mapping[str, Any]:
    a = d.get("annotations")
    return a if isinstance(a, Mapping) else {}


def find(client: RegistryClient, image: Reference, key: SnapshotKey) -> Found:
    """The newest snapshot of ``image`` whose key is ``key``; else the reasons, per snapshot
    read, that it is not (another CPU, another command …)."""
    found = Found(key.components["image"])
    descs = find_referrers(client, image, found.image, ARTIFACT_TYPE)
    if not descs:
        found.reasons.append(f"no snapshot refers to {found.image}")
        return found
    descs = sorted(reversed(descs), key=lambda d: str(_ann(d).get(A_CREATED, "")),
                   reverse=True)
    same = [d for d in descs if _ann(d).get(A_KEY) == key.digest]
    unsaid = [d for d in descs if A_KEY not in _ann(d)]
    for d in [*same, *unsaid]:
        try:
            return _load(client, image, str(d["digest"]), key, Found(found.image))
        except ColdstartError as exc:
            found.reasons.append(f"snapshot {str(d.get('digest'))[:19]}: {exc}")
    for d in [d for d in descs if d not in same and d not in unsaid][:EXPLAIN]:
        found.reasons.append(_why_not(client, image, d, key))
    return found


def _load(client: RegistryClient, image: Reference, digest: str, key: SnapshotKey,
          found: Found) -> Found:
    body, _, digest = client.get_manifest(image.with_digest(digest), (OCI_MANIFEST,))
    doc = json_object(body, f"snapshot {digest}")
    if doc.get("artifactType") != ARTIFACT_TYPE:
        raise FormatError(f"{digest} is not a snapshot ({doc.get('artifactType')!r})")
    layers = doc.get("layers")
    if not isinstance(layers, list) or len(layers) != 1 or not isinstance(layers[0], dict):
        raise FormatError(f"snapshot {digest}: expected one layer")
    subject = doc.get("subject")
    if not isinstance(subject, dict) or subject.get("digest") != found.image:
        raise IntegrityError(f"snapshot {digest} refers to "
                             f"{subject.get('digest') if isinstance(subject, dict) else None}, "
                             f"not to {found.image}")
    config = doc.get("config") or {}
    have = SnapshotKey.parse(client.get_blob(image, str(config.get("digest")),
                                             max_size=1 << 16))
    if have.digest != key.digest:
        raise IntegrityError("its key differs: " + ("; ".join(differences(key, have)) or
                                                     f"{have.digest} is not {key.digest}"))
    found.digest, found.layer = digest, layers[0]
    return found


def _why_not(client: RegistryClient, image: Reference, desc: Mapping[str, Any],
             key: SnapshotKey) -> str:
    name = str(desc.get("digest", "?"))[:19]
    try:
        body, _, _ = client.get_manifest(image.with_digest(str(desc["digest"])), (OCI_MANIFEST,))
        config = json_object(body, f"snapshot {name}").get("config") or {}
        have = SnapshotKey.parse(client.get_blob(image, str(config.get("digest")),
                                                 max_size=1 << 16))
    except ColdstartError as exc:
        return f"snapshot {name}: unreadable key ({exc})"
    return f"snapshot {name}: " + ("; ".join(differences(key, have)) or "same key")
