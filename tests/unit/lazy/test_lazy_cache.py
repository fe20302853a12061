"""The node chunk cache: content addressing, LRU limit, restarts, concurrent processes.

Tests that look at ``sha256/`` files use ``pack_threshold=0`` (every chunk a file); the rest
run with both layouts (see also test_lazy_cache_packs.py).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from coldstart.cache import ChunkCache
from coldstart.errors import IntegrityError, InvalidArgument


def dg(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def blob(i: int, n: int = 1000) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * (n // 32 + 1)


LAYOUTS = pytest.mark.parametrize("threshold", [0, 256 << 10], ids=["files", "packs"])


def test_put_get_and_slices(tmp_path: Path) -> None:
    c = ChunkCache(tmp_path, max_bytes=1 << 20, pack_threshold=0)
    data = blob(1)[:1000]
    d = dg(data)
    assert c.get(d) is None
    c.put(d, data)
    assert c.get(d) == data
    assert c.read(d, 10, 20) == data[10:30]
    assert c.read(d, 990, 100) == data[990:]
    hexd = d.split(":")[1]
    assert (tmp_path / "sha256" / hexd[:2] / hexd).read_bytes() == data
    assert c.stats.hits == 3 and c.stats.misses == 1
    assert list((tmp_path / "wip").iterdir()) == []


@LAYOUTS
def test_put_refuses_data_that_does_not_match(tmp_path: Path, threshold: int) -> None:
    c = ChunkCache(tmp_path, max_bytes=1 << 20, pack_threshold=threshold)
    with pytest.raises(IntegrityError):
        c.put(dg(b"abc"), b"abd")
    assert c.get(dg(b"abc")) is None
    assert len(c) == 0
    assert c.get("sha512:" + "a" * 128) is None       # only sha256 chunks are cached
    assert ("sha512:" + "a" * 128) not in c
    with pytest.raises(InvalidArgument):
        c.put("md5:abc", b"abc")


@LAYOUTS
def test_wrong_size_file_is_a_miss_and_dropped(tmp_path: Path, threshold: int) -> None:
    c = ChunkCache(tmp_path, max_bytes=1 << 20, pack_threshold=threshold)
    data = b"x" * 100
    c.put(dg(data), data)
    assert c.get(dg(data), expected_size=100) == data
    assert c.get(dg(data), expected_size=99) is None
    assert dg(data) not in c


def test_verify_reads_catches_corruption_on_disk(tmp_path: Path) -> None:
    c = ChunkCache(tmp_path, max_bytes=1 << 20, verify_reads=True, pack_threshold=0)
    data = b"y" * 100
    c.put(dg(data), data)
    hexd = dg(data).split(":")[1]
    (tmp_path / "sha256" / hexd[:2] / hexd).write_bytes(b"z" * 100)
    assert c.get(dg(data)) is None


def test_lru_eviction_at_the_limit(tmp_path: Path) -> None:
    c = ChunkCache(tmp_path, max_bytes=3500, pack_threshold=0)
    chunks = [blob(i)[:1000] for i in range(4)]
    for ch in chunks[:3]:
        c.put(dg(ch), ch)
    assert c.get(dg(chunks[0])) == chunks[0]       # 0 is now the most recent
    c.put(dg(chunks[3]), chunks[3])               # over the limit: 1 (least recent) goes
    assert c.total_bytes <= 3500
    assert dg(chunks[1]) not in c
    for i in (0, 2, 3):
        assert c.get(dg(chunks[i])) == chunks[i]
    assert c.stats.evictions == 1


def test_dedup_same_digest_stored_once(tmp_path: Path) -> None:
    c = ChunkCache(tmp_path, max_bytes=1 << 20, pack_threshold=0)
    data = blob(7)[:500]
    c.put(dg(data), data)
    c.put(dg(data), data)
    assert len(c) == 1 and c.total_bytes == 500
    files = [p for p in (tmp_path / "sha256").rglob("*") if p.is_file()]
    assert len(files) == 1


def test_survives_restart_and_keeps_lru_order(tmp_path: Path) -> None:
    c = ChunkCache(tmp_path, max_bytes=10_000, pack_threshold=0)
    chunks = [blob(i)[:1000] for i in range(3)]
    for i, ch in enumerate(chunks):
        c.put(dg(ch), ch)
        hexd = dg(ch).split(":")[1]
        os.utime(tmp_path / "sha256" / hexd[:2] / hexd, (1000 + i, 1000 + i))
    (tmp_path / "wip" / "stale").write_bytes(b"half")
    os.utime(tmp_path / "wip" / "stale", (1, 1))
    # smaller limit: the oldest goes at start
    c2 = ChunkCache(tmp_path, max_bytes=2500, pack_threshold=0)
    assert len(c2) == 2
    assert dg(chunks[0]) not in c2
    assert c2.get(dg(chunks[2])) == chunks[2]
    assert not (tmp_path / "wip" / "stale").exists()


def _writer(directory: str, seed: int, out: multiprocessing.Queue,  # type: ignore[type-arg]
            threshold: int) -> None:
    c = ChunkCache(directory, max_bytes=1 << 30, pack_threshold=threshold)
    for i in range(40):
        data = blob(i % 25, 4000 + (i % 25))       # overlapping digests across processes
        c.put(dg(data), data)
    out.put(seed)


@LAYOUTS
def test_concurrent_writer_processes(tmp_path: Path, threshold: int) -> None:
    ctx = multiprocessing.get_context("fork")
    q: multiprocessing.Queue = ctx.Queue()  # type: ignore[type-arg]
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), s, q, threshold))
             for s in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    c = ChunkCache(tmp_path, max_bytes=1 << 30, pack_threshold=threshold)
    assert len(c) == 25
    for i in range(25):
        data = blob(i, 4000 + i)
        assert c.get(dg(data)) == data
    assert list((tmp_path / "wip").iterdir()) == []


@LAYOUTS
def test_put_async_is_readable_at_once_and_lands_on_disk(tmp_path: Path, threshold: int) -> None:
    c = ChunkCache(tmp_path, max_bytes=1 << 20, pack_threshold=threshold)
    chunks = [blob(i)[:3000] for i in range(50)]
    for ch in chunks:
        c.put_async(dg(ch), ch, verified=True)
    for ch in chunks:                                 # from memory or disk, whichever
        assert dg(ch) in c
        assert c.read(dg(ch), 100, 50) == ch[100:150]
    assert c.flush(30)
    c.close()
    c2 = ChunkCache(tmp_path, max_bytes=1 << 20, pack_threshold=threshold)
    assert len(c2) == 50
    assert all(c2.get(dg(ch)) == ch for ch in chunks)
    with pytest.raises(IntegrityError):
        c2.put_async(dg(b"a"), b"b")


def test_background_writes_wait_at_the_gate_and_are_served_from_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from coldstart.cache import chunks as chunks_module

    monkeypatch.setattr(chunks_module, "_GATE_WAIT", 60.0)   # no give-up on a slow machine
    c = ChunkCache(tmp_path / "c", max_bytes=1 << 20)
    opened = threading.Event()
    waits: list[float] = []

    def gate(longest: float) -> bool:      # the node is reading: hold the writes
        waits.append(longest)
        return opened.wait(longest)

    c.write_gate = gate
    chunks = [blob(i)[:3000] for i in range(5)]
    for ch in chunks:
        c.put_async(dg(ch), ch, verified=True)
    assert wait_until(lambda: len(waits) >= 1)
    other = ChunkCache(tmp_path / "c", max_bytes=1 << 20)     # what the disk holds
    assert not any(dg(ch) in other for ch in chunks)
    assert all(c.get(dg(ch)) == ch for ch in chunks)           # served from memory meanwhile
    assert all(0 < w <= 0.02 for w in waits)                   # short steps
    opened.set()
    assert c.flush(30)
    other.close()
    other = ChunkCache(tmp_path / "c", max_bytes=1 << 20)
    assert all(other.get(dg(ch)) == ch for ch in chunks)
    other.close()
    c.close()


def test_flush_does_not_wait_for_the_gate(tmp_path: Path) -> None:
    import time

    c = ChunkCache(tmp_path, max_bytes=1 << 20)
    def busy(longest: float) -> bool:     # the node never goes quiet
        time.sleep(longest)
        return False

    c.write_gate = busy
    chunks = [blob(i)[:3000] for i in range(20)]
    for ch in chunks:
        c.put_async(dg(ch), ch, verified=True)
    assert c.flush(3)      # the gate alone would hold the first write 5 s
    c.close()


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


class Decoder:
    """A chunk kept encoded: ``decode()`` counts its calls (and raises if ``broken``)."""

    def __init__(self, data: bytes, *, broken: bool = False) -> None:
        self.data = data
        self.broken = broken
        self.calls = 0

    def __call__(self) -> bytes:
        self.calls += 1
        if self.broken:
            raise RuntimeError("decoder bug")
        return bytes(self.data)


def held_gate(c: ChunkCache, monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Hold ``c``'s background writes (the node is reading); returns what opens the gate."""
    import threading

    from coldstart.cache import chunks as chunks_module

    monkeypatch.setattr(chunks_module, "_GATE_WAIT", 600.0)  # no give-up on a slow machine
    opened = threading.Event()
    c.write_gate = opened.wait
    return opened.set


