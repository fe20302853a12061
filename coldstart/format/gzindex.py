"""A seekable index for a plain gzip layer (the zran idea): read any file of an unconverted
layer with one range request.

A gzip stream cannot be entered in the middle, except at the start of a deflate block, given
the 32 KiB of output before it (the "window"): :class:`Checkpoint`. The index holds one every
few MiB of output, and the layer's file table as a TOC (the JSON of eStargz and zstd:chunked,
so :func:`~coldstart.format.tocjson.parse_toc` checks it by the same rules): each regular
file's bytes are cut at the checkpoints into chunks, one per span, each chunk naming its span's
compressed range (``offset``, ``endOffset``), where its bytes start in the span's output
(``innerOffset``) and their digest (``chunkDigest``). Reading a chunk fetches the span,
inflates it from its checkpoint and checks the digest: :class:`IndexedLayer`, a
:class:`~coldstart.format.layer.SeekableLayer` whose chunks are spans.

The index is not covered by the image's digests: where it comes from, and when a node trusts
it, is decided outside this module (``coldstart.lazyfs.indexes``). What this module makes sure
of: a malformed index is refused when opened (FormatError); a chunk whose bytes do not inflate
at its checkpoint or hash to its digest never comes out (IntegrityError or FormatError naming
the layer's file); a window that is not the end of the span before it fails once that span
is inflated. What it cannot make sure of: an index whose author forged a window and the
digests to match, or the file table's metadata (names, modes, owners, links), before the whole
blob has been read. That is why a node reads a layer through an index only if it trusts the
index's author (``coldstart.lazyfs.indexes``), as it trusts an image's.

The blob (media type :data:`MEDIA_TYPE_INDEX`) is one zstd frame of::

    b"CSGZIX01" | u64 meta length | meta JSON | u64 TOC length | TOC JSON | windows

meta: ``{"version": 1, "layer": DIGEST, "size": BLOB_BYTES, "uncompressedSize": N,
"diffID": DIGEST, "span": BYTES, "checkpoints": [[in, bits, out, window_bytes], ...]}``, where
``in``/``bits`` follow zlib's zran.c: the block starts ``bits`` bits before byte ``in`` (this
version: always 0, see :func:`coldstart.oci.gzindex.find_checkpoints`), ``out`` is its
uncompressed offset, and the windows follow in checkpoint order. An index built with a start-up
profile (``coldstart index --profile``) also holds ``"prefetch": {"files": [NAME, ...],
"ranges": [[offset, length], ...]}``: the files the recorded start-up read, in access order,
and the compressed ranges of the spans it touched, sorted and disjoint. A node prefetches those
spans as soon as it mounts the layer (the blob's order cannot be changed: the spans are the
start-up set). A lying list costs fetches, never wrong bytes: every piece is still checked.
"""

from __future__ import annotations

import bisect
import collections
import hashlib
import io
import json
import struct
import tarfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import zstandard
from isal import isal_zlib

from coldstart.errors import FormatError, IntegrityError
from coldstart.format.footer import Footer
from coldstart.format.layer import MAX_DECODE, SeekableLayer
from coldstart.format.readat import ReadAt
from coldstart.format.tarread import HeaderLog, checked_members, entry_from, member_reader
from coldstart.format.toc import Chunk, normalize_name
from coldstart.format.tocjson import (
    MAX_TOC_SIZE,
    _decode_json,
    encode_toc,
    entry_json,
    parse_toc,
)

__all__ = [
    "ARTIFACT_TYPE",
    "INDEX_FORMAT",
    "INDEX_LAYER_ANNOTATION",
    "MEDIA_TYPE_INDEX",
    "WINDOW",
    "Checkpoint",
    "GzipIndex",
    "IndexedLayer",
    "build_index",
    "encode_index",
    "inflate_span",
    "open_indexed_layer",
    "parse_index",
]

