"""Client-side lazy pull into containerd, like ``ctr-remote image rpull``.

The registry gives the manifest and config; containerd gets them in its content store (with the
``containerd.io/gc.ref.*`` labels tying image → manifest → config → layers → snapshots) and an
image record. Each layer is prepared through containerd's own snapshots service with the labels a
remote snapshotter needs; ALREADY_EXISTS means the snapshotter mounted it lazily, mounts mean it
could not, and the layer is downloaded and unpacked through containerd's diff service instead.

>>> with Containerd(sock) as ctd, RegistryClient() as reg:            # doctest: +SKIP
...     result = pull_image(ctd, reg, "127.0.0.1:5000/app:v1", snapshotter="coldstart")
...     print(result.lazy_layers, result.downloaded_bytes)
"""

from __future__ import annotations

import contextlib
import functools
import json
import secrets
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from coldstart.containerd.client import Containerd
from coldstart.errors import (
    AlreadyExists,
    ColdstartError,
    FailedPrecondition,
    FormatError,
    IntegrityError,
)
from coldstart.lazyfs.spec import (
    CRI_IMAGE_LAYERS,
    LABEL_LIMIT,
    PULLED_LABEL,
    REASON_LABEL,
    REMOTE_ANNOTATIONS,
    REMOTE_DIGEST,
    REMOTE_MANIFEST_DIGEST,
    REMOTE_MEDIA_TYPE,
    REMOTE_REFERENCE,
    REMOTE_SIZE,
    SNAPSHOT_PREFIX,
    TARGET_SNAPSHOT_REF,
    image_layers_label,
)
from coldstart.oci.manifest import (
    Descriptor,
    ImageConfig,
    Manifest,
    Platform,
    chain_id,
)
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient, Resolved
from coldstart.progress import ByteProgress

__all__ = ["LayerResult", "PullResult", "chain_ids", "layer_labels", "pull_image"]

GC_CONTENT = "containerd.io/gc.ref.content"
GC_SNAPSHOT = "containerd.io/gc.ref.snapshot"
UNCOMPRESSED = "containerd.io/uncompressed"
DISTRIBUTION_SOURCE = "containerd.io/distribution.source"

Progress = Callable[[str], None]
_T = TypeVar("_T")


@dataclass(frozen=True)
class LayerResult:
    """What happened to one layer: ``present`` (snapshot existed), ``lazy`` (the snapshotter
    mounted it remotely), ``pulled`` (the snapshotter pulled it in full, in parallel) or
    ``downloaded`` (fetched and unpacked here)."""

    digest: str
    chain_id: str
    size: int
    how: str
    fetched_bytes: int = 0


@dataclass(frozen=True)
class PullResult:
    name: str
    target: Descriptor
    manifest_digest: str
    config_digest: str
    chain_id: str
    layers: tuple[LayerResult, ...]
    seconds: float
    #: CPU seconds of the threads that pulled (the caller's and the side thread's)
    cpu_s: float = 0.0

    @property
    def lazy_layers(self) -> int:
        return sum(1 for la in self.layers if la.how == "lazy")

    @property
    def downloaded_layers(self) -> int:
        return sum(1 for la in self.layers if la.how == "downloaded")

    @property
    def downloaded_bytes(self) -> int:
        return sum(la.fetched_bytes for la in self.layers if la.how == "downloaded")


def chain_ids(diff_ids: Sequence[str]) -> list[str]:
    """containerd's (OCI's) ChainIDs: ``chain[0] = diff[0]``, ``chain[i] = sha256(chain[i-1] +
    " " + diff[i])``.

    >>> chain_ids(["sha256:a"])
    ['sha256:a']
    """
    out: list[str] = []
    for diff_id in diff_ids:
        out.append(chain_id(out[-1] if out else "", diff_id))
    return out


