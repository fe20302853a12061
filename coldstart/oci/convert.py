"""Convert an image's layers to a seekable format (zstd:chunked or eStargz), copying it between
registries and OCI layouts.

The output is still a plain OCI image: any runtime pulls and unpacks it. Every platform of an index
is converted; layers already seekable are kept byte for byte; each converted layer's uncompressed
content is checked against the source config's ``diff_id`` before it is written anywhere.

>>> summary = convert_image("127.0.0.1:5000/app:v1", "127.0.0.1:5000/app:v1-zstd",
...                         format="zstd:chunked")                     # doctest: +SKIP
>>> print(summary.size_before, summary.size_after)                   # doctest: +SKIP
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import tarfile
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO, cast

import zstandard

from coldstart.errors import FormatError, IntegrityError, InvalidArgument
from coldstart.oci.manifest import (
    DOCKER_CONFIG,
    DOCKER_LAYER_FOREIGN_GZIP,
    DOCKER_LAYER_GZIP,
    INDEX_TYPES,
    LAYER_TYPES,
    MANIFEST_TYPES,
    OCI_CONFIG,
    OCI_INDEX,
    OCI_LAYER_GZIP,
    OCI_MANIFEST,
    Descriptor,
    ImageConfig,
    Index,
    Manifest,
    Platform,
    canonical_json,
    parse_any,
    parse_manifest,
)
from coldstart.oci.registry import RegistryClient
from coldstart.oci.store import ImageStore, open_store
from coldstart.prefetch.profile import LayerProfile, Profile
from coldstart.prefetch.ranges import (
    PREFETCH_RANGES_ANNOTATION,
    chunk_cuts,
    encode_ranges,
    touched_ranges,
)
from coldstart.progress import ByteProgress

__all__ = [
    "FORMATS",
    "PREFETCH_FILES_ANNOTATION",
    "ConvertSummary",
    "ImageSummary",
    "LayerSummary",
    "convert_image",
    "normalise_format",
    "read_prefetch_list",
]

log = logging.getLogger(__name__)

FORMATS: Mapping[str, str] = {
    "zstd-chunked": "zstd:chunked",
    "zstd:chunked": "zstd:chunked",
    "estargz": "estargz",
}

#: on a layer written with a prefetch list: how many files lie before its prefetch landmark
PREFETCH_FILES_ANNOTATION = "dev.coldstart.prefetch.files"

# annotations describing a previous seekable encoding; stale once the blob is rewritten
_STALE_PREFIXES = ("containerd.io/snapshot/stargz/", "io.containers.estargz.",
                   "io.github.containers.zstd-chunked.", PREFETCH_FILES_ANNOTATION,
                   PREFETCH_RANGES_ANNOTATION)
_ATTESTATION_KEY = "vnd.docker.reference.type"


def normalise_format(name: str) -> str:
    """``zstd-chunked``/``zstd:chunked`` → ``zstd:chunked``; ``estargz`` → ``estargz``."""
    try:
        return FORMATS[name.lower()]
    except KeyError:
        raise InvalidArgument(
            f"unknown layer format {name!r} (choose zstd-chunked or estargz)") from None


@dataclass(frozen=True)
class LayerSummary:
    """One layer: where it came from, what it became."""

    source: Descriptor
    output: Descriptor
    diff_id: str
    kept: bool                    # already seekable (or foreign): copied unchanged
    seconds: float
    toc_digest: str | None = None
    prefetch_files: int = 0       # files placed first, before the prefetch landmark
    prefetch_missing: tuple[str, ...] = ()   # profile paths the layer does not hold

    @property
    def size_before(self) -> int:
        return self.source.size

    @property
    def size_after(self) -> int:
        return self.output.size


@dataclass(frozen=True)
class ImageSummary:
    """One platform's manifest."""

    platform: str | None
    source_digest: str
    digest: str
    layers: tuple[LayerSummary, ...]

    @property
    def size_before(self) -> int:
        return sum(x.size_before for x in self.layers)

    @property
    def size_after(self) -> int:
        return sum(x.size_after for x in self.layers)


