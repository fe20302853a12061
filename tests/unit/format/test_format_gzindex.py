"""The seekable index of a plain gzip layer (coldstart.format.gzindex, coldstart.oci.gzindex):
built from real gzip streams, every file read back through it equals the tar's; a malformed
index is refused when opened; an index that describes chunks wrongly never yields their bytes."""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import tarfile
from pathlib import Path

import pytest
import zstandard

from coldstart.errors import FormatError, IntegrityError
from coldstart.format import BytesReadAt
from coldstart.format.gzindex import (
    INDEX_FORMAT,
    Checkpoint,
    encode_index,
    open_indexed_layer,
    parse_index,
)
from coldstart.oci.gzindex import find_checkpoints, index_blob_file
from tests.unit.format.layers import (
    add,
    assert_same_as_tar,
    every_kind_tar,
    raw_index,
    rewrite_index,
)

SPAN = 64 << 10


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _big_tar() -> bytes:
    """Many small files and a few large ones, over many spans (64 KiB spans)."""
    import io
    rnd = random.Random(5)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        add(tf, "./", type=tarfile.DIRTYPE, mode=0o755)
        for i in range(400):
            words = " ".join(rnd.choice(["torch", "cuda", "lib", "so", "py"])
                             for _ in range(rnd.randrange(5, 400)))
            add(tf, f"./pkg/m{i:03d}.py", words.encode())
        add(tf, "./pkg/big.bin", rnd.randbytes(300_000) + bytes(200_000))
        add(tf, "./pkg/after", b"after the big one\n")
    return buf.getvalue()


def _indexed(tmp_path: Path, tar: bytes, level: int = 6):
    blob = gzip.compress(tar, compresslevel=level, mtime=0)
    path = tmp_path / "layer.tar.gz"
    path.write_bytes(blob)
    digest = _digest(blob)
    index, diff_id, files = index_blob_file(path, layer=digest, span=SPAN)
    return blob, digest, index, diff_id, files


@pytest.mark.parametrize("tar_of", ["every-kind", "big"])
def test_every_file_reads_back_through_the_index(tmp_path: Path, tar_of: str) -> None:
    tar = every_kind_tar(portable=False) if tar_of == "every-kind" else _big_tar()
    blob, digest, index, diff_id, _ = _indexed(tmp_path, tar)
    assert diff_id == _digest(tar)
    layer = open_indexed_layer(BytesReadAt(blob), index, layer=digest)
    assert layer.format == INDEX_FORMAT
    assert_same_as_tar(layer, tar)
    if tar_of == "big":
        assert len(layer.index.checkpoints) > 5
        big = layer.toc.entries["pkg/big.bin"]
        assert len(big.chunks) > 1           # cut at the checkpoints


def test_a_multi_member_gzip_reads_back_or_is_refused(tmp_path: Path) -> None:
    # indexed_gzip puts a checkpoint where each member's deflate data starts; one dropped (too
    # close to the last) leaves a span that ends early, which the build refuses
    tar = _big_tar()
    half = len(tar) // 2
    blob = gzip.compress(tar[:half], mtime=0) + gzip.compress(tar[half:], mtime=0)
    path = tmp_path / "two.gz"
    path.write_bytes(blob)
    index, diff_id, _ = index_blob_file(path, layer=_digest(blob), span=SPAN)
    assert diff_id == _digest(tar)
    assert_same_as_tar(open_indexed_layer(BytesReadAt(blob), index, layer=_digest(blob)), tar)
    with pytest.raises(FormatError, match="several members"):
        index_blob_file(path, layer=_digest(blob), span=half + 1000)


def test_a_stream_that_ends_early_is_refused(tmp_path: Path) -> None:
    blob = gzip.compress(_big_tar(), mtime=0)
    path = tmp_path / "short.gz"
    path.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(FormatError):
        index_blob_file(path, layer=_digest(blob), span=SPAN)


