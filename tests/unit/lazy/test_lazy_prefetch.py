"""Prefetch at mount (the span before the landmark, in a few large requests, only the chunks
the recording touched when the layer says which) and the hybrid fill's order and states."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from coldstart.cache import ChunkCache
from coldstart.errors import Unavailable
from coldstart.format.gzindex import GzipIndex, IndexedLayer
from coldstart.format.toc import Chunk
from coldstart.lazyfs import batches as batching
from coldstart.lazyfs import fill as fill_module
from coldstart.lazyfs import layers as layers_module
from coldstart.lazyfs.batches import unique_chunks
from coldstart.lazyfs.coalesce import MAX_GAP, pack_runs
from coldstart.lazyfs.fetcher import QUIET_SECONDS, ChunkFetcher
from coldstart.lazyfs.layers import _index_then_trim
from coldstart.lazyfs.prefetch import PREFETCH_GROWTH
from coldstart.lazyfs.reader import LayerReader
from coldstart.lazyfs.target import DEMAND, FILL, PREFETCH
from coldstart.prefetch.profile import LayerProfile
from coldstart.prefetch.recorder import AccessRecorder
from tests.integration.lazy.lazy_helpers import metadata_tar
from tests.unit.lazy.test_lazy_reader import FORMATS, GatedSource, make, read_all


def _growing(chunks: list[Chunk], first: int, limit: int) -> list[list[Chunk]]:
    """The prefetch's batches: growing by PREFETCH_GROWTH."""
    return batching.growing_batches(chunks, first, limit, growth=PREFETCH_GROWTH)


def test_growing_batches() -> None:
    chunks = [Chunk(i * 100, i * 100 + 100, i * 100, 100, f"d{i}") for i in range(40)]
    batches = _growing(chunks, 200, 800)
    sizes = [sum(c.compressed_size for c in b) for b in batches]
    assert sizes[:3] == [200, 800, 800]
    assert [c for b in batches for c in b] == chunks


def test_chunks_sharing_one_range_stay_in_one_batch() -> None:
    """An indexed gzip layer's span: many files' pieces, one compressed range each time. A
    batch cut between them fetched the span once per batch (twice the bytes, measured)."""
    spans = [(i * 1000, i * 1000 + 1000) for i in range(6)]
    chunks = [Chunk(a, b, 0, 10, f"d{a}-{k}", k * 10) for a, b in spans for k in range(7)]
    for batches in (_growing(chunks, 1500, 3000), batching.batches(chunks, 2000)):
        assert [c for b in batches for c in b] == chunks
        ranges = [{(c.offset, c.end_offset) for c in b} for b in batches]
        assert all(not (x & y) for i, x in enumerate(ranges) for y in ranges[i + 1:])
    # each range counted once: 1500 bytes -> two spans in the first batch, then 3000
    assert [len({c.offset for c in b}) for b in _growing(chunks, 1500, 3000)] == [2, 3, 1]
    # the fill's batches stay within the limit (one request each): 2 spans of 1000 in 2000
    assert [len({c.offset for c in b}) for b in batching.batches(chunks, 2000)] == [2, 2, 2]
    assert [len({c.offset for c in b}) for b in batching.batches(chunks, 500)] == [1] * 6
    assert batching.batches([], 10) == []
    # the fill's: also at most ``most`` chunks, cut at a range's start only (a span whole)
    got = list(batching.iter_batches(iter(chunks), 1 << 20, 1 << 20, most=10))
    assert [c for b in got for c in b] == chunks
    assert [len(b) for b in got] == [14, 14, 14]        # two spans of 7: the cut after 10
    small = [Chunk(i * 10, i * 10 + 10, 0, 10, f"s{i}") for i in range(25)]
    assert [len(b) for b in batching.iter_batches(small, 1 << 20, 1 << 20, most=10)] == \
        [10, 10, 5]


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefetch_is_a_few_requests_counted_as_prefetch(tmp_path: Path, fmt: str) -> None:
    tree = metadata_tar()
    names = ["usr/lib/big.so", "usr/bin/sudo", "etc/os-release"]
    reader, src, _ = make(tmp_path, fmt, tar=tree.tar, prefetch=names)
    fetched = reader.prefetcher.prefetch()
    assert fetched > 0
    stats = reader.stats.as_dict()
    assert stats["prefetched_bytes"] >= fetched and stats["on_demand_bytes"] == 0
    # big.so (5 MiB) + two small files, contiguous: the growing batches, not one per chunk
    assert src.counting.requests <= 4
    before = src.counting.requests
    for n in names:
        assert read_all(reader, n) == tree.files[n]
    assert src.counting.requests == before        # all of it came from the prefetch


