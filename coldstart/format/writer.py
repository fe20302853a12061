"""Convert a tar layer (plain, gzip or zstd) into a seekable zstd:chunked or eStargz layer.

The output stays a valid OCI layer: ``zstd -d | tar x`` (zstd:chunked: the TOC, tar-split and
footer are skippable frames) or ``gunzip | tar x`` (eStargz: the TOC is the last tar entry,
``stargz.index.json``, and the footer an empty gzip member).

Layout: tar headers and padding go into their own frames (gzip members for eStargz); each chunk
of a regular file (``chunk_size`` bytes, the last one shorter; a profiled conversion also
starts chunks at given offsets, :func:`chunk_starts`) is one frame holding exactly that chunk,
so a reader can fetch and verify any chunk alone. Compression runs in a bounded thread
pool (zlib and zstandard release the GIL), output is written strictly in order. The input is
read through :mod:`coldstart.format.tarread` (plain, gzip or zstd, every header checked).

Entry handling:

* names are normalized (``./a/`` -> ``a``); absolute names, ``..``, duplicates, entries below a
  non-directory and hardlinks without an earlier target are refused with FormatError naming the
  entry (tar semantics would let the last duplicate win silently);
* an eStargz input's own ``stargz.index.json`` and prefetch landmarks are dropped (the output
  gets its own), so converting a converted layer again works;
* GNU/PAX sparse files are expanded into regular files;
* SCHILY.xattr.* PAX records become TOC xattrs (and stay in the tar);
* whiteouts (``.wh.*``, ``.wh..wh..opq``) are ordinary entries, kept as they are;
* non-UTF-8 names are kept byte for byte in the tar (PAX ``hdrcharset=BINARY``) and appear in
  the TOC surrogate-escaped (see :mod:`coldstart.format.tocjson`).
"""

from __future__ import annotations

import collections
import gzip
import hashlib
import io
import os
import queue
import shutil
import tarfile
import tempfile
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any, BinaryIO, Literal, cast

import zstandard

from coldstart.errors import FormatError, InvalidArgument
from coldstart.format.footer import (
    estargz_footer,
    skippable_frame,
    zstd_chunked_footer,
    zstd_chunked_legacy_footer,
)
from coldstart.format.layer import (
    ESTARGZ_TOC_DIGEST,
    ESTARGZ_UNCOMPRESSED_SIZE,
    MEDIA_TYPE_GZIP,
    MEDIA_TYPE_ZSTD,
    ZSTD_CHUNKED_LEGACY_CHECKSUM,
    ZSTD_CHUNKED_LEGACY_POSITION,
    ZSTD_CHUNKED_MANIFEST_CHECKSUM,
    ZSTD_CHUNKED_MANIFEST_POSITION,
    ZSTD_CHUNKED_TARSPLIT_POSITION,
)
from coldstart.format.tarread import (
    BLOCK,
    XATTR_PREFIX,
    Counted,
    HeaderLog,
    checked_members,
    entry_from,
    member_reader,
    open_tar_stream,
    tar_errors,
)
from coldstart.format.tarsplit import TarSplitWriter
from coldstart.format.toc import NO_PREFETCH_LANDMARK, PREFETCH_LANDMARK, Entry, normalize_name
from coldstart.format.tocjson import encode_toc, entry_json

__all__ = ["DEFAULT_CHUNK_SIZE", "FORMATS", "LayerResult", "convert_layer"]

#: Measured by bench/bench_convert.py (1.08 GB layer, zstd:chunked, 2 cores): 1/4/16 MiB chunks
#: give 0.979/0.975/0.974 of the gzip size at the same conversion speed (within noise), while a
#: random 1 MiB read fetches 1.7/3.4/13.4 MB and a random 4 KiB read 0.4/1.6/6.2 MB. 4 MiB keeps
#: most of 16 MiB's compression with a quarter of its read amplification, needs 4x fewer chunk
#: fetches, cache entries and TOC records than 1 MiB for whole-file reads (model weights), and
#: matches ctr-remote's eStargz chunking, so chunk digests (the cache key) agree across both.
DEFAULT_CHUNK_SIZE = 4 << 20
FORMATS = ("zstd:chunked", "estargz")
#: Entries that belong to the eStargz format itself; dropped from input, written afresh.
_ARTIFACTS = frozenset({"stargz.index.json", PREFETCH_LANDMARK, NO_PREFETCH_LANDMARK})


