"""Open a seekable layer (eStargz or zstd:chunked) through range reads and read its files.

Trust chain: the manifest's layer annotation names the TOC digest; :func:`open_layer` refuses a
TOC that does not match it, and every chunk read afterwards is checked against the chunk digest
that the verified TOC holds. Nothing unverified comes out of :meth:`SeekableLayer.decode_chunk`.
"""

from __future__ import annotations

import bisect
import hashlib
import re
import struct
from collections.abc import Mapping

from coldstart.errors import FailedPrecondition, FormatError, IntegrityError, NotFound
from coldstart.format.codec import gunzip_member, unzstd_frame
from coldstart.format.footer import SKIPPABLE_MAGIC, Footer, parse_footer
from coldstart.format.readat import ReadAt
from coldstart.format.toc import TOC, Chunk, Entry
from coldstart.format.tocjson import MAX_TOC_SIZE, parse_toc

__all__ = [
    "ESTARGZ_TOC_DIGEST",
    "ESTARGZ_UNCOMPRESSED_SIZE",
    "MEDIA_TYPE_GZIP",
    "MEDIA_TYPE_ZSTD",
    "TAIL_READ",
    "ZSTD_CHUNKED_MANIFEST_CHECKSUM",
    "ZSTD_CHUNKED_MANIFEST_POSITION",
    "ZSTD_CHUNKED_TARSPLIT_POSITION",
    "SeekableLayer",
    "is_seekable",
    "open_layer",
]

ESTARGZ_TOC_DIGEST = "containerd.io/snapshot/stargz/toc.digest"
ESTARGZ_UNCOMPRESSED_SIZE = "io.containers.estargz.uncompressed-size"
ZSTD_CHUNKED_MANIFEST_CHECKSUM = "io.github.containers.zstd-chunked.manifest-checksum"
ZSTD_CHUNKED_MANIFEST_POSITION = "io.github.containers.zstd-chunked.manifest-position"
ZSTD_CHUNKED_TARSPLIT_POSITION = "io.github.containers.zstd-chunked.tarsplit-position"
#: Older containers/storage spelled the keys without "github".
ZSTD_CHUNKED_LEGACY_CHECKSUM = "io.containers.zstd-chunked.manifest-checksum"
ZSTD_CHUNKED_LEGACY_POSITION = "io.containers.zstd-chunked.manifest-position"
_LEGACY_CHECKSUM = ZSTD_CHUNKED_LEGACY_CHECKSUM
_LEGACY_POSITION = ZSTD_CHUNKED_LEGACY_POSITION

MEDIA_TYPE_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
MEDIA_TYPE_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
_SEEKABLE_MEDIA = {
    MEDIA_TYPE_GZIP,
    MEDIA_TYPE_ZSTD,
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
}
#: One read of the blob's end usually holds footer and TOC together.
TAIL_READ = 512 << 10
_ESTARGZ_TOC_NAME = "stargz.index.json"
#: Largest chunk decode_chunk materializes (our writer caps chunks at 1 GiB; ctr-remote and
#: containers/storage write MiB-sized ones). A TOC declaring more is refused, not trusted.
MAX_DECODE = 1 << 30
MAX_ZERO_CHUNK = MAX_DECODE


def _position(annotations: Mapping[str, str]) -> str | None:
    """The zstd:chunked TOC position annotation (either spelling)."""
    return annotations.get(ZSTD_CHUNKED_MANIFEST_POSITION) or annotations.get(_LEGACY_POSITION)


def _zstd_checksum(annotations: Mapping[str, str]) -> str | None:
    return annotations.get(ZSTD_CHUNKED_MANIFEST_CHECKSUM) or annotations.get(_LEGACY_CHECKSUM)


def _ambiguous(annotations: Mapping[str, str]) -> bool:
    # containers/storage refuses a layer with both its TOC key and eStargz's. stargz-snapshotter's
    # own zstd:chunked output carries eStargz's key with the older, github-less zstd key: that
    # pair describes one TOC (both digests are checked), so it is accepted.
    return ESTARGZ_TOC_DIGEST in annotations and ZSTD_CHUNKED_MANIFEST_CHECKSUM in annotations