@dataclass(frozen=True)
class ConvertSummary:
    """What :func:`convert_image` did; sizes are compressed layer bytes."""

    source: str
    destination: str
    format: str
    digest: str                   # of the pushed root (manifest or index)
    media_type: str
    images: tuple[ImageSummary, ...]
    seconds: float
    skipped: tuple[str, ...] = field(default_factory=tuple)

    def _unique(self) -> dict[str, LayerSummary]:
        return {x.source.digest: x for img in self.images for x in img.layers}

    @property
    def size_before(self) -> int:
        return sum(x.size_before for x in self._unique().values())

    @property
    def size_after(self) -> int:
        return sum(x.size_after for x in self._unique().values())

    @property
    def layers_converted(self) -> int:
        return sum(1 for x in self._unique().values() if not x.kept)

    @property
    def layers_kept(self) -> int:
        return sum(1 for x in self._unique().values() if x.kept)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``coldstart convert --json``)."""
        return {
            "source": self.source, "destination": self.destination, "format": self.format,
            "digest": self.digest, "mediaType": self.media_type, "seconds": self.seconds,
            "sizeBefore": self.size_before, "sizeAfter": self.size_after,
            "skipped": list(self.skipped),
            "images": [{
                "platform": img.platform, "sourceDigest": img.source_digest,
                "digest": img.digest,
                "layers": [{
                    "sourceDigest": x.source.digest, "sourceMediaType": x.source.media_type,
                    "sizeBefore": x.size_before, "digest": x.output.digest,
                    "mediaType": x.output.media_type, "sizeAfter": x.size_after,
                    "diffId": x.diff_id, "tocDigest": x.toc_digest, "kept": x.kept,
                    "seconds": round(x.seconds, 3),
                } for x in img.layers],
            } for img in self.images],
        }


LayerCallback = Callable[[LayerSummary, int, int], None]


class _CountingFile:
    """A file whose progress through it is reported (``on_read(n)``: ``n`` more bytes read
    past the furthest point so far; a re-read after a seek back counts once)."""

    def __init__(self, inner: BinaryIO, on_read: Callable[[int], None] | None) -> None:
        self._inner = inner
        self._on_read = on_read
        self._high = inner.tell()

    def read(self, n: int = -1) -> bytes:
        data = self._inner.read(n)
        if self._on_read is not None and data:
            pos = self._inner.tell()
            if pos > self._high:
                self._on_read(pos - self._high)
                self._high = pos
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._inner.seek(offset, whence)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _HashingReader:
    """A read-only stream that hashes (and optionally copies) what passes through."""

    def __init__(self, inner: IO[bytes], copy_to: IO[bytes] | None = None) -> None:
        self._inner = inner
        self._copy = copy_to
        self._hash = hashlib.sha256()
        self.count = 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        data = self._inner.read(n)
        self._hash.update(data)
        if self._copy is not None:
            self._copy.write(data)
        self.count += len(data)
        return data

    def drain(self) -> None:
        while self.read(1 << 20):
            pass

    def digest(self) -> str:
        return f"sha256:{self._hash.hexdigest()}"


_DECOMPRESS_ERRORS = (OSError, EOFError, zlib.error, zstandard.ZstdError)


def _check_diff_id(desc: Descriptor, got: str, want: str) -> None:
    if got != want:
        raise IntegrityError(f"layer {desc.digest}: uncompressed content is {got}, "
                             f"the image config says {want}")


def _decompressed(f: BinaryIO) -> IO[bytes]:
    magic = f.read(4)
    f.seek(0)
    if magic[:2] == b"\x1f\x8b":
        return cast(IO[bytes], gzip.GzipFile(fileobj=f, mode="rb"))
    if magic == b"\x28\xb5\x2f\xfd":
        return zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)
    return f


def _is_seekable(desc: Descriptor) -> bool:
    from coldstart.format.layer import is_seekable

    return bool(is_seekable(desc.annotations, desc.media_type))


class _Converter:
    def __init__(self, src: ImageStore, dst: ImageStore, *, format: str, chunk_size: int,
                 prefetch: Sequence[str] | None, level: int | None, workdir: Path,
                 workers: int, on_layer: LayerCallback | None,
                 profile: Profile | None = None, keep_layers: bool = False,
                 progress: ByteProgress | None = None, cut_chunks: bool = True) -> None:
        self.src, self.dst = src, dst
        self.cut_chunks = cut_chunks
        self.progress = progress
        self.format = format
        self.chunk_size = chunk_size
        self.prefetch = list(prefetch) if prefetch else None
        self.profile = profile
        self.keep_layers = keep_layers
        self.level = level
        self.workdir = workdir
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers),
                                       thread_name_prefix="convert")
        self.on_layer = on_layer
        self._lock = threading.Lock()
        self._futures: dict[str, Future[LayerSummary]] = {}
        self._done = 0
        self.total = 0

    # -- layers ----------------------------------------------------------------------------

    def submit(self, desc: Descriptor, diff_id: str,
               recorded: LayerProfile | None = None) -> Future[LayerSummary]:
        """Convert one layer (once per digest); ``recorded``: its profile (its files go first,
        and the chunks they touched are annotated), else the image-wide prefetch list."""
        with self._lock:
            fut = self._futures.get(desc.digest)
            if fut is None:
                fut = self.pool.submit(self._layer, desc, diff_id, recorded)
                self._futures[desc.digest] = fut
                self.total += 1
                if self.progress is not None:
                    self.progress.expect(desc.size)
            return fut

    def _advance(self, phase: str) -> Callable[[int], None] | None:
        progress = self.progress
        if progress is None:
            return None
        return lambda n: progress.advance(phase, n)

    def _report(self, summary: LayerSummary) -> None:
        with self._lock:
            self._done += 1
            done, total = self._done, self.total
        log.info("layer %s: %d -> %d bytes (%s)", summary.source.digest, summary.size_before,
                 summary.size_after, "kept" if summary.kept else self.format)
        if self.on_layer is not None:
            self.on_layer(summary, done, total)

    def _layer(self, desc: Descriptor, diff_id: str,
               recorded: LayerProfile | None) -> LayerSummary:
        t0 = time.monotonic()
        prefetch = self.prefetch if self.profile is None else (
            recorded.paths if recorded is not None else None)
        if desc.urls or desc.media_type == DOCKER_LAYER_FOREIGN_GZIP:
            # non-distributable layers live elsewhere; the manifest keeps pointing there
            summary = LayerSummary(desc, desc, diff_id, True, time.monotonic() - t0)
        elif (_is_seekable(desc) and prefetch and recorded is not None
              and self.keep_layers):
            summary = self._annotate(desc, diff_id, t0, recorded)
        elif desc.media_type not in LAYER_TYPES or (_is_seekable(desc) and not prefetch):
            # (a seekable layer with a prefetch list is rewritten: its files go in that order)
            self._copy_blob(desc)
            out = desc
            if desc.media_type == DOCKER_LAYER_GZIP:
                out = Descriptor(OCI_LAYER_GZIP, desc.digest, desc.size, desc.annotations)
            summary = LayerSummary(desc, out, diff_id, True, time.monotonic() - t0,
                                   _toc_of(desc.annotations))
        else:
            summary = self._convert(desc, diff_id, t0, prefetch, recorded)
        if summary.kept and self.progress is not None:
            if desc.urls or desc.media_type == DOCKER_LAYER_FOREIGN_GZIP:
                self.progress.advance("download", desc.size)
            self.progress.advance("convert", desc.size)
        self._report(summary)
        return summary

    def _annotate(self, desc: Descriptor, diff_id: str, t0: float,
                  recorded: LayerProfile) -> LayerSummary:
        """A seekable layer kept byte for byte, with the chunks the profile touched named in
        its prefetch-ranges annotation (the node prefetches them; no landmark needed)."""
        with tempfile.NamedTemporaryFile(dir=self.workdir, prefix="keep-") as f:
            self.src.download_blob(desc, f, self._advance("download"))
            f.flush()
            touched = _touched_ranges(Path(f.name), desc.annotations, recorded)
            if not self.dst.has_blob(desc.digest) and not self.dst.try_mount(desc.digest,
                                                                             self.src):
                self.dst.put_blob_file(Path(f.name), desc)
        annotations = {k: v for k, v in desc.annotations.items()
                       if k != PREFETCH_RANGES_ANNOTATION}
        if touched is None:
            log.warning("layer %s: the profile records no byte ranges; --keep-layers has "
                        "nothing to annotate it with", desc.digest)
        else:
            annotations[PREFETCH_RANGES_ANNOTATION] = touched
        out = Descriptor(desc.media_type, desc.digest, desc.size, annotations)
        return LayerSummary(desc, out, diff_id, True, time.monotonic() - t0,
                            _toc_of(desc.annotations),
                            prefetch_files=len(recorded.files) if touched else 0)

    def _copy_blob(self, desc: Descriptor, *, count: bool = True) -> None:
        """Copy a blob as it is; ``count``: a layer's, whose bytes progress counts."""
        if self.dst.has_blob(desc.digest) or self.dst.try_mount(desc.digest, self.src):
            if self.progress is not None and count:
                self.progress.advance("download", desc.size)
            return
        with tempfile.NamedTemporaryFile(dir=self.workdir, prefix="copy-", delete=False) as f:
            path = Path(f.name)
            try:
                self.src.download_blob(desc, f, self._advance("download") if count else None)
            except BaseException:
                f.close()
                path.unlink(missing_ok=True)
                raise
        try:
            self.dst.put_blob_file(path, desc)
        finally:
            path.unlink(missing_ok=True)

    def _convert(self, desc: Descriptor, diff_id: str, t0: float,
                 wanted: list[str] | None, recorded: LayerProfile | None) -> LayerSummary:
        from coldstart.format.writer import convert_layer

        tag = f"{desc.digest[7:19]}-{threading.get_ident()}"
        src_path = self.workdir / f"{tag}.src"
        tar_path = self.workdir / f"{tag}.tar"
        out_path = self.workdir / f"{tag}.out"
        prefetch: list[str] | None = None
        missing: tuple[str, ...] = ()
        try:
            with open(src_path, "w+b") as file:
                self.src.download_blob(desc, file, self._advance("download"))
                file.seek(0)
                raw = cast(BinaryIO, _CountingFile(file, self._advance("convert")))
                with open(out_path, "wb") as out:
                    if wanted:
                        # the image-wide list names files in many layers: give each layer the
                        # ones it holds, which needs one pass over the tar first
                        names = self._unpack_listing(desc, raw, tar_path, diff_id)
                        src_path.unlink()
                        prefetch = [p for p in wanted if p in names]
                        if self.profile is not None:
                            missing = tuple(p for p in wanted if p not in names)
                        # a profile's files get chunks cut at the edges of what was read
                        cuts = chunk_cuts(recorded.files) \
                            if recorded is not None and self.cut_chunks else None
                        with open(tar_path, "rb") as tar:
                            result = convert_layer(tar, out, format=self.format,
                                                   chunk_size=self.chunk_size,
                                                   prefetch=prefetch, level=self.level,
                                                   cuts=cuts)
                    else:
                        stream = _HashingReader(_decompressed(raw))
                        try:
                            result = convert_layer(cast(BinaryIO, stream), out,
                                                   format=self.format,
                                                   chunk_size=self.chunk_size,
                                                   prefetch=None, level=self.level)
                            stream.drain()
                        except _DECOMPRESS_ERRORS as exc:
                            raise FormatError(
                                f"layer {desc.digest}: cannot decompress: {exc}") from exc
                        _check_diff_id(desc, stream.digest(), diff_id)
            src_path.unlink(missing_ok=True)
            tar_path.unlink(missing_ok=True)
            annotations = {k: v for k, v in desc.annotations.items()
                           if not k.startswith(_STALE_PREFIXES)}
            annotations.update(result.annotations)
            if prefetch:
                annotations[PREFETCH_FILES_ANNOTATION] = str(len(prefetch))
            if prefetch and recorded is not None:
                touched = _touched_ranges(out_path, result.annotations, recorded)
                if touched is not None:
                    annotations[PREFETCH_RANGES_ANNOTATION] = touched
            out_desc = Descriptor(media_type=result.media_type, digest=result.digest,
                                  size=result.size, annotations=annotations)
            if out_path.stat().st_size != result.size:
                raise IntegrityError(f"layer {desc.digest}: writer reported {result.size} "
                                     f"bytes, wrote {out_path.stat().st_size}")
            if not self.dst.has_blob(out_desc.digest):
                self.dst.put_blob_file(out_path, out_desc)
            if missing:
                log.warning("layer %s: %d profile file(s) are not in the layer (skipped), "
                            "e.g. %r", desc.digest, len(missing), missing[0])
            return LayerSummary(desc, out_desc, result.diff_id, False, time.monotonic() - t0,
                                result.toc_digest, prefetch_files=len(prefetch or ()),
                                prefetch_missing=missing)
        finally:
            for p in (src_path, tar_path, out_path):
                p.unlink(missing_ok=True)

    @staticmethod
    def _unpack_listing(desc: Descriptor, raw: BinaryIO, tar_path: Path,
                        diff_id: str) -> set[str]:
        """Decompress into ``tar_path``, checking ``diff_id``; return the regular files' names."""
        names: set[str] = set()
        with open(tar_path, "w+b") as spool:
            tee = _HashingReader(_decompressed(raw), copy_to=spool)
            try:
                with tarfile.open(fileobj=tee, mode="r|") as tf:  # type: ignore[call-overload]
                    for member in tf:
                        if member.isreg():
                            names.add(member.name.removeprefix("./").strip("/"))
                tee.drain()
            except (*_DECOMPRESS_ERRORS, tarfile.TarError) as exc:
                raise FormatError(f"layer {desc.digest}: not a readable tar: {exc}") from exc
        _check_diff_id(desc, tee.digest(), diff_id)
        return names

    # -- manifests -------------------------------------------------------------------------

    def plan(self, body: bytes, media: str) -> tuple[Manifest, ImageConfig, bytes,
                                                     list[Future[LayerSummary]]]:
        manifest = parse_manifest(body, media or None)
        config_bytes = self.src.get_blob(manifest.config.digest)
        config = ImageConfig.parse(config_bytes)
        if len(config.diff_ids) != len(manifest.layers):
            raise FormatError(f"manifest has {len(manifest.layers)} layers, its config "
                              f"{len(config.diff_ids)} diff_ids")
        n = len(manifest.layers)
        futs = [self.submit(d, diff, None if self.profile is None
                            else self.profile.for_layer(i, diff, n))
                for i, (d, diff) in enumerate(zip(manifest.layers, config.diff_ids,
                                                  strict=True))]
        return manifest, config, config_bytes, futs

    def finish(self, body: bytes, source_digest: str, manifest: Manifest, config: ImageConfig,
               config_bytes: bytes, futs: list[Future[LayerSummary]], *,
               root: bool) -> tuple[ImageSummary, Descriptor]:
        layers = [f.result() for f in futs]
        diff_ids = [x.diff_id for x in layers]
        unchanged = all(x.kept and x.output == x.source for x in layers)
        if list(config.diff_ids) == diff_ids:
            new_config_bytes = config_bytes
        else:
            new_config_bytes = config.with_diff_ids(diff_ids).to_bytes()
        config_type = OCI_CONFIG if manifest.config.media_type in (DOCKER_CONFIG, "",
                                                                   OCI_CONFIG) \
            else manifest.config.media_type
        if unchanged and manifest.media_type == OCI_MANIFEST \
                and new_config_bytes is config_bytes:
            new_body = body
            self._copy_blob(manifest.config, count=False)
        else:
            config_desc = self.dst.put_blob_bytes(new_config_bytes, config_type)
            raw = dict(manifest.raw)
            raw["schemaVersion"] = 2
            raw["mediaType"] = OCI_MANIFEST
            raw["config"] = config_desc.to_json()
            raw["layers"] = [x.output.to_json() for x in layers]
            new_body = canonical_json(raw)
        digest = self.dst.put_manifest(new_body, OCI_MANIFEST, root=root)
        plat = ImageConfig.parse(new_config_bytes).platform
        summary = ImageSummary(platform=str(plat) if plat else None,
                               source_digest=source_digest, digest=digest,
                               layers=tuple(layers))
        return summary, Descriptor(OCI_MANIFEST, digest, len(new_body))