def layer_labels(layer: Descriptor, *, reference: str, manifest_digest: str, chain_id: str,
                 warn: Progress | None = None,
                 image_layers: Sequence[str] = ()) -> dict[str, str]:
    """The labels a Prepare carries for one layer (see ``coldstart.lazyfs.spec``);
    ``image_layers``: the image's layer digests from this one up (the CRI's label, which lets
    the snapshotter open the later layers ahead)."""
    labels: dict[str, str] = {}
    extra: dict[str, str] = {}
    for key, value in sorted(layer.annotations.items()):
        if key.startswith(SNAPSHOT_PREFIX):
            if len(key) + len(value) > LABEL_LIMIT:
                if warn:
                    warn(f"  dropping annotation {key}: longer than {LABEL_LIMIT} bytes")
                continue
            labels[key] = value
        else:
            extra[key] = value
    labels.update({
        REMOTE_REFERENCE: reference,
        REMOTE_DIGEST: layer.digest,
        REMOTE_SIZE: str(layer.size),
        REMOTE_MEDIA_TYPE: layer.media_type,
        REMOTE_MANIFEST_DIGEST: manifest_digest,
        TARGET_SNAPSHOT_REF: chain_id,
    })
    if image_layers:
        labels[CRI_IMAGE_LAYERS] = image_layers_label(image_layers)
    if extra:
        # the largest annotations go first when they do not all fit; the snapshotter can still
        # find them in the manifest (REMOTE_MANIFEST_DIGEST)
        kept = dict(extra)
        text = json.dumps(kept, sort_keys=True)
        while kept and len(REMOTE_ANNOTATIONS) + len(text) > LABEL_LIMIT:
            biggest = max(kept, key=lambda k: len(k) + len(kept[k]))
            del kept[biggest]
            if warn:
                warn(f"  annotation {biggest} does not fit in a label; left out")
            text = json.dumps(kept, sort_keys=True)
        if kept:
            labels[REMOTE_ANNOTATIONS] = text
    return labels


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"  # pragma: no cover


def _short(digest: str) -> str:
    return digest.split(":", 1)[-1][:12]


def pull_image(ctd: Containerd, registry: RegistryClient, ref: str, *,
               snapshotter: str = "coldstart", platform: Platform | None = None,
               progress: Progress | None = None, tmp_dir: Path | None = None,
               timeout: float | None = None,
               byte_progress: ByteProgress | None = None) -> PullResult:
    """Pull ``ref`` into containerd, lazily where ``snapshotter`` can, and unpack the rest.

    The image record is named ``ref`` exactly as given (what ``ctr run`` is later told).
    ``progress`` gets a line per step; ``byte_progress`` counts the bytes of the layers that
    are downloaded (phase ``download``).
    """
    say = progress or (lambda _msg: None)
    started = time.monotonic()
    cpu0 = time.thread_time()
    side_cpu: list[float] = []
    parsed = Reference.parse(ref)
    results: list[LayerResult] = []
    with ThreadPoolExecutor(1, thread_name_prefix="pull") as side, \
            contextlib.ExitStack() as held:
        # containerd makes the lease (a metadata transaction, synced to disk) while the
        # registry answers; it is released when the block ends, however it ends
        leasing = side.submit(_timed, side_cpu, ctd.create_lease)
        held.push(functools.partial(_release, ctd, leasing))
        resolved = registry.resolve(parsed, platform, timeout=timeout)
        manifest = resolved.manifest
        config_bytes = registry.get_blob(resolved.ref, manifest.config.digest, timeout=timeout)
        if len(config_bytes) != manifest.config.size:
            raise IntegrityError(f"config {manifest.config.digest}: {len(config_bytes)} bytes, "
                                 f"manifest says {manifest.config.size}")
        config = ImageConfig.parse(config_bytes)
        diff_ids = config.diff_ids
        if len(diff_ids) != len(manifest.layers):
            raise FormatError(f"image {ref}: {len(manifest.layers)} layers but "
                              f"{len(diff_ids)} diff_ids in its config")
        chains = chain_ids(diff_ids)
        target, index_bytes = _target(registry, resolved, timeout)
        say(f"{ref}: manifest {_short(resolved.digest)}, {len(manifest.layers)} layers, "
            f"{_human(sum(la.size for la in manifest.layers))} compressed")
        leasing.result()

        source = {f"{DISTRIBUTION_SOURCE}.{parsed.registry}": parsed.repository}
        # the config, manifest and index go into the content store while the layers are
        # prepared (each write is a synced transaction too): nothing here waits for them.
        # Each may take as long as a layer's Prepare: a containerd that prepares inside its
        # metadata transaction (1.6.20 does not) holds the writes' commits that long.
        writing = side.submit(_timed, side_cpu, _write_content, ctd, resolved, config_bytes,
                              target, index_bytes, source, 3 * (timeout or ctd.timeout))
        held.callback(futures.wait, [writing])      # (before the lease is released)
        parent = ""
        for i, (layer, chain) in enumerate(zip(manifest.layers, chains, strict=True)):
            if writing.done():
                writing.result()        # a failed write fails the pull now, not after the layers
            head = f"layer {i + 1}/{len(manifest.layers)} {_short(layer.digest)}"
            result = _unpack_layer(ctd, registry, resolved, layer, diff_ids[i], chain, parent,
                                   snapshotter=snapshotter, source=source, say=say,
                                   tmp_dir=tmp_dir, timeout=timeout, head=head,
                                   byte_progress=byte_progress,
                                   image_layers=[la.digest for la in manifest.layers[i:]])
            results.append(result)
            parent = chain
        writing.result()
        top = chains[-1] if chains else ""
        if top:
            ctd.update_content_labels(manifest.config.digest,
                                      {f"{GC_SNAPSHOT}.{snapshotter}": top})
        ctd.put_image(ref, target)
    out = PullResult(name=ref, target=target, manifest_digest=resolved.digest,
                     config_digest=manifest.config.digest, chain_id=chains[-1] if chains else "",
                     layers=tuple(results), seconds=time.monotonic() - started,
                     cpu_s=time.thread_time() - cpu0 + sum(side_cpu))
    present = sum(1 for la in results if la.how == "present")
    pulled = sum(1 for la in results if la.how == "pulled")
    say(f"{ref}: {len(results)} layers: {out.lazy_layers} lazy, {out.downloaded_layers} "
        f"downloaded ({_human(out.downloaded_bytes)}), {present} already present"
        f"{f', {pulled} pulled in full by the snapshotter' if pulled else ''}; "
        f"done in {out.seconds:.2f} s")
    return out