def test_an_encoded_chunk_is_decoded_by_its_first_read_and_kept_for_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = ChunkCache(tmp_path / "c", max_bytes=1 << 30)
    open_gate = held_gate(c, monkeypatch)
    data = blob(1, 300_000)                 # a big chunk (a file of its own)
    dec = Decoder(data)
    c.put_async_encoded(dg(data), len(data), dec, held=1234)
    assert c.contains(dg(data)) and dg(data) in c
    assert c._pending_bytes == 1234                      # the encoded bytes only
    assert c.read_local(dg(data), 0, 10) is None          # the loop leaves the decode to a worker
    assert dec.calls == 0
    assert c.get(dg(data), keep=False) == data            # read once: it stays encoded
    assert dec.calls == 1 and c._pending_bytes == 1234
    assert c.read_local(dg(data), 0, 10) is None
    assert c.read(dg(data), 5, 10) == data[5:15]
    assert dec.calls == 2
    assert c._pending_bytes == len(data)                 # now kept decoded...
    assert c.read_local(dg(data), 100, 20) == data[100:120]   # ...for the loop's reads too
    assert c.get(dg(data)) == data
    assert dec.calls == 2
    open_gate()
    assert c.flush(30)
    assert dec.calls == 2                                 # written from the decoded bytes
    assert c._pending_bytes == 0
    c.close()
    c2 = ChunkCache(tmp_path / "c", max_bytes=1 << 30)
    assert c2.get(dg(data)) == data
    c2.close()


