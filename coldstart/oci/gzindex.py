"""Indexing a plain gzip layer: its deflate checkpoints (found by ``indexed_gzip``, zlib's
zran.c), then the index blob (:func:`coldstart.format.gzindex.build_index`).

``indexed_gzip`` writes its index in its GZIDX format (v1, little-endian): a 35-byte header
(``GZIDX``, version, flags, compressed size, uncompressed size, spacing, window size, point
count), 18 bytes per point (compressed offset, uncompressed offset, bits, has-window), then the
windows of the points that have one.
"""

from __future__ import annotations

import os
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from coldstart.errors import FailedPrecondition, FormatError, IntegrityError
from coldstart.format.gzindex import (
    ARTIFACT_TYPE,
    INDEX_FORMAT,
    INDEX_LAYER_ANNOTATION,
    MAX_PREFETCH_FILES,
    MEDIA_TYPE_INDEX,
    WINDOW,
    Checkpoint,
    GzipIndex,
    build_index,
    parse_index,
)
from coldstart.format.layer import (
    ESTARGZ_TOC_DIGEST,
    MEDIA_TYPE_GZIP,
    ZSTD_CHUNKED_MANIFEST_CHECKSUM,
)
from coldstart.format.tocjson import parse_toc
from coldstart.oci.manifest import (
    DOCKER_LAYER_GZIP,
    OCI_MANIFEST,
    Descriptor,
    ImageConfig,
    Platform,
    canonical_json,
    digest_of,
)
from coldstart.oci.reference import Reference
from coldstart.oci.referrers import push_referrer
from coldstart.oci.registry import RegistryClient
from coldstart.prefetch.profile import LayerProfile, Profile
from coldstart.prefetch.ranges import touched_ranges

__all__ = ["DEFAULT_SPAN", "ImageIndex", "LayerIndex", "find_checkpoints", "index_blob_file",
           "index_image", "push_image_index", "with_profile"]

#: uncompressed bytes between two checkpoints: a miss inflates half of it on average, and each
#: checkpoint costs a 32 KiB window in the index
DEFAULT_SPAN = 2 << 20
_HEADER = struct.Struct("<5sBBQQIII")
_POINT = struct.Struct("<QQBB")