def test_a_malformed_index_is_refused_when_opened(tmp_path: Path) -> None:
    blob, digest, index, _, _ = _indexed(tmp_path, _big_tar())
    src = BytesReadAt(blob)
    bad = {
        "not zstd": b"GZIDX" + index,
        "truncated": zstandard.ZstdCompressor().compress(raw_index(index)[:-100]),
        "another layer": rewrite_index(index, meta=lambda m: m.update(layer="sha256:" + "0" * 64)),
        "another size": rewrite_index(index, meta=lambda m: m.update(size=m["size"] + 1)),
        "out of order": rewrite_index(index, meta=lambda m: m["checkpoints"].reverse()),
        "past the blob": rewrite_index(index, meta=lambda m: m["checkpoints"][-1].__setitem__(
            0, len(blob) + 10)),
        "bits": rewrite_index(index, meta=lambda m: m["checkpoints"][1].__setitem__(1, 9)),
        "window size": rewrite_index(index, meta=lambda m: m["checkpoints"][1].__setitem__(3, 5)),
        "escaping name": rewrite_index(index, toc=lambda t: t["entries"][1].update(
            name="../../etc/passwd")),
        "chunk outside": rewrite_index(index, toc=lambda t: next(
            e for e in t["entries"] if e.get("offset")).update(offset=len(blob) + 1)),
    }
    for what, data in bad.items():
        with pytest.raises(FormatError):
            open_indexed_layer(src, data, layer=digest)
            pytest.fail(what)


def test_an_index_that_lies_about_a_chunk_never_yields_its_bytes(tmp_path: Path) -> None:
    blob, digest, index, _, _ = _indexed(tmp_path, _big_tar())

    def lie_digest(t: dict) -> None:
        e = next(e for e in t["entries"] if e["name"] == "pkg/m010.py")
        e["chunkDigest"] = "sha256:" + "1" * 64

    def lie_offset(t: dict) -> None:
        # the file's bytes claimed to be 100 bytes further into the span
        e = next(e for e in t["entries"] if e["name"] == "pkg/m200.py")
        e["innerOffset"] = e.get("innerOffset", 0) + 100

    moved: list[str] = []

    def lie_span(t: dict) -> None:
        # a file's first chunk pointed at the previous checkpoint's span: other bytes, other
        # window (the first file that starts in the second span)
        entries = [e for e in t["entries"] if e.get("offset") and e["type"] == "reg"]
        spans = sorted({(e["offset"], e["endOffset"]) for e in entries})
        e = next(e for e in entries if e["offset"] == spans[1][0])
        e["offset"], e["endOffset"] = spans[0]
        moved.append(e["name"])

    for lie in (lie_digest, lie_offset, lie_span):
        layer = open_indexed_layer(BytesReadAt(blob), rewrite_index(index, toc=lie), layer=digest)
        told: list[str] = []
        layer.on_bad = told.append
        name = {lie_digest: "pkg/m010.py", lie_offset: "pkg/m200.py"}.get(lie) or moved[0]
        with pytest.raises((IntegrityError, FormatError)):
            layer.read_file(name)
        entry = layer.toc.entries[name]
        layer.chunk_failed(entry.chunks[0], IntegrityError("x"))
        assert told and "IntegrityError" in told[0]


def test_checkpoints_match_a_sequential_inflate(tmp_path: Path) -> None:
    tar = _big_tar()
    blob = gzip.compress(tar, mtime=0)
    path = tmp_path / "l.gz"
    path.write_bytes(blob)
    points, usize = find_checkpoints(path, SPAN)
    assert usize == len(tar)
    assert points[0].out == 0 and points[0].window == b""
    for p in points[1:]:
        assert p.window == tar[p.out - len(p.window) : p.out]


def test_encode_parse_round_trip() -> None:
    points = (Checkpoint(10, 0, 0, b""), Checkpoint(500, 0, 40_000, b"w" * 32768))
    toc = json.dumps({"version": 1, "entries": []}).encode()
    blob = encode_index(layer="sha256:" + "a" * 64, size=1000, uncompressed_size=50_000,
                        diff_id="sha256:" + "b" * 64, span=SPAN, checkpoints=points,
                        toc_json=toc)
    got = parse_index(blob, layer="sha256:" + "a" * 64, size=1000)
    assert got.checkpoints == points and got.toc_json == toc
    assert got.span_end(0) == (500, 40_000) and got.span_end(1) == (1000, 50_000)


def test_a_decoded_span_hands_out_its_other_files_once(tmp_path: Path) -> None:
    tar = _big_tar()
    blob, digest, index, _, _ = _indexed(tmp_path, tar)
    layer = open_indexed_layer(BytesReadAt(blob), index, layer=digest)
    first = layer.toc.entries["pkg/m000.py"].chunks[0]
    assert layer.spread(first) == []                     # nothing decoded yet
    layer.read_chunks([first])
    pieces = dict(layer.spread(first))
    same_span = {c.digest: n for n, e in layer.toc.entries.items() for c in e.chunks
                 if c.offset == first.offset and c.digest != first.digest}
    assert set(pieces) == set(same_span) and len(pieces) > 10
    for d, data in pieces.items():
        assert "sha256:" + hashlib.sha256(data).hexdigest() == d
    assert layer.spread(first) == []                     # once per span