@dataclass(frozen=True)
class LayerResult:
    """What a converted layer is: the values its manifest descriptor and config need."""

    digest: str
    size: int
    diff_id: str
    toc_digest: str
    media_type: str
    annotations: dict[str, str]

class _Sink:
    """The output: counts and hashes what is written."""

    def __init__(self, dst: IO[bytes]) -> None:
        self.dst = dst
        self.pos = 0
        self.hash = hashlib.sha256()

    def write(self, data: bytes) -> int:
        start = self.pos
        self.dst.write(data)
        self.hash.update(data)
        self.pos += len(data)
        return start


@dataclass
class _Pending:
    future: Future[tuple[bytes, str]]
    chunk: dict[str, Any] | None  # TOC record to fill with offsets once written
    whole: bool = False  # the chunk is the whole file: its digest is the file's digest


class _Hasher:
    """Sequential hashes (diff_id, multi-chunk files) fed in order, computed on a thread."""

    def __init__(self) -> None:
        self._q: queue.Queue[tuple[Any, bytes] | None] = queue.Queue(16)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="convert-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            try:
                item[0].update(item[1])
            except BaseException as exc:  # reported by join()
                self._error = exc

    def update(self, h: Any, data: bytes) -> None:
        self._q.put((h, data))

    def join(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()
        if self._error is not None:
            raise self._error


def chunk_starts(size: int, chunk_size: int, cuts: Sequence[int] = ()) -> list[int]:
    """Where the chunks of a file of ``size`` bytes start: at 0, at each of ``cuts`` inside
    the file, and ``chunk_size`` bytes after each start while that is short of the next
    (no chunk holds more than ``chunk_size`` bytes).

    >>> chunk_starts(10, 4)
    [0, 4, 8]
    >>> chunk_starts(10, 4, [5, 99])
    [0, 4, 5, 9]
    """
    starts = [0]
    for cut in [*sorted({c for c in cuts if 0 < c < size}), size]:
        while cut - starts[-1] > chunk_size:
            starts.append(starts[-1] + chunk_size)
        if cut < size:
            starts.append(cut)
    return starts


class _Writer:
    def __init__(self, dst: IO[bytes], fmt: str, chunk_size: int, level: int | None,
                 threads: int, cuts: Mapping[str, Sequence[int]] | None = None) -> None:
        self.sink = _Sink(dst)
        self.fmt = fmt
        self.gzip = fmt == "estargz"
        self.chunk_size = chunk_size
        self.cuts = cuts or {}
        self.level = level if level is not None else (6 if self.gzip else 3)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="convert")
        self.max_inflight = threads * 2
        self.pending: collections.deque[_Pending] = collections.deque()
        self.meta = bytearray()
        self.diff = hashlib.sha256()
        self.usize = 0
        self.toc: list[dict[str, Any]] = []
        self.tarsplit = TarSplitWriter()
        self._zero_digests: dict[int, str] = {}
        self.hasher = _Hasher()
        self._file_hashes: list[tuple[dict[str, Any], Any]] = []

    # compression jobs run in the pool ------------------------------------------------------

    def _compress(self, data: bytes, want_digest: bool) -> tuple[bytes, str]:
        digest = ""
        if want_digest:
            digest = self._zero_digests.get(len(data), "") if data.count(0) == len(data) else ""
            if not digest:
                digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if self.gzip:
            c = zlib.compressobj(self.level, zlib.DEFLATED, 31)
            return c.compress(data) + c.flush(), digest
        return zstandard.ZstdCompressor(level=self.level).compress(data), digest

    def _submit(self, data: bytes, chunk: dict[str, Any] | None, whole: bool = False) -> None:
        if chunk is not None and data.count(0) == len(data) and len(data) not in self._zero_digests:
            self._zero_digests[len(data)] = "sha256:" + hashlib.sha256(data).hexdigest()
        fut = self.pool.submit(self._compress, data, chunk is not None)
        self.pending.append(_Pending(fut, chunk, whole))
        while len(self.pending) > self.max_inflight:
            self._drain_one()

    def _drain_one(self) -> None:
        p = self.pending.popleft()
        compressed, digest = p.future.result()
        start = self.sink.write(compressed)
        if p.chunk is not None:
            p.chunk["offset"] = start
            if not self.gzip:
                p.chunk["endOffset"] = self.sink.pos
            p.chunk["chunkDigest"] = digest
            if p.whole:
                p.chunk["digest"] = digest

    def drain(self) -> None:
        while self.pending:
            self._drain_one()

    def hash_diff(self, data: bytes) -> None:
        self.hasher.update(self.diff, data)

    def finish_hashes(self) -> None:
        """Wait for the hashing thread; fill in the multi-chunk files' digests."""
        self.hasher.join()
        for rec, h in self._file_hashes:
            rec["digest"] = "sha256:" + h.hexdigest()

    # the uncompressed tar stream -----------------------------------------------------------

    def add_meta(self, raw: bytes) -> None:
        self.meta += raw
        self.hash_diff(raw)
        self.usize += len(raw)
        self.tarsplit.segment(raw)

    def flush_meta(self) -> None:
        if self.meta:
            self._submit(bytes(self.meta), None)
            self.meta = bytearray()

    def add_entry(self, info: tarfile.TarInfo, entry: Entry,
                  read: Callable[[int], bytes] | None) -> None:
        header = info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
        self.add_meta(header)
        self.tarsplit.file(info.name, entry.size)
        rec = entry_json(entry)
        self.toc.append(rec)
        if entry.type != "reg" or entry.size == 0:
            if entry.type == "reg":
                rec["digest"] = "sha256:" + hashlib.sha256(b"").hexdigest()
            return
        assert read is not None
        self.flush_meta()
        starts = chunk_starts(entry.size, self.chunk_size, self.cuts.get(entry.name, ()))
        whole = len(starts) == 1
        fhash = None if whole else hashlib.sha256()
        if fhash is not None:
            self._file_hashes.append((rec, fhash))
        first = True
        for done, end in zip(starts, [*starts[1:], entry.size], strict=True):
            n = end - done
            data = read(n)
            if len(data) != n:
                raise FormatError(f"entry {entry.name!r}: tar data ends after {done + len(data)}"
                                  f" of {entry.size} bytes")
            if fhash is not None:
                self.hasher.update(fhash, data)
            self.hash_diff(data)
            self.usize += n
            if first:
                chunk = rec
                first = False
            else:
                chunk = {"name": entry.name, "type": "chunk"}
                self.toc.append(chunk)
            # Zero chunkOffset, and eStargz's chunkSize of a one-chunk file, are implied (as
            # the Go writer leaves them out); ~30 bytes per file in the TOC.
            if done:
                chunk["chunkOffset"] = done
            if not (whole and self.gzip):
                chunk["chunkSize"] = n
            self._submit(data, chunk, whole)
        self.add_meta(bytes(-entry.size % BLOCK))

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.hasher.join()