def _touched_ranges(blob: Path, annotations: Mapping[str, str],
                    recorded: LayerProfile) -> str | None:
    """The compressed ranges of the written layer's chunks that the recording touched, as the
    prefetch-ranges annotation; None when the recording holds no ranges (paths only)."""
    from coldstart.format.layer import open_layer
    from coldstart.format.readat import FileReadAt

    if not any(f.ranges for f in recorded.files):
        return None
    src = FileReadAt(str(blob))
    try:
        toc = open_layer(src, annotations=annotations).toc
    finally:
        src.close()
    return encode_ranges(touched_ranges(toc, recorded.files))


def _toc_of(annotations: Mapping[str, str]) -> str | None:
    return (annotations.get("containerd.io/snapshot/stargz/toc.digest")
            or annotations.get("io.github.containers.zstd-chunked.manifest-checksum"))


def _wanted(desc: Descriptor, platforms: Sequence[Platform] | None) -> str | None:
    """Why an index entry is skipped, or ``None`` to convert it."""
    if desc.annotations.get(_ATTESTATION_KEY):
        return f"{desc.digest} (attestation manifest; it names the unconverted image)"
    if desc.media_type not in MANIFEST_TYPES:
        return f"{desc.digest} ({desc.media_type or 'unknown media type'})"
    if platforms and not (desc.platform and any(desc.platform.matches(p) for p in platforms)):
        return f"{desc.digest} (platform {desc.platform or 'unknown'} not selected)"
    return None