def test_a_span_decoded_in_part_spreads_only_once_decoded_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefetch inflates a span only as far as its pieces reach (``upto``): the piece is
    served and verified, nothing is spread from the part, a piece past it inflates the span
    again, and :meth:`spread_from` (the deferred spread) hands out the rest once."""
    import dataclasses

    tar = _big_tar()
    blob, digest, index, _, _ = _indexed(tmp_path, tar)
    layer = open_indexed_layer(BytesReadAt(blob), index, layer=digest)
    limits = count_inflates(monkeypatch)
    first = layer.toc.entries["pkg/m000.py"].chunks[0]
    whole = layer.index.span_end(0)[1]
    compressed = blob[first.offset : first.end_offset]
    need = first.inner_offset + first.chunk_size
    assert need < whole // 4
    assert layer.decode_chunk(first, compressed, upto=need) == _member(tar, "pkg/m000.py")
    assert limits == [need]
    assert layer.spread(first) == []                     # a part: nothing handed out
    forged = dataclasses.replace(first, digest="sha256:" + "0" * 64)
    with pytest.raises(IntegrityError):                  # a part is verified all the same
        layer.decode_chunk(forged, compressed, upto=need)
    later = next(c for c in layer.toc.entries["pkg/m030.py"].chunks)
    assert later.offset == first.offset and later.inner_offset > need
    assert layer.decode_chunk(later, compressed, upto=need) == _member(tar, "pkg/m030.py")
    assert limits[-1] == later.inner_offset + later.chunk_size     # inflated again, further
    # the deferred spread does not verify the chunk it is handed (a lying piece costs only
    # itself): every piece of the span whose bytes match its digest comes out
    pieces = dict(layer.spread_from(forged, compressed))
    assert limits[-1] == whole                           # whole, for the spread
    same_span = {c.digest for e in layer.toc.entries.values() for c in e.chunks
                 if c.offset == first.offset}
    assert set(pieces) == same_span
    assert all("sha256:" + hashlib.sha256(d).hexdigest() == k for k, d in pieces.items())
    assert layer.spread_from(first, compressed) == [] and layer.spread(first) == []
    n = len(limits)
    assert layer.decode_chunk(first, compressed, upto=need) == _member(tar, "pkg/m000.py")
    assert len(limits) == n                              # the whole decoding kept serves it


def count_inflates(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ``limit`` of every span inflate from now on, in order (a list that fills)."""
    from coldstart.format import gzindex
    limits: list[int] = []
    inflate = gzindex.inflate_span

    def counting(compressed: bytes, point: gzindex.Checkpoint, limit: int, *,
                 what: str) -> bytes:
        limits.append(limit)
        return inflate(compressed, point, limit, what=what)
    monkeypatch.setattr(gzindex, "inflate_span", counting)
    return limits


def _member(tar: bytes, name: str) -> bytes:
    import io
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        f = tf.extractfile("./" + name)
        assert f is not None
        return f.read()


def test_a_forged_window_is_caught_by_the_span_before_it(tmp_path: Path) -> None:
    import struct
    blob, digest, index, _, _ = _indexed(tmp_path, _big_tar())
    raw = bytearray(raw_index(index))
    (mlen,) = struct.unpack_from("<Q", raw, 8)
    meta = json.loads(raw[16 : 16 + mlen])
    wlens = [c[3] for c in meta["checkpoints"]]
    assert len(wlens) >= 3 and wlens[2] == 32768
    raw[len(raw) - sum(wlens[2:]) + 100] ^= 0xFF          # a byte of checkpoint #2's window
    forged = zstandard.ZstdCompressor().compress(bytes(raw))
    layer = open_indexed_layer(BytesReadAt(blob), forged, layer=digest)
    span1 = layer.index.checkpoints[1].cin
    chunk = next(c for e in layer.toc.entries.values() for c in e.chunks if c.offset == span1)
    with pytest.raises(IntegrityError, match="window of checkpoint #2"):
        layer.read_chunks([chunk])