def _out_info(info: tarfile.TarInfo, entry: Entry) -> tarfile.TarInfo:
    """The header we write: normalized name, sparse files expanded, only xattr PAX records."""
    out = tarfile.TarInfo("./" if entry.name == "" else
                          entry.name + ("/" if entry.type == "dir" else ""))
    out.type = tarfile.REGTYPE if entry.type == "reg" else info.type
    out.size = entry.size
    out.mode = entry.mode
    out.uid, out.gid, out.uname, out.gname = info.uid, info.gid, info.uname, info.gname
    out.mtime = info.mtime
    out.linkname = entry.link_name if entry.type == "hardlink" else info.linkname
    out.devmajor, out.devminor = entry.dev_major, entry.dev_minor
    out.pax_headers = {k: v for k, v in info.pax_headers.items()
                       if k.startswith(XATTR_PREFIX) or k == "mtime"}
    return out


def _landmark(name: str) -> tuple[tarfile.TarInfo, Entry]:
    info = tarfile.TarInfo(name)
    info.size = 1
    info.mode = 0o644
    return info, Entry(name=name, type="reg", size=1, mode=0o644)


#: Headers whose contents tarfile reads into memory at once (PAX records, GNU long names).
def convert_layer(src: BinaryIO, dst: BinaryIO, *, format: str = "zstd:chunked",
                  chunk_size: int = DEFAULT_CHUNK_SIZE, prefetch: Sequence[str] | None = None,
                  level: int | None = None, threads: int | None = None,
                  legacy_footer: bool = False,
                  cuts: Mapping[str, Sequence[int]] | None = None) -> LayerResult:
    """Convert the tar stream ``src`` into a seekable layer written sequentially to ``dst``.

    ``src`` may be plain, gzip or zstd (sniffed from its first bytes). ``prefetch`` names files
    to place first, followed by ``.prefetch.landmark``; ``[]`` writes ``.no.prefetch.landmark``;
    ``None`` writes no landmark for zstd:chunked and ``.no.prefetch.landmark`` for eStargz (as
    ctr-remote does). ``legacy_footer`` (zstd:chunked only) writes stargz-snapshotter's 40-byte
    footer and annotations, without tar-split, for readers that predate containers/storage's
    64-byte footer (stargz-snapshotter 0.12, Debian's ``ctr-remote``). ``cuts``: per file name,
    offsets where a chunk starts besides every ``chunk_size`` bytes
    (:func:`coldstart.prefetch.ranges.chunk_cuts`: the edges of what a start-up read, so that
    its prefetch decodes those parts alone). Memory stays bounded
    (about ``2 * threads`` chunks in flight); with a
    prefetch list the uncompressed input is spooled to a temporary file to reorder it.

    >>> with open("layer.tar", "rb") as s, open("out", "wb") as d:  # doctest: +SKIP
    ...     result = convert_layer(s, d, format="estargz")
    """
    if format not in FORMATS:
        raise InvalidArgument(f"unknown layer format {format!r} (want one of {FORMATS})")
    if not 4096 <= chunk_size <= 1 << 30:
        raise InvalidArgument(f"chunk size {chunk_size} is outside 4 KiB..1 GiB")
    if prefetch is None and format == "estargz":
        prefetch = []
    for name, offsets in (cuts or {}).items():
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in offsets):
            raise InvalidArgument(f"cuts of {name!r}: offsets must be integers")
    nthreads = threads or min(8, os.cpu_count() or 1)
    w = _Writer(dst, format, chunk_size, level, nthreads, cuts)
    tar_stream: IO[bytes] | None = None
    try:
        tar_stream = open_tar_stream(src)
        counted = Counted(tar_stream)
        stream = cast(IO[bytes], counted)
        if prefetch:
            with tempfile.TemporaryFile() as spool:
                try:
                    shutil.copyfileobj(stream, spool, 1 << 20)
                except (EOFError, zlib.error, zstandard.ZstdError, gzip.BadGzipFile) as exc:
                    raise FormatError(f"input is truncated or corrupt: {exc}") from None
                spool.seek(0)
                end = _convert_entries(w, spool, "r:", list(prefetch))
                total = spool.seek(0, os.SEEK_END)
        else:
            end = _convert_entries(w, stream, "r|", None if prefetch is None else [])
            total = counted.count
        # tarfile accepts a stream that stops at a header boundary; a layer must not.
        if total < end + BLOCK:
            raise FormatError("input tar ends without its end-of-archive marker (truncated?)")
        return _finish(w, legacy_footer)
    finally:
        if tar_stream is not None:
            tar_stream.close()
        w.close()