def test_prefetch_takes_only_the_touched_chunks(tmp_path: Path) -> None:
    tree = metadata_tar()
    reader, src, _ = make(tmp_path, "zstd:chunked", tar=tree.tar,
                          prefetch=["usr/lib/big.so", "etc/os-release"])
    big = reader.layer.resolve("usr/lib/big.so")
    assert len(big.chunks) > 10
    wanted = [big.chunks[0], big.chunks[3]]
    reader.prefetcher.ranges = sorted((c.offset, c.end_offset) for c in wanted)
    reader.prefetcher.prefetch()
    assert reader.cache is not None
    assert all(c.digest in reader.cache for c in wanted)
    assert big.chunks[1].digest not in reader.cache
    assert reader.layer.resolve("etc/os-release").chunks[0].digest not in reader.cache
    assert reader.stats.bytes_by_kind[PREFETCH] < sum(c.compressed_size for c in big.chunks) / 4
    # the rest is still read on demand, correctly
    assert read_all(reader, "usr/lib/big.so") == tree.files["usr/lib/big.so"]
    assert reader.stats.bytes_by_kind[DEMAND] > 0
    assert src.counting.requests > 1


class ManyRangeSource(GatedSource):
    """A local blob that also reads several ranges at once, as a registry answering
    multi-range requests does (coldstart.remote.source.ManyRangeSource); records each call."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.calls: list[list[tuple[int, int]]] = []

    answers = True

    def reads_many(self) -> bool:
        return self.answers

    def read_many(self, ranges: Sequence[tuple[int, int]], *,
                  timeout: float | None = None) -> list[bytes]:
        self.calls.append(list(ranges))
        return [self.read_at(off, n, timeout=timeout) for off, n in ranges]


@pytest.mark.parametrize("answers", [True, False])
def test_a_source_that_reads_several_ranges_at_once_gets_the_touched_runs_in_one_request(
        tmp_path: Path, answers: bool) -> None:
    tree = metadata_tar()
    reader, many, _ = make(tmp_path, "zstd:chunked", tar=tree.tar,
                           prefetch=["usr/lib/big.so", "etc/os-release"],
                           source=ManyRangeSource)
    assert isinstance(many, ManyRangeSource)
    many.answers = answers
    big = reader.layer.resolve("usr/lib/big.so")
    wanted = [big.chunks[0], big.chunks[4], big.chunks[9]]
    assert all(b.offset - a.end_offset > MAX_GAP for a, b in itertools.pairwise(wanted))
    reader.prefetcher.ranges = sorted((c.offset, c.end_offset) for c in wanted)
    reader.prefetcher.prefetch()
    assert reader.stats.requests_by_kind[PREFETCH] == 1
    if not answers:
        # (a registry that does not answer them now) one range, the bytes between fetched
        # and dropped
        assert many.calls == []
        assert reader.stats.bytes_by_kind[PREFETCH] == wanted[-1].end_offset - wanted[0].offset
        return
    assert many.calls == [[(c.offset, c.compressed_size) for c in wanted]]
    # the bytes between the runs were not asked: exactly the touched chunks' own
    assert reader.stats.bytes_by_kind[PREFETCH] == sum(c.compressed_size for c in wanted)
    assert reader.cache is not None
    assert all(c.digest in reader.cache for c in wanted)
    assert big.chunks[1].digest not in reader.cache
    assert read_all(reader, "usr/lib/big.so") == tree.files["usr/lib/big.so"]


def test_fill_order_is_profile_then_small_then_big(tmp_path: Path) -> None:
    tree = metadata_tar()
    reader, _, _ = make(tmp_path, "zstd:chunked", tar=tree.tar, prefetch=["etc/shadow"])
    order = list(reader.fill.fill_order())
    shadow = reader.layer.resolve("etc/shadow").chunks
    big = reader.layer.resolve("usr/lib/big.so")
    assert order[:len(shadow)] == shadow
    first_big = order.index(big.chunks[0])
    assert all(c in order[first_big:] for c in big.chunks)
    small = reader.layer.resolve("usr/share/doc/f000.txt").chunks[0]
    assert order.index(small) < first_big
    keys = [(c.offset, c.inner_offset) for c in order]
    assert len(keys) == len(set(keys))             # each chunk once


@pytest.mark.parametrize("fmt", FORMATS)
def test_fill_completes_and_says_so(tmp_path: Path, fmt: str) -> None:
    tree = metadata_tar()
    reader, src, _ = make(tmp_path, fmt, tar=tree.tar)
    reader.fill.rate = 1 << 40
    reader.fill.fetch_rest()
    stats = reader.stats.as_dict()
    assert stats["state"] == "complete"
    assert stats["filled_bytes"] > 0 and stats["local_bytes"] == stats["total_bytes"] > 0
    assert stats["requests_by_kind"][FILL] == src.counting.requests
    before = src.counting.requests
    for name, data in tree.files.items():
        assert read_all(reader, name) == data
    assert src.counting.requests == before


def test_fill_that_is_stopped_is_not_complete(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fill_module, "BACKGROUND_REQUEST", 16 << 10)
    reader, _, _ = make(tmp_path, "zstd:chunked", chunk_size=8 << 10)
    reader.fill.rate = 1 << 10         # slow: the pacing sleeps after a few requests

    def stop_at_first_pause(_seconds: float) -> None:
        reader.close()                         # stopped in the middle of the fill

    reader.fill.fetch_rest(sleep=stop_at_first_pause)
    stats = reader.stats.as_dict()
    assert stats["state"] == "on-demand"
    assert stats["filled_bytes"] > 0 and stats["local_bytes"] < stats["total_bytes"]


def test_a_read_joining_a_held_fill_request_does_not_wait_for_quiet(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fill holds its requests while reads keep coming; a read that needs a chunk of
    such a held request takes it over at once instead of waiting with it.

    Quiet takes an hour here (``QUIET_SECONDS``) after the start-up's read: the fill's request
    stays held for the whole test, so a read that waited with it would end at its deadline
    (10 s) with an error, not with the file's bytes."""
    from coldstart.lazyfs import fetcher as fetcher_module

    monkeypatch.setattr(fetcher_module, "QUIET_SECONDS", 3600.0)
    tree = metadata_tar()
    reader, src, fetcher = make(tmp_path, "zstd:chunked", tar=tree.tar)
    big = reader.layer.resolve("usr/lib/big.so")
    fetcher.note_read()                    # the start-up, reading on: not quiet for an hour
    futures = fetcher.request(reader.target, big.chunks[3:6], background=True)
    time.sleep(0.5)
    assert not any(f.done() for f in futures.values())     # held by the quiet gate
    assert src.counting.requests == 0
    got = read_all(reader, "usr/lib/big.so")
    assert got == tree.files["usr/lib/big.so"]
    assert all(f.done() for f in futures.values())
    # taken over, not fetched beside it: no byte of the blob asked for twice
    spans = sorted(src.counting.ranges)
    assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(spans)), spans


