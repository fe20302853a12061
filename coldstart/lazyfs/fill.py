"""The background fill: the rest of a layer fetched after its start-up, so the node ends with
the whole layer local (DESIGN, "Hybrid fill").

Once the start-up prefetch (:mod:`~coldstart.lazyfs.prefetch`) has ended, :class:`BackgroundFill`
fetches every other chunk of the layer: the prefetch set first (what it left), then the small
files' chunks, then the big files' (:meth:`BackgroundFill.fill_order`, each part in blob order),
in large requests, at a bounded rate, yielding to on-demand reads and to the node's metadata
requests (a start-up's lookups, a ``find``), so a start-up that reads widely waits on few
round trips and a complete layer never touches the network again. Its plan is made as it is
fetched, so its memory does not grow with the layer's files.

Everything about when and how the fill runs is here: :meth:`BackgroundFill.after_start_up`
(its thread niced, then waiting for a pause in the reads and for the prefetch's deferred spreads)
and :meth:`BackgroundFill.fetch_rest` (its order, batches, window of requests and pacing). The
thread is the one the FUSE server starts after a mount
(:meth:`~coldstart.lazyfs.reader.LayerReader.prefetch_then_rest`, after the prefetch); its
requests run in the fetcher's low-priority ``fill`` pool
(:meth:`~coldstart.lazyfs.fetcher.ChunkFetcher.request`, ``background=True``), which holds them
while on-demand fetches are in flight. The :class:`~coldstart.lazyfs.reader.LayerReader` owns
one per layer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator

from coldstart.config import FetchConfig
from coldstart.errors import ColdstartError
from coldstart.format.layer import SeekableLayer
from coldstart.format.toc import Chunk
from coldstart.lazyfs.batches import (
    Landing,
    first_per_range,
    fits_in_cache,
    is_local,
    iter_batches,
    range_bytes,
    ranges,
    unique_chunks,
)
from coldstart.lazyfs.fetcher import ChunkFetcher, lower_priority
from coldstart.lazyfs.target import FILL, FetchTarget

__all__ = ["BACKGROUND_CHUNKS", "BACKGROUND_DEPTH", "BACKGROUND_REQUEST", "BackgroundFill"]

log = logging.getLogger(__name__)

#: the fill's defaults, from the one config tree (CONVENTIONS §9)
_DEFAULTS = FetchConfig()

#: Compressed bytes per request of the background fetch of the rest of a layer: large enough
#: that requests are few, small enough that a read waiting on one is not held up long.
BACKGROUND_REQUEST = 4 << 20
#: The background fetch keeps this many requests outstanding.
BACKGROUND_DEPTH = 2
#: Chunks per request at most: a layer of small files puts thousands in 4 MiB, whose
#: decoding, hashing and caching then hold the GIL for a second in one go; with this many, a
#: request is some tens of milliseconds of that, between two looks at the node's FUSE requests.
BACKGROUND_CHUNKS = 1024
#: Regular files the fill's plan makes between two waits for a pause in the FUSE requests
#: (a few milliseconds of making entries).
PLAN_STEP = 1024
#: The fill fetches more only while the chunk cache's writer has at most this much left to
#: write (bytes, chunks): it never runs ahead of the disk, and the rest of the backlog's room
#: stays the on-demand reads'.
FILL_BACKLOG = (32 << 20, 4096)


class BackgroundFill:
    """The background fill of one layer (see the module docstring).

    ``rate``: compressed bytes a second at most (0: no fill). ``small_file_bytes``: files up to
    this size are filled before the big ones (the reader's small-file limit)."""

    def __init__(self, target: FetchTarget, fetcher: ChunkFetcher, *, small_file_bytes: int,
                 read_deadline: float, rate: int = _DEFAULTS.background_rate) -> None:
        self.target = target
        self.layer: SeekableLayer = target.layer
        self.fetcher = fetcher
        self.cache = fetcher.cache
        self.small_file_bytes = small_file_bytes
        self.read_deadline = read_deadline
        self.rate = max(0, rate)

    def after_start_up(self) -> None:
        """The fill as the FUSE server runs it, in the mount's thread once the prefetch has
        ended: the rest is background work, so this thread yields the CPU from here on, and
        plans the fill (every entry of the TOC) only once the start-up pauses; the spans the
        prefetch holds are spread first (the fill would fetch them again). Nothing at rate 0.
        """
        if self.rate <= 0:
            return
        lower_priority()
        self.fetcher.wait_quiet(stop=self.target.stopped)
        self.fetcher.wait_deferred(stop=self.target.stopped)
        self.fetch_rest()

    def fill_order(self) -> Iterator[Chunk]:
        """Every chunk of the layer in the order the fill fetches it, each once (a chunk is
        one file's; the prefetch set's are not repeated): the prefetch set first (in blob
        order), then the small files' chunks, then the big files' (each part in the layer's
        order, the blob's in the formats read here).

        Made as it is fetched, an entry at a time (:meth:`~coldstart.format.toc.TOCEntries.made`,
        not kept): a plan held whole was every chunk of the layer as objects, some 200 MB
        for 200,000 files. Every ``PLAN_STEP`` entries it waits for a pause in the node's
        FUSE requests (:meth:`~coldstart.lazyfs.fetcher.ChunkFetcher.wait_quiet`), so making
        it never holds the GIL while a start-up looks its files up or lists its directories.
        """
        entries = self.layer.toc.entries
        first = unique_chunks(self.layer, self.layer.toc.prefetch)
        yield from first
        taken = {(c.offset, c.inner_offset) for c in first}
        big: list[int] = []
        made = 0
        for i, kind in enumerate(entries.types):
            if kind != "reg":
                continue
            made += 1
            if not made % PLAN_STEP and not self._pause():
                return
            e = entries.made(i)
            if e.size > self.small_file_bytes:
                big.append(i)
                continue
            yield from (c for c in e.chunks
                        if not c.zeros and (c.offset, c.inner_offset) not in taken)
        for n, i in enumerate(big, 1):
            if not n % PLAN_STEP and not self._pause():
                return
            yield from (c for c in entries.made(i).chunks
                        if not c.zeros and (c.offset, c.inner_offset) not in taken)

    def _pause(self) -> bool:
        """Wait for a pause in the node's FUSE requests, and for the chunk cache's writer to
        be within ``FILL_BACKLOG``; False once the layer is no longer served."""
        stop = self.target.stopped
        self.fetcher.wait_quiet(stop=stop)
        wait_backlog = getattr(self.cache, "wait_backlog", None)
        if wait_backlog is not None:
            while not stop.is_set() and not wait_backlog(*FILL_BACKLOG, 1.0, stop):
                self.fetcher.wait_quiet(stop=stop)
        return not stop.is_set()

    def _measure(self) -> tuple[int, int]:
        """(compressed bytes, decoded bytes) of :meth:`fill_order`'s chunks; a compressed
        range that several chunks share is counted once (in a row, or: an indexed gzip
        layer's few spans, anywhere)."""
        compressed = decoded = 0
        last = (-1, -1)
        seen: set[tuple[int, int]] | None = set() if self.layer.spreads else None
        for c in self.fill_order():
            decoded += c.chunk_size
            here = (c.offset, c.end_offset)
            if here != last and (seen is None or here not in seen):
                compressed += c.compressed_size
                if seen is not None:
                    seen.add(here)
            last = here
        return compressed, decoded

    def fetch_rest(self, *, clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], object] = time.sleep) -> int:
        """The hybrid fill: fetch every chunk not yet local, in :meth:`fill_order`, at most
        ``rate`` bytes a second (0: do nothing); blocks, returns the compressed bytes fetched.

        Requests are ``BACKGROUND_REQUEST`` bytes, ``BACKGROUND_DEPTH`` outstanding, run in
        the fetcher's low-priority (niced) thread and wait while on-demand fetches are in
        flight or the node's FUSE requests have not paused: a read jumps the queue and is
        never starved. A read that needs a chunk already in one of them joins that fetch
        (single flight) instead of asking again. Errors are logged and counted; the chunks
        they concern are simply left for on-demand reads. When every chunk is local the
        layer's state becomes ``complete``.
        """
        rate = self.rate
        if rate <= 0:
            return 0
        stats = self.target.stats
        stop = self.target.stopped
        cache = self.cache
        total, decoded = self._measure()
        if stop.is_set() or not fits_in_cache(self.target, cache, decoded):
            return 0
        with stats._lock:
            stats.state = "filling"
            stats.total_bytes = total
        fetched = 0
        local = 0       # compressed bytes known local: found cached, or fetched by the fill
        start = clock()

        # a range is counted once: a batch holds every chunk of the ranges it touches
        # (iter_batches), but an indexed gzip layer's span holds pieces of files in several
        # parts of the order (its few spans are remembered)
        counted: set[tuple[int, int]] | None = set() if self.layer.spreads else None

        def count(done: Iterable[tuple[int, int]]) -> None:
            nonlocal local
            if counted is not None:
                done = [r for r in done if r not in counted]
                counted.update(done)
            local += sum(b - a for a, b in done)
            with stats._lock:       # what a span's repeats still miscount: at most all
                stats.local_bytes = min(local, total)

        def landed(nbytes: int, landing: Landing) -> int:
            count(ranges(landing.wait(self.read_deadline * 4)))
            return nbytes

        def run(planned: Iterable[list[Chunk]], one_per_span: bool) -> bool:
            """Fetch ``planned`` paced at ``rate``; False if stopped or a request failed."""
            nonlocal fetched
            window: list[tuple[int, Landing]] = []
            ok = True
            for batch in planned:
                if stop.is_set():
                    ok = False
                    break
                if not self._pause():
                    ok = False
                    break
                want = [c for c in batch if not is_local(cache, c, indexed=True)]
                wanted = ranges(want)
                count(r for r in ranges(batch) if r not in wanted)
                if not want:
                    continue
                if one_per_span:
                    want = first_per_range(want)
                try:
                    landing = Landing(self.fetcher.request(self.target, want, background=True,
                                                           max_bytes=BACKGROUND_REQUEST,
                                                           kind=FILL))
                except ColdstartError:
                    ok = False
                    break
                window.append((range_bytes(want), landing))
                if len(window) >= BACKGROUND_DEPTH:
                    nbytes, oldest = window.pop(0)
                    fetched += landed(nbytes, oldest)
                    # token bucket with no burst: never ahead of rate x elapsed
                    ahead = fetched / rate - (clock() - start)
                    if ahead > 0:
                        sleep(ahead)
            for nbytes, landing in window:
                fetched += landed(nbytes, landing)
            return ok

        def planned(chunks: Iterable[Chunk]) -> Iterator[list[Chunk]]:
            return iter_batches(chunks, BACKGROUND_REQUEST, BACKGROUND_REQUEST,
                                most=BACKGROUND_CHUNKS)

        def missing() -> Iterator[Chunk]:
            return (c for c in self.fill_order() if not is_local(cache, c, indexed=True))

        spreads = self.layer.spreads
        # where decoding one piece of a span caches the others (an indexed gzip layer), one
        # piece per span is asked for; a span handed out before in this mount (its pieces since
        # evicted), or a piece whose digest another fetch had in flight, leaves pieces
        # missing: those are then asked for one by one
        if run(planned(self.fill_order()), spreads) and spreads:
            run(planned(missing()), False)
        # the scan ends early, finding nothing, once the layer is no longer served: only a
        # scan that ran to its end with nothing missing says complete
        complete = next(missing(), None) is None and not stop.is_set()
        with stats._lock:
            stats.background_done = True
            stats.local_bytes = total if complete else stats.local_bytes
            stats.state = "complete" if complete else "on-demand"
        log.info("layer %s: background fill %s, %d bytes in %.1f s", self.target.digest,
                 "complete" if complete else "stopped", fetched, clock() - start)
        return fetched