def _convert_entries(w: _Writer, stream: IO[bytes], mode: Literal["r:", "r|"],
                     prefetch: list[str] | None) -> int:
    """Emit every entry; return the input offset where the tar's end marker should be."""
    headers = HeaderLog()
    with tar_errors():
        tf = tarfile.open(  # noqa: SIM115 (closed by the with below)
            None, mode, fileobj=stream, encoding="utf-8", errors="surrogateescape",
            tarinfo=headers.tarinfo)
    seen: set[str] = set()

    types: dict[str, str] = {}
    implied: set[str] = set()

    def check(entry: Entry) -> None:
        # Refuse here what a reader would refuse (TOC.build): nothing can live under a
        # non-directory, and a hardlink needs an earlier, non-directory target.
        name = entry.name
        if not name and entry.type != "dir":     # "./" as a regular file, a symlink...
            raise FormatError(f"the root entry is a {entry.type}, not a directory")
        if entry.type != "dir" and name in implied:
            raise FormatError(f"entry {name!r} is a {entry.type} but other entries lie below it")
        parts = name.split("/")[:-1] if name else []
        for i in range(len(parts)):
            parent = "/".join(parts[: i + 1])
            if types.get(parent, "dir") != "dir":
                raise FormatError(f"entry {name!r}: parent {parent!r} is a {types[parent]}")
            implied.add(parent)
        if entry.type == "hardlink" and types.get(entry.link_name, "dir") == "dir":
            raise FormatError(f"hardlink {name!r}: target {entry.link_name!r} is not an earlier "
                              "non-directory entry")
        types[name] = entry.type

    def emit(info: tarfile.TarInfo) -> None:
        name = normalize_name(info.name, what="tar entry")
        if name in _ARTIFACTS:
            return  # an eStargz input's own TOC and landmark: rewritten, not copied
        if name in seen:
            raise FormatError(f"entry {name!r} appears twice in the tar stream")
        seen.add(name)
        entry = entry_from(info, name)
        check(entry)
        read = member_reader(tf, info) if entry.type == "reg" and entry.size else None
        w.add_entry(_out_info(info, entry), entry, read)

    def landmark(name: str) -> None:
        info, entry = _landmark(name)
        seen.add(name)
        types[name] = "reg"
        w.add_entry(info, entry, io.BytesIO(b"\x0f").read)

    with tf:
        if not prefetch:
            if prefetch is not None:
                landmark(NO_PREFETCH_LANDMARK)
            for info in checked_members(tf, headers):
                emit(info)
            return tf.offset
        members = list(checked_members(tf, headers))
        by_name: dict[str, tarfile.TarInfo] = {}
        for info in members:
            by_name.setdefault(normalize_name(info.name, what="tar entry"), info)
        first: list[tarfile.TarInfo] = []
        placed: set[int] = set()

        def place(name: str) -> None:
            info = by_name.get(name)
            if info is None or id(info) in placed:
                return
            # taken before its parent and its link target: a cycle (a hardlink to itself or to
            # something below it) ends here, and emit() refuses it as it would unreordered
            placed.add(id(info))
            parent = name.rpartition("/")[0]
            if name:
                place(parent)
            if info.type == tarfile.LNKTYPE:
                place(normalize_name(info.linkname, what=f"hardlink {name!r} target"))
            first.append(info)

        for raw in prefetch:
            name = normalize_name(raw, what="prefetch")
            if name not in by_name:
                raise InvalidArgument(f"prefetch file {raw!r} is not in the layer")
            place(name)
        for info in first:
            emit(info)
        landmark(PREFETCH_LANDMARK)
        for info in members:
            if id(info) not in placed:
                emit(info)
        return tf.offset


