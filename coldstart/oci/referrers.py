"""OCI referrers: artifacts that point at an image through their ``subject`` (OCI 1.1).

Reading asks the referrers API (``GET /v2/<name>/referrers/<digest>``) and, on a registry
without it (distribution 2.x, Debian's ``docker-registry``), the fallback tag the spec defines:
``<alg>-<hex>`` of the subject, an image index listing the referrers. Pushing writes the
artifact manifest and, when the registry did not take the subject itself (no ``OCI-Subject``
header), adds it to that fallback index.
"""

from __future__ import annotations

import json
from typing import Any

from coldstart.errors import FormatError, NotFound
from coldstart.oci.manifest import OCI_INDEX, OCI_MANIFEST, canonical_json, digest_of
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient

__all__ = ["fallback_tag", "find_referrers", "push_referrer"]


def fallback_tag(subject: str) -> str:
    """The fallback tag of ``subject`` (``sha256:ab…`` → ``sha256-ab…``)."""
    return subject.replace(":", "-", 1)


def _descriptors(body: bytes, what: str) -> list[dict[str, Any]]:
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise FormatError(f"{what}: not JSON: {exc}") from None
    manifests = doc.get("manifests") if isinstance(doc, dict) else None
    if not isinstance(manifests, list):
        raise FormatError(f"{what}: not an image index")
    return [m for m in manifests if isinstance(m, dict) and isinstance(m.get("digest"), str)]


def find_referrers(client: RegistryClient, ref: Reference, subject: str,
                   artifact_type: str) -> list[dict[str, Any]]:
    """Descriptors (JSON objects) of ``ref``'s repository's artifacts of ``artifact_type``
    whose subject is ``subject``, newest last; [] when there are none."""
    try:
        body = client.get_referrers(ref, subject, artifact_type)
        what = f"referrers of {subject}"
    except NotFound:
        try:
            body, _, _ = client.get_manifest(ref.with_tag(fallback_tag(subject)), (OCI_INDEX,))
        except NotFound:
            return []
        what = f"fallback tag {fallback_tag(subject)}"
    return [d for d in _descriptors(body, what) if d.get("artifactType") == artifact_type]


def push_referrer(client: RegistryClient, ref: Reference, manifest: bytes, *,
                  artifact_type: str) -> str:
    """Push artifact ``manifest`` (which names its subject) and make it findable; its digest."""
    doc = json.loads(manifest)
    subject = doc["subject"]["digest"]
    digest = digest_of(manifest)
    _, took = client.push_artifact(ref.with_digest(digest), manifest, OCI_MANIFEST)
    if took:
        return digest
    tag = ref.with_tag(fallback_tag(subject))
    try:
        body, _, _ = client.get_manifest(tag, (OCI_INDEX,))
        manifests = _descriptors(body, f"fallback tag {tag}")
    except NotFound:
        manifests = []
    desc = {"mediaType": OCI_MANIFEST, "digest": digest, "size": len(manifest),
            "artifactType": artifact_type}
    if doc.get("annotations"):
        desc["annotations"] = doc["annotations"]
    manifests = [m for m in manifests if m.get("digest") != digest] + [desc]
    index = canonical_json({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests})
    client.push_manifest(tag, index, OCI_INDEX)
    return digest