def _release(ctd: Containerd, leasing: futures.Future[str], exc_type: object,
             exc: object, tb: object) -> bool:
    """Release the pull's lease once it is made (if it was); a failure to release it is
    the pull's only when nothing else failed."""
    futures.wait([leasing])
    if not leasing.cancelled() and leasing.exception() is None:
        ctd.release_lease(check=exc_type is None)
    return False


def _timed(spent: list[float], fn: Callable[..., _T], *args: object) -> _T:
    """``fn(*args)``, its thread's CPU seconds appended to ``spent``."""
    t = time.thread_time()
    try:
        return fn(*args)
    finally:
        spent.append(time.thread_time() - t)


def _write_content(ctd: Containerd, resolved: Resolved, config_bytes: bytes,
                   target: Descriptor, index_bytes: bytes | None,
                   source: Mapping[str, str], timeout: float) -> None:
    """The image's config, manifest and index (if the reference named one) into
    containerd's content store, with the labels that tie them together for its GC; each
    write within ``timeout`` seconds."""
    manifest = resolved.manifest
    ctd.write_content(config_bytes, manifest.config.digest, size=manifest.config.size,
                      labels=source, timeout=timeout)
    ctd.write_content(resolved.manifest_bytes, resolved.digest,
                      size=len(resolved.manifest_bytes),
                      labels={**source, **_manifest_gc_labels(manifest)}, timeout=timeout)
    if index_bytes is not None:
        ctd.write_content(index_bytes, target.digest, size=target.size,
                          labels={**source, **_index_gc_labels(resolved)}, timeout=timeout)


def _target(registry: RegistryClient, resolved: Resolved,
            timeout: float | None) -> tuple[Descriptor, bytes | None]:
    """The image record's target (index if the reference named one) and the index's bytes."""
    if resolved.index is None or resolved.index_digest is None:
        return Descriptor(media_type=resolved.media_type, digest=resolved.digest,
                          size=len(resolved.manifest_bytes)), None
    pinned = resolved.ref.with_digest(resolved.index_digest)
    body, media, digest = registry.get_manifest(pinned, timeout=timeout)
    return Descriptor(media_type=resolved.index.media_type or media, digest=digest,
                      size=len(body)), body