def is_seekable(annotations: Mapping[str, str], media_type: str) -> bool:
    """True when a layer's descriptor says it is a verifiable eStargz or zstd:chunked layer.

    Cheap: looks only at the annotations and media type (no blob read). A layer carrying both
    formats' TOC annotations is not seekable (it is ambiguous, and containers/storage refuses it).

    >>> is_seekable({ESTARGZ_TOC_DIGEST: "sha256:" + "0" * 64}, MEDIA_TYPE_GZIP)
    True
    """
    if _ambiguous(annotations):
        return False
    if _zstd_checksum(annotations) is not None:
        return media_type == MEDIA_TYPE_ZSTD
    return ESTARGZ_TOC_DIGEST in annotations and media_type in _SEEKABLE_MEDIA


class SeekableLayer:
    """An opened layer: its verified TOC, and chunk decoding that verifies every chunk.

    Thread-safe: decoding shares no mutable state.
    """

    #: whether decoding one chunk of a compressed range gives the other chunks sharing that
    #: range (:meth:`spread`; the first time that range is decoded): a fill then asks for
    #: one chunk per range first
    spreads = False
    #: compressed ranges ``[start, end)`` of the start-up set the layer's own metadata names
    #: apart from its order (an indexed gzip layer's index); empty: none
    prefetch_ranges: tuple[tuple[int, int], ...] = ()
    #: whether ``toc.prefetch`` is such a set (its files lie where the blob's producer put
    #: them), not the files before a prefetch landmark
    prefetch_named_apart = False

    def __init__(self, blob: ReadAt, toc: TOC, toc_digest: str, *, footer: Footer,
                 toc_offset: int, verified: bool) -> None:
        self.blob = blob
        self.format = toc.format
        self.toc = toc
        self.toc_digest = toc_digest
        self.footer = footer
        #: Compressed offset where the data area ends (the TOC starts).
        self.toc_offset = toc_offset
        self.verified = verified
        #: each TOC annotation key the open checked, and the digest it found for it (the
        #: eStargz key names the TOC JSON's digest, the zstd:chunked keys the compressed TOC's:
        #: a layer may carry both)
        self.toc_claims: dict[str, str] = {}
        self._gzip = toc.format == "estargz"

    # -- mapping ----------------------------------------------------------------------------

    def resolve(self, name: str) -> Entry:
        """The entry for ``name``, following a hardlink to its target; NotFound if absent."""
        entry = self.toc.entries.get(name)
        seen = 0
        while entry is not None and entry.type == "hardlink":
            seen += 1
            if seen > 64:
                raise FormatError(f"hardlink {name!r}: too many levels of hardlinks")
            entry = self.toc.entries.get(entry.link_name)
        if entry is None:
            raise NotFound(f"{name!r} is not in the layer")
        return entry

    def chunks_for(self, entry: Entry, offset: int, length: int) -> list[Chunk]:
        """The chunks of ``entry`` that hold bytes ``[offset, offset+length)`` (clamped to size)."""
        if offset < 0 or length < 0:
            raise FormatError(f"entry {entry.name!r}: bad range {offset}+{length}")
        end = min(entry.size, offset + length)
        if offset >= end or not entry.chunks:
            return []
        starts = [c.chunk_offset for c in entry.chunks]
        i = bisect.bisect_right(starts, offset) - 1
        out: list[Chunk] = []
        while i < len(entry.chunks) and entry.chunks[i].chunk_offset < end:
            out.append(entry.chunks[i])
            i += 1
        return out

    # -- decoding ---------------------------------------------------------------------------

    def decode_chunk(self, chunk: Chunk, compressed: bytes | memoryview, *,
                     upto: int | None = None) -> bytes:
        """Decompress ``blob[chunk.offset:chunk.end_offset]`` and verify it: ``chunk_size`` bytes.

        Raises IntegrityError (wrong digest) or FormatError (corrupt, short, or a frame that
        holds more than its declared size), each naming the entry and chunk. ``upto``: the
        decompressed bytes of the range the caller needs at most (its chunks' ends): a layer
        that decodes whole ranges shared by many chunks (:attr:`spreads`) may stop there,
        and then spreads nothing until the range is decoded whole (:meth:`spread_from`).
        """
        owner = chunk.owner or "?"
        what = f"entry {owner!r} chunk at {chunk.chunk_offset} (+{chunk.chunk_size})"
        if chunk.inner_offset + chunk.chunk_size > MAX_DECODE:
            raise FormatError(f"{what}: chunk needs {chunk.inner_offset + chunk.chunk_size} "
                              f"decompressed bytes, over the {MAX_DECODE} byte limit")
        if chunk.zeros:
            if chunk.chunk_size > MAX_ZERO_CHUNK:
                raise FormatError(f"{what}: zero chunk too large to materialize")
            data = bytes(chunk.chunk_size)
        else:
            if len(compressed) != chunk.end_offset - chunk.offset:
                raise FormatError(f"{what}: got {len(compressed)} compressed bytes, "
                                  f"expected {chunk.end_offset - chunk.offset}")
            need = chunk.inner_offset + chunk.chunk_size
            inflate = gunzip_member if self._gzip else unzstd_frame
            out, more = inflate(compressed, need, what=what)
            if len(out) < need:
                raise FormatError(f"{what}: decompresses to {len(out)} bytes, fewer than "
                                  f"the {need} declared")
            if more and chunk.exact:
                raise FormatError(f"{what}: decompresses past its declared size")
            data = out[chunk.inner_offset :] if chunk.inner_offset else out
        if chunk.digest:
            got = "sha256:" + hashlib.sha256(data).hexdigest()
            if got != chunk.digest:
                raise IntegrityError(f"{what}: digest {got} does not match {chunk.digest}")
        return data

    def chunk_failed(self, chunk: Chunk, exc: BaseException) -> None:
        """Told when ``chunk`` failed to decode or verify for good (after any refetch)."""

    def spread(self, chunk: Chunk) -> list[tuple[str, bytes]]:
        """Other chunks' verified bytes that decoding ``chunk`` produced: ``(digest, bytes)``
        for the cache (none here: a gzip member or zstd frame holds one chunk)."""
        return []

    def spread_from(self, chunk: Chunk, compressed: bytes) -> list[tuple[str, bytes]]:
        """:meth:`spread` for a range decoded before only in part (``upto``) or not kept:
        ``compressed`` (the range's bytes, fetched before) is decoded whole again if needed."""
        return []

    def read_chunks(self, chunks: list[Chunk]) -> list[bytes]:
        """Fetch (coalescing adjacent ranges into one read) and decode ``chunks``."""
        out: list[bytes] = []
        i = 0
        while i < len(chunks):
            c = chunks[i]
            if c.zeros:
                out.append(self.decode_chunk(c, b""))
                i += 1
                continue
            j = i + 1
            start, end = c.offset, c.end_offset
            while j < len(chunks) and not chunks[j].zeros and chunks[j].offset in (end, start):
                end = max(end, chunks[j].end_offset)
                j += 1
            raw = self.blob.read_at(start, end - start)
            for k in range(i, j):
                ck = chunks[k]
                out.append(self.decode_chunk(ck, raw[ck.offset - start : ck.end_offset - start]))
            i = j
        return out

    def read_file(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes ``[offset, offset+length)`` of regular file ``name`` (hardlinks followed).

        Reading a whole file also checks the file's digest when the TOC has one.
        """
        entry = self.resolve(name)
        if entry.type != "reg":
            raise FormatError(f"entry {name!r} is a {entry.type}, not a regular file")
        if length is None:
            length = max(0, entry.size - offset)
        end = min(entry.size, offset + length)
        chunks = self.chunks_for(entry, offset, length)
        result = b""
        if chunks:
            data = b"".join(self.read_chunks(chunks))
            base = chunks[0].chunk_offset
            result = data[offset - base : end - base]
        # an empty file too: a TOC that gives it the digest of some content is lying
        if offset == 0 and end == entry.size and entry.digest:
            got = "sha256:" + hashlib.sha256(result).hexdigest()
            if got != entry.digest:
                raise IntegrityError(f"entry {name!r}: file digest {got} does not match "
                                     f"{entry.digest}")
        return result


# -- opening ------------------------------------------------------------------------------------


class _Tail:
    """The blob's last bytes, read once; ranges inside it cost no further request."""

    def __init__(self, blob: ReadAt, tail_read: int, size: int) -> None:
        self.blob = blob
        self.size = size
        self.start = max(0, self.size - tail_read)
        self.data = blob.read_at(self.start, self.size - self.start)

    def read(self, offset: int, length: int, *, what: str) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise FormatError(f"{what} at {offset}+{length} is outside the blob "
                              f"({self.size} bytes)")
        if offset >= self.start:
            return self.data[offset - self.start : offset - self.start + length]
        head_len = min(length, self.start - offset)
        head = self.blob.read_at(offset, head_len)
        rest = length - head_len
        return head + self.data[:rest]


def _parse_position(value: str, fields: int, key: str) -> tuple[int, ...]:
    parts = value.split(":")
    # ASCII digits, as many as a uint64 has: str.isdigit() also takes "²", which int() refuses,
    # and int() refuses more than 4300 digits
    if len(parts) != fields or not all(_UINT64.fullmatch(p) for p in parts):
        raise FormatError(f"annotation {key}={value!r:.80} is not {fields} ':'-separated numbers")
    return tuple(int(p) for p in parts)


_UINT64 = re.compile(r"[0-9]{1,20}")


def _estargz_toc(tail: _Tail, footer: Footer) -> tuple[bytes, int]:
    end = tail.size - footer.size
    if not 0 <= footer.toc_offset < end:
        raise FormatError(f"eStargz footer: TOC offset {footer.toc_offset} is outside the blob")
    if end - footer.toc_offset > MAX_TOC_SIZE:
        raise FormatError(f"eStargz TOC is {end - footer.toc_offset} compressed bytes, over "
                          f"the {MAX_TOC_SIZE} byte limit")
    member = tail.read(footer.toc_offset, end - footer.toc_offset, what="eStargz TOC")
    tar, _ = gunzip_member(member, MAX_TOC_SIZE + (64 << 10), what="eStargz TOC")
    pos = 0
    while pos + 512 <= len(tar):
        hdr = tar[pos : pos + 512]
        if hdr == bytes(512):
            break
        name = hdr[:100].split(b"\0", 1)[0]
        size = _tar_size(hdr[124:136])
        body = tar[pos + 512 : pos + 512 + size]
        if len(body) != size:
            raise FormatError(f"eStargz TOC entry {name!r} is truncated")
        if hdr[156:157] in (b"x", b"g"):
            pos += 512 + (size + 511) // 512 * 512
            continue
        if name != _ESTARGZ_TOC_NAME.encode():
            raise FormatError(f"eStargz TOC member holds {name!r}, not {_ESTARGZ_TOC_NAME}")
        return body, footer.toc_offset
    raise FormatError(f"eStargz TOC member holds no {_ESTARGZ_TOC_NAME}")


def _tar_size(field: bytes) -> int:
    if field[:1] and field[0] & 0x80:
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\0", 1)[0].strip(b" ")
    try:
        return int(text or b"0", 8)
    except ValueError:
        raise FormatError(f"tar header size field {field!r} is not octal") from None


def _zstd_toc(tail: _Tail, footer: Footer,
              annotations: Mapping[str, str]) -> tuple[bytes, bytes, int]:
    offset, length, ulength = footer.toc_offset, footer.toc_length, footer.toc_uncompressed
    pos = _position(annotations)
    if pos is not None:
        a = _parse_position(pos, 4, ZSTD_CHUNKED_MANIFEST_POSITION)
        if (a[0], a[1], a[2]) != (offset, length, ulength):
            raise FormatError(f"manifest-position annotation {pos!r} disagrees with the footer "
                              f"({offset}:{length}:{ulength})")
    if length > MAX_TOC_SIZE or ulength > MAX_TOC_SIZE:
        raise FormatError(f"zstd:chunked TOC is {length} bytes ({ulength} uncompressed), over "
                          f"the {MAX_TOC_SIZE} byte limit")
    limit = tail.size - footer.size
    # stargz-snapshotter's footer points at the skippable frame; containers/storage's at its
    # payload. Tell them apart by the frame magic.
    if not 8 <= offset <= limit:
        raise FormatError(f"zstd:chunked TOC offset {offset} is outside the blob")
    # One read covers either layout (8 bytes more than the TOC, where the blob has them).
    raw = tail.read(offset, min(length + 8, limit - offset), what="zstd:chunked TOC")
    frame_start = offset - 8
    if raw[:4] == SKIPPABLE_MAGIC and len(raw) >= 8 + length:
        (plen,) = struct.unpack("<I", raw[4:8])
        if plen != length:
            raise FormatError(f"zstd:chunked TOC frame holds {plen} bytes, footer says {length}")
        frame_start, offset = offset, offset + 8
        raw = raw[8:]
    if offset + length > limit:
        raise FormatError(f"zstd:chunked TOC at {offset}+{length} is outside the blob")
    compressed = raw[:length]
    data, more = unzstd_frame(compressed, ulength, what="zstd:chunked TOC")
    if len(data) != ulength or more:
        raise FormatError(f"zstd:chunked TOC decompresses to {len(data)}{'+' if more else ''} "
                          f"bytes, footer says {ulength}")
    return data, compressed, frame_start


def _tail_read(size: int, annotations: Mapping[str, str], tail_read: int) -> int:
    """How many of the blob's last bytes to read at once: ``tail_read``, or, for a
    zstd:chunked layer (its TOC checksum annotated), from where its position annotation puts
    the TOC to the end, so that footer and TOC come in one request however large the TOC
    (containers/storage's layout puts the tar-split after the TOC: it comes along, as it did
    in the second read before). The annotation only sizes this read: the footer still says
    where the TOC is, and :func:`_zstd_toc` refuses an annotation that disagrees; a lying one
    costs at most ``MAX_TOC_SIZE`` more bytes read, as a lying footer can."""
    if _zstd_checksum(annotations) is None or ESTARGZ_TOC_DIGEST in annotations:
        return tail_read
    pos = _position(annotations)
    if pos is None:
        return tail_read
    try:
        offset = _parse_position(pos, 4, ZSTD_CHUNKED_MANIFEST_POSITION)[0]
    except FormatError:
        return tail_read        # refused with its reason once the footer is read
    return min(max(tail_read, size - offset), tail_read + MAX_TOC_SIZE)


def open_layer(blob: ReadAt, *, annotations: Mapping[str, str],
               allow_unverified: bool = False, tail_read: int = TAIL_READ) -> SeekableLayer:
    """Open an eStargz or zstd:chunked layer: read footer and TOC, verify, index.

    One range read of the last ``tail_read`` bytes suffices when the TOC fits in it; a bigger
    TOC costs one more, unless a zstd:chunked position annotation says where it starts. The
    TOC must match the manifest annotation (eStargz ``toc.digest``: digest of the TOC JSON;
    zstd:chunked ``manifest-checksum``: digest of the compressed TOC) or IntegrityError is
    raised; with no such annotation, FailedPrecondition, unless ``allow_unverified``.

    >>> layer = open_layer(FileReadAt("blob"), annotations=desc.annotations)  # doctest: +SKIP
    >>> layer.read_file("etc/hostname")  # doctest: +SKIP
    """
    estargz_digest = annotations.get(ESTARGZ_TOC_DIGEST)
    zstd_checksum = _zstd_checksum(annotations)
    if _ambiguous(annotations):
        raise FormatError("layer carries both eStargz and zstd:chunked TOC annotations")
    if estargz_digest is None and zstd_checksum is None and not allow_unverified:
        raise FailedPrecondition("layer has no TOC digest annotation: cannot verify its TOC")
    size = blob.size()
    tail = _Tail(blob, _tail_read(size, annotations, tail_read), size)
    footer = parse_footer(tail.data)
    if footer.format == "estargz":
        if zstd_checksum is not None:
            raise FormatError("zstd:chunked annotations on an eStargz (gzip) blob")
        toc_json, data_end = _estargz_toc(tail, footer)
        compressed_toc = b""
        exact = False
    else:
        toc_json, compressed_toc, data_end = _zstd_toc(tail, footer, annotations)
        exact = not footer.legacy
    if estargz_digest is not None:
        json_digest = "sha256:" + hashlib.sha256(toc_json).hexdigest()
        if json_digest != estargz_digest:
            raise IntegrityError(f"TOC digest {json_digest} does not match the annotation "
                                 f"{ESTARGZ_TOC_DIGEST}={estargz_digest}")
        toc_digest = json_digest
    if zstd_checksum is not None:
        got = "sha256:" + hashlib.sha256(compressed_toc).hexdigest()
        if got != zstd_checksum:
            raise IntegrityError(f"TOC checksum {got} does not match the annotation "
                                 f"{ZSTD_CHUNKED_MANIFEST_CHECKSUM}={zstd_checksum}")
        if estargz_digest is None:
            toc_digest = got
    if estargz_digest is None and zstd_checksum is None:
        toc_digest = "sha256:" + hashlib.sha256(toc_json).hexdigest()
    toc = parse_toc(toc_json, format=footer.format, data_end=data_end, exact_frames=exact)
    layer = SeekableLayer(blob, toc, toc_digest, footer=footer, toc_offset=data_end,
                          verified=estargz_digest is not None or zstd_checksum is not None)
    if estargz_digest is not None:
        layer.toc_claims[ESTARGZ_TOC_DIGEST] = estargz_digest
    if zstd_checksum is not None:
        layer.toc_claims.update({ZSTD_CHUNKED_MANIFEST_CHECKSUM: zstd_checksum,
                                 _LEGACY_CHECKSUM: zstd_checksum})
    return layer
