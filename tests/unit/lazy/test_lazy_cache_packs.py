"""The chunk cache's pack files: small chunks appended to per-process packs, verified on scan."""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
from pathlib import Path

import pytest

from coldstart.cache import ChunkCache
from coldstart.cache import chunks as chunks_mod

HDR = 4 + 32 + 4      # magic, digest, length


def dg(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def blob(i: int, n: int = 1000) -> bytes:
    return (hashlib.sha256(str(i).encode()).digest() * (n // 32 + 1))[:n]


def packs(d: Path) -> list[Path]:
    return sorted((d / "packs").iterdir())


def loose(d: Path) -> list[Path]:
    return [p for p in (d / "sha256").rglob("*") if p.is_file()]


def test_small_chunks_round_trip_through_one_pack(tmp_path: Path) -> None:
    c = ChunkCache(tmp_path, max_bytes=1 << 30)
    chunks = [blob(i, 100 + 37 * i) for i in range(50)]
    for ch in chunks:
        c.put(dg(ch), ch, verified=True)
    assert loose(tmp_path) == [] and len(packs(tmp_path)) == 1
    assert len(c) == 50
    for ch in chunks:
        assert dg(ch) in c
        assert c.get(dg(ch), expected_size=len(ch)) == ch
        assert c.read(dg(ch), 10, 20) == ch[10:30]
        assert c.read(dg(ch), len(ch) - 5, 100) == ch[-5:]
    pack_size = packs(tmp_path)[0].stat().st_size
    assert pack_size == sum(HDR + len(ch) for ch in chunks)
    assert c.total_bytes == pack_size
    assert c.stats.puts == 50 and c.stats.hits == 150
    c.put(dg(chunks[0]), chunks[0])                  # already there: nothing appended
    assert packs(tmp_path)[0].stat().st_size == pack_size


def test_big_chunks_stay_one_file_each(tmp_path: Path) -> None:
    c = ChunkCache(tmp_path, max_bytes=1 << 30, pack_threshold=1000)
    small, big = blob(1, 1000), blob(2, 1001)
    c.put(dg(small), small)
    c.put(dg(big), big)
    assert [p.name for p in loose(tmp_path)] == [dg(big)[7:]]
    assert c.get(dg(small)) == small and c.get(dg(big)) == big
    assert list((tmp_path / "wip").iterdir()) == []


def test_restart_sees_packed_chunks(tmp_path: Path) -> None:
    c = ChunkCache(tmp_path, max_bytes=1 << 30, pack_bytes=10_000)
    chunks = [blob(i, 3000) for i in range(20)]
    for ch in chunks:
        c.put(dg(ch), ch)
    assert len(packs(tmp_path)) > 1                   # rolled over
    c.close()
    c2 = ChunkCache(tmp_path, max_bytes=1 << 30)
    assert len(c2) == 20
    assert c2.total_bytes == sum(p.stat().st_size for p in packs(tmp_path))
    for ch in chunks:
        assert c2.get(dg(ch)) == ch
    extra = blob(99, 500)                            # a new writer uses a pack of its own
    before = set(packs(tmp_path))
    c2.put(dg(extra), extra)
    assert len(set(packs(tmp_path)) - before) == 1
    assert ChunkCache(tmp_path, max_bytes=1 << 30).get(dg(extra)) == extra


def test_truncated_pack_tail_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                        ) -> None:
    c = ChunkCache(tmp_path, max_bytes=1 << 30)
    chunks = [blob(i, 2000) for i in range(3)]
    for ch in chunks:
        c.put(dg(ch), ch)
    c.close()
    (pack,) = packs(tmp_path)
    with open(pack, "r+b") as f:                     # a writer died mid-append
        f.truncate(pack.stat().st_size - 10)
    with caplog.at_level(logging.INFO, logger="coldstart.cache.chunks"):
        c2 = ChunkCache(tmp_path, max_bytes=1 << 30)
    assert "truncated" in caplog.text
    assert len(c2) == 2
    assert c2.get(dg(chunks[0])) == chunks[0] and c2.get(dg(chunks[1])) == chunks[1]
    assert c2.get(dg(chunks[2])) is None and dg(chunks[2]) not in c2
    c2.put(dg(chunks[2]), chunks[2])                 # stored again, in a new pack
    assert c2.get(dg(chunks[2])) == chunks[2]
    c3 = ChunkCache(tmp_path, max_bytes=1 << 30)
    assert all(c3.get(dg(ch)) == ch for ch in chunks)


def test_half_written_header_is_ignored(tmp_path: Path) -> None:
    c = ChunkCache(tmp_path, max_bytes=1 << 30)
    data = blob(1, 700)
    c.put(dg(data), data)
    c.close()
    (pack,) = packs(tmp_path)
    with open(pack, "ab") as f:
        f.write(b"CSK1" + b"\x01" * 7)
    c2 = ChunkCache(tmp_path, max_bytes=1 << 30)
    assert len(c2) == 1 and c2.get(dg(data)) == data


@pytest.mark.parametrize("where", ["data", "digest"])
def test_flipped_byte_is_detected_at_rebuild_and_not_served(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str) -> None:
    c = ChunkCache(tmp_path, max_bytes=1 << 30)
    chunks = [blob(i, 1500) for i in range(3)]
    for ch in chunks:
        c.put(dg(ch), ch)
    c.close()
    (pack,) = packs(tmp_path)
    raw = bytearray(pack.read_bytes())
    second = HDR + 1500                               # the second record's offset
    raw[second + (HDR + 700 if where == "data" else 4 + 5)] ^= 0x40
    pack.write_bytes(bytes(raw))
    with caplog.at_level(logging.ERROR, logger="coldstart.cache.chunks"):
        c2 = ChunkCache(tmp_path, max_bytes=1 << 30)
    assert "corrupt" in caplog.text
    assert c2.get(dg(chunks[1])) is None
    assert dg(chunks[1]) not in c2
    assert c2.get(dg(chunks[0])) == chunks[0]
    assert c2.get(dg(chunks[2])) == chunks[2]        # the records after it still count
    assert len(c2) == 2


def test_verify_reads_catches_a_pack_corrupted_after_the_scan(tmp_path: Path) -> None:
    c = ChunkCache(tmp_path, max_bytes=1 << 30, verify_reads=True)
    data = blob(5, 900)
    c.put(dg(data), data)
    (pack,) = packs(tmp_path)
    with open(pack, "r+b") as f:
        f.seek(HDR + 10)
        f.write(b"\xff")
    assert c.get(dg(data)) is None
    assert dg(data) not in c


def test_eviction_at_the_limit_deletes_whole_packs(tmp_path: Path) -> None:
    limit = 64 << 10
    c = ChunkCache(tmp_path, max_bytes=limit)
    assert c.pack_bytes == limit // 16
    chunks = [blob(i, 1000) for i in range(300)]
    for ch in chunks:
        c.put(dg(ch), ch)
        on_disk = sum(p.stat().st_size for p in packs(tmp_path))
        assert on_disk == c.total_bytes
        assert c.total_bytes <= limit + c.pack_bytes + HDR + 1000
    assert c.stats.evictions > 0
    assert c.stats.evicted_bytes == 1000 * c.stats.evictions
    assert len(packs(tmp_path)) <= 2 * limit // c.pack_bytes
    assert len(c) == 300 - c.stats.evictions
    assert dg(chunks[0]) not in c and c.get(dg(chunks[0])) is None
    assert c.get(dg(chunks[-1])) == chunks[-1]
    kept = [ch for ch in chunks if dg(ch) in c]
    assert len(kept) == len(c)
    assert all(c.get(dg(ch)) == ch for ch in kept)
    c.close()
    c2 = ChunkCache(tmp_path, max_bytes=limit // 2)   # smaller limit: oldest packs go at start
    assert c2.total_bytes <= limit // 2
    assert c2.total_bytes == sum(p.stat().st_size for p in packs(tmp_path))
    assert c2.get(dg(chunks[-1])) == chunks[-1]
    assert all(c2.get(dg(ch)) == ch for ch in chunks if dg(ch) in c2)


def test_recently_used_pack_outlives_an_older_one(tmp_path: Path) -> None:
    c = ChunkCache(tmp_path, max_bytes=16 * 5000, pack_bytes=5000)
    first = [blob(i, 2000) for i in range(3)]        # pack 1
    for ch in first:
        c.put(dg(ch), ch)
    second = [blob(10 + i, 2000) for i in range(3)]  # pack 2
    for ch in second:
        c.put(dg(ch), ch)
    assert c.get(dg(first[0])) == first[0]           # pack 1 is now the more recent
    i = 100
    while dg(second[0]) in c:
        ch = blob(i, 2000)
        c.put(dg(ch), ch)
        i += 1
    assert c.get(dg(first[0])) == first[0]


def test_remove_drops_a_packed_chunk_and_empty_packs_go(tmp_path: Path) -> None:
    c = ChunkCache(tmp_path, max_bytes=1 << 30, pack_bytes=2000)
    a, b, x = blob(1, 1000), blob(2, 1000), blob(3, 1000)
    for ch in (a, b, x):                              # a, b in the first pack; x rolls over
        c.put(dg(ch), ch)
    assert len(packs(tmp_path)) == 2
    c.remove(dg(a))
    assert dg(a) not in c and c.get(dg(a)) is None
    assert c.get(dg(b)) == b
    assert len(packs(tmp_path)) == 2                  # the bytes stay while b lives there
    c.remove(dg(b))
    assert len(packs(tmp_path)) == 1                  # nothing left in it: deleted
    assert c.total_bytes == HDR + 1000
    c.remove(dg(a))                                   # absent: no error
    assert c.get(dg(x)) == x


def test_put_async_then_flush_lands_in_a_pack(tmp_path: Path) -> None:
    c = ChunkCache(tmp_path, max_bytes=1 << 30)
    chunks = [blob(i, 4000) for i in range(200)]
    for ch in chunks:
        c.put_async(dg(ch), ch, verified=True)
    assert all(c.read(dg(ch), 1, 3) == ch[1:4] for ch in chunks)
    assert c.flush(30)
    assert loose(tmp_path) == []
    assert sum(p.stat().st_size for p in packs(tmp_path)) == 200 * (HDR + 4000)
    c.close()
    c2 = ChunkCache(tmp_path, max_bytes=1 << 30)
    assert all(c2.get(dg(ch)) == ch for ch in chunks)


def _pack_writer(directory: str, seed: int, n: int) -> None:
    c = ChunkCache(directory, max_bytes=1 << 30, pack_bytes=20_000)
    for i in range(n):
        data = blob(i % 60 + (seed * 1000 if i % 2 else 0), 1000 + i % 60)  # half shared
        c.put(dg(data), data)
        assert c.get(dg(data)) == data
    c.close()


def test_two_processes_writing_packs_at_once(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    watcher = ChunkCache(tmp_path, max_bytes=1 << 30)    # open before they write
    procs = [ctx.Process(target=_pack_writer, args=(str(tmp_path), s, 300)) for s in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    want = {blob(i % 60 + (s * 1000 if i % 2 else 0), 1000 + i % 60)
            for s in (1, 2) for i in range(300)}
    pids = {p.name.split("-")[0] for p in packs(tmp_path)}
    assert pids == {str(p.pid) for p in procs}            # each wrote its own packs
    assert watcher.rescan() > 0                           # a live cache sees them on rescan
    assert all(watcher.get(dg(d)) == d for d in want)
    c = ChunkCache(tmp_path, max_bytes=1 << 30)
    assert len(c) == len(want)
    assert all(c.get(dg(d)) == d for d in want)


def test_a_miss_rescans_for_other_writers_chunks(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    reader = ChunkCache(tmp_path, max_bytes=1 << 30)
    writer = ChunkCache(tmp_path, max_bytes=1 << 30)
    data = blob(7, 800)
    writer.put(dg(data), data)
    assert dg(data) not in reader                         # not rescanned yet (interval)
    monkeypatch.setattr(chunks_mod, "_RESCAN_INTERVAL", 0.0)
    assert reader.get(dg(data)) == data
    more = blob(8, 800)
    writer.put(dg(more), more)                            # appended to the same pack
    assert dg(more) in reader
    assert reader.total_bytes == writer.total_bytes


def test_a_pack_deleted_under_its_writer(tmp_path: Path) -> None:
    c = ChunkCache(tmp_path, max_bytes=1 << 30)
    a, b, x = blob(1, 600), blob(2, 600), blob(3, 600)
    c.put(dg(a), a)
    os.unlink(packs(tmp_path)[0])                         # another process evicted it
    c.put(dg(b), b)                                       # noticed: next append rolls
    c.put(dg(x), x)
    assert c.get(dg(a)) == a and c.get(dg(b)) == b        # the open descriptor still serves
    c2 = ChunkCache(tmp_path, max_bytes=1 << 30)
    assert c2.get(dg(x)) == x
    assert c2.get(dg(a)) is None


def test_a_reader_looking_for_a_file_does_not_unindex_a_chunk_packed_meanwhile(
        tmp_path: Path) -> None:
    # The race: a reader finds the chunk neither pending nor packed and looks for its own file;
    # meanwhile the writer thread packs it. The missing file must not drop the packed entry
    # (it did once: the next read missed and the chunk was fetched again).
    c = ChunkCache(tmp_path, max_bytes=1 << 30)
    data = blob(7)
    c.put(dg(data), data, verified=True)          # packed, no file of its own
    hexd = hashlib.sha256(data).hexdigest()
    assert c._read_file(dg(data), hexd, 0, -1, None) is None   # the reader's late file lookup
    assert c.get(dg(data)) == data                 # still indexed and served from the pack
    assert dg(data) in c