def test_recorder_sees_cached_and_fetched_reads(tmp_path: Path) -> None:
    tree = metadata_tar()
    reader, _, _ = make(tmp_path, "zstd:chunked", tar=tree.tar)
    reader.recorder = AccessRecorder()
    sudo = reader.layer.resolve("usr/bin/sudo")
    reader.read(sudo, 0, 100)                           # fetched (worker path)
    got = reader.read_cached(sudo, 50, 100)             # local now (the loop's path)
    assert isinstance(got, bytes)
    reader.read(reader.layer.resolve("etc/os-release"), 0, 4096)
    acc = reader.recorder.accesses()
    assert [a.path for a in acc] == ["usr/bin/sudo", "etc/os-release"]
    assert acc[0].ranges == [(0, 150)]
    assert acc[1].ranges == [(0, len(tree.files["etc/os-release"]))]


def _many_small(n: int = 600) -> tuple[bytes, list[str], dict[str, bytes]]:
    import io
    import tarfile

    from coldstart.stack.images import realistic_bytes

    buf = io.BytesIO()
    files = {}
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for i in range(n):
            data = realistic_bytes(6000 + 37 * i, i)
            ti = tarfile.TarInfo(f"pkg/m{i:04d}.py")
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
            files[ti.name] = data
    return buf.getvalue(), list(files), files