@LAYOUTS
def test_an_encoded_chunk_nobody_reads_is_decoded_to_be_written(tmp_path: Path,
                                                                 threshold: int) -> None:
    c = ChunkCache(tmp_path / "c", max_bytes=1 << 30, pack_threshold=threshold)
    data = blob(2, 5000)
    dec = Decoder(data)
    c.put_async_encoded(dg(data), len(data), dec, held=99)
    c.put_async_encoded(dg(data), len(data), dec, held=99)     # pending already: once
    assert c.flush(30)
    assert dec.calls == 1
    assert c._pending_bytes == 0
    assert c.read_local(dg(data), 0, -1) == data
    c.close()
    c2 = ChunkCache(tmp_path / "c", max_bytes=1 << 30, pack_threshold=threshold)
    assert c2.get(dg(data)) == data
    c2.close()


def test_an_encoded_chunk_that_fails_to_decode_again_is_not_cached(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    c = ChunkCache(tmp_path / "c", max_bytes=1 << 30)
    open_gate = held_gate(c, monkeypatch)
    data = blob(3, 300_000)
    short = Decoder(data[:-1])                  # a decoder that gives the wrong size
    broken = Decoder(data, broken=True)
    other = blob(4, 300_000)
    c.put_async_encoded(dg(data), len(data), short, held=10)
    c.put_async_encoded(dg(other), len(other), broken, held=10)
    assert c.read(dg(data), 0, 10) is None       # a miss: the reader fetches it again
    assert c.read(dg(other), 0, 10) is None
    assert f"decoded to {len(data) - 1} bytes" in caplog.text and "decoder bug" in caplog.text
    assert not c.contains(dg(data)) and not c.contains(dg(other))    # dropped at once
    assert c._pending_bytes == 0
    assert c.read(dg(data), 0, 10) is None and short.calls == 1      # not decoded again
    c.put_async(dg(data), data, verified=True)          # the reader's fetch stores it again
    assert c.read(dg(data), 0, 10) == data[:10]
    open_gate()
    assert c.flush(30)
    assert c._pending_bytes == 0
    assert dg(other) not in c
    assert len(c) == 1 and c.get(dg(data)) == data
    c.close()


def test_put_async_waits_for_the_disk_once_the_backlog_is_full(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the node's reads never pause; past _GATED_PENDING the writer writes anyway, and past
    # _MAX_PENDING each put_async waits for it: what waits in memory stays bounded
    from coldstart.cache import chunks as chunks_module

    monkeypatch.setattr(chunks_module, "_MAX_PENDING", 600_000)
    monkeypatch.setattr(chunks_module, "_GATED_PENDING", 450_000)   # the first chunk waits
    c = ChunkCache(tmp_path / "c", max_bytes=1 << 30)
    open_gate = held_gate(c, monkeypatch)
    chunks = [blob(i, 300_000) for i in range(8)]
    most = 0
    for ch in chunks:
        c.put_async(dg(ch), ch, verified=True)
        most = max(most, c._pending_bytes)
    assert most <= 600_000 + len(chunks[0])
    other = ChunkCache(tmp_path / "c", max_bytes=1 << 30)     # what the disk holds
    # at most three wait (600,000 bytes or fewer let a third in)
    assert sum(dg(ch) in other for ch in chunks) >= len(chunks) - 3
    assert all(c.get(dg(ch)) == ch for ch in chunks)
    open_gate()
    assert c.flush(30)
    other.close()
    c.close()


def test_small_chunks_are_bounded_by_their_count_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a layer of small files: the byte count stays far below _MAX_PENDING while each waiting
    # chunk costs more than its bytes; past half _MAX_PENDING_CHUNKS the writer writes at
    # once, past it each put_async waits for the disk
    from coldstart.cache import chunks as chunks_module

    monkeypatch.setattr(chunks_module, "_MAX_PENDING_CHUNKS", 40)
    c = ChunkCache(tmp_path / "c", max_bytes=1 << 30)
    open_gate = held_gate(c, monkeypatch)
    chunks = [blob(i, 200) for i in range(300)]
    most = 0
    for ch in chunks:
        c.put_async(dg(ch), ch, verified=True)
        most = max(most, c.backlog()[1])
    assert most <= 40
    assert c.backlog()[0] <= 40 * max(map(len, chunks))
    assert all(c.get(dg(ch)) == ch for ch in chunks)
    open_gate()
    assert c.flush(30) and c.backlog() == (0, 0)
    c.close()


def test_wait_backlog_blocks_until_the_writer_catches_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    c = ChunkCache(tmp_path / "c", max_bytes=1 << 30)
    open_gate = held_gate(c, monkeypatch)
    chunks = [blob(i, 500) for i in range(20)]
    for ch in chunks:
        c.put_async(dg(ch), ch, verified=True)
    assert c.backlog() == (sum(map(len, chunks)), 20)
    assert not c.wait_backlog(1 << 20, 5, timeout=0.2)       # held at the gate: still over
    stop = threading.Event()
    stop.set()
    assert not c.wait_backlog(1 << 20, 5, timeout=600, stop=stop)   # stopped: at once
    open_gate()
    assert c.wait_backlog(1 << 20, 5, timeout=60)
    assert c.backlog()[1] <= 5
    c.close()


def test_chunks_queued_after_a_backlog_that_waited_out_wait_at_the_gate_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The node never pauses: a backlog that outgrew the gate's wait is written at once, but
    a chunk queued while it is written (a fill's) waits at the gate again, instead of being
    written while the node reads because the queue never ran empty."""
    import threading
    import time

    from coldstart.cache import chunks as chunks_module

    monkeypatch.setattr(chunks_module, "_GATE_WAIT", 600.0)      # never given up by time
    monkeypatch.setattr(chunks_module, "_MAX_PENDING_CHUNKS", 8)  # the gate gives up at 4
    c = ChunkCache(tmp_path / "c", max_bytes=1 << 30)
    asked, released, asked_since = threading.Event(), threading.Event(), threading.Event()

    def gate(step: float) -> bool:
        asked.set()
        if released.is_set():
            asked_since.set()
        time.sleep(step)
        return False
    c.write_gate = gate
    first = [blob(i, 300) for i in range(5)]
    held, hold = threading.Event(), threading.Event()
    real_put = ChunkCache.put

    def put(self: ChunkCache, digest: str, data: bytes, *, verified: bool = False) -> None:
        if digest == dg(first[2]) and not hold.is_set():
            held.set()
            hold.wait(60)
        real_put(self, digest, data, verified=verified)
    monkeypatch.setattr(ChunkCache, "put", put)
    c.put_async(dg(first[0]), first[0], verified=True)
    assert asked.wait(60)                   # the first chunk waits at the gate
    for ch in first[1:]:                    # the backlog outgrows the gate: written at once
        c.put_async(dg(ch), ch, verified=True)
    assert held.wait(60)                    # ... and being written
    late = blob(99, 300)
    c.put_async(dg(late), late, verified=True)
    released.set()
    hold.set()
    assert asked_since.wait(60), "a chunk queued meanwhile was written without the gate"
    assert c.backlog()[1] == 1 and c.contains(dg(late))    # it waits there
    other = ChunkCache(tmp_path / "c", max_bytes=1 << 30)
    assert all(dg(ch) in other for ch in first) and dg(late) not in other
    assert c.flush(30) and dg(late) in ChunkCache(tmp_path / "c", max_bytes=1 << 30)
    other.close()
    c.close()
