"""Warm-up caches as OCI artifacts that refer to their image.

One artifact per key (hardware class, model version): its config is the key
(:class:`~coldstart.warmup.keys.WarmupKey`, canonical JSON), its one layer the bundle
(zstd:chunked), its subject the image manifest, found through the referrers API or the
``sha256-<hex>`` fallback tag as :mod:`coldstart.oci.referrers` does. The manifest's
annotations carry the key's digest (so a node picks its artifact from the referrers list
without fetching the others), where each role's directory was, and how many compiles the
capturing start did.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from coldstart.errors import ColdstartError, FormatError, IntegrityError
from coldstart.format.layer import SeekableLayer, open_layer
from coldstart.format.readat import BytesReadAt, ReadAt
from coldstart.oci.manifest import OCI_MANIFEST, canonical_json, digest_of, json_object
from coldstart.oci.reference import Reference
from coldstart.oci.referrers import find_referrers, push_referrer
from coldstart.oci.registry import RegistryClient
from coldstart.remote.registry_blob import open_blob
from coldstart.warmup.bundle import Packed, ReadFile
from coldstart.warmup.keys import WarmupKey, differences

if TYPE_CHECKING:
    from coldstart.cache.chunks import ChunkCache

__all__ = ["ARTIFACT_TYPE", "Found", "LayerOf", "cached_reader", "fetch", "find", "open_bundle",
           "push"]

ARTIFACT_TYPE = "application/vnd.coldstart.warmup.v1"
KEY_MEDIA_TYPE = "application/vnd.coldstart.warmup.key.v1+json"
A_KEY = "dev.coldstart.warmup.key"
A_DIRS = "dev.coldstart.warmup.dirs"
A_COMPILES = "dev.coldstart.warmup.compiles"
A_CREATED = "org.opencontainers.image.created"
#: at most this many other artifacts' keys are read to say why none matched
EXPLAIN = 8


def _now() -> str:
    import datetime as dt

    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def push(client: RegistryClient, image: Reference, key: WarmupKey, packed: Packed, blob: Path,
         *, dirs: Mapping[str, Path], compiles: int) -> str:
    """Push the bundle ``blob`` (what :func:`~coldstart.warmup.bundle.pack` wrote) as an
    artifact of ``image`` under ``key``; its digest."""
    resolved = client.resolve(image)
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
                        A_DIRS: json.dumps({r: str(p) for r, p in sorted(dirs.items())},
                                           separators=(",", ":")),
                        A_COMPILES: str(compiles)},
    })
    return push_referrer(client, image, manifest, artifact_type=ARTIFACT_TYPE)


@dataclass
class Found:
    """The artifact matching a key, or why none does (``digest`` None)."""

    image: str                       # the image manifest's digest
    digest: str | None = None        # the artifact's
    layer: dict[str, Any] = field(default_factory=dict)    # its bundle's descriptor
    dirs: dict[str, str] = field(default_factory=dict)     # role → directory at capture
    compiles: int | None = None      # compiles the capturing start did
    reasons: list[str] = field(default_factory=list)       # why no artifact matched


def find(client: RegistryClient, image: Reference, key: WarmupKey) -> Found:
    """The newest artifact of ``image`` whose key is ``key``; else the reasons, per artifact
    read, that it is not (another torch, another CPU …)."""
    resolved = client.resolve(image)
    found = Found(resolved.digest)
    descs = find_referrers(client, image, resolved.digest, ARTIFACT_TYPE)
    if not descs:
        found.reasons.append(f"no warm-up artifact refers to {resolved.digest}")
        return found

    def ann(d: Mapping[str, Any]) -> Mapping[str, Any]:
        a = d.get("annotations")
        return a if isinstance(a, Mapping) else {}

    # the newest first: by when our pushes say they were made, else the fallback index's
    # order (newest last; the referrers API promises no order)
    descs = sorted(reversed(descs), key=lambda d: str(ann(d).get(A_CREATED, "")), reverse=True)
    # ours first (annotated with this key), then those whose list entry says no key (a
    # registry may leave the annotations out): each is read, and one that fails (deleted,
    # malformed, another subject or key) leaves its reason and the next is tried
    same = [d for d in descs if ann(d).get(A_KEY) == key.digest]
    unsaid = [d for d in descs if A_KEY not in ann(d)]
    for d in [*same, *unsaid]:
        try:
            return _load(client, image, str(d["digest"]), key, Found(found.image))
        except ColdstartError as exc:
            if d in same or not isinstance(exc, IntegrityError):
                found.reasons.append(f"artifact {str(d.get('digest'))[:19]}: {exc}")
            else:
                found.reasons.append(_why_not(client, image, d, key))
    for d in [d for d in descs if d not in same and d not in unsaid][:EXPLAIN]:
        found.reasons.append(_why_not(client, image, d, key))     # another key: how it differs
    return found


def fetch(client: RegistryClient, image: Reference, digest: str) -> Found:
    """Artifact ``digest`` of ``image``'s repository, whatever its key (a node that pinned it,
    the bench's local copy)."""
    return _load(client, image, digest, None, Found(""))