def test_a_profile_names_the_touched_spans_and_round_trips(tmp_path: Path) -> None:
    from coldstart.oci.gzindex import with_profile
    from coldstart.prefetch.profile import LayerProfile
    from coldstart.prefetch.recorder import FileAccess

    blob, digest, index, _, _ = _indexed(tmp_path, _big_tar())
    parsed = parse_index(index, layer=digest, size=len(blob))
    assert parsed.prefetch_files == () and parsed.prefetch_ranges == ()
    recorded = LayerProfile(0, files=(
        FileAccess("pkg/m300.py", 0.1),                      # no ranges: the whole file
        FileAccess("pkg/big.bin", 0.2, [(0, 10)]),           # its first piece only
        FileAccess("pkg/not-there", 0.3, [(0, 10)]),
        FileAccess("pkg", 0.4)))                             # a directory: not a file read
    got, missing = with_profile(parsed, recorded)
    assert missing == ["pkg/not-there", "pkg"]
    assert got.prefetch_files == ("pkg/m300.py", "pkg/big.bin")
    layer = open_indexed_layer(BytesReadAt(blob), got.encode(), layer=digest)
    assert layer.index.prefetch_ranges == got.prefetch_ranges
    assert layer.toc.prefetch == ["pkg/m300.py", "pkg/big.bin"]
    big = layer.toc.entries["pkg/big.bin"].chunks
    wanted = [*layer.toc.entries["pkg/m300.py"].chunks, big[0]]

    def named(c: object) -> bool:
        return any(a <= c.offset and c.end_offset <= b   # type: ignore[attr-defined]
                   for a, b in got.prefetch_ranges)

    assert all(named(c) for c in wanted)
    assert not named(big[-1])                # the rest of big.bin: not read, not named
    assert sum(b - a for a, b in got.prefetch_ranges) < len(blob) // 2


def test_a_malformed_start_up_set_is_refused(tmp_path: Path) -> None:
    blob, digest, index, _, _ = _indexed(tmp_path, _big_tar())
    parsed = parse_index(index, layer=digest, size=len(blob))
    spans = [(p.cin, parsed.span_end(i)[0]) for i, p in enumerate(parsed.checkpoints)]
    (a0, b0), (a1, b1), (a2, b2) = spans[:3]
    good = {"files": ["pkg/m000.py"], "ranges": [[a0, b1 - a0], [a2, b2 - a2]]}
    data = rewrite_index(index, meta=lambda m: m.update(prefetch=good))
    assert parse_index(data, layer=digest, size=len(blob)).prefetch_ranges == ((a0, b1), (a2, b2))
    bad = {
        "not an object": ([1, 2], "not an object"),
        "names": ({"files": "pkg/m000.py"}, "list of at most"),
        "escaping name": ({"files": ["../etc/passwd"]}, "prefetch file"),
        "too many ranges": ({"ranges": [[a0, b0 - a0]] * (len(spans) + 1)}, "one range per"),
        "past the end": ({"ranges": [[spans[-1][0], len(blob) - spans[-1][0] + 5]]}, "whole"),
        "inside a span": ({"ranges": [[a0 + 1, b0 - a0 - 1]]}, "whole spans"),
        "empty": ({"ranges": [[a0, 0]]}, "whole spans"),
        "unsorted": ({"ranges": [[a1, b1 - a1], [a0, b0 - a0]]}, "not after"),
        "overlapping": ({"ranges": [[a0, b1 - a0], [a1, b1 - a1]]}, "not after"),
        "not a pair": ({"ranges": [[a0]]}, "not \\[offset, length\\]"),
    }
    for what, (value, says) in bad.items():
        data = rewrite_index(index, meta=lambda m, v=value: m.update(prefetch=v))
        with pytest.raises(FormatError, match=says):
            parse_index(data, layer=digest, size=len(blob))
            pytest.fail(what)


def test_a_landmark_in_the_tar_keeps_its_meaning_unless_the_index_names_a_set(
        tmp_path: Path) -> None:
    """A plain gzip tar may hold a prefetch landmark (an eStargz layer recompressed): its
    files before it stay the set, as the blob's order; a set the index names replaces it and
    is marked as named apart from that order."""
    import io

    from coldstart.oci.gzindex import with_profile
    from coldstart.prefetch.profile import LayerProfile
    from coldstart.prefetch.recorder import FileAccess

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        add(tf, "first.txt", b"first\n" * 100)
        add(tf, ".prefetch.landmark", b"\0")
        add(tf, "later.txt", b"later\n" * 100)
    blob, digest, index, _, _ = _indexed(tmp_path, buf.getvalue())
    plain = open_indexed_layer(BytesReadAt(blob), index, layer=digest)
    assert plain.toc.prefetch == ["first.txt"] and not plain.prefetch_named_apart
    named, _ = with_profile(parse_index(index, layer=digest, size=len(blob)),
                            LayerProfile(0, files=(FileAccess("later.txt", 0.0),)))
    layer = open_indexed_layer(BytesReadAt(blob), named.encode(), layer=digest)
    assert layer.toc.prefetch == ["later.txt"] and layer.prefetch_named_apart