def _finish(w: _Writer, legacy_footer: bool) -> LayerResult:
    if w.gzip:
        w.flush_meta()
        w.drain()
        toc_offset = w.sink.pos
        ti = tarfile.TarInfo("stargz.index.json")
        ti.mode = 0o644
        w.finish_hashes()
        toc_json = encode_toc(w.toc)
        ti.size = len(toc_json)
        tar_tail = (ti.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict") + toc_json
                    + bytes(-len(toc_json) % BLOCK) + bytes(2 * BLOCK))
        w.diff.update(tar_tail)
        w.usize += len(tar_tail)
        c = zlib.compressobj(w.level, zlib.DEFLATED, 31)
        w.sink.write(c.compress(tar_tail) + c.flush())
        w.sink.write(estargz_footer(toc_offset))
        toc_digest = "sha256:" + hashlib.sha256(toc_json).hexdigest()
        annotations = {ESTARGZ_TOC_DIGEST: toc_digest, ESTARGZ_UNCOMPRESSED_SIZE: str(w.usize)}
        media_type = MEDIA_TYPE_GZIP
    else:
        w.add_meta(bytes(2 * BLOCK))
        w.flush_meta()
        w.drain()
        w.finish_hashes()
        cctx = zstandard.ZstdCompressor(level=w.level)
        if legacy_footer:
            toc_json = encode_toc(w.toc)
            toc_comp = cctx.compress(toc_json)
            toc_offset = w.sink.write(skippable_frame(toc_comp)) + 8
            w.sink.write(zstd_chunked_legacy_footer(toc_offset, len(toc_comp), len(toc_json)))
            toc_digest = "sha256:" + hashlib.sha256(toc_json).hexdigest()
            # The eStargz key plus the github-less zstd keys: what stargz-snapshotter writes.
            annotations = {
                ESTARGZ_TOC_DIGEST: toc_digest,
                ESTARGZ_UNCOMPRESSED_SIZE: str(w.usize),
                ZSTD_CHUNKED_LEGACY_CHECKSUM: "sha256:" + hashlib.sha256(toc_comp).hexdigest(),
                ZSTD_CHUNKED_LEGACY_POSITION: f"{toc_offset}:{len(toc_comp)}:{len(toc_json)}:1",
            }
            return LayerResult(
                digest="sha256:" + w.sink.hash.hexdigest(), size=w.sink.pos,
                diff_id="sha256:" + w.diff.hexdigest(), toc_digest=toc_digest,
                media_type=MEDIA_TYPE_ZSTD, annotations=annotations)
        ts_raw = w.tarsplit.getvalue()
        ts_comp = cctx.compress(ts_raw)
        toc_json = encode_toc(w.toc, tarSplitDigest="sha256:" + hashlib.sha256(ts_comp).hexdigest())
        toc_comp = cctx.compress(toc_json)
        toc_offset = w.sink.write(skippable_frame(toc_comp)) + 8
        ts_offset = w.sink.write(skippable_frame(ts_comp)) + 8
        w.sink.write(zstd_chunked_footer(toc_offset, len(toc_comp), len(toc_json),
                                         ts_offset, len(ts_comp), len(ts_raw)))
        toc_digest = "sha256:" + hashlib.sha256(toc_comp).hexdigest()
        annotations = {
            ZSTD_CHUNKED_MANIFEST_CHECKSUM: toc_digest,
            ZSTD_CHUNKED_MANIFEST_POSITION: f"{toc_offset}:{len(toc_comp)}:{len(toc_json)}:1",
            ZSTD_CHUNKED_TARSPLIT_POSITION: f"{ts_offset}:{len(ts_comp)}:{len(ts_raw)}",
        }
        media_type = MEDIA_TYPE_ZSTD
    return LayerResult(
        digest="sha256:" + w.sink.hash.hexdigest(), size=w.sink.pos,
        diff_id="sha256:" + w.diff.hexdigest(), toc_digest=toc_digest, media_type=media_type,
        annotations=annotations,
    )
