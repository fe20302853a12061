"""What a layer's fetching paths share: which chunks, cut into requests, waited on lightly.

The start-up prefetch (:mod:`~coldstart.lazyfs.prefetch`), the background fill
(:mod:`~coldstart.lazyfs.fill`), a big file's stream and the read-ahead
(:mod:`~coldstart.lazyfs.streams`) and the small-file windows (:mod:`~coldstart.lazyfs.windows`)
each choose chunks of one layer and hand them to the :class:`~coldstart.lazyfs.fetcher.ChunkFetcher`
in requests of their own. The pieces they have in common live here, as plain functions and one
small class, none of which holds a layer's state:

- choosing: :func:`is_local` (cached or a hole), :func:`unique_chunks` (a layer's chunks, each
  once, in blob order), :func:`fits_in_cache` (a fill or stream that would evict its own chunks
  is skipped);
- cutting: :func:`growing_batches` and :func:`batches` (requests of a bounded, or growing, size
  that never split a compressed range shared by several chunks), :func:`first_per_range`;
- waiting: :class:`Landing` (which of one request's chunks came, without keeping their bytes),
  :func:`settle`, :func:`range_bytes`.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future

from coldstart.cache import ChunkStore
from coldstart.format.layer import SeekableLayer
from coldstart.format.toc import Chunk
from coldstart.lazyfs.pagecache import PageCacheWarmer
from coldstart.lazyfs.target import FetchTarget

__all__ = [
    "Landing",
    "batches",
    "first_per_range",
    "fits_in_cache",
    "growing_batches",
    "is_local",
    "iter_batches",
    "range_bytes",
    "ranges",
    "settle",
    "unique_chunks",
    "warms",
]

log = logging.getLogger(__name__)


def is_local(cache: ChunkStore | None, c: Chunk, *, indexed: bool = False) -> bool:
    """Whether chunk ``c`` is local: a hole, or in ``cache``, also if another process stored
    it (may ``stat``: worker and background threads only, never the FUSE loop). ``indexed``:
    as the cache's in-memory index knows it, no I/O (the background fill asks it of every
    chunk of a layer: a ``stat`` each was most of the time its plan took)."""
    if c.zeros:
        return True
    if not c.digest or cache is None:
        return False
    return cache.contains(c.digest) if indexed else c.digest in cache


def fits_in_cache(target: FetchTarget, cache: ChunkStore | None, todo: Iterable[Chunk] | int,
                  what: str = "background fill") -> bool:
    """Whether ``todo`` (a layer's or a file's chunks, or their decoded bytes) fits in the
    cache at all: a fill (or a
    file's stream) that does not would evict its own chunks and never end (it is skipped,
    and the layer's status says why). Older chunks of other layers are evicted as usual
    (LRU)."""
    limit = getattr(cache, "max_bytes", None)
    if cache is None or not isinstance(limit, int):
        return True
    total = todo if isinstance(todo, int) else sum(c.chunk_size for c in todo if not c.zeros)
    if total <= limit:
        return True
    log.warning("layer %s: %s skipped: its %d bytes do not fit in the chunk cache "
                "(cache.max_bytes %d)", target.digest, what, total, limit)
    target.stats.record_error(f"{what} skipped: it does not fit in the chunk cache "
                              "(raise cache.max_bytes)")
    return False


def unique_chunks(layer: SeekableLayer, names: list[str] | None = None) -> list[Chunk]:
    """The non-hole chunks of ``names`` (default: every regular file of ``layer``), each once,
    in blob order."""
    entries = layer.toc.entries
    files = (entries.values() if names is None
             else (e for e in (entries.get(n) for n in names) if e is not None))
    seen: set[tuple[int, int]] = set()
    out: list[Chunk] = []
    for e in files:
        if e.type != "reg":
            continue
        for c in e.chunks:
            k = (c.offset, c.inner_offset)
            if c.zeros or k in seen:
                continue
            seen.add(k)
            out.append(c)
    out.sort(key=lambda c: (c.offset, c.inner_offset))
    return out


def growing_batches(chunks: list[Chunk], first: int, limit: int, *, growth: int,
                    within: bool = False) -> list[list[Chunk]]:
    """``chunks`` (in blob order within each part of a fill or prefetch order), cut into
    batches of ``first`` compressed bytes, then ``growth`` times as many each, up to
    ``limit``: a batch ends at the first range that reaches its size, or with ``within``
    before the range that would take it past its size (a contiguous batch is then one request
    of at most that size; one range larger than that is a batch of its own). Consecutive
    chunks that share one compressed range (an indexed gzip layer's span holds many files'
    pieces) count it once and stay in one batch: a cut between them would fetch that range
    once per batch."""
    return list(iter_batches(chunks, first, limit, growth=growth, within=within))


def iter_batches(chunks: Iterable[Chunk], first: int, limit: int, *, growth: int = 1,
                 within: bool = True, most: int = 0) -> Iterator[list[Chunk]]:
    """:func:`growing_batches` as it goes: each batch once it is cut (the background fill's
    order is made as it is fetched, never held whole). ``most``: a batch also ends at the
    first range past this many chunks (0: no such limit)."""
    batch: list[Chunk] = []
    size = want = 0
    cut = False
    last = (-1, -1)
    for c in chunks:
        here = (c.offset, c.end_offset)
        if here != last:
            full = size + c.compressed_size > want if within else size >= want
            if not cut or (size and (full or 0 < most <= len(batch))):
                if batch:
                    yield batch
                want = first if not cut else min(limit, want * growth)
                cut = True
                batch = []
                size = 0
            size += c.compressed_size
            last = here
        batch.append(c)
    if batch:
        yield batch


def batches(chunks: list[Chunk], limit: int) -> list[list[Chunk]]:
    """Batches of at most ``limit`` compressed bytes each (see :func:`growing_batches`,
    ``within``): a scattered prefetch set's (one range each)."""
    return growing_batches(chunks, limit, limit, growth=1, within=True)


def first_per_range(chunks: list[Chunk]) -> list[Chunk]:
    """The first of ``chunks`` in each compressed range, in order."""
    seen: set[tuple[int, int]] = set()
    out: list[Chunk] = []
    for c in chunks:
        if (c.offset, c.end_offset) not in seen:
            seen.add((c.offset, c.end_offset))
            out.append(c)
    return out


def ranges(chunks: Iterable[Chunk]) -> set[tuple[int, int]]:
    """The compressed ranges ``chunks`` are fetched with (holes have none)."""
    return {(c.offset, c.end_offset) for c in chunks if not c.zeros}


def range_bytes(chunks: Iterable[Chunk]) -> int:
    """The compressed bytes of ``chunks``, each range counted once (chunks may share one:
    see :func:`growing_batches`)."""
    return sum(b - a for a, b in ranges(chunks))


def warms(warmer: PageCacheWarmer | None) -> bool:
    """Whether ``warmer`` stores what it is handed now (the fetcher may then keep those
    chunks encoded in the chunk cache: reads are not expected to ask it for them)."""
    return warmer is not None and warmer.takes()


def _hand_over(warmer: PageCacheWarmer, c: Chunk, f: Future[bytes]) -> None:
    """A prefetch future's done-callback (in the thread that decoded the chunk: it never
    waits; past the warmer's bound the chunk is dropped)."""
    if not f.cancelled() and f.exception() is None:
        warmer.put(c, f.result())


class Landing:
    """Which of one request's chunks came, without holding their bytes.

    A prefetch (or fill, or stream) keeps a window of requests in flight and waits for the
    oldest; holding their futures would keep every decoded chunk of the window alive until
    then (a start-up's prefetch: all of it, some 200 MB of fresh memory), where the page cache
    and the chunk cache have each chunk as soon as it is verified. Each future tells this
    when it is done (a done-callback) and is not kept. With a ``warmer``, each chunk is
    handed to it first (:func:`_hand_over`)."""

    __slots__ = ("_came", "_cv", "_left")

    def __init__(self, futures: dict[Chunk, Future[bytes]],
                 warmer: PageCacheWarmer | None = None) -> None:
        self._cv = threading.Condition()
        self._left = len(futures)
        self._came: list[Chunk] = []
        for c, f in futures.items():
            if warmer is not None:
                f.add_done_callback(functools.partial(_hand_over, warmer, c))
            f.add_done_callback(functools.partial(self._land, c))

    def _land(self, c: Chunk, f: Future[bytes]) -> None:
        came = not f.cancelled() and f.exception() is None
        with self._cv:
            if came:
                self._came.append(c)
            self._left -= 1
            if self._left <= 0:
                self._cv.notify_all()

    def wait(self, timeout: float) -> list[Chunk]:
        """Wait until every chunk is done (``timeout`` seconds at most); those that came."""
        with self._cv:
            self._cv.wait_for(lambda: self._left <= 0, timeout)
            return list(self._came)


def settle(landing: Landing, timeout: float) -> int:
    """Wait for ``landing``; the compressed bytes of the chunks that came (see
    :func:`range_bytes`)."""
    return range_bytes(landing.wait(timeout))