def convert_image(src: str, dst: str, *, format: str = "zstd:chunked",
                  chunk_size: int = 4 << 20, prefetch: Sequence[str] | None = None,
                  platforms: Iterable[Platform | str] | None = None,
                  insecure_hosts: Iterable[str] = (), client: RegistryClient | None = None,
                  workers: int = 2, level: int | None = None, workdir: Path | None = None,
                  on_layer: LayerCallback | None = None,
                  profile: Profile | None = None, keep_layers: bool = False,
                  progress: ByteProgress | None = None,
                  cut_chunks: bool = True) -> ConvertSummary:
    """Convert image ``src`` into ``dst`` (each ``registry/repo:tag`` or ``oci:DIR[:tag]``).

    ``format`` is ``zstd:chunked`` or ``estargz``; ``platforms`` limits which entries of an
    index are converted (default: all); ``on_layer(summary, done, total)`` is called as each
    layer finishes; ``progress`` counts each layer's compressed bytes through the phases
    ``download`` and ``convert``. Blobs the destination already has are not sent again; blobs
    in another
    repository of the same registry are mounted rather than uploaded.

    ``profile`` (from ``coldstart optimize``): each layer's recorded files are placed first,
    in access order, before the prefetch landmark (layers already seekable are rewritten);
    a profile path the layer lacks is skipped with a warning (``prefetch_missing``), and
    with ``cut_chunks`` a chunk starts at each edge of what the start-up read of a file
    (:func:`coldstart.prefetch.ranges.chunk_cuts`), so that the node prefetches and decodes
    those parts and not whole fixed-size chunks around them. ``keep_layers``: with a profile,
    layers already seekable are kept byte for byte (their chunks uncut) and only annotated
    with the chunks the profile touched (the node prefetches those at mount).
    ``prefetch``: one image-wide list instead (each layer takes the files it holds).
    """
    if profile is not None and prefetch:
        raise InvalidArgument("give a profile or a prefetch list, not both")
    fmt = normalise_format(format)
    if chunk_size <= 0:
        raise InvalidArgument(f"chunk size must be positive, got {chunk_size}")
    wanted_platforms = [p if isinstance(p, Platform) else Platform.parse(p)
                        for p in platforms or ()]
    own_client = client is None
    reg = client or RegistryClient(insecure_hosts=insecure_hosts)
    t0 = time.monotonic()
    try:
        source = open_store(src, reg)
        # read the source before touching the destination: a typo in SRC must not leave an
        # empty layout behind at DST
        root = source.get_root()
        dest = open_store(dst, reg, create=True)
        with tempfile.TemporaryDirectory(prefix="coldstart-convert-", dir=workdir) as tmp:
            conv = _Converter(source, dest, format=fmt, chunk_size=chunk_size,
                              prefetch=prefetch, level=level, workdir=Path(tmp),
                              workers=workers, on_layer=on_layer, profile=profile,
                              keep_layers=keep_layers, progress=progress,
                              cut_chunks=cut_chunks)
            try:
                return _run(conv, source, root, dest, fmt, wanted_platforms, t0)
            finally:
                conv.pool.shutdown(wait=True, cancel_futures=True)
    finally:
        if own_client:
            reg.close()


