"""Which gzip index a node uses for a plain gzip layer, and which layers it never reads through
one again.

An index (``coldstart index IMAGE --push``: an OCI artifact whose subject is the image
manifest, found through the referrers API or its fallback tag) is not covered by the image's
digests: whoever can push to the repository can push one, and an index says everything the
FUSE layer serves (names, modes, owners, which bytes a file holds). So a node trusts one only
as ``[index]`` says (see :class:`~coldstart.config.IndexConfig`):

- ``pinned`` (the default): the artifact's digest is in ``index.trusted`` or in the trust file
  (one digest per line, ``#`` comments; read again on every lookup, so an operator adds one
  without a restart). ``coldstart index`` prints the digest to pin. The artifact manifest is
  fetched by that digest and each layer's index blob by the digest the manifest names: a
  pinned digest covers every byte of the index.
- ``repository``: any index in the image's repository (for registries where push access is
  trusted as much as the image itself: the index's author decides what the mount serves, as
  the image's does). A layer served already through one image's index is served to another
  image with the same layer (the same blob digest) through that index.
- ``off``: indexes are never used.

Whatever the trust, every chunk read through an index is checked against the index's chunk
digest, and a chunk the index describes wrongly (the blob's bytes do not inflate at its
checkpoint, or hash to another digest) makes the read fail with EIO naming the layer, is not
cached, and puts the layer on the node's list of bad indexes (``<root>/bad-indexes.json``):
from then on that layer is never mounted through an index again and is pulled in full.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from coldstart.config import INDEX_TRUST_MODES
from coldstart.errors import ColdstartError, FailedPrecondition, FormatError, NotFound
from coldstart.files import atomic_write, read_optional
from coldstart.format.gzindex import ARTIFACT_TYPE, INDEX_LAYER_ANNOTATION, MEDIA_TYPE_INDEX
from coldstart.lazyfs.spec import BAD_INDEX, NO_INDEX, UNTRUSTED, LayerSpec
from coldstart.oci.manifest import OCI_MANIFEST, parse_manifest
from coldstart.oci.reference import Reference
from coldstart.oci.referrers import find_referrers
from coldstart.oci.registry import RegistryClient

__all__ = ["MAX_INDEX_BLOB", "IndexFinder"]

log = logging.getLogger(__name__)

#: largest index blob fetched
MAX_INDEX_BLOB = 256 << 20
#: seconds an image's referrers and artifact manifests are kept
_TTL = 60.0


class IndexFinder:
    """Find, check trust of, and fetch the index of a plain gzip layer; keep the bad list.

    >>> finder = IndexFinder(client, trust="pinned", trusted=("sha256:…",),
    ...                      trusted_file=Path("/etc/coldstart/trusted-indexes"),
    ...                      bad_file=Path("/var/lib/coldstart/bad-indexes.json"))  # doctest: +SKIP
    >>> blob, artifact = finder.find(spec)                                       # doctest: +SKIP
    """

    def __init__(self, client: RegistryClient, *, trust: str, trusted: tuple[str, ...],
                 trusted_file: Path | None, bad_file: Path) -> None:
        if trust not in INDEX_TRUST_MODES:
            raise ValueError(trust)
        self.client = client
        self.trust = trust
        self.trusted = frozenset(trusted)
        self.trusted_file = trusted_file
        self.bad_file = bad_file
        self._lock = threading.Lock()
        # an image's layers are prepared one after the other: its referrers and artifact
        # manifests are asked once per image (for ``_TTL`` seconds), not once per layer
        self._seen: dict[str, tuple[float, Any]] = {}

    def _pinned(self) -> frozenset[str]:
        pins = set(self.trusted)
        if self.trusted_file is not None:
            try:
                text = (read_optional(self.trusted_file) or b"").decode()
            except (OSError, UnicodeDecodeError) as exc:
                log.warning("cannot read the trusted index file %s: %s", self.trusted_file, exc)
                text = ""
            for line in text.splitlines():
                word = line.split("#", 1)[0].strip()
                if word:
                    pins.add(word)
        return frozenset(pins)

    # -- the bad list -------------------------------------------------------------------------

    def _bad(self) -> dict[str, Any]:
        raw = read_optional(self.bad_file)
        if not raw:
            return {}
        try:
            data = json.loads(raw)
        except ValueError:
            log.error("%s is not JSON; treating every index as bad until it is fixed",
                      self.bad_file)
            return {"*": {"why": f"{self.bad_file} is corrupt"}}
        return data if isinstance(data, dict) else {}

    def bad(self, layer: str) -> str | None:
        """Why ``layer``'s index proved wrong, or None."""
        with self._lock:
            bad = self._bad()
        rec = bad.get(layer) or bad.get("*")
        return None if rec is None else str(rec.get("why", "?"))

    def mark_bad(self, layer: str, index: str, why: str) -> None:
        """Never read ``layer`` through an index again (first reason kept; durable)."""
        with self._lock:
            bad = self._bad()
            if layer in bad:
                return
            bad[layer] = {"index": index, "why": why[:500],
                          "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            try:
                atomic_write(self.bad_file, json.dumps(bad, indent=1).encode(), mode=0o600)
            except OSError as exc:
                log.error("cannot record the bad index of layer %s in %s: %s", layer,
                          self.bad_file, exc)
        log.error("layer %s: %s (index %s): %s; the layer is pulled in full from now on",
                  layer, BAD_INDEX, index, why)

    # -- finding ------------------------------------------------------------------------------

    def find(self, spec: LayerSpec) -> tuple[bytes, str]:
        """The index blob of ``spec``'s layer and the artifact it came from.

        FailedPrecondition (the layer is then pulled in full) when there is none, none is
        trusted, the layer's index proved wrong before, or ``trust`` is off."""
        why = self.bad(spec.digest)
        if why is not None:
            raise FailedPrecondition(f"layer {spec.digest}: its {BAD_INDEX} ({why})")
        if self.trust == "off":
            raise FailedPrecondition(f"layer {spec.digest}: no TOC digest annotation, and "
                                     f"{NO_INDEX} is used (index.trust is off)")
        if not spec.manifest_digest:
            raise FailedPrecondition(f"layer {spec.digest}: no TOC digest annotation, and "
                                     f"{NO_INDEX} can be found (the labels name no manifest "
                                     "digest)")
        ref = Reference.parse(spec.reference)
        found = self._cached(f"referrers {ref.registry}/{ref.repository}@"
                             f"{spec.manifest_digest}", lambda: find_referrers(
                                 self.client, ref, spec.manifest_digest, ARTIFACT_TYPE))
        if not found:
            raise FailedPrecondition(
                f"layer {spec.digest}: no TOC digest annotation and {NO_INDEX} for image "
                f"{spec.manifest_digest} (`coldstart index {spec.reference} --push` makes one)")
        pins = self._pinned() if self.trust == "pinned" else frozenset()
        untrusted: list[str] = []
        for desc in reversed(found):             # the fallback tag lists the newest last
            digest = desc["digest"]
            if self.trust == "pinned" and digest not in pins:
                untrusted.append(digest)
                continue
            try:
                blob = self._fetch(ref, digest, spec.digest)
            except (FormatError, NotFound) as exc:
                log.warning("layer %s: gzip index artifact %s is unusable: %s", spec.digest,
                            digest, exc)
                continue
            if blob is not None:
                return blob, digest
        if untrusted:
            raise FailedPrecondition(
                f"layer {spec.digest}: {UNTRUSTED}: {', '.join(untrusted[:3])} "
                f"(index.trust is pinned: add the digest to index.trusted or "
                f"{self.trusted_file})")
        raise FailedPrecondition(f"layer {spec.digest}: no TOC digest annotation, and "
                                 f"{NO_INDEX}: the image's indexes do not cover this layer")

    def _cached(self, key: str, get: Any) -> Any:
        now = time.monotonic()
        with self._lock:
            hit = self._seen.get(key)
            if hit is not None and now - hit[0] < _TTL:
                return hit[1]
        value = get()
        with self._lock:
            if len(self._seen) > 256:
                self._seen.clear()
            self._seen[key] = (now, value)
        return value

    def _fetch(self, ref: Reference, artifact: str, layer: str) -> bytes | None:
        body, media, _ = self._cached(
            f"artifact {ref.registry}/{ref.repository}@{artifact}",
            lambda: self.client.get_manifest(ref.with_digest(artifact), (OCI_MANIFEST,)))
        try:
            manifest = parse_manifest(body, media or None)
        except (FormatError, ColdstartError) as exc:
            raise FormatError(f"gzip index artifact {artifact}: {exc}") from None
        for desc in manifest.layers:
            if (desc.media_type == MEDIA_TYPE_INDEX
                    and desc.annotations.get(INDEX_LAYER_ANNOTATION) == layer):
                if desc.size > MAX_INDEX_BLOB:
                    raise FormatError(f"gzip index {desc.digest} is {desc.size} bytes, over "
                                      f"the {MAX_INDEX_BLOB} byte limit")
                try:
                    return self.client.get_blob(ref, desc.digest, max_size=MAX_INDEX_BLOB)
                except NotFound:
                    return None
        return None