def find_checkpoints(path: str | Path, span: int = DEFAULT_SPAN) -> tuple[list[Checkpoint], int]:
    """Deflate checkpoints of the gzip file at ``path``, about every ``span`` bytes of output,
    and its uncompressed size. FormatError if it is not gzip.

    Only blocks that start on a byte boundary are taken: Python's zlib cannot prime inflate
    with the bits of a partial byte (``inflatePrime``), and shifting the stream instead would
    move the byte alignment of every stored block after it. indexed_gzip is asked for a
    candidate every ``span / 8`` bytes (about one in eight starts on a byte; every block after
    a stored one does); the first aligned candidate ``span`` after the last kept one is kept.
    """
    import indexed_gzip  # a C extension, needed only to index

    spacing = max(2 * WINDOW, span // 8)
    with tempfile.TemporaryDirectory(prefix="coldstart-gzidx-") as tmp:
        exported = Path(tmp) / "index"
        try:
            with indexed_gzip.IndexedGzipFile(str(path), spacing=spacing,
                                              window_size=WINDOW) as f:
                f.build_full_index()
                f.export_index(str(exported))
        except (indexed_gzip.ZranError, OSError, ValueError) as exc:
            raise FormatError(f"{path}: not a gzip stream that can be indexed: {exc}") from None
        with open(exported, "rb") as f:
            head = f.read(_HEADER.size)
            magic, version, _flags, _csize, usize, _sp, wsize, npoints = _HEADER.unpack(head)
            if magic != b"GZIDX" or version != 1 or wsize != WINDOW:
                raise FormatError(f"{path}: indexed_gzip wrote an index this reader does not "
                                  f"know ({magic!r} v{version}, window {wsize})")
            table = f.read(npoints * _POINT.size)
            windows_at = _HEADER.size + npoints * _POINT.size
            points: list[Checkpoint] = []
            nth_window = 0
            for i in range(npoints):
                cin, uout, bits, has_window = _POINT.unpack_from(table, i * _POINT.size)
                where = windows_at + nth_window * wsize
                nth_window += 1 if has_window else 0
                if uout >= usize or bits:
                    continue    # a point at the stream's end, or one inside a byte
                if points and uout - points[-1].out < span:
                    continue
                window = b""
                if has_window and uout:
                    f.seek(where)
                    window = f.read(wsize)[-min(WINDOW, uout):]
                points.append(Checkpoint(cin, 0, uout, window))
    return points, usize


def index_blob_file(path: str | Path, *, layer: str,
                    span: int = DEFAULT_SPAN) -> tuple[bytes, str, int]:
    """Index the gzip layer blob at ``path``: ``(index blob, diffID, files)``."""
    points, usize = find_checkpoints(path, span)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        def read_at(offset: int, length: int) -> bytes:
            return os.pread(f.fileno(), length, offset)
        return build_index(read_at, points, layer=layer, size=size, usize=usize, span=span)


# -- an image's indexes, as one OCI artifact ---------------------------------------------------

#: the empty config of an artifact manifest (OCI 1.1)
EMPTY_CONFIG = b"{}"
EMPTY_MEDIA = "application/vnd.oci.empty.v1+json"


@dataclass(frozen=True)
class LayerIndex:
    """One layer's outcome: indexed (``blob`` set) or skipped with ``reason``."""

    digest: str
    size: int
    reason: str = ""
    blob: bytes = b""
    files: int = 0
    checkpoints: int = 0
    seconds: float = 0.0
    #: the start-up set from a profile: files, and compressed bytes of the spans they touched
    prefetch_files: int = 0
    prefetch_bytes: int = 0

    @property
    def index_digest(self) -> str:
        return digest_of(self.blob) if self.blob else ""


@dataclass(frozen=True)
class ImageIndex:
    """An image's indexes: the image (``subject``: its manifest), each layer's outcome, and
    the artifact manifest that carries them."""

    image: Reference
    subject: Descriptor
    span: int
    layers: tuple[LayerIndex, ...]

    @property
    def manifest_digest(self) -> str:
        return self.subject.digest

    @property
    def artifact(self) -> bytes:
        """The OCI 1.1 artifact manifest: one layer per index blob, the image as subject."""
        layers = [Descriptor(MEDIA_TYPE_INDEX, li.index_digest, len(li.blob),
                             annotations={INDEX_LAYER_ANNOTATION: li.digest})
                  for li in self.layers if li.blob]
        return canonical_json({
            "schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": ARTIFACT_TYPE,
            "config": {"mediaType": EMPTY_MEDIA, "digest": digest_of(EMPTY_CONFIG), "size": 2},
            "layers": [d.to_json() for d in layers],
            "subject": self.subject.to_json(),
            "annotations": {"io.coldstart.gzip-index.span": str(self.span)},
        })

    @property
    def digest(self) -> str:
        return digest_of(self.artifact)


def _skip_reason(desc: Descriptor) -> str:
    if desc.media_type not in (MEDIA_TYPE_GZIP, DOCKER_LAYER_GZIP):
        return f"not a gzip layer ({desc.media_type})"
    if any(k in desc.annotations for k in (ESTARGZ_TOC_DIGEST, ZSTD_CHUNKED_MANIFEST_CHECKSUM)):
        return "seekable already (it has a TOC)"
    return ""


def with_profile(index: GzipIndex, recorded: LayerProfile) -> tuple[GzipIndex, list[str]]:
    """``index`` with the start-up set of ``recorded`` (one layer's profile): the files it read
    that the layer holds, in access order, and the spans it touched. Also returns the files the
    layer does not hold as regular files (a profile of another build of the image)."""
    toc = parse_toc(index.toc_json, format=INDEX_FORMAT, data_end=index.size)
    names: list[str] = []
    missing: list[str] = []
    for f in recorded.files:
        e = toc.entries.get(f.path)
        (names if e is not None and e.type == "reg" else missing).append(f.path)
    del names[MAX_PREFETCH_FILES:]      # what a reader takes (the start-up's first files)
    # only the spans touched: the prefetch asks for each span on its own (a gap closed would
    # be a span fetched and inflated for nothing)
    ranges = touched_ranges(toc, recorded.files, overfetch=0.0)
    return replace(index, prefetch_files=tuple(names), prefetch_ranges=tuple(ranges)), missing


def index_image(client: RegistryClient, ref: Reference, *, span: int = DEFAULT_SPAN,
                workdir: Path, platform: Platform | None = None,
                profile: Profile | None = None,
                say: Callable[[str], None] = lambda _: None) -> ImageIndex:
    """Index every plain gzip layer of image ``ref`` (nothing is pushed: see
    :func:`push_image_index`). Each blob is downloaded (verified) into ``workdir``, indexed,
    its diffID checked against the image config, and removed. With ``profile`` (what
    ``coldstart optimize`` recorded), each layer's index also names the spans its start-up
    touched, which a node prefetches at mount; files of the profile that a layer does not hold
    are skipped with a warning (``say``)."""
    resolved = client.resolve(ref, platform)
    config = ImageConfig.parse(client.get_blob(ref, resolved.manifest.config.digest))
    diff_ids = config.diff_ids
    out: list[LayerIndex] = []
    matched = 0
    for i, desc in enumerate(resolved.manifest.layers):
        reason = _skip_reason(desc)
        if reason:
            say(f"layer {desc.digest}: skipped: {reason}")
            out.append(LayerIndex(desc.digest, desc.size, reason=reason))
            continue
        t0 = time.monotonic()
        path = workdir / desc.digest.replace(":", "-")
        try:
            with open(path, "wb") as f:
                client.download_blob(ref, desc.digest, f, size=desc.size)
            blob, diff_id, files = index_blob_file(path, layer=desc.digest, span=span)
        except FormatError as exc:
            say(f"layer {desc.digest}: skipped: {exc}")
            out.append(LayerIndex(desc.digest, desc.size, reason=str(exc)))
            continue
        finally:
            path.unlink(missing_ok=True)
        if i < len(diff_ids) and diff_ids[i] != diff_id:
            raise IntegrityError(f"layer {desc.digest}: its tar stream is {diff_id}, the image "
                                 f"config says {diff_ids[i]}")
        index = parse_index(blob, layer=desc.digest, size=desc.size)
        recorded = (profile.for_layer(i, diff_id, len(resolved.manifest.layers))
                    if profile is not None else None)
        if recorded is not None and recorded.files:
            index, missing = with_profile(index, recorded)
            blob = index.encode()
            matched += bool(index.prefetch_files)
            if missing:
                say(f"warning: layer {desc.digest}: {len(missing)} files of the profile are "
                    f"not regular files of this layer (first: {missing[0]!r}); skipped")
        li = LayerIndex(desc.digest, desc.size, blob=blob, files=files,
                        checkpoints=len(index.checkpoints), seconds=time.monotonic() - t0,
                        prefetch_files=len(index.prefetch_files),
                        prefetch_bytes=sum(b - a for a, b in index.prefetch_ranges))
        say(f"layer {desc.digest}: {files} files, {li.checkpoints} checkpoints, index "
            f"{len(blob)} bytes ({li.seconds:.1f} s)"
            + (f"; start-up set: {li.prefetch_files} files, {li.prefetch_bytes} bytes of "
               f"spans" if recorded is not None else ""))
        out.append(li)
    if profile is not None and not matched:
        say("warning: the profile names no file of this image's indexed layers (matched by "
            "diffID, or by position): the indexes name no start-up set")
    subject = Descriptor(resolved.media_type, resolved.digest, len(resolved.manifest_bytes))
    return ImageIndex(ref, subject, span, tuple(out))


def push_image_index(client: RegistryClient, index: ImageIndex) -> str:
    """Push the index blobs and the artifact (findable by the image's referrers)."""
    ref = index.image
    if not any(li.blob for li in index.layers):
        raise FailedPrecondition(f"{ref}: no layer could be indexed; nothing to push")
    client.push_blob(ref, EMPTY_CONFIG, digest_of(EMPTY_CONFIG))
    for li in index.layers:
        if li.blob:
            client.push_blob(ref, li.blob, li.index_digest)
    return push_referrer(client, ref, index.artifact, artifact_type=ARTIFACT_TYPE)