def _run(conv: _Converter, source: ImageStore, source_root: tuple[bytes, str, str],
         dest: ImageStore, fmt: str, platforms: Sequence[Platform],
         t0: float) -> ConvertSummary:
    body, media, digest = source_root
    root = parse_any(body, media or None)
    skipped: list[str] = []
    if isinstance(root, Index) or media in INDEX_TYPES:
        assert isinstance(root, Index)
        plans = []
        for desc in root.manifests:
            why = _wanted(desc, platforms)
            if why is not None:
                skipped.append(why)
                continue
            child, child_media = source.get_manifest(desc.digest)
            plans.append((desc, child, *conv.plan(child, child_media or desc.media_type)))
        if not plans:
            raise InvalidArgument(f"{source.describe()}: no manifest to convert "
                                  f"(skipped: {'; '.join(skipped) or 'none'})")
        images: list[ImageSummary] = []
        entries: list[dict[str, Any]] = []
        for desc, child, manifest, config, config_bytes, futs in plans:
            summary, out = conv.finish(child, desc.digest, manifest, config, config_bytes,
                                       futs, root=False)
            images.append(summary)
            entry = out.to_json()
            if desc.platform is not None:
                entry["platform"] = desc.platform.to_json()
            if desc.annotations:
                entry["annotations"] = dict(desc.annotations)
            entries.append(entry)
        raw = dict(root.raw)
        raw.update(schemaVersion=2, mediaType=OCI_INDEX, manifests=entries)
        out_digest = dest.put_manifest(canonical_json(raw), OCI_INDEX, root=True)
        out_media = OCI_INDEX
    else:
        assert isinstance(root, Manifest)
        manifest, config, config_bytes, futs = conv.plan(body, root.media_type)
        summary, out = conv.finish(body, digest, manifest, config, config_bytes, futs,
                                   root=True)
        images = [summary]
        out_digest, out_media = out.digest, OCI_MANIFEST
    return ConvertSummary(source=source.describe(), destination=dest.describe(), format=fmt,
                          digest=out_digest, media_type=out_media, images=tuple(images),
                          seconds=time.monotonic() - t0, skipped=tuple(skipped))


def read_prefetch_list(path: Path) -> list[str]:
    """Paths to prefetch, one per line (``#`` comments and blank lines ignored)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise InvalidArgument(f"cannot read prefetch list {path}: {exc}") from exc
    out = []
    for line in lines:
        s = line.strip()
        if s and not s.startswith("#"):
            out.append(s.lstrip("/") if s != "/" else s)
    return out

