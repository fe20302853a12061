"""Untrusted blobs and TOCs: every lie is a FormatError/IntegrityError that names the entry."""

from __future__ import annotations

import collections
import copy
import io
import random
import struct
import tarfile
from typing import Any

import pytest
import zstandard

from coldstart.errors import (
    FailedPrecondition,
    FormatError,
    IntegrityError,
    InvalidArgument,
)
from coldstart.format import BytesReadAt, convert_layer, is_seekable, open_layer
from coldstart.format.footer import skippable_frame, zstd_chunked_footer
from coldstart.format.layer import (
    ESTARGZ_TOC_DIGEST,
    MEDIA_TYPE_GZIP,
    MEDIA_TYPE_ZSTD,
    ZSTD_CHUNKED_MANIFEST_CHECKSUM,
)
from coldstart.format.toc import normalize_name
from tests.unit.format.layers import FORMATS, Converted, add, convert, toc_doc, with_toc

DATA = bytes(range(256)) * 200  # 51,200 bytes, 7 chunks of 8 KiB


def small_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        add(tf, "dir/", type=tarfile.DIRTYPE, mode=0o755)
        add(tf, "dir/file", DATA)
        add(tf, "dir/small", b"small")
    return buf.getvalue()


@pytest.fixture(scope="module", params=FORMATS)
def layer(request: pytest.FixtureRequest) -> Converted:
    return convert(small_tar(), request.param, chunk_size=8192)


def reopen(blob: bytes, annotations: dict[str, str]) -> Any:
    return open_layer(BytesReadAt(blob), annotations=annotations)