def test_neighbour_window_grows_while_neighbours_are_read(tmp_path: Path) -> None:
    tar, names, files = _many_small()
    reader, src, _ = make(tmp_path, "zstd:chunked", tar=tar)
    reader.windows.neighbor_bytes = reader.windows.neighbor_window = 32 << 10
    reader.windows.neighbor_max_bytes = 1 << 20
    reader.fetcher.plan = lambda fn: None        # no follow-ahead: only misses fetch
    for name in names:
        assert read_all(reader, name) == files[name]
    assert reader.windows.neighbor_window == 1 << 20
    # a fixed 32 KiB window would take one request per ~5 files; the grown one far fewer
    assert src.counting.requests < len(names) / 20


def test_neighbour_window_shrinks_when_neighbours_are_not_read(tmp_path: Path) -> None:
    tar, names, files = _many_small()
    reader, _, _ = make(tmp_path, "zstd:chunked", tar=tar)
    reader.windows.neighbor_bytes = 32 << 10
    reader.windows.neighbor_window = 512 << 10  # grown earlier
    reader.fetcher.plan = lambda fn: None
    for name in names[::60]:                     # far apart: no neighbour is ever read
        assert read_all(reader, name) == files[name]
    # back to the configured window, not below it
    assert reader.windows.neighbor_window == 32 << 10


def test_ranges_without_a_landmark_prefetch_those_chunks(tmp_path: Path) -> None:
    """The profile rides with an image that was not reordered: the layer's prefetch-ranges
    annotation alone names the chunks to fetch at mount."""
    tree = metadata_tar()
    reader, _, _ = make(tmp_path, "zstd:chunked", tar=tree.tar)
    assert not reader.layer.toc.prefetch and not reader.prefetcher.wanted
    big = reader.layer.resolve("usr/lib/big.so")
    sudo = reader.layer.resolve("usr/bin/sudo").chunks[0]
    wanted = [big.chunks[2], sudo]
    reader.prefetcher.ranges = sorted((c.offset, c.end_offset) for c in wanted)
    assert reader.prefetcher.wanted
    assert reader.prefetcher.prefetch() > 0
    assert reader.cache is not None
    assert all(c.digest in reader.cache for c in wanted)
    assert big.chunks[0].digest not in reader.cache


def test_touched_chunks_match_a_scan_of_the_whole_layer(tmp_path: Path) -> None:
    """With a landmark, only the prefetch span is looked at when the ranges end within it;
    the answer is the same as a scan of every entry, also for ranges that reach past it."""
    import random

    tree = metadata_tar()
    reader, _, _ = make(tmp_path, "zstd:chunked", tar=tree.tar,
                        prefetch=["usr/lib/big.so", "etc/os-release"])
    every = unique_chunks(reader.layer)
    front = unique_chunks(reader.layer, reader.layer.toc.prefetch)
    span = max(c.end_offset for c in front)
    rng = random.Random(5)
    for trial in range(40):
        pool = front if trial % 2 == 0 else every     # within the span, then anywhere
        picked = sorted(rng.sample(pool, min(len(pool), rng.randint(1, 6))),
                        key=lambda c: c.offset)
        reader.prefetcher.ranges = [(c.offset, c.end_offset) for c in picked]
        want = [c for c in every if reader.prefetcher._touched(c)]
        assert reader.prefetcher._touched_chunks() == want
        if trial % 2 == 0:
            assert all(c.end_offset <= span for c in want)


def test_a_fill_that_does_not_fit_in_the_cache_is_skipped_and_says_why(tmp_path: Path) -> None:
    tree = metadata_tar()
    small = ChunkCache(tmp_path / "small", max_bytes=64 << 10)    # the layer holds more
    fetcher = ChunkFetcher(small, concurrency=2, request_timeout=5.0)
    reader, src, _ = make(tmp_path, "zstd:chunked", tar=tree.tar, fetcher=fetcher)
    reader.fill.rate = 1 << 40
    assert reader.fill.fetch_rest() == 0 and src.counting.requests == 0
    assert "does not fit in the chunk cache" in reader.stats.last_error


