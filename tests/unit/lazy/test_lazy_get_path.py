"""The one get-or-fetch path: a read asks the cache once per chunk, the FUSE loop's fast path
touches only the in-memory index (no rescan, no stat, no planning), single flight holds."""

from __future__ import annotations

import os
import pathlib
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from coldstart.cache import ChunkCache
from coldstart.format.toc import Entry
from coldstart.lazyfs.fetcher import ChunkFetcher
from coldstart.lazyfs.reader import LayerReader, PartialRead
from tests.integration.lazy.lazy_helpers import metadata_tar
from tests.unit.lazy.test_lazy_reader import make

BIG = "usr/lib/big.so"
#: the cache methods that look a chunk up (read_local: the loop's in-memory probe)
LOOKUPS = ("get", "read", "__contains__", "contains")


class CountingStore:
    """A ChunkStore around a real cache that records every look-up (method, digest, thread);
    ``gate``, when set, holds :meth:`read` until it opens."""

    def __init__(self, inner: ChunkCache) -> None:
        self.inner = inner
        self.calls: list[tuple[str, str, str]] = []
        self.gate: threading.Event | None = None
        self._lock = threading.Lock()

    def _note(self, method: str, digest: object) -> None:
        with self._lock:
            self.calls.append((method, str(digest), threading.current_thread().name))

    def counts(self, digest: str) -> Counter[str]:
        with self._lock:
            return Counter(m for m, d, _ in self.calls if d == digest)

    def get(self, digest: str, expected_size: int | None = None, *,
            keep: bool = True) -> bytes | None:
        self._note("get", digest)
        return self.inner.get(digest, expected_size, keep=keep)

    def read(self, digest: str, offset: int, length: int, *,
             expected_size: int | None = None, keep: bool = True) -> bytes | None:
        self._note("read", digest)
        if self.gate is not None:
            self.gate.wait(10)
        return self.inner.read(digest, offset, length, expected_size=expected_size,
                               keep=keep)

    def read_local(self, digest: str, offset: int, length: int, *,
                   expected_size: int | None = None) -> bytes | None:
        self._note("read_local", digest)
        return self.inner.read_local(digest, offset, length, expected_size=expected_size)

    def contains(self, digest: str) -> bool:
        self._note("contains", digest)
        return self.inner.contains(digest)

    def __contains__(self, digest: object) -> bool:
        self._note("__contains__", digest)
        return digest in self.inner

    def put(self, digest: str, data: bytes | bytearray | memoryview, *,
            verified: bool = False) -> None:
        self.inner.put(digest, data, verified=verified)

    def put_async(self, digest: str, data: bytes, *, verified: bool = False) -> None:
        self.inner.put_async(digest, data, verified=verified)

    def put_async_encoded(self, digest: str, size: int, decode: Callable[[], bytes], *,
                          held: int) -> None:
        self.inner.put_async_encoded(digest, size, decode, held=held)


def counted_reader(tmp: Path) -> tuple[LayerReader, CountingStore]:
    store = CountingStore(ChunkCache(tmp / "cache", max_bytes=1 << 30))
    fetcher = ChunkFetcher(store, concurrency=4, request_timeout=5.0)
    reader, _src, _ = make(tmp, "zstd:chunked", fetcher=fetcher)
    return reader, store


def fuse_read(reader: LayerReader, entry: Entry, offset: int, length: int) -> bytes:
    """What FuseFS.read does: the fast path on the calling ("loop") thread, then one worker
    call that finishes the read."""
    got = reader.read_cached(entry, offset, length)
    if isinstance(got, bytes):
        return got
    out: list[bytes] = []
    partial = got if isinstance(got, PartialRead) else None
    t = threading.Thread(target=lambda: out.append(reader.read(entry, offset, length, partial)),
                         name="worker")
    t.start()
    t.join(30)
    return out[0]


def test_a_miss_asks_the_cache_once_per_chunk(tmp_path: Path) -> None:
    reader, store = counted_reader(tmp_path)
    entry = reader.layer.resolve(BIG)
    data = metadata_tar().files[BIG]
    off, n = 100_000, 300_000                        # spans several 64 KiB chunks
    chunks = reader.layer.chunks_for(entry, off, n)
    assert len(chunks) >= 4
    assert fuse_read(reader, entry, off, n) == data[off:off + n]
    for c in chunks:
        got = store.counts(c.digest)
        # the worker's one look-up; the loop probed the index of the first chunk only
        assert sum(got[m] for m in LOOKUPS) == 1, (c.digest, got)
        assert got["read_local"] == (1 if c is chunks[0] else 0), got
    # straight in a worker (no loop before it): one look-up each as well
    reader2, store2 = counted_reader(tmp_path / "2")
    entry2 = reader2.layer.resolve(BIG)
    assert reader2.read(entry2, off, n) == data[off:off + n]
    for c in chunks:
        assert sum(store2.counts(c.digest)[m] for m in LOOKUPS) == 1
        assert store2.counts(c.digest)["read_local"] == 0
    # a warm read: the loop's index probe, nothing else
    store.calls.clear()
    assert fuse_read(reader, entry, off, n) == data[off:off + n]
    assert {m for m, _, _ in store.calls} == {"read_local"}