def entry(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return next(e for e in doc["entries"] if e["name"] == name)


# -- the annotations and the TOC digest -------------------------------------------------------


def test_wrong_toc_digest_is_refused(layer: Converted) -> None:
    ann = {k: "sha256:" + "0" * 64 if "digest" in k or "checksum" in k else v
           for k, v in layer.result.annotations.items()}
    with pytest.raises(IntegrityError, match="does not match"):
        reopen(layer.blob, ann)


def test_no_digest_annotation_needs_explicit_permission(layer: Converted) -> None:
    with pytest.raises(FailedPrecondition):
        reopen(layer.blob, {})
    opened = open_layer(BytesReadAt(layer.blob), annotations={}, allow_unverified=True)
    assert not opened.verified and opened.read_file("dir/file") == DATA


def test_both_formats_annotations_are_refused(layer: Converted) -> None:
    ann = {ESTARGZ_TOC_DIGEST: layer.result.toc_digest,
           ZSTD_CHUNKED_MANIFEST_CHECKSUM: layer.result.toc_digest}
    with pytest.raises(FormatError, match="both"):
        reopen(layer.blob, ann)
    assert not is_seekable(ann, MEDIA_TYPE_ZSTD)


def test_is_seekable() -> None:
    d = "sha256:" + "1" * 64
    assert is_seekable({ESTARGZ_TOC_DIGEST: d}, MEDIA_TYPE_GZIP)
    assert is_seekable({ZSTD_CHUNKED_MANIFEST_CHECKSUM: d}, MEDIA_TYPE_ZSTD)
    assert not is_seekable({ZSTD_CHUNKED_MANIFEST_CHECKSUM: d}, MEDIA_TYPE_GZIP)
    assert not is_seekable({}, MEDIA_TYPE_GZIP)
    assert not is_seekable({ESTARGZ_TOC_DIGEST: d}, "application/vnd.oci.image.layer.v1.tar")


# -- corrupted and truncated blobs -------------------------------------------------------------


def test_corrupt_chunk_bytes_name_the_entry(layer: Converted) -> None:
    chunk = layer.layer.toc.entries["dir/file"].chunks[3]
    raw = bytearray(layer.blob[chunk.offset : chunk.end_offset])
    raw[len(raw) // 2] ^= 0xFF
    with pytest.raises((IntegrityError, FormatError), match="'dir/file' chunk at 24576"):
        layer.layer.decode_chunk(chunk, bytes(raw))
    with pytest.raises(FormatError, match="'dir/file'"):
        layer.layer.decode_chunk(chunk, bytes(raw[:-1]))


def test_wrong_chunk_digest_in_a_signed_toc(layer: Converted) -> None:
    """Valid compressed data, but not what the (verified) TOC says: IntegrityError."""
    bad = "sha256:" + "ab" * 32
    blob, ann = lie(layer, lambda d: entry(d, "dir/small").update(chunkDigest=bad))
    opened = reopen(blob, ann)
    with pytest.raises(IntegrityError, match="'dir/small' chunk at 0"):
        opened.read_file("dir/small")
    blob, ann = lie(layer, lambda d: entry(d, "dir/small").update(digest="sha256:" + "ab" * 32))
    with pytest.raises(IntegrityError, match="'dir/small': file digest"):
        reopen(blob, ann).read_file("dir/small")


def test_truncated_blob_fails_cleanly(layer: Converted) -> None:
    for cut in (1, 10, 51, 72, 200, len(layer.blob) // 2, len(layer.blob) - 1):
        with pytest.raises(FormatError):
            reopen(layer.blob[: len(layer.blob) - cut], layer.result.annotations)
    with pytest.raises(FormatError):
        reopen(b"", layer.result.annotations)


def test_random_corruption_never_raises_anything_else(layer: Converted) -> None:
    """Random bytes overwritten anywhere: opening refuses the blob, or the (verified) TOC is
    the original and each file reads back right or fails; never anything else, never wrong
    bytes."""
    clean = reopen(layer.blob, layer.result.annotations)
    want = {n: clean.read_file(n) for n, e in clean.toc.entries.items() if e.type == "reg"}
    assert want["dir/file"] == DATA and want["dir/small"] == b"small"
    rng = random.Random(1234)
    outcomes: collections.Counter[str] = collections.Counter()
    for _ in range(150):
        blob = bytearray(layer.blob)
        for _ in range(rng.randint(1, 4)):
            blob[rng.randrange(len(blob))] = rng.randrange(256)
        try:
            opened = open_layer(BytesReadAt(bytes(blob)), annotations=layer.result.annotations,
                                allow_unverified=True)
        except (FormatError, IntegrityError):
            outcomes["refused"] += 1
            continue
        assert opened.toc.entries.keys() == clean.toc.entries.keys()
        for name, data in want.items():
            try:
                got = opened.read_file(name)
            except (FormatError, IntegrityError):
                outcomes["read failed"] += 1
                continue
            assert got == data, name
            outcomes["read"] += 1
    # the seed hits the TOC and footer, the chunks, and bytes no read needs
    assert outcomes["refused"] and outcomes["read failed"] and outcomes["read"], outcomes


# -- lying TOCs (re-signed, so only the structural checks can catch them) ----------------------


def lie(layer: Converted, mutate: Any) -> tuple[bytes, dict[str, str]]:
    doc = copy.deepcopy(toc_doc(layer))
    mutate(doc)
    return with_toc(layer, doc)


def test_resigned_but_honest_toc_opens(layer: Converted) -> None:
    blob, ann = lie(layer, lambda d: None)
    assert reopen(blob, ann).read_file("dir/file") == DATA


@pytest.mark.parametrize("name", ["/etc/passwd", "../escape", "a/../../b", "a/\x00b"])
def test_escaping_names(layer: Converted, name: str) -> None:
    blob, ann = lie(layer, lambda d: entry(d, "dir/small").update(name=name))
    with pytest.raises(FormatError, match="name"):
        reopen(blob, ann)


def test_duplicate_entry(layer: Converted) -> None:
    blob, ann = lie(layer, lambda d: d["entries"].append(copy.deepcopy(entry(d, "dir/small"))))
    with pytest.raises(FormatError, match="'dir/small' appears twice"):
        reopen(blob, ann)


def test_chunk_outside_the_blob(layer: Converted) -> None:
    blob, ann = lie(layer, lambda d: entry(d, "dir/small").update(offset=10**12))
    with pytest.raises(FormatError, match=r"'dir/small'.*outside"):
        reopen(blob, ann)


def test_sizes_that_do_not_add_up(layer: Converted) -> None:
    blob, ann = lie(layer, lambda d: entry(d, "dir/file").update(size=len(DATA) + 5))
    with pytest.raises(FormatError, match="'dir/file'"):
        reopen(blob, ann)
    blob, ann = lie(layer, lambda d: entry(d, "dir/file").update(chunkSize=100))
    with pytest.raises(FormatError, match=r"'dir/file'.*do not add up"):
        reopen(blob, ann)


def test_missing_chunk_digest(layer: Converted) -> None:
    blob, ann = lie(layer, lambda d: entry(d, "dir/small").pop("chunkDigest"))
    with pytest.raises(FormatError, match=r"'dir/small'.*chunkDigest"):
        reopen(blob, ann)


def test_wrong_types_in_toc(layer: Converted) -> None:
    for field, value in [("size", "12"), ("size", -1), ("mode", True), ("modtime", "yesterday"),
                         ("type", "socket"), ("xattrs", {"user.x": "@@"})]:
        blob, ann = lie(layer, lambda d, f=field, v=value: entry(d, "dir/small").update({f: v}))
        with pytest.raises(FormatError, match="dir/small"):
            reopen(blob, ann)


def test_hardlink_to_nowhere(layer: Converted) -> None:
    def mutate(d: dict[str, Any]) -> None:
        d["entries"].append({"name": "dir/ln", "type": "hardlink", "linkName": "nope"})
    blob, ann = lie(layer, mutate)
    with pytest.raises(FormatError, match="'dir/ln'"):
        reopen(blob, ann)


def test_toc_not_json(layer: Converted) -> None:
    blob, ann = with_toc(layer, b"{not json")
    with pytest.raises(FormatError, match="JSON"):
        reopen(blob, ann)


def test_chunk_that_claims_less_than_its_frame_holds() -> None:
    """A zstd:chunked frame holding more than the chunk it is declared as is refused."""
    c = convert(small_tar(), "zstd:chunked", chunk_size=8192)

    def mutate(d: dict[str, Any]) -> None:
        e = entry(d, "dir/file")
        # Pretend the file is only 100 bytes: its first frame holds 8192.
        e["size"] = 100
        e["chunkSize"] = 100
        d["entries"] = [x for x in d["entries"] if not (x["name"] == "dir/file"
                                                        and x["type"] == "chunk")]
    blob, ann = lie(c, mutate)
    opened = reopen(blob, ann)
    with pytest.raises(FormatError, match=r"'dir/file'.*past its declared size"):
        opened.read_file("dir/file")


def test_decompression_bomb_is_capped() -> None:
    """A tiny frame that inflates to 1 GiB is never inflated past the declared chunk size."""
    c = convert(small_tar(), "zstd:chunked", chunk_size=8192)
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(1 << 30))
    data = c.blob[: c.layer.toc_offset]
    start = len(data)
    data += bomb

    def mutate(d: dict[str, Any]) -> None:
        e = entry(d, "dir/small")
        e.update(offset=start, endOffset=start + len(bomb), size=10, chunkSize=10)
    doc = copy.deepcopy(toc_doc(c))
    mutate(doc)
    blob, ann = with_toc(c, doc, data)
    opened = reopen(blob, ann)
    with pytest.raises(FormatError, match=r"'dir/small'.*past its declared size"):
        opened.read_file("dir/small")


def test_toc_over_150_mib_is_refused_without_reading_it(layer: Converted) -> None:
    if layer.layer.format != "zstd:chunked":
        pytest.skip("zstd:chunked only: its footer declares the TOC size; an eStargz footer "
                    "holds only the TOC offset, so there is no size to lie about")
    body = layer.blob[: layer.layer.toc_offset]
    blob = body + skippable_frame(b"x" * 10) + zstd_chunked_footer(
        len(body) + 8, 151 << 20, 151 << 20, 0, 0, 0)
    with pytest.raises(FormatError, match="over the"):
        open_layer(BytesReadAt(blob), annotations={}, allow_unverified=True)


def test_lying_footer_offsets(layer: Converted) -> None:
    if layer.layer.format == "zstd:chunked":
        body = layer.blob[: layer.layer.toc_offset]
        for off, ln, uln in [(2**63, 10, 10), (len(body) + 8, 10**9, 10), (0, 0, 0)]:
            blob = body + skippable_frame(b"x" * 10) + zstd_chunked_footer(off, ln, uln, 0, 0, 0)
            with pytest.raises(FormatError):
                open_layer(BytesReadAt(blob), annotations={}, allow_unverified=True)
    else:
        from coldstart.format.footer import estargz_footer
        body = layer.blob[:-51]
        for off in (len(body) + 5, 2**60, 0):
            with pytest.raises(FormatError):
                open_layer(BytesReadAt(body + estargz_footer(off)), annotations={},
                           allow_unverified=True)


def test_legacy_estargz_footer_is_read(layer: Converted) -> None:
    if layer.layer.format != "estargz":
        pytest.skip("eStargz only: the 47-byte legacy footer is an eStargz variant; "
                    "zstd:chunked has none")
    off = layer.layer.toc_offset
    payload = b"%016xSTARGZ" % off
    legacy = (b"\x1f\x8b\x08\x04" + bytes(4) + b"\x00\xff" + struct.pack("<H", 22) + payload
              + b"\x01\x00\x00\xff\xff" + bytes(8))
    assert len(legacy) == 47
    opened = reopen(layer.blob[:-51] + legacy, layer.result.annotations)
    assert opened.footer.legacy and opened.read_file("dir/file") == DATA


# -- the writer's input -------------------------------------------------------------------------


def _tar(*names: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for n in names:
            add(tf, n, b"x")
    return buf.getvalue()


@pytest.mark.parametrize("names,match", [
    (("a", "./a"), "'a' appears twice"),
    (("/abs",), "absolute"),
    (("x/../../etc",), r"'\.\.'"),
])
def test_writer_refuses_bad_entries(names: tuple[str, ...], match: str) -> None:
    with pytest.raises(FormatError, match=match):
        convert_layer(io.BytesIO(_tar(*names)), io.BytesIO())


def test_writer_refuses_truncated_or_garbage_input() -> None:
    tar = small_tar()
    z = zstandard.ZstdCompressor().compress(tar)
    no_end = tar.rstrip(b"\0")
    no_end += bytes(-len(no_end) % 512)  # cut exactly at a member boundary
    for bad in (tar[:3000], b"\x1f\x8b" + b"garbage" * 10, z[: len(z) // 2],
                b"not a tar at all" * 100, no_end, zstandard.ZstdCompressor().compress(no_end)):
        with pytest.raises(FormatError):
            convert_layer(io.BytesIO(bad), io.BytesIO())


def test_writer_arguments() -> None:
    with pytest.raises(InvalidArgument):
        convert_layer(io.BytesIO(small_tar()), io.BytesIO(), format="squashfs")
    with pytest.raises(InvalidArgument):
        convert_layer(io.BytesIO(small_tar()), io.BytesIO(), chunk_size=10)
    with pytest.raises(InvalidArgument, match="not in the layer"):
        convert_layer(io.BytesIO(small_tar()), io.BytesIO(), prefetch=["nope"])


def test_normalize_name() -> None:
    assert normalize_name("./a//b/./c/") == "a/b/c"
    assert normalize_name(".") == "" and normalize_name("./") == ""


def test_writer_refuses_entries_a_reader_would_refuse() -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        add(tf, "f", b"1")
        add(tf, "f/child", b"2")
    with pytest.raises(FormatError, match="'f/child': parent 'f' is a reg"):
        convert_layer(io.BytesIO(buf.getvalue()), io.BytesIO())
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        add(tf, "d/child", b"2")
        add(tf, "d", b"1")
    with pytest.raises(FormatError, match="'d' is a reg but other entries lie below it"):
        convert_layer(io.BytesIO(buf.getvalue()), io.BytesIO())
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        add(tf, "link", type=tarfile.LNKTYPE, link="later")
        add(tf, "later", b"1")
    with pytest.raises(FormatError, match="hardlink 'link'"):
        convert_layer(io.BytesIO(buf.getvalue()), io.BytesIO())


def test_chunk_declared_over_the_decode_limit(layer: Converted) -> None:
    """A signed TOC that declares a 2 GiB chunk over a small frame is refused before inflating."""
    def mutate(d: dict[str, Any]) -> None:
        e = entry(d, "dir/small")
        e.update(size=2 << 30, chunkSize=0)
        e.pop("digest", None)
    blob, ann = lie(layer, mutate)
    opened = reopen(blob, ann)
    with pytest.raises(FormatError, match=r"'dir/small'.*over the \d+ byte limit"):
        opened.read_file("dir/small", 0, 10)


def test_corrupt_data_area_never_serves_wrong_bytes(layer: Converted) -> None:
    """Flip bytes in the chunk data only: every read returns the right bytes or raises."""
    rng = random.Random(99)
    want = {"dir/file": DATA, "dir/small": b"small"}
    failures = 0
    for _ in range(60):
        blob = bytearray(layer.blob)
        pos = rng.randrange(layer.layer.toc_offset)
        blob[pos] ^= 1 << rng.randrange(8)
        opened = reopen(bytes(blob), layer.result.annotations)  # the TOC is intact
        for name, data in want.items():
            for off, ln in ((0, None), (9000, 20000)):
                try:
                    got = opened.read_file(name, off, ln)
                except (IntegrityError, FormatError):
                    failures += 1
                    continue
                assert got == data[off : None if ln is None else off + ln]
    assert failures > 0