def test_the_fill_of_an_indexed_gzip_layer_reads_each_span_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each file's piece of a span is a chunk over the whole span: the fill's requests must
    not cut a span in two (it was fetched once per request), and its byte counts (the pacing,
    the states) must count a span once, not once per piece."""
    import io
    import tarfile

    from coldstart.format.gzindex import open_indexed_layer
    from tests.unit.format.test_format_gzindex import _big_tar, _indexed

    tar = _big_tar()
    blob, digest, index, _, _ = _indexed(tmp_path, tar)
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        files = {m.name.removeprefix("./"): tf.extractfile(m).read()  # type: ignore[union-attr]
                 for m in tf.getmembers() if m.isreg()}
    src = GatedSource(blob)
    layer = open_indexed_layer(src, index, layer=digest)
    assert len(layer.index.checkpoints) > 5
    fetcher = ChunkFetcher(ChunkCache(tmp_path / "cache", max_bytes=1 << 30), concurrency=4,
                           max_coalesce_bytes=16 << 20, request_timeout=5.0)
    reader = LayerReader(digest, layer, src, fetcher, read_deadline=10.0)
    monkeypatch.setattr(fill_module, "BACKGROUND_REQUEST", 4 << 10)   # cuts every span
    reader.fill.rate = 1 << 40
    src.counting.reset()
    reader.fill.fetch_rest()
    stats = reader.stats.as_dict()
    assert stats["state"] == "complete"
    assert stats["local_bytes"] == stats["total_bytes"] <= len(blob)
    assert src.counting.bytes_read <= len(blob), (src.counting.bytes_read, len(blob))
    before = src.counting.requests
    for name, data in files.items():
        assert read_all(reader, name) == data
    assert src.counting.requests == before


def test_the_fill_completes_a_span_handed_out_before_whose_pieces_were_evicted(
        tmp_path: Path) -> None:
    """A span is spread once per mount: when its other pieces left the cache since (LRU, a
    failed write), asking for one piece caches nothing else, and the fill asks for them."""
    from coldstart.format.gzindex import open_indexed_layer
    from tests.unit.format.test_format_gzindex import _big_tar, _indexed

    blob, digest, index, _, _ = _indexed(tmp_path, _big_tar())
    src = GatedSource(blob)
    layer = open_indexed_layer(src, index, layer=digest)
    cache = ChunkCache(tmp_path / "cache", max_bytes=1 << 30)
    fetcher = ChunkFetcher(cache, concurrency=4, max_coalesce_bytes=16 << 20,
                           request_timeout=5.0)
    reader = LayerReader(digest, layer, src, fetcher, read_deadline=10.0)
    first = layer.resolve("pkg/m000.py").chunks[0]
    read_all(reader, "pkg/m000.py")                 # its span is spread: all pieces cached
    cache.flush()
    others = [c for c in unique_chunks(reader.layer)
              if c.offset == first.offset and c.digest != first.digest][:3]
    assert others and all(c.digest in cache for c in others)
    for c in others:
        cache.remove(c.digest)
    reader.fill.rate = 1 << 40
    reader.fill.fetch_rest()
    stats = reader.stats.as_dict()
    assert stats["state"] == "complete", stats
    assert all(c.digest in cache for c in others)
    assert stats["local_bytes"] == stats["total_bytes"]


def _profiled(tmp_path: Path, names: tuple[str, ...]
              ) -> tuple[LayerProfile, GzipIndex, GatedSource, IndexedLayer]:
    """``_big_tar``'s gzip layer indexed with a recorded start-up reading ``names`` (in that
    order): the profile, the index carrying it, the blob's counting source, the layer."""
    from coldstart.format.gzindex import open_indexed_layer, parse_index
    from coldstart.oci.gzindex import with_profile
    from coldstart.prefetch.recorder import FileAccess
    from tests.unit.format.test_format_gzindex import _big_tar, _indexed

    blob, digest, index, _, _ = _indexed(tmp_path, _big_tar())
    recorded = LayerProfile(0, files=tuple(
        FileAccess(name, t / 100) for t, name in enumerate(names)))
    named, _ = with_profile(parse_index(index, layer=digest, size=len(blob)), recorded)
    src = GatedSource(blob)
    return recorded, named, src, open_indexed_layer(src, named.encode(), layer=digest)