def test_the_loop_fast_path_never_rescans_stats_or_plans(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    loop = threading.current_thread()

    class LoopGuardCache(ChunkCache):
        def rescan(self, *, wait: bool = True) -> int:
            assert threading.current_thread() is not loop, "rescan on the loop"
            return super().rescan(wait=wait)

        def __contains__(self, digest: object) -> bool:
            assert threading.current_thread() is not loop, "a stat-ing look-up on the loop"
            return super().__contains__(digest)

        def read(self, digest: str, offset: int, length: int, *,
                 expected_size: int | None = None, keep: bool = True) -> bytes | None:
            assert threading.current_thread() is not loop, "a full look-up on the loop"
            return super().read(digest, offset, length, expected_size=expected_size,
                                keep=keep)

    cache = LoopGuardCache(tmp_path / "cache", max_bytes=1 << 30)
    fetcher = ChunkFetcher(cache, concurrency=4, request_timeout=5.0)
    reader, src, _ = make(tmp_path, "zstd:chunked", fetcher=fetcher)
    reader.sequential.readahead_bytes = 0           # none while warming up
    tree = metadata_tar()
    big = reader.layer.resolve(BIG)
    step = big.chunks[1].chunk_offset                 # one chunk per read
    # warm the first two chunks of the big file and a few small files (in worker threads)
    assert fuse_read(reader, big, 0, step) == tree.files[BIG][:step]
    assert fuse_read(reader, big, step, step) == tree.files[BIG][step:2 * step]
    small = ["etc/os-release", "usr/bin/sudo", "usr/bin/tool"]
    for name in small:
        e = reader.layer.resolve(name)
        assert fuse_read(reader, e, 0, e.size) == tree.files[name]
    assert cache.flush()
    _wait(lambda: fetcher.inflight() == 0)

    active = [False]

    def on_loop(fn: Callable[..., object]) -> Callable[..., object]:
        def guarded(*args: object, **kwargs: object) -> object:
            if active[0]:
                assert threading.current_thread() is not loop, f"{fn.__name__} on the loop"
            return fn(*args, **kwargs)
        return guarded

    reader.sequential.readahead_bytes = 128 << 10
    planned: list[str] = []
    real_plan = fetcher.plan
    before = src.counting.requests
    with monkeypatch.context() as m:
        for mod, name in [(os, "stat"), (os, "lstat"), (os, "listdir"), (os, "scandir"),
                          (os, "utime"), (os.path, "exists"), (pathlib.Path, "exists"),
                          (pathlib.Path, "stat")]:
            m.setattr(mod, name, on_loop(getattr(mod, name)))
        m.setattr(fetcher, "plan", lambda fn: (planned.append("plan"), real_plan(fn)))
        m.setattr(reader.sequential, "_read_ahead", on_loop(reader.sequential._read_ahead))
        m.setattr(reader.windows, "_small_between", on_loop(reader.windows._small_between))
        active[0] = True
        try:
            for name in small:                        # warm small files: served on the loop
                e = reader.layer.resolve(name)
                assert reader.read_cached(e, 0, e.size) == tree.files[name]
            assert reader.read_cached(big, 0, step) == tree.files[BIG][:step]
            # sequential into the next chunk: read-ahead is planned, in the planner thread
            assert reader.read_cached(big, step, step) == tree.files[BIG][step:2 * step]
            assert planned
            _wait(lambda: src.counting.requests > before)     # the planner fetched ahead
        finally:
            active[0] = False
    after = reader.read_cached(big, 2 * step, step)
    assert after is None or isinstance(after, (bytes, PartialRead))


def test_single_flight_holds_when_the_owner_finds_the_chunk_cached(tmp_path: Path) -> None:
    """A reader that joins a chunk whose owner is still looking it up gets the bytes when the
    owner finds it cached (the owner hands over the whole chunk), and nothing is fetched."""
    reader, store = counted_reader(tmp_path)
    entry = reader.layer.resolve(BIG)
    data = metadata_tar().files[BIG]
    c = entry.chunks[5]
    assert reader.read(entry, c.chunk_offset, 10) == data[c.chunk_offset:c.chunk_offset + 10]
    assert store.inner.flush()
    src_requests = reader.target.stats.requests
    store.gate = threading.Event()                    # the owner's look-up now waits
    results: dict[str, bytes] = {}

    def one(key: str, off: int) -> None:
        results[key] = reader.read(entry, c.chunk_offset + off, 100)

    owner = threading.Thread(target=one, args=("owner", 0))
    owner.start()
    _wait(lambda: reader.fetcher.inflight() == 1)
    joiner = threading.Thread(target=one, args=("joiner", 1000))
    joiner.start()
    _wait(lambda: any(fl.joiners for fl in reader.fetcher._inflight.values()))
    store.gate.set()
    owner.join(10)
    joiner.join(10)
    at = c.chunk_offset
    assert results == {"owner": data[at:at + 100], "joiner": data[at + 1000:at + 1100]}
    assert reader.target.stats.requests == src_requests
    assert reader.fetcher.inflight() == 0


def test_single_flight_holds_for_concurrent_fuse_reads(tmp_path: Path) -> None:
    reader, src, _ = make(tmp_path, "zstd:chunked")
    entry = reader.layer.resolve(BIG)
    data = metadata_tar().files[BIG]
    src.gate.clear()
    results: list[bytes] = []
    threads = [threading.Thread(target=lambda: results.append(
        fuse_read(reader, entry, 1000, 5000))) for _ in range(6)]
    for t in threads:
        t.start()
    _wait(lambda: reader.fetcher.inflight() > 0)
    time.sleep(0.1)
    src.gate.set()
    for t in threads:
        t.join(30)
    assert results == [data[1000:6000]] * 6
    assert src.counting.requests == 1


def _wait(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_warm_sequential_reader_is_not_replanned_at_every_chunk(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    # the read-ahead of a file whose next chunks are all local records how far it looked;
    # the loop then skips the planner thread until the reader gets near that point
    reader, _src, fetcher = make(tmp_path, "zstd:chunked")
    tree = metadata_tar()
    big = reader.layer.resolve(BIG)
    n = len(big.chunks)
    assert n >= 8
    step = big.chunks[1].chunk_offset                 # one chunk per read
    reader.sequential.readahead_bytes = 0           # warm the whole file first
    for i in range(n):
        off = big.chunks[i].chunk_offset
        assert fuse_read(reader, big, off, step) == tree.files[BIG][off:off + step]
    assert fetcher.cache is not None and fetcher.cache.flush()
    _wait(lambda: fetcher.inflight() == 0)

    reader.sequential.readahead_bytes = 2 * max(c.compressed_size for c in big.chunks)  # ~2 chunks
    planned: list[int] = []
    real_plan = fetcher.plan

    def plan_now(fn: Callable[[], object]) -> None:   # run it inline: deterministic
        planned.append(1)
        fn()

    monkeypatch.setattr(fetcher, "plan", plan_now)
    for i in range(n):
        off = big.chunks[i].chunk_offset
        got = reader.read_cached(big, off, step)
        assert got == tree.files[BIG][off:off + step]
    # one plan at the second chunk covers up to _LOOK_FURTHER chunks ahead; not one per chunk
    assert 1 <= len(planned) <= 1 + n // 64, (len(planned), n)
    monkeypatch.setattr(fetcher, "plan", real_plan)


def test_a_long_sequential_read_widens_its_window_and_a_jump_narrows_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the window doubles every two chunks entered in order, up to readahead_max_bytes, so a
    # weights file streams at the link's rate; a read elsewhere starts it over
    reader, _src, fetcher = make(tmp_path, "zstd:chunked")
    tree = metadata_tar()
    big = reader.layer.resolve(BIG)
    n = len(big.chunks)
    assert n >= 12
    chunk = max(c.compressed_size for c in big.chunks)
    reader.sequential.readahead_bytes = chunk
    reader.sequential.readahead_max_bytes = 4 * chunk
    asked: list[int] = []
    monkeypatch.setattr(fetcher, "plan", lambda fn: fn())
    monkeypatch.setattr(fetcher, "request",
                        lambda target, chunks, **kw: asked.append(len(chunks)))
    step = big.chunks[1].chunk_offset                 # one chunk per read
    for i in range(8):
        off = big.chunks[i].chunk_offset
        reader.read(big, off, step)
    # the budget is bytes: a window holds one chunk more than budget / the largest chunk at most
    assert asked[0] <= 2 and 4 <= max(asked) <= 5, asked     # widened to the max, not past it
    assert asked == sorted(asked)
    asked.clear()
    off = big.chunks[10].chunk_offset                 # a jump: not sequential, no read-ahead
    assert reader.read(big, off, step) == tree.files[BIG][off:off + step]
    reader.read(big, big.chunks[11].chunk_offset, step)
    assert len(asked) == 1 and asked[0] <= 2, asked   # and the window starts small again
