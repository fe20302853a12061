"""What a prefetch keeps in memory: its chunks wait for the disk in their compressed form (the
page cache has them decoded), and nothing holds a decoded chunk once it is settled."""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import pytest

from coldstart.cache import ChunkCache
from coldstart.cache import chunks as chunks_module
from coldstart.cache.chunks import _Encoded
from coldstart.errors import Unavailable
from coldstart.format.toc import Chunk
from coldstart.lazyfs import fetcher as fetcher_module
from coldstart.lazyfs.batches import Landing
from coldstart.lazyfs.fetcher import ChunkFetcher
from coldstart.lazyfs.pagecache import PageCacheWarmer
from coldstart.lazyfs.reader import LayerReader
from coldstart.lazyfs.target import PREFETCH
from tests.integration.lazy.lazy_helpers import SourceTree, metadata_tar
from tests.unit.lazy.test_lazy_cache import wait_until
from tests.unit.lazy.test_lazy_reader import FORMATS, GatedSource, make, read_all

BIG = "usr/lib/big.so"


def pending(cache: ChunkCache, c: Chunk) -> int | bytes | None:
    """How ``cache`` holds ``c`` until it is written: the bytes it keeps of the encoded
    form, ``b"decoded"``, or None (not pending)."""
    got = cache._pending.get(c.digest.removeprefix("sha256:"))
    if got is None:
        return None
    return got.held if isinstance(got, _Encoded) else b"decoded"