def test_an_indexed_layer_prefetches_the_spans_its_index_names(tmp_path: Path) -> None:
    """A plain gzip layer cannot be reordered: its index names the recorded start-up's files
    and spans (``coldstart index --profile``); the prefetch fetches those spans, one request
    each, in the order the start-up first read them (here a file late in the blob first), and
    the start-up's reads then need none."""
    recorded, named, src, layer = _profiled(
        tmp_path, ("pkg/after", "pkg/m390.py", "pkg/m000.py", "pkg/m001.py"))
    digest = layer.index.layer
    # two threads: one prefetch request at a time (half the pool), so they arrive in order
    fetcher = ChunkFetcher(ChunkCache(tmp_path / "cache", max_bytes=1 << 30), concurrency=2,
                           max_coalesce_bytes=16 << 20, request_timeout=5.0)
    reader = LayerReader(digest, layer, src, fetcher, read_deadline=10.0)
    assert reader.prefetcher.wanted and reader.prefetcher.ranges == list(named.prefetch_ranges)
    src.counting.reset()
    assert reader.prefetcher.prefetch() > 0
    order: list[int] = []
    for f in recorded.files:
        for c in layer.toc.entries[f.path].chunks:
            if c.offset not in order:
                order.append(c.offset)
    assert len(order) >= 2 and order != sorted(order)
    assert [a for a, _ in src.counting.ranges] == order
    assert src.counting.bytes_read <= sum(b - a for a, b in named.prefetch_ranges)
    assert reader.stats.as_dict()["on_demand_bytes"] == 0
    before = src.counting.requests
    for f in recorded.files:
        read_all(reader, f.path)
    assert src.counting.requests == before           # the start-up's reads: all local
    read_all(reader, "pkg/big.bin")                  # outside the set: on demand
    assert src.counting.requests > before


@pytest.mark.parametrize("held", ["deferred", "over-the-budget"])
def test_an_indexed_prefetch_spreads_its_spans_later_without_fetching_them_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: str) -> None:
    """The prefetch of an indexed layer inflates each span only as far as the start-up's
    pieces reach; the span's other files are cached once the node is quiet, from the bytes
    the prefetch fetched (no second request). Past the node's budget of held bytes a span
    is inflated whole and spread at once, as a read's is."""
    import time

    from coldstart.lazyfs import fetcher as fetcher_module
    from tests.unit.format.test_format_gzindex import count_inflates

    if held == "over-the-budget":
        monkeypatch.setattr(fetcher_module, "DEFERRED_SPREAD_BYTES", 0)
    limits = count_inflates(monkeypatch)
    recorded, _, src, layer = _profiled(tmp_path, ("pkg/m000.py", "pkg/m390.py", "pkg/after"))
    digest = layer.index.layer
    cache = ChunkCache(tmp_path / "cache", max_bytes=1 << 30)
    fetcher = ChunkFetcher(cache, concurrency=2, max_coalesce_bytes=16 << 20,
                           request_timeout=5.0)
    reader = LayerReader(digest, layer, src, fetcher, read_deadline=10.0)
    need: dict[int, int] = {}         # span -> how far the start-up's pieces reach in it
    for f in recorded.files:
        for c in layer.toc.entries[f.path].chunks:
            need[c.offset] = max(need.get(c.offset, 0), c.inner_offset + c.chunk_size)
    spans = set(need)
    whole = {p.cin: layer.index.span_end(i)[1] - p.out
             for i, p in enumerate(layer.index.checkpoints) if p.cin in spans}
    assert len(spans) >= 2 and any(need[s] < whole[s] for s in spans)
    src.counting.reset()
    limits.clear()
    assert reader.prefetcher.prefetch() > 0
    requests = src.counting.requests
    assert requests == len(spans)
    others = [c for c in unique_chunks(reader.layer) if c.offset in spans
              and c.owner not in {f.path for f in recorded.files}]
    assert len(others) > 10
    deadline = time.monotonic() + 10
    while (fetcher._deferred or not all(c.digest in cache for c in others)) \
            and time.monotonic() < deadline:
        cache.flush()
        time.sleep(0.05)
    assert all(c.digest in cache for c in others)        # spread: the span's other files
    if held == "deferred":
        # each span inflated as far as the set reaches, then (if that was a part) whole, to
        # spread it: once each
        assert sorted(limits) == sorted([*need.values(),
                                         *(whole[s] for s in spans if need[s] < whole[s])])
        assert fetcher._deferred == 0
    else:
        assert sorted(limits) == sorted(whole.values())
    before = src.counting.requests
    assert before == requests                            # from the bytes fetched once
    for c in others[:20]:
        read_all(reader, c.owner or "")
    assert src.counting.requests == before
    fetcher.close()


