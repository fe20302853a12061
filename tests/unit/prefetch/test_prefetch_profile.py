"""Start-up profiles: the recorder, the JSON form and its checks, the prefetch-ranges label."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from coldstart.errors import InvalidArgument
from coldstart.prefetch.profile import (
    SCHEMA,
    LayerProfile,
    Profile,
    file_overlap,
    load_profile,
)
from coldstart.prefetch.ranges import MAX_TEXT, decode_ranges, encode_ranges
from coldstart.prefetch.recorder import MAX_RANGES, AccessRecorder, FileAccess, merge_range


def test_recorder_keeps_first_access_order_time_and_merged_ranges() -> None:
    ticks = iter([100.0, 100.25, 100.5, 101.0, 102.0])
    rec = AccessRecorder(clock=lambda: next(ticks))
    rec.note("b", 4096, 8192)
    rec.note("a", 0, 10)
    rec.note("b", 0, 4096)          # touches the first range: merged
    rec.note("b", 65536, 65540)     # apart: kept apart
    got = rec.accesses()
    assert [(x.path, x.first) for x in got] == [("b", 0.25), ("a", 0.5)]
    assert got[0].ranges == [(0, 8192), (65536, 65540)]
    assert got[0].bytes == 8196


def test_recorder_bounds_ranges_per_file() -> None:
    rec = AccessRecorder()
    for i in range(MAX_RANGES * 3):
        rec.note("big", i * 100, i * 100 + 10)
    (acc,) = rec.accesses()
    assert len(acc.ranges) == MAX_RANGES
    assert acc.ranges[0][0] == 0 and acc.ranges[-1][1] == (MAX_RANGES * 3 - 1) * 100 + 10


def test_recorder_is_thread_safe() -> None:
    rec = AccessRecorder()

    def reader(k: int) -> None:
        for i in range(500):
            rec.note(f"f{i % 50}", k * 1000 + i, k * 1000 + i + 1)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(rec) == 50
    for acc in rec.accesses():
        ranges = acc.ranges
        assert ranges == sorted(ranges)
        assert all(a < b for a, b in ranges)
        assert all(ranges[i][1] < ranges[i + 1][0] for i in range(len(ranges) - 1))


@pytest.mark.parametrize(("ranges", "new", "want"), [
    ([], (5, 9), [(5, 9)]),
    ([(0, 4), (10, 14)], (4, 10), [(0, 14)]),
    ([(0, 4), (10, 14)], (20, 30), [(0, 4), (10, 14), (20, 30)]),
    ([(10, 14)], (0, 2), [(0, 2), (10, 14)]),
    ([(0, 4), (6, 8), (10, 14)], (3, 11), [(0, 14)]),
    ([(0, 4)], (2, 2), [(0, 4)]),
])
def test_merge_range(ranges: list[tuple[int, int]], new: tuple[int, int],
                     want: list[tuple[int, int]]) -> None:
    merge_range(ranges, *new)
    assert ranges == want


def _profile() -> Profile:
    return Profile(image="oci:x", ready="exit", seconds=1.5, layers=(
        LayerProfile(0, "sha256:d0", "sha256:b0",
                     (FileAccess("usr/bin/python3", 0.01, [(0, 4096), (8192, 9000)]),
                      FileAccess("etc/ld.so.cache", 0.02, [(0, 100)]))),
        LayerProfile(1, "sha256:d1", "sha256:b1", ()),
    ))


def test_profile_json_round_trip(tmp_path: Path) -> None:
    p = _profile()
    path = tmp_path / "p.json"
    path.write_text(p.dumps())
    back = load_profile(path)
    assert back == p
    assert json.loads(path.read_text())["schema"] == SCHEMA
    # one line per file: a diff of two recordings reads well
    assert sum('"path"' in line for line in path.read_text().splitlines()) == 2


def test_profile_layer_matching() -> None:
    p = _profile()
    layer = p.for_layer(5, "sha256:d1", 9)     # by diff_id, wherever it is
    assert layer is not None and layer.index == 1
    layer = p.for_layer(0, "sha256:other", 2)  # same layer count: by index
    assert layer is not None and layer.paths == ["usr/bin/python3", "etc/ld.so.cache"]
    assert p.for_layer(0, "sha256:other", 3) is None


@pytest.mark.parametrize(("text", "message"), [
    ("", "empty"),
    ("   \n", "empty"),
    ("{not json", "not JSON"),
    ("[]", "JSON object"),
    ('{"schema": "other", "layers": []}', "schema"),
    (json.dumps({"schema": SCHEMA}), "'layers' must be a list"),
    (json.dumps({"schema": SCHEMA, "layers": [{"index": -1}]}), "index"),
    (json.dumps({"schema": SCHEMA, "layers": [{"index": 0}, {"index": 0}]}), "twice"),
    (json.dumps({"schema": SCHEMA, "layers": [{"index": 0, "files": [{"path": "../x"}]}]}),
     "escapes"),
    (json.dumps({"schema": SCHEMA, "layers": [{"index": 0, "files": [{"path": ""}]}]}),
     "bad path"),
    (json.dumps({"schema": SCHEMA, "layers": [{"index": 0, "files": [
        {"path": "a", "ranges": [[0]]}]}]}), "ranges"),
    (json.dumps({"schema": SCHEMA, "layers": [{"index": 0, "files": [
        {"path": "a", "ranges": [[0, -5]]}]}]}), "ranges"),
    (json.dumps({"schema": SCHEMA, "layers": [{"index": 0, "files": [7]}]}), "a path"),
])
def test_bad_profiles_are_one_line_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(InvalidArgument, match=message) as info:
        load_profile(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_missing_profile_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="cannot read profile"):
        load_profile(tmp_path / "nope.json")


def test_bare_paths_are_accepted_and_normalized() -> None:
    p = Profile.parse(json.dumps({"schema": SCHEMA, "layers": [
        {"index": 0, "files": ["/usr/lib/./libc.so", "etc//hosts"]}]}))
    assert p.layers[0].paths == ["usr/lib/libc.so", "etc/hosts"]


def test_file_overlap() -> None:
    assert file_overlap([], []) == 1.0
    assert file_overlap(["a"], ["b"]) == 0.0
    assert file_overlap(["a", "b", "c", "d"], ["a", "b", "c", "d", "e"]) == 0.8


def test_ranges_round_trip_and_fit_one_label() -> None:
    ranges = [(i * 1_000_000, i * 1_000_000 + 4096) for i in range(2000)]
    text = encode_ranges(ranges)
    assert len(text) <= MAX_TEXT
    back = decode_ranges(text)
    # merged to fit: never less than asked for
    for a, b in ranges:
        assert any(x <= a and b <= y for x, y in back)
    assert back == sorted(back)
    small = [(0, 10), (10, 20), (50, 60)]
    assert decode_ranges(encode_ranges(small)) == [(0, 20), (50, 60)]


@pytest.mark.parametrize("text", ["v2:0+1", "v1:zz+1", "v1:10+0", "v1:10+5,0+5", "v1:5"])
def test_bad_ranges_are_refused(text: str) -> None:
    with pytest.raises(InvalidArgument):
        decode_ranges(text)


def test_merge_gaps_closes_the_smallest_gaps_within_the_budget() -> None:
    from coldstart.prefetch.ranges import merge_gaps

    ranges = [(0, 100), (150, 250), (260, 360), (2000, 2100)]
    assert merge_gaps(ranges, 0.0) == ranges
    # 400 bytes of ranges, 10 % = 40: only the 10-byte gap closes
    assert merge_gaps(ranges, 0.1) == [(0, 100), (150, 360), (2000, 2100)]
    # 15 % = 60: the 50-byte gap too, never the big one
    assert merge_gaps(ranges, 0.15) == [(0, 360), (2000, 2100)]
    assert merge_gaps(ranges, 10.0) == [(0, 2100)]
    assert merge_gaps([(5, 10), (0, 6)], 0.0) == [(0, 10)]


def test_chunk_cuts_are_the_aligned_edges_of_what_was_read() -> None:
    from coldstart.prefetch.ranges import CUT_ALIGN, chunk_cuts

    read = [(70_000, 80_000), (300_000, 400_000), (900_000, 901_000)]
    files = [FileAccess("lib.so", 0.0, read), FileAccess("whole.txt", 0.1, []),
             FileAccess("head", 0.2, [(0, 100)])]
    # parts closer than 256 KiB are one; a file read whole (no ranges) gets no cut
    assert chunk_cuts(files) == {"lib.so": [65536, 458752, 851968, 917504], "head": [65536]}
    assert chunk_cuts(files[:1], gap=0) == {
        "lib.so": [65536, 131072, 262144, 458752, 851968, 917504]}
    assert all(x % CUT_ALIGN == 0 for xs in chunk_cuts(files).values() for x in xs)


def test_a_cut_layer_prefetches_what_was_read_not_the_chunks_around_it() -> None:
    """The point of the cuts: the chunks a recorded read touches hold about what it read."""
    import io
    import random
    import tarfile

    from coldstart.format import BytesReadAt, convert_layer, open_layer
    from coldstart.prefetch.ranges import chunk_cuts, touched_ranges

    data = random.Random(1).randbytes(1 << 20)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        info = tarfile.TarInfo("lib/big.so")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    read = [FileAccess("lib/big.so", 0.0, [(300_000, 310_000)])]   # cut at 256 and 320 KiB

    def touched(cuts: dict[str, list[int]] | None) -> int:
        out = io.BytesIO()
        result = convert_layer(io.BytesIO(buf.getvalue()), out, chunk_size=256 << 10,
                               prefetch=["lib/big.so"], cuts=cuts)
        toc = open_layer(BytesReadAt(out.getvalue()), annotations=result.annotations).toc
        return sum(b - a for a, b in touched_ranges(toc, read, overfetch=0))

    grid, cut = touched(None), touched(chunk_cuts(read))
    assert grid > 256_000                  # the whole 256 KiB chunk around the read
    assert 60_000 < cut < 70_000           # the read's 64 KiB, random bytes: ~their size