def hold_writes(cache: ChunkCache, monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """The node is reading: ``cache`` keeps its background writes pending until the returned
    function opens the gate."""
    monkeypatch.setattr(chunks_module, "_GATE_WAIT", 600.0)  # no give-up on a slow machine
    opened = threading.Event()
    cache.write_gate = opened.wait
    return opened.set


def warm(reader: LayerReader, root: Path, names: list[str],
         sizes: dict[str, int]) -> dict[str, bytearray]:
    """Give ``reader`` a page-cache warmer whose stand-in kernel collects what it is given
    (by file) under ``root``."""
    got: dict[str, bytearray] = {}
    for n in names:
        (root / n).parent.mkdir(parents=True, exist_ok=True)
        (root / n).write_bytes(b"")

    def store(ino: int, offset: int, data: memoryview) -> None:
        name = next(n for n in names if os.stat(root / n).st_ino == ino)
        buf = got.setdefault(name, bytearray(sizes[name]))
        buf[offset : offset + len(data)] = data

    reader.page_cache = PageCacheWarmer(root, sizes.get, store)
    return got


def start_up(tmp_path: Path, fmt: str = "zstd:chunked", *, warmed: bool = True
             ) -> tuple[SourceTree, LayerReader, GatedSource, ChunkFetcher, ChunkCache]:
    """A layer that prefetches ``BIG``, read by a reader with (``warmed``) a page-cache warmer
    under ``tmp_path / "mnt"``; the tree, reader, source, fetcher and the fetcher's cache."""
    tree = metadata_tar()
    reader, src, fetcher = make(tmp_path, fmt, tar=tree.tar, prefetch=[BIG])
    cache = fetcher.cache
    assert isinstance(cache, ChunkCache)
    if warmed:
        warm(reader, tmp_path / "mnt", [BIG], {BIG: len(tree.files[BIG])})
    return tree, reader, src, fetcher, cache


def keeps_encoded(c: Chunk) -> bool:
    """Whether a prefetched chunk the page cache gets waits for the disk encoded (one that
    compresses poorly waits decoded: see ``KEEP_ENCODED_RATIO``)."""
    return c.end_offset - c.offset <= c.chunk_size * fetcher_module.KEEP_ENCODED_RATIO


def count_decodes(reader: LayerReader, monkeypatch: pytest.MonkeyPatch) -> Counter[Chunk]:
    """Count each chunk's decodes (the fetch's, a pending chunk's again)."""
    layer = reader.target.layer
    decode = layer.decode_chunk
    counts: Counter[Chunk] = Counter()

    def counted(c: Chunk, compressed: bytes | memoryview, *, upto: int | None = None) -> bytes:
        counts[c] += 1
        return decode(c, compressed, upto=upto)

    monkeypatch.setattr(layer, "decode_chunk", counted)
    return counts


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefetched_chunks_wait_for_the_disk_compressed_and_read_ones_decoded(
        tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    tree, reader, _, _, cache = start_up(tmp_path, fmt, warmed=False)
    pushed = warm(reader, tmp_path / "mnt", [BIG], {BIG: len(tree.files[BIG])})
    decodes = count_decodes(reader, monkeypatch)
    open_gate = hold_writes(cache, monkeypatch)
    assert reader.prefetcher.prefetch() > 0
    assert reader.page_cache is not None and reader.page_cache.join(10)
    assert bytes(pushed[BIG]) == tree.files[BIG]         # the page cache has it decoded
    big = reader.layer.resolve(BIG)
    compressed = sum(c.end_offset - c.offset for c in big.chunks)
    assert compressed < sum(c.chunk_size for c in big.chunks) / 2    # big.so compresses well
    # every chunk of big.so is pending, each as its compressed bytes, but one that compresses
    # poorly (its random part): decoded, not to be decoded and hashed once more for the disk
    kept = [c for c in big.chunks if keeps_encoded(c)]
    assert 0 < len(kept) < len(big.chunks)
    assert [pending(cache, c) for c in big.chunks] == [
        c.end_offset - c.offset if c in kept else b"decoded" for c in big.chunks]
    assert cache._pending_bytes == sum(c.end_offset - c.offset if c in kept else c.chunk_size
                                       for c in big.chunks)

    sudo = reader.layer.resolve("usr/bin/sudo")          # not prefetched: a read fetches it
    assert reader.read(sudo, 0, 100) == tree.files["usr/bin/sudo"][:100]
    first = sudo.chunks[0]
    assert pending(cache, first) == b"decoded"

    # the kernel let go of big.so's pages: reads decode each chunk once more and keep it
    assert read_all(reader, BIG, step=16 << 10) == tree.files[BIG]
    assert all(pending(cache, c) == b"decoded" for c in big.chunks)
    assert all(decodes[c] == (2 if c in kept else 1) for c in big.chunks)

    open_gate()
    assert cache.flush(30)
    assert cache._pending_bytes == 0
    # written from the kept bytes
    assert all(decodes[c] == (2 if c in kept else 1) for c in big.chunks)
    on_disk = ChunkCache(cache.dir, max_bytes=1 << 30)
    for c in [*big.chunks, first]:
        assert on_disk.get(c.digest, expected_size=c.chunk_size) is not None, c
    on_disk.close()


def test_a_prefetch_nobody_reads_is_written_from_its_compressed_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree, reader, _, _, cache = start_up(tmp_path)
    decodes = count_decodes(reader, monkeypatch)
    open_gate = hold_writes(cache, monkeypatch)
    assert reader.prefetcher.prefetch() > 0
    big = reader.layer.resolve(BIG)
    assert all(isinstance(pending(cache, c), int) == keeps_encoded(c) for c in big.chunks)
    # a second start-up of the image before the writes: its prefetch finds the chunks
    # pending and hands them to the page cache, still encoded (those kept so)
    assert reader.prefetcher.prefetch() == 0
    assert reader.page_cache is not None and reader.page_cache.join(10)
    assert all(isinstance(pending(cache, c), int) == keeps_encoded(c) for c in big.chunks)
    # the fetch's, the second start's (of those kept encoded)
    assert all(decodes[c] == (2 if keeps_encoded(c) else 1) for c in big.chunks)
    open_gate()
    assert cache.flush(30)
    # ... and the writer's
    assert all(decodes[c] == (3 if keeps_encoded(c) else 1) for c in big.chunks)
    on_disk = ChunkCache(cache.dir, max_bytes=1 << 30)
    got = b"".join(on_disk.get(c.digest, expected_size=c.chunk_size) or b"?"
                   for c in big.chunks)
    assert got == tree.files[BIG]
    on_disk.close()


@pytest.mark.parametrize("why", ["no warmer", "recording"])
def test_a_prefetch_the_page_cache_does_not_get_waits_decoded(
        tmp_path: Path, why: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a warmer that stores (none, or the layer records its reads) the start-up
    reads the prefetched chunks through the cache: they stay decoded."""
    _, reader, _, _, cache = start_up(tmp_path, warmed=why == "recording")
    if why == "recording":
        assert reader.page_cache is not None
        reader.page_cache.enabled = lambda: False
    hold_writes(cache, monkeypatch)
    assert reader.prefetcher.prefetch() > 0
    big = reader.layer.resolve(BIG)
    assert all(pending(cache, c) == b"decoded" for c in big.chunks)


def test_a_prefetched_chunk_a_read_waited_for_stays_decoded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree, reader, src, fetcher, cache = start_up(tmp_path)
    hold_writes(cache, monkeypatch)
    big = reader.layer.resolve(BIG)
    src.gate.clear()                      # the prefetch's requests wait
    prefetch = threading.Thread(target=reader.prefetcher.prefetch)
    prefetch.start()
    assert wait_until(lambda: all(cache.contains(c.digest) or fetcher.inflight() > 0
                                  for c in big.chunks[:1]))
    got: list[bytes] = []
    read = threading.Thread(target=lambda: got.append(reader.read(big, 0, 100)))
    read.start()                          # joins the first chunk's fetch
    assert wait_until(lambda: src.gate.is_set() or _joined(fetcher))
    src.gate.set()
    read.join(10)
    prefetch.join(10)
    assert got == [tree.files[BIG][:100]]
    assert pending(cache, big.chunks[0]) == b"decoded"
    assert all(isinstance(pending(cache, c), int) == keeps_encoded(c) for c in big.chunks[1:])


def _joined(fetcher: ChunkFetcher) -> bool:
    with fetcher._lock:
        return any(fl.joiners for fl in fetcher._inflight.values())


def test_a_request_keeps_no_chunk_it_has_settled(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """One request of many chunks (a prefetch's: tens of MB): a chunk's bytes are its readers'
    once it is settled, not held until the request's last chunk is decoded."""
    tree = metadata_tar()
    reader, src, fetcher = make(tmp_path, "zstd:chunked", tar=tree.tar)
    chunks = reader.layer.resolve(BIG).chunks[:6]
    layer = reader.target.layer
    decode = layer.decode_chunk
    alive: list[bool] = []
    refs: list[weakref.ref[Future[bytes]]] = []

    def decode_and_look(c: Chunk, compressed: bytes | memoryview, *,
                        upto: int | None = None) -> bytes:
        if c is chunks[-1]:          # the last one: the five before it are settled
            alive.extend(r() is not None for r in refs[:-1])
        return decode(c, compressed, upto=upto)

    monkeypatch.setattr(layer, "decode_chunk", decode_and_look)
    src.gate.clear()                 # the request waits until the futures are let go
    futures = fetcher.request(reader.target, chunks, kind=PREFETCH)
    assert src.counting.requests == 0
    refs.extend(weakref.ref(futures[c]) for c in chunks)
    last = futures[chunks[-1]]
    del futures
    src.gate.set()
    assert len(last.result(timeout=10)) == chunks[-1].chunk_size
    assert src.counting.requests == 1           # one request for the six
    assert alive == [False] * 5


def test_a_landing_says_which_chunks_came_without_keeping_them() -> None:
    chunks = [Chunk(offset=i * 10, end_offset=i * 10 + 10, chunk_offset=0, chunk_size=100,
                    digest="", owner=f"f{i}") for i in range(3)]
    futures: dict[Chunk, Future[bytes]] = {c: Future() for c in chunks}
    refs = [weakref.ref(f) for f in futures.values()]
    landing = Landing(futures)
    futures[chunks[0]].set_result(b"x" * 100)
    futures[chunks[1]].set_exception(Unavailable("registry down"))
    assert landing.wait(0.05) == [chunks[0]]         # timed out: the third is still out
    futures[chunks[2]].set_result(b"y" * 100)
    assert landing.wait(5) == [chunks[0], chunks[2]]
    del futures
    assert [r() for r in refs] == [None, None, None]  # the landing kept none of them


def test_a_checkpoint_sized_prefetch_waits_while_start_up_code_is_prefetched() -> None:
    """The start-up's code and libraries (small sets) are prefetched first on the node; a set
    the size of a checkpoint waits before each of its requests while one runs, at most until
    its deadline."""
    fetcher = ChunkFetcher(None)
    try:
        with fetcher.prefetching(fetcher_module.BIG_PREFETCH) as big:
            assert big
            fetcher.wait_small_prefetches(time.monotonic() + 60)    # only big ones: no wait
        returned = threading.Event()

        def big_set() -> None:
            fetcher.wait_small_prefetches(time.monotonic() + 60)
            returned.set()

        with fetcher.prefetching(50 << 20) as big:
            assert not big
            waiter = threading.Thread(target=big_set)
            waiter.start()
            assert not returned.wait(0.3)          # held while the small set runs
        assert returned.wait(10)                    # and let go when it ends
        waiter.join(10)
        with fetcher.prefetching(1 << 20):
            t0 = time.monotonic()
            fetcher.wait_small_prefetches(t0 + 0.2)   # never past its deadline
            assert time.monotonic() - t0 < 5
    finally:
        fetcher.close()