def test_a_deferred_spread_of_a_layer_no_longer_served_is_dropped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A span held for a deferred spread whose layer is unmounted (its reader closed) before
    the node is quiet is let go: its other files are not cached (the unmount's reclaim would
    miss them), and the held bytes are given back at once.

    Quiet takes an hour here (``QUIET_SECONDS``): the spans are let go within the minute the
    test waits only if the unmount lets them go, not the node's quiet."""
    from coldstart.lazyfs import fetcher as fetcher_module

    monkeypatch.setattr(fetcher_module, "QUIET_SECONDS", 3600.0)
    recorded, _, src, layer = _profiled(tmp_path, ("pkg/m000.py", "pkg/m390.py", "pkg/after"))
    cache = ChunkCache(tmp_path / "cache", max_bytes=1 << 30)
    fetcher = ChunkFetcher(cache, concurrency=2, max_coalesce_bytes=16 << 20,
                           request_timeout=5.0)
    reader = LayerReader(layer.index.layer, layer, src, fetcher, read_deadline=10.0)
    try:
        fetcher.note_read()              # a start-up reading: spreads wait QUIET_SECONDS
        assert reader.prefetcher.prefetch() > 0
        assert fetcher._deferred > 0     # held
        reader.close()                   # unmounted
        read = {f.path for f in recorded.files}
        spans = {c.offset for f in recorded.files for c in layer.toc.entries[f.path].chunks}
        others = [c for c in unique_chunks(reader.layer)
                  if c.offset in spans and c.owner not in read]
        assert len(others) > 10
        # given back at once, not once the node is quiet (an hour away)
        assert fetcher.wait_deferred(timeout=60), "the held spans wait for the node's quiet"
        cache.flush()
        assert not any(c.digest in cache for c in others)
        assert all(c.digest in cache for f in recorded.files
                   for c in layer.toc.entries[f.path].chunks)
    finally:
        fetcher.close()