def _load(client: RegistryClient, image: Reference, digest: str, key: WarmupKey | None,
          found: Found) -> Found:
    body, _, digest = client.get_manifest(image.with_digest(digest), (OCI_MANIFEST,))
    doc = json_object(body, f"warm-up artifact {digest}")
    if doc.get("artifactType") != ARTIFACT_TYPE:
        raise FormatError(f"{digest} is not a warm-up artifact ({doc.get('artifactType')!r})")
    layers = doc.get("layers")
    if not isinstance(layers, list) or len(layers) != 1 or not isinstance(layers[0], dict):
        raise FormatError(f"warm-up artifact {digest}: expected one layer")
    subject = doc.get("subject")
    if found.image and (not isinstance(subject, dict) or subject.get("digest") != found.image):
        raise IntegrityError(f"warm-up artifact {digest} refers to "
                             f"{subject.get('digest') if isinstance(subject, dict) else None}, "
                             f"not to {found.image}")
    config = doc.get("config") or {}
    have = WarmupKey.parse(client.get_blob(image, str(config.get("digest")), max_size=1 << 16))
    if key is not None and have.digest != key.digest:
        raise IntegrityError(f"warm-up artifact {digest}: wanted key {key.digest}, its config "
                             f"is key {have.digest}")
    ann = doc.get("annotations") or {}
    found.digest, found.layer = digest, layers[0]
    try:
        dirs = json.loads(ann.get(A_DIRS, "{}"))
        found.dirs = {str(k): str(v) for k, v in dirs.items()} if isinstance(dirs, dict) else {}
        found.compiles = int(ann[A_COMPILES]) if A_COMPILES in ann else None
    except (ValueError, AttributeError):
        found.dirs, found.compiles = {}, None
    return found


def _why_not(client: RegistryClient, image: Reference, desc: Mapping[str, Any],
             key: WarmupKey) -> str:
    name = str(desc.get("digest", "?"))[:19]
    try:
        body, _, _ = client.get_manifest(image.with_digest(str(desc["digest"])), (OCI_MANIFEST,))
        config = json_object(body, f"artifact {name}").get("config") or {}
        have = WarmupKey.parse(client.get_blob(image, str(config.get("digest")),
                                               max_size=1 << 16))
    except ColdstartError as exc:
        return f"artifact {name}: unreadable key ({exc})"
    return f"artifact {name}: " + ("; ".join(differences(key, have)) or "same key")


#: a bundle up to this size is fetched whole when asked (:func:`open_bundle`): one request
#: instead of its tail and then a read per file, for a restore into empty directories, which
#: reads every file; held in memory (twice, briefly) beside the starting app, hence the bound
WHOLE_MAX = 64 << 20


class _WholeBlob(BytesReadAt):
    """A bundle fetched whole and verified against its digest (counted as one request: a
    download the registry client had to resume made more)."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.bytes, self.requests = len(data), 1


class LayerOf(Protocol):
    """An artifact's one layer: its descriptor and the artifact's digest (:class:`Found`, a
    snapshot's)."""

    digest: str | None
    layer: dict[str, Any]


def open_bundle(client: RegistryClient, image: Reference, found: LayerOf, *,
                timeout: float = 60.0, whole: bool = False) -> SeekableLayer:
    """The artifact's bundle (its TOC verified against the layer's annotation): fetched whole
    in one request and verified against its digest when ``whole`` and it is at most
    :data:`WHOLE_MAX` bytes, else opened lazily from the registry (range reads of what is
    read). Each registry call has ``timeout`` seconds, the whole blob's too. Either way each
    chunk and file read is verified against the TOC's digests."""
    desc = found.layer
    size = desc.get("size")
    annotations = desc.get("annotations")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0 or \
            not isinstance(annotations, dict):
        raise FormatError(f"artifact {found.digest}: its layer descriptor has no size "
                          "or no annotations")
    digest = str(desc.get("digest"))
    blob: ReadAt
    if whole and size <= WHOLE_MAX:
        blob = _WholeBlob(client.get_blob(image, digest, max_size=size, timeout=timeout))
    else:
        blob = open_blob(client, image, digest, size, timeout=timeout)
    return open_layer(blob, annotations=annotations)


@dataclass
class Fetched:
    chunks_cached: int = 0     # chunks served by the node's chunk cache
    chunks_fetched: int = 0    # chunks fetched from the registry (verified, then cached)


def cached_reader(cache: ChunkCache | None, stats: Fetched) -> ReadFile:
    """A file reader for :func:`~coldstart.warmup.bundle.unpack` that takes each chunk from
    ``cache`` when it is there and fetches, verifies and caches the rest (the whole file is
    verified against its digest either way)."""
    import hashlib

    def read(layer: SeekableLayer, name: str) -> bytes:
        entry = layer.resolve(name)
        if cache is None:
            stats.chunks_fetched += len(entry.chunks)
            return layer.read_file(name)
        chunks = layer.chunks_for(entry, 0, entry.size)
        parts: list[bytes | None] = [None] * len(chunks)
        missing = []
        for i, c in enumerate(chunks):
            got = cache.get(c.digest, c.chunk_size) if c.digest and not c.zeros else None
            if got is not None:
                parts[i] = bytes(got)
                stats.chunks_cached += 1
            else:
                missing.append(i)
        if missing:
            fetched = layer.read_chunks([chunks[i] for i in missing])   # decoded and verified
            for i, data in zip(missing, fetched, strict=True):
                parts[i] = data
                c = chunks[i]
                if c.digest and not c.zeros:
                    cache.put(c.digest, data, verified=True)
            stats.chunks_fetched += len(missing)
        data = b"".join(p or b"" for p in parts)
        if chunks:
            data = data[: entry.size]
        if entry.digest and "sha256:" + hashlib.sha256(data).hexdigest() != entry.digest:
            if from_cache := [c for i, c in enumerate(chunks) if i not in missing]:
                # a chunk the cache held is wrong (its disk, its owner): drop those and read
                # the file from the registry, verified, instead of refusing every restore
                for c in from_cache:
                    if c.digest:
                        cache.remove(c.digest)
                return layer.read_file(name)
            raise IntegrityError(f"warm-up bundle entry {name!r}: file digest does not match "
                                 f"{entry.digest}")
        return data

    return read