def _manifest_gc_labels(manifest: Manifest) -> dict[str, str]:
    labels = {f"{GC_CONTENT}.config": manifest.config.digest}
    for i, layer in enumerate(manifest.layers):
        labels[f"{GC_CONTENT}.l.{i}"] = layer.digest
    return labels


def _index_gc_labels(resolved: Resolved) -> dict[str, str]:
    assert resolved.index is not None
    return {f"{GC_CONTENT}.m.{i}": d.digest for i, d in enumerate(resolved.index.manifests)
            if d.digest == resolved.digest}


def _unpack_layer(ctd: Containerd, registry: RegistryClient, resolved: Resolved,
                  layer: Descriptor, diff_id: str, chain: str, parent: str, *,
                  snapshotter: str, source: Mapping[str, str], say: Progress,
                  tmp_dir: Path | None, timeout: float | None, head: str,
                  byte_progress: ByteProgress | None = None,
                  image_layers: Sequence[str] = ()) -> LayerResult:
    if ctd.has_snapshot(snapshotter, chain):
        say(f"{head}: already present")
        return LayerResult(layer.digest, chain, layer.size, "present")
    labels = layer_labels(layer, reference=str(resolved.ref), manifest_digest=resolved.digest,
                          chain_id=chain, warn=say, image_layers=image_layers)
    key = f"extract-{secrets.token_hex(6)} {chain}"
    try:
        # a remote snapshotter may fetch and verify the layer's TOC before it answers
        mounts = ctd.prepare_snapshot(snapshotter, key, parent, labels,
                                      timeout=3 * (timeout or ctd.timeout))
    except AlreadyExists:
        if not ctd.has_snapshot(snapshotter, chain):
            raise FailedPrecondition(
                f"{head}: snapshotter {snapshotter} answered ALREADY_EXISTS for {key!r} but "
                f"has no snapshot {chain}") from None
        info = ctd.stat_snapshot(snapshotter, chain)
        if info.labels.get(PULLED_LABEL) == "full":
            why = info.labels.get(REASON_LABEL, "?")
            say(f"{head}: pulled in full by the snapshotter ({_human(layer.size)}, parallel; "
                f"not lazy: {why})")
            return LayerResult(layer.digest, chain, layer.size, "pulled", layer.size)
        say(f"{head}: lazy (remote snapshot, {_human(layer.size)} not downloaded)")
        return LayerResult(layer.digest, chain, layer.size, "lazy")
    try:
        t0 = time.monotonic()
        fetched = 0
        if not ctd.has_content(layer.digest):
            with tempfile.TemporaryFile(dir=tmp_dir) as tmp:
                advance = None
                if byte_progress is not None:
                    bp = byte_progress
                    bp.expect(layer.size)

                    def advance(n: int) -> None:
                        bp.advance("download", n)
                fetched = registry.download_blob(resolved.ref, layer.digest, tmp,
                                                 size=layer.size, timeout=timeout,
                                                 progress=advance)
                tmp.flush()
                tmp.seek(0)
                ctd.write_content(tmp, layer.digest, size=layer.size,
                                  labels={**source, UNCOMPRESSED: diff_id})
        applied = ctd.apply_diff(layer, mounts)
        if applied.digest != diff_id:
            raise IntegrityError(f"{head}: unpacked to {applied.digest}, config says {diff_id}")
        try:
            ctd.commit_snapshot(snapshotter, chain, key, labels)
        except AlreadyExists:  # another pull committed the same layer meanwhile
            with contextlib.suppress(ColdstartError):
                ctd.remove_snapshot(snapshotter, key)
    except BaseException:
        with contextlib.suppress(ColdstartError):
            ctd.remove_snapshot(snapshotter, key)
        raise
    say(f"{head}: downloaded {_human(fetched)} and unpacked in {time.monotonic() - t0:.2f} s")
    return LayerResult(layer.digest, chain, layer.size, "downloaded", fetched)