def test_the_fill_after_an_indexed_prefetch_fetches_no_span_twice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fill starts once the node is quiet, when the prefetch's held spans may not be
    spread yet (here each spread takes 0.3 s): it waits for them, and asks the registry only
    for the other spans."""
    import time

    _, _, src, layer = _profiled(tmp_path, ("pkg/m000.py", "pkg/m390.py", "pkg/after"))
    digest = layer.index.layer
    spread_from = IndexedLayer.spread_from

    def slow(self: IndexedLayer, chunk: Chunk, compressed: bytes) -> list[tuple[str, bytes]]:
        time.sleep(0.3)
        return spread_from(self, chunk, compressed)
    monkeypatch.setattr(IndexedLayer, "spread_from", slow)
    fetcher = ChunkFetcher(ChunkCache(tmp_path / "cache", max_bytes=1 << 30), concurrency=2,
                           max_coalesce_bytes=16 << 20, request_timeout=5.0)
    try:
        reader = LayerReader(digest, layer, src, fetcher, read_deadline=10.0)
        reader.fill.rate = 1 << 40
        src.counting.reset()
        reader.prefetch_then_rest()
        assert reader.stats.as_dict()["state"] == "complete"
        starts = [a for a, _ in src.counting.ranges]
        assert len(starts) == len(set(starts)), starts   # no span asked for twice
        assert src.counting.bytes_read == sum(
            layer.index.span_end(i)[0] - p.cin for i, p in enumerate(layer.index.checkpoints))
    finally:
        fetcher.close()


def test_a_multi_range_prefetch_that_fails_leaves_its_chunks_to_reads(tmp_path: Path) -> None:
    class Failing(ManyRangeSource):
        def read_many(self, ranges: Sequence[tuple[int, int]], *,
                      timeout: float | None = None) -> list[bytes]:
            raise Unavailable("the registry went away mid-answer")

    tree = metadata_tar()
    reader, _, _ = make(tmp_path, "zstd:chunked", tar=tree.tar,
                        prefetch=["usr/lib/big.so"], source=Failing)
    big = reader.layer.resolve("usr/lib/big.so")
    reader.prefetcher.ranges = [(big.chunks[0].offset, big.chunks[0].end_offset),
                              (big.chunks[5].offset, big.chunks[5].end_offset)]
    reader.prefetcher.prefetch()            # logged and counted, not raised; nothing waits
    assert reader.cache is not None and big.chunks[0].digest not in reader.cache
    assert reader.stats.as_dict()["errors"]
    assert read_all(reader, "usr/lib/big.so") == tree.files["usr/lib/big.so"]


def test_runs_are_packed_by_bytes_and_parts_and_an_empty_range_goes_alone() -> None:
    def run(a: int, b: int) -> list[Chunk]:
        return [Chunk(a, b, 0, 5, f"d{a}")]

    runs = [run(0, 10), run(20, 20), run(50, 60), run(70, 80), run(90, 100), run(200, 290)]
    packs = pack_runs(runs, 40, 2)
    assert [[r[0].offset for r in p] for p in packs] == [[0], [20], [50, 70], [90], [200]]


def test_housekeeping_waits_for_the_prefetch_and_a_pause_in_the_reads(tmp_path: Path) -> None:
    """wait_start_up (what the TOC's compaction waits for after a mount) returns only once
    the prefetch has ended and no read was served for QUIET_SECONDS; closing the layer ends
    the wait at once, in any of its stages (each of which would last an hour here)."""
    tree = metadata_tar()
    reader, src, _ = make(tmp_path, "zstd:chunked", tar=tree.tar,
                          prefetch=["usr/lib/big.so", "etc/os-release"])
    reader.fill.rate = 0
    assert reader.prefetcher.wanted
    src.gate.clear()                        # the prefetch's requests wait
    returned: list[float] = []
    waiter = threading.Thread(
        target=lambda: reader.wait_start_up(0.0, 30.0) and returned.append(time.monotonic()))
    waiter.start()
    prefetch = threading.Thread(target=reader.prefetch_then_rest)
    prefetch.start()
    time.sleep(0.5)
    assert not returned                     # the prefetch is under way
    read_at = time.monotonic()
    reader.fetcher.note_read()              # and the start-up reads
    src.gate.set()
    prefetch.join(10)
    waiter.join(10)
    assert not prefetch.is_alive() and not waiter.is_alive()
    # a lower bound, which a busy machine only makes longer: the quiet is counted from the
    # read, which came after read_at
    assert returned and returned[0] - read_at >= QUIET_SECONDS

    for stage, after in (("the first wait", 3600.0), ("the prefetch", 0.0),
                         ("the reads", 0.0)):
        layer, gated, _ = make(tmp_path / stage.replace(" ", "-"), "zstd:chunked",
                               tar=tree.tar, prefetch=["usr/lib/big.so"])
        layer.fill.rate = 0
        gated.gate.clear()
        results: list[bool] = []
        t = threading.Thread(target=lambda r=layer, a=after, out=results: out.append(
            r.wait_start_up(a, 3600.0)), daemon=True)
        if stage == "the reads":
            layer._prefetched.set()           # the prefetch ended; the reads go on
            keep_reading = threading.Event()

            def reads(r: LayerReader = layer, go: threading.Event = keep_reading) -> None:
                while not go.wait(0.05):
                    r.fetcher.note_read()
            layer.fetcher.note_read()
            reading = threading.Thread(target=reads, daemon=True)
            reading.start()
        elif stage == "the prefetch":
            threading.Thread(target=layer.prefetch_then_rest, daemon=True).start()
        t.start()
        try:
            time.sleep(0.4)
            assert not results, stage
            layer.close()
            t.join(60)
            assert not t.is_alive(), f"closing the layer did not end {stage}"
        finally:
            if stage == "the reads":
                keep_reading.set()
            gated.gate.set()
        assert results == [False], stage


def test_a_layer_restored_after_a_restart_is_compacted_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No start-up waits on a layer the server restored: its TOC is compacted without waiting
    for a prefetch (none ran here) or a pause in the reads (each an hour long here)."""
    monkeypatch.setattr(layers_module, "COMPACT_AFTER", 3600.0)
    monkeypatch.setattr(layers_module, "COMPACT_WAIT", 3600.0)
    tree = metadata_tar()
    reader, _, _ = make(tmp_path, "zstd:chunked", tar=tree.tar, prefetch=["usr/lib/big.so"])
    assert reader.prefetcher.wanted
    assert reader.layer.toc.entries._index is not None        # not compacted yet
    # in a thread of its own, as the server runs it: it nices the thread that calls it
    t = threading.Thread(target=_index_then_trim, args=(reader,), kwargs={"at_once": True},
                         daemon=True)
    t.start()
    try:
        t.join(60)
        assert not t.is_alive(), "the restored layer waits for a start-up"
    finally:
        reader.close()                  # ends such a wait
    assert reader.layer.toc.entries._index is None            # compacted