#: artifactType of the OCI artifact that carries an image's indexes (one blob per layer)
ARTIFACT_TYPE = "application/vnd.coldstart.gzip-index.v1"
#: media type of one layer's index blob
MEDIA_TYPE_INDEX = "application/vnd.coldstart.gzip-index.v1+zstd"
#: on each index blob of the artifact: the digest of the image layer it describes
INDEX_LAYER_ANNOTATION = "io.coldstart.gzip-index.layer"
#: the TOC's format name for an indexed gzip layer
INDEX_FORMAT = "gzip-index"
#: deflate's window: the output a checkpoint needs before it
WINDOW = 32 << 10
_MAGIC = b"CSGZIX01"
#: largest span (output between two checkpoints) an index may declare
MAX_SPAN = 64 << 20
#: most checkpoints an index may hold (a 1 TiB layer at 64 KiB spans)
MAX_CHECKPOINTS = 1 << 24
#: largest index, decompressed
MAX_INDEX_BYTES = 1 << 30
#: most files an index's start-up set may name
MAX_PREFETCH_FILES = 1 << 20
#: decoded spans kept per layer: the small files of one span are read together
_KEEP_SPANS = 4


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Where a deflate block starts: at compressed byte ``cin`` (``bits``: always 0, a block
    that starts on a byte boundary; the field is zran's, kept for one that may not), at
    uncompressed offset ``out``, after the ``window`` (the output before it, ≤ 32 KiB)."""

    cin: int
    bits: int
    out: int
    window: bytes

    @property
    def start(self) -> int:
        """The first compressed byte of the span."""
        return self.cin


@dataclass(frozen=True)
class GzipIndex:
    """A parsed index: the layer it describes, its checkpoints, and its TOC JSON."""

    layer: str
    size: int
    uncompressed_size: int
    diff_id: str
    span: int
    checkpoints: tuple[Checkpoint, ...]
    toc_json: bytes
    #: the recorded start-up's files (access order) and the spans it touched ``[start, end)``
    prefetch_files: tuple[str, ...] = ()
    prefetch_ranges: tuple[tuple[int, int], ...] = ()

    def encode(self, level: int = 3) -> bytes:
        """The index blob of this index."""
        return encode_index(layer=self.layer, size=self.size,
                            uncompressed_size=self.uncompressed_size, diff_id=self.diff_id,
                            span=self.span, checkpoints=self.checkpoints,
                            toc_json=self.toc_json, prefetch_files=self.prefetch_files,
                            prefetch_ranges=self.prefetch_ranges, level=level)

    def span_end(self, i: int) -> tuple[int, int]:
        """Compressed end (exclusive) and uncompressed end of span ``i``."""
        if i + 1 < len(self.checkpoints):
            nxt = self.checkpoints[i + 1]
            return nxt.cin, nxt.out
        return self.size, self.uncompressed_size


def encode_index(*, layer: str, size: int, uncompressed_size: int, diff_id: str, span: int,
                 checkpoints: Sequence[Checkpoint], toc_json: bytes,
                 prefetch_files: Sequence[str] = (),
                 prefetch_ranges: Sequence[tuple[int, int]] = (), level: int = 3) -> bytes:
    """The index blob (see the module's doc)."""
    meta: dict[str, Any] = {
        "version": 1, "layer": layer, "size": size, "uncompressedSize": uncompressed_size,
        "diffID": diff_id, "span": span,
        "checkpoints": [[c.cin, c.bits, c.out, len(c.window)] for c in checkpoints]}
    if prefetch_files or prefetch_ranges:
        meta["prefetch"] = {"files": list(prefetch_files),
                            "ranges": [[a, b - a] for a, b in prefetch_ranges]}
    meta_json = json.dumps(meta, separators=(",", ":")).encode()
    parts = [_MAGIC, struct.pack("<Q", len(meta_json)), meta_json,
             struct.pack("<Q", len(toc_json)), toc_json, *(c.window for c in checkpoints)]
    return zstandard.ZstdCompressor(level=level).compress(b"".join(parts))


def _int(v: Any, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise FormatError(f"gzip index: {what} is not a non-negative integer: {v!r:.40}")
    return v


def parse_index(data: bytes, *, layer: str, size: int) -> GzipIndex:
    """Parse and check an index blob for layer ``layer`` (``size`` bytes).

    FormatError for anything malformed: not zstd, truncated, another layer's, checkpoints that
    are not strictly increasing or lie outside the blob, a window of the wrong size, a span
    over :data:`MAX_SPAN`. What it cannot check here (that the checkpoints and digests match
    the blob) is checked by every chunk read.
    """
    # what an honest index of this blob can hold: its metadata and TOC, and a window per
    # checkpoint, no more checkpoints than compressed KiB (a span of output needs at least
    # a few bytes of deflate data; the cap keeps a lying frame from filling the memory)
    limit = min(16 + 2 * MAX_TOC_SIZE + (size // 1024 + 64) * WINDOW, MAX_INDEX_BYTES)
    try:
        with zstandard.ZstdDecompressor().stream_reader(data) as r:
            raw = r.read(limit + 1)
            if len(raw) <= limit and r.read(1):
                raise FormatError("gzip index: more than one zstd frame")
    except zstandard.ZstdError as exc:
        raise FormatError(f"gzip index: not a whole zstd frame: {exc}") from None
    if len(raw) > limit:
        raise FormatError(f"gzip index: decompresses to over {limit} bytes, more than an "
                          f"index of a {size} byte blob holds")
    if raw[:8] != _MAGIC or len(raw) < 16:
        raise FormatError("gzip index: bad magic (not a coldstart gzip index v1)")
    (mlen,) = struct.unpack_from("<Q", raw, 8)
    if mlen > MAX_TOC_SIZE or 16 + mlen + 8 > len(raw):
        raise FormatError("gzip index: truncated (its metadata runs past the end)")
    try:
        meta = json.loads(raw[16 : 16 + mlen])
    except ValueError as exc:
        raise FormatError(f"gzip index: metadata is not JSON: {exc}") from None
    if not isinstance(meta, dict) or meta.get("version") != 1:
        raise FormatError("gzip index: metadata is not a version 1 object")
    pos = 16 + mlen
    (tlen,) = struct.unpack_from("<Q", raw, pos)
    pos += 8
    if tlen > MAX_TOC_SIZE or pos + tlen > len(raw):
        raise FormatError("gzip index: truncated (its TOC runs past the end)")
    toc_json = raw[pos : pos + tlen]
    pos += tlen
    if meta.get("layer") != layer:
        raise FormatError(f"gzip index: describes layer {str(meta.get('layer'))[:80]!r}, "
                          f"not {layer}")
    if _int(meta.get("size"), "size") != size:
        raise FormatError(f"gzip index: describes a blob of {meta.get('size')} bytes, the "
                          f"layer has {size}")
    usize = _int(meta.get("uncompressedSize"), "uncompressedSize")
    span = _int(meta.get("span"), "span")
    diff_id = meta.get("diffID")
    if not isinstance(diff_id, str):
        raise FormatError("gzip index: diffID is not a string")
    raws = meta.get("checkpoints")
    if not isinstance(raws, list) or not raws or len(raws) > MAX_CHECKPOINTS:
        raise FormatError("gzip index: no checkpoints (or too many)")
    points: list[Checkpoint] = []
    for i, rc in enumerate(raws):
        if not isinstance(rc, list) or len(rc) != 4:
            raise FormatError(f"gzip index: checkpoint #{i} is not [in, bits, out, window]")
        cin, bits, out, wlen = (_int(v, f"checkpoint #{i}") for v in rc)
        if bits:
            raise FormatError(f"gzip index: checkpoint #{i} starts inside a byte (bits "
                              f"{bits}): this reader takes byte-aligned checkpoints only")
        if not 10 <= cin < size:
            raise FormatError(f"gzip index: checkpoint #{i} at byte {cin} is outside the "
                              f"blob's deflate data")
        # no window: a checkpoint where a gzip member starts (its data refers to nothing
        # before it); a wrong one makes that span's chunks fail, as any lie does
        if wlen not in (0, min(WINDOW, out)) or out > usize:
            raise FormatError(f"gzip index: checkpoint #{i} (output {out}) has a window of "
                              f"{wlen} bytes, not {min(WINDOW, out)}")
        if points and (cin <= points[-1].cin or out <= points[-1].out):
            raise FormatError(f"gzip index: checkpoint #{i} does not follow #{i - 1}")
        if points and out - points[-1].out > MAX_SPAN:
            raise FormatError(f"gzip index: span #{i - 1} is {out - points[-1].out} bytes, "
                              f"over the {MAX_SPAN} byte limit")
        if pos + wlen > len(raw):
            raise FormatError(f"gzip index: truncated (window of checkpoint #{i} is missing)")
        points.append(Checkpoint(cin, bits, out, raw[pos : pos + wlen]))
        pos += wlen
    if points[0].out != 0:
        raise FormatError("gzip index: the first checkpoint is not at the stream's start")
    if usize - points[-1].out > MAX_SPAN:
        raise FormatError("gzip index: the last span is over the size limit")
    if pos != len(raw):
        raise FormatError(f"gzip index: {len(raw) - pos} bytes after the last window")
    files, ranges = _prefetch(meta.get("prefetch"), points, size)
    return GzipIndex(layer, size, usize, diff_id, span, tuple(points), toc_json,
                     prefetch_files=files, prefetch_ranges=ranges)


def _prefetch(raw: Any, points: Sequence[Checkpoint],
              size: int) -> tuple[tuple[str, ...], tuple[tuple[int, int], ...]]:
    """The metadata's start-up set (see the module's doc), checked: FormatError if malformed.
    Each range starts at a checkpoint and ends where a span ends, after the range before it;
    there are no more ranges than spans, nor more names than :data:`MAX_PREFETCH_FILES`."""
    if raw is None:
        return (), ()
    if not isinstance(raw, dict):
        raise FormatError("gzip index: prefetch is not an object")
    files, pairs = raw.get("files", []), raw.get("ranges", [])
    if (not isinstance(files, list) or len(files) > MAX_PREFETCH_FILES
            or not all(isinstance(f, str) for f in files)):
        raise FormatError(f"gzip index: prefetch files is not a list of at most "
                          f"{MAX_PREFETCH_FILES} names")
    if not isinstance(pairs, list) or len(pairs) > len(points):
        raise FormatError("gzip index: prefetch ranges is not a list of at most one range "
                          "per span")
    names = tuple(normalize_name(f, what="gzip index: prefetch file") for f in files)
    starts = {p.cin for p in points}
    ends = {p.cin for p in points[1:]} | {size}
    ranges: list[tuple[int, int]] = []
    for i, pair in enumerate(pairs):
        if not isinstance(pair, list) or len(pair) != 2:
            raise FormatError(f"gzip index: prefetch range #{i} is not [offset, length]")
        start, length = (_int(v, f"prefetch range #{i}") for v in pair)
        what = f"gzip index: prefetch range #{i} ({start}+{length})"
        if start not in starts or start + length not in ends or not length:
            raise FormatError(f"{what} does not cover whole spans (it starts at no "
                              f"checkpoint, or ends where no span ends)")
        if ranges and start < ranges[-1][1]:
            raise FormatError(f"{what} is not after the range before it")
        ranges.append((start, start + length))
    return names, tuple(ranges)


#: ISA-L's inflate error (its stubs declare ``error`` an instance)
_INFLATE_ERROR = cast("type[Exception]", isal_zlib.error)


def inflate_span(compressed: bytes | memoryview, point: Checkpoint, limit: int, *,
                 what: str) -> bytes:
    """Inflate the deflate data in ``compressed`` (``blob[point.cin:...]``) from ``point``:
    at most ``limit`` bytes. FormatError if the bytes are not deflate data there."""
    try:
        # ISA-L: the same inflate at about twice zlib's speed (a 2 MiB span: ~3 against 6 ms)
        d = (isal_zlib.decompressobj(-15, zdict=point.window) if point.window
             else isal_zlib.decompressobj(-15))
        return d.decompress(compressed, limit)
    except _INFLATE_ERROR as exc:
        raise FormatError(f"{what}: not deflate data at this checkpoint: {exc}") from None


class IndexedLayer(SeekableLayer):
    """A plain gzip layer read through its index: a chunk is a span's piece of one file.

    Decoding inflates the chunk's span from its checkpoint (a few decoded spans are kept: the
    small files of one span are read together) and checks the chunk's digest. ``on_bad``: told
    of a chunk that failed for good (its bytes do not inflate at its checkpoint, or hash to
    another digest): the index lies, or the blob does.
    """

    spreads = True

    def __init__(self, blob: ReadAt, index: GzipIndex, index_digest: str) -> None:
        toc = parse_toc(index.toc_json, format=INDEX_FORMAT, data_end=index.size)
        super().__init__(blob, toc, index_digest, footer=Footer(INDEX_FORMAT, 0, index.size),
                         toc_offset=index.size, verified=True)
        self.index = index
        if index.prefetch_files:
            # the start-up set the index names (apart from the blob's order, which is the
            # producer's); without one, a landmark in the tar keeps its meaning
            self.toc.prefetch = list(index.prefetch_files)
            self.prefetch_ranges = index.prefetch_ranges
            self.prefetch_named_apart = True
        self._spans = {c.start: i for i, c in enumerate(index.checkpoints)}
        self._decoded: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self._lock = threading.Lock()
        #: told once the index proves wrong (a chunk fails for good): its message
        self.on_bad: Callable[[str], None] | None = None
        # every piece of every span, for :meth:`spread`: span offset -> (inner, size, digest);
        # made at the first spread (a fetch's worker thread), not on the mount's path
        self._pieces: dict[int, list[tuple[int, int, str]]] | None = None
        self._spread: set[int] = set()

    def spread(self, chunk: Chunk) -> list[tuple[str, bytes]]:
        """The other files' pieces of ``chunk``'s span, each checked against its digest, the
        first time that span is decoded whole (``[]`` afterwards, and while only a part of it
        was decoded): a span is one range request and one inflate, and the small files it
        holds are read together. The fetcher caches them, so a later read of any of them costs
        neither again."""
        i = self._spans.get(chunk.offset)
        if i is None:
            return []
        whole = self.index.span_end(i)[1] - self.index.checkpoints[i].out
        with self._lock:
            if chunk.offset in self._spread:
                return []
            out = self._decoded.get(chunk.offset)
            if out is None or len(out) < whole:    # decoded in part (``upto``): not yet
                return []
            self._spread.add(chunk.offset)
        return self._pieces_of(chunk.offset, out, chunk.digest)

    def spread_from(self, chunk: Chunk, compressed: bytes) -> list[tuple[str, bytes]]:
        """:meth:`spread` of ``chunk``'s span, inflating ``compressed`` (the span's bytes) whole
        when no whole decoding of it is kept (a prefetch decoded it in part; evicted since);
        ``[]`` when the span was spread already. ``chunk`` itself is not verified here (a
        piece the index lies about costs only that piece: each is checked); FormatError or
        IntegrityError when the span does not inflate as its index says."""
        what = f"span at compressed byte {chunk.offset}"
        with self._lock:
            if chunk.offset in self._spread:
                return []
            out = self._decoded.get(chunk.offset)
        i, point, length = self._span(chunk, what)
        if out is None or len(out) < length:
            if len(compressed) != chunk.end_offset - chunk.offset:
                raise FormatError(f"{what}: got {len(compressed)} compressed bytes, expected "
                                  f"{chunk.end_offset - chunk.offset}")
            out = self._inflate(i, point, length, compressed, what)
            self._keep(chunk.offset, out)
        with self._lock:
            if chunk.offset in self._spread:
                return []
            self._spread.add(chunk.offset)
        return self._pieces_of(chunk.offset, out, chunk.digest)

    def _pieces_of(self, offset: int, out: bytes, skip: str) -> list[tuple[str, bytes]]:
        """The pieces of the span at ``offset`` in its decoding ``out`` whose bytes hash to
        their digest, but the one with digest ``skip`` (the chunk decoded for a reader)."""
        pieces = self._pieces
        if pieces is None:
            pieces = self._pieces = _span_pieces(self.index.toc_json)
        got: list[tuple[str, bytes]] = []
        for inner, size, digest in pieces.get(offset, ()):
            if digest == skip or inner + size > len(out):
                continue
            data = out[inner : inner + size]
            if "sha256:" + hashlib.sha256(data).hexdigest() == digest:
                got.append((digest, data))
        return got

    def _keep(self, key: int, out: bytes) -> None:
        """Keep a decoding of span ``key`` (a few are kept); never a part over a longer one."""
        with self._lock:
            kept = self._decoded.get(key)
            if kept is None or len(kept) < len(out):
                self._decoded[key] = out
            self._decoded.move_to_end(key)
            while len(self._decoded) > _KEEP_SPANS:
                self._decoded.popitem(last=False)

    def _inflate(self, i: int, point: Checkpoint, limit: int, compressed: bytes | memoryview,
                 what: str) -> bytes:
        """Span #i inflated from ``point``: ``limit`` bytes (FormatError if fewer), checked
        against the next checkpoint's window when that is the whole span."""
        out = inflate_span(compressed, point, limit, what=what)
        length = self.index.span_end(i)[1] - point.out
        if len(out) != limit:
            raise FormatError(f"{what}: span #{i} inflates to {len(out)} bytes, fewer than "
                              f"the {limit} of its {length} its index says it holds")
        nxt = self.index.checkpoints[i + 1] if i + 1 < len(self.index.checkpoints) else None
        if limit == length and nxt is not None and nxt.window and not out.endswith(nxt.window):
            # the next checkpoint's window is this span's end: one that is not would make
            # the next span inflate to bytes the blob does not hold
            raise IntegrityError(f"{what}: the window of checkpoint #{i + 1} is not the "
                                 f"output before it: the index lies")
        return out

    def chunk_failed(self, chunk: Chunk, exc: BaseException) -> None:
        if self.on_bad is not None:
            self.on_bad(f"{type(exc).__name__}: {exc}")

    def _span(self, chunk: Chunk, what: str) -> tuple[int, Checkpoint, int]:
        i = self._spans.get(chunk.offset)
        if i is None:
            raise FormatError(f"{what}: no checkpoint starts at compressed byte {chunk.offset}")
        point = self.index.checkpoints[i]
        end, uend = self.index.span_end(i)
        if chunk.end_offset != end:
            raise FormatError(f"{what}: span ends at {chunk.end_offset}, its checkpoint's at "
                              f"{end}")
        return i, point, uend - point.out

    def decode_chunk(self, chunk: Chunk, compressed: bytes | memoryview, *,
                     upto: int | None = None) -> bytes:
        """The chunk's bytes, verified; its span inflated from its checkpoint (or a decoding
        of it kept), whole, or with ``upto`` only that far (at least to the chunk's end)."""
        owner = chunk.owner or "?"
        what = f"entry {owner!r} chunk at {chunk.chunk_offset} (+{chunk.chunk_size})"
        if len(compressed) != chunk.end_offset - chunk.offset:
            raise FormatError(f"{what}: got {len(compressed)} compressed bytes, expected "
                              f"{chunk.end_offset - chunk.offset}")
        i, point, length = self._span(chunk, what)
        need = chunk.inner_offset + chunk.chunk_size
        if need > min(length, MAX_DECODE):
            raise FormatError(f"{what}: reaches past its span ({length} bytes)")
        key = chunk.offset
        with self._lock:
            out = self._decoded.get(key)
            if out is not None:
                # a decoding in part: of no use when it stops before this chunk, or when the
                # caller wants the span whole (the other pieces are spread from it)
                if len(out) < (need if upto is not None else length):
                    out = None
                else:
                    self._decoded.move_to_end(key)
        if out is None:
            # a span's bytes past what the caller needs are inflated for nothing: a prefetch
            # needs its set's pieces now, and spreads the rest later (when the node is quiet)
            limit = length if upto is None else min(length, max(upto, need))
            out = self._inflate(i, point, limit, compressed, what)
            self._keep(key, out)
        data = out[chunk.inner_offset : chunk.inner_offset + chunk.chunk_size]
        got = "sha256:" + hashlib.sha256(data).hexdigest()
        if got != chunk.digest:
            with self._lock:    # the span may be what is wrong: the next try inflates anew
                self._decoded.pop(key, None)
            raise IntegrityError(f"{what}: digest {got} does not match {chunk.digest}")
        return data


def _span_pieces(toc_json: bytes) -> dict[int, list[tuple[int, int, str]]]:
    """Span offset -> every file piece in it ``(innerOffset, chunkSize, chunkDigest)``, from
    the TOC (checked already by parse_toc: a piece that is not well-formed is left out)."""
    out: dict[int, list[tuple[int, int, str]]] = {}
    for e in _decode_json(toc_json).get("entries", ()):
        off, size, digest = e.get("offset"), e.get("chunkSize"), e.get("chunkDigest")
        if isinstance(off, int) and isinstance(size, int) and isinstance(digest, str):
            out.setdefault(off, []).append((int(e.get("innerOffset", 0)), size, digest))
    return out


def open_indexed_layer(blob: ReadAt, index_blob: bytes, *, layer: str) -> IndexedLayer:
    """Open plain gzip layer ``layer`` through its index (FormatError: a malformed index)."""
    index = parse_index(index_blob, layer=layer, size=blob.size())
    digest = "sha256:" + hashlib.sha256(index_blob).hexdigest()
    return IndexedLayer(blob, index, digest)


# -- building ---------------------------------------------------------------------------------


class _Spans(io.RawIOBase):
    """The layer's tar stream, inflated span by span with :func:`inflate_span` (so an index
    is built only if the reader can use it); ``sha`` hashes it (the diffID)."""

    def __init__(self, read_at: Callable[[int, int], bytes], points: Sequence[Checkpoint],
                 size: int, usize: int) -> None:
        self.read_at = read_at
        self.points = points
        self.size = size
        self.usize = usize
        self.i = 0
        self.buf = b""
        self.pos = 0
        self.sha = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def _next(self) -> bool:
        if self.i >= len(self.points):
            return False
        p = self.points[self.i]
        end = self.points[self.i + 1].cin if self.i + 1 < len(self.points) else self.size
        uend = self.points[self.i + 1].out if self.i + 1 < len(self.points) else self.usize
        out = inflate_span(self.read_at(p.start, end - p.start), p, uend - p.out,
                           what=f"span #{self.i}")
        if len(out) != uend - p.out:
            raise FormatError(f"span #{self.i} inflates to {len(out)} bytes, not "
                              f"{uend - p.out}: the checkpoints do not fit this gzip stream "
                              "(several members?)")
        self.sha.update(out)
        self.buf, self.pos = out, 0
        self.i += 1
        return True

    def readinto(self, b: Any) -> int:
        while self.pos >= len(self.buf):
            if not self._next():
                return 0
        n = min(len(b), len(self.buf) - self.pos)
        b[:n] = self.buf[self.pos : self.pos + n]
        self.pos += n
        return n

    def rest(self) -> None:
        """Inflate what the tar reader left (the end marker, padding) for the diffID."""
        self.pos = len(self.buf)
        while self._next():
            pass


def _pieces(outs: Sequence[int], start: int, size: int) -> Iterator[tuple[int, int, int]]:
    """``(span, offset in the file, bytes)`` of a file whose data is at ``start`` (``outs``:
    each span's first uncompressed offset)."""
    i = bisect.bisect_right(outs, start) - 1
    done = 0
    while done < size:
        span_end = outs[i + 1] if i + 1 < len(outs) else start + size
        n = min(size - done, span_end - (start + done))
        yield i, done, n
        done += n
        i += 1


def build_index(read_at: Callable[[int, int], bytes], points: Sequence[Checkpoint], *,
                layer: str, size: int, usize: int, span: int) -> tuple[bytes, str, int]:
    """Build the index blob of gzip layer ``layer`` (``size`` bytes, inflating to ``usize``)
    from its checkpoints (``coldstart.oci.gzindex`` finds them): one pass over the layer,
    each span inflated as a reader will, its tar read for the file table and every file piece
    hashed. Returns ``(index blob, diffID, files)``.

    FormatError when the layer cannot be indexed: not one gzip member, not a tar, a sparse
    file, a name twice (containerd would apply the later one; a TOC cannot say that).
    """
    stream = _Spans(read_at, points, size, usize)
    headers = HeaderLog()
    try:
        tf = tarfile.open(None, "r|", fileobj=io.BufferedReader(stream, 1 << 20),  # noqa: SIM115
                          encoding="utf-8", errors="surrogateescape", tarinfo=headers.tarinfo)
    except (tarfile.TarError, EOFError) as exc:
        raise FormatError(f"layer {layer}: not a tar stream: {exc}") from None
    entries: list[dict[str, Any]] = []
    seen: set[str] = set()
    outs = [p.out for p in points]
    with tf:
        for info in checked_members(tf, headers):
            name = normalize_name(info.name, what="tar entry")
            if name in seen:
                raise FormatError(f"layer {layer}: {name!r} appears twice (a TOC cannot say "
                                  "which one wins)")
            seen.add(name)
            if info.issparse():
                raise FormatError(f"layer {layer}: {name!r} is a sparse file")
            entry = entry_from(info, name)
            rec = entry_json(entry)
            entries.append(rec)
            if entry.type != "reg":
                continue
            fhash = hashlib.sha256()
            read = member_reader(tf, info) if entry.size else None
            first = True
            for i, off, n in _pieces(outs, info.offset_data, entry.size):
                assert read is not None
                data = read(n)
                if len(data) != n:
                    raise FormatError(f"entry {name!r}: tar data ends early")
                fhash.update(data)
                p = points[i]
                end = points[i + 1].cin if i + 1 < len(points) else size
                chunk: dict[str, Any] = rec if first else {"name": name, "type": "chunk"}
                if not first:
                    entries.append(chunk)
                first = False
                chunk.update({"offset": p.start, "endOffset": end, "chunkOffset": off,
                              "chunkSize": n,
                              "chunkDigest": "sha256:" + hashlib.sha256(data).hexdigest()})
                if info.offset_data + off - p.out:
                    chunk["innerOffset"] = info.offset_data + off - p.out
            rec["digest"] = "sha256:" + fhash.hexdigest()
    stream.rest()
    diff_id = "sha256:" + stream.sha.hexdigest()
    toc_json = encode_toc(entries)
    blob = encode_index(layer=layer, size=size, uncompressed_size=usize, diff_id=diff_id,
                        span=span, checkpoints=points, toc_json=toc_json)
    return blob, diff_id, len(seen)
