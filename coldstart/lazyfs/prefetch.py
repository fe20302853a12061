"""The start-up prefetch: a layer's start-up set fetched in bulk as soon as it is mounted.

A layer names its start-up set by a prefetch landmark (the files before it in the TOC: ours,
ctr-remote's), by the compressed ranges a recorded start-up touched (the layer's
prefetch-ranges annotation), or through a gzip index (its files, named apart from the blob's
order). :class:`Prefetcher` fetches that set, concurrently with the container's start, at
on-demand priority, in a few large range requests, each verified chunk also handed to the
kernel's page cache (:class:`~coldstart.lazyfs.pagecache.PageCacheWarmer`).

The :class:`~coldstart.lazyfs.reader.LayerReader` owns one per layer; its
:meth:`~coldstart.lazyfs.reader.LayerReader.prefetch_then_rest` (the thread the FUSE server
starts after a mount) runs :meth:`Prefetcher.prefetch`, then the background fill
(:mod:`~coldstart.lazyfs.fill`).
"""

from __future__ import annotations

import bisect
import logging
import time

from coldstart.errors import ColdstartError
from coldstart.format.layer import SeekableLayer
from coldstart.format.toc import PREFETCH_LANDMARK, Chunk
from coldstart.lazyfs.batches import (
    Landing,
    batches,
    growing_batches,
    is_local,
    settle,
    unique_chunks,
    warms,
)
from coldstart.lazyfs.fetcher import BIG_PREFETCH_WAIT, ChunkFetcher
from coldstart.lazyfs.pagecache import PageCacheWarmer
from coldstart.lazyfs.target import PREFETCH, FetchTarget

__all__ = ["PREFETCH_FIRST", "PREFETCH_GROWTH", "PREFETCH_REQUEST", "Prefetcher"]

log = logging.getLogger(__name__)

#: Compressed bytes of the first prefetch request; each next one is ``PREFETCH_GROWTH`` times
#: as large, up to ``PREFETCH_REQUEST``; at most ``PREFETCH_STREAMS`` per layer are in flight.
PREFETCH_FIRST = 4 << 20
#: (64 MiB before: the server image's 2.1 GB set of weights then held four of them and their
#: decoded chunks at once, the FUSE server at 566 MB; issue 49)
PREFETCH_REQUEST = 16 << 20
PREFETCH_STREAMS = 4
PREFETCH_GROWTH = 4
#: Chunks of the prefetch set this many compressed bytes apart share a request (the bytes of
#: the untouched chunks between them are fetched and dropped): fewer round trips. A source
#: that reads several ranges in one request (a registry answering multi-range requests)
#: is asked the runs apart instead, the bytes between them left out
#: (:data:`~coldstart.lazyfs.coalesce.MULTI_BYTES`).
PREFETCH_GAP = 1 << 20


class Prefetcher:
    """The start-up prefetch of one layer (see the module docstring)."""

    def __init__(self, target: FetchTarget, fetcher: ChunkFetcher, *,
                 read_deadline: float) -> None:
        self.target = target
        self.layer: SeekableLayer = target.layer
        self.fetcher = fetcher
        self.cache = fetcher.cache
        self.read_deadline = read_deadline
        #: the compressed ranges of the prefetch span the recorded start-up touched (the
        #: layer's prefetch-ranges annotation, or what its index names); None: prefetch the
        #: whole span
        self.ranges: list[tuple[int, int]] | None = list(self.layer.prefetch_ranges) or None
        #: hands each prefetched chunk, once verified, to the kernel's page cache (set by the
        #: reader's owner after the mount, see
        #: :attr:`~coldstart.lazyfs.reader.LayerReader.page_cache`)
        self.page_cache: PageCacheWarmer | None = None

    @property
    def wanted(self) -> bool:
        """Whether the layer names a start-up set (a landmark, or touched chunk ranges)."""
        return bool(self.layer.toc.prefetch or self.ranges)

    def prefetch(self) -> int:
        """Fetch the chunks of the TOC's prefetch list (the start-up set before the prefetch
        landmark) in bulk; blocks, returns the compressed bytes fetched.

        Runs in a thread of the server as soon as the layer is mounted, concurrently with the
        container's start, at on-demand priority: in blob order (the profile's access order),
        in a few large range requests, the first small (the start-up wants its first files at
        once) and each next one ``PREFETCH_GROWTH`` times as large up to ``PREFETCH_REQUEST``;
        at most ``PREFETCH_STREAMS`` per layer and half the fetch pool node-wide at a time, so
        that the pool keeps threads for reads of files outside the set. With the layer's
        prefetch-ranges annotation only the chunks the recorded start-up touched are fetched.
        A set named apart from the blob's order (a gzip index's: its spans lie where the
        image's producer put the files) goes one range per request instead, in the order the
        start-up first read them, each decoded by its own pool thread as it arrives (a span
        only as far as the set's pieces reach; its other pieces are cached when the node is
        quiet: :meth:`~coldstart.lazyfs.fetcher.ChunkFetcher._defer_spread`).
        A set of ``BIG_PREFETCH`` bytes or more (a checkpoint) waits while smaller sets (the
        start-up's code) are prefetched on the node, ``BIG_PREFETCH_WAIT`` seconds at most.
        A read that needs a chunk in flight joins its fetch. Errors are logged and counted,
        not raised: the chunks they concern are left to on-demand reads.
        """
        stats = self.target.stats
        if self.ranges:
            # the chunks the recorded start-up touched (the layer's prefetch-ranges
            # annotation), wherever they lie: behind a landmark or not
            wanted = self._touched_chunks()
        else:
            wanted = unique_chunks(self.layer, self.layer.toc.prefetch)
        todo: list[Chunk] = []
        local: list[Chunk] = []
        for c in wanted:
            (local if is_local(self.cache, c) else todo).append(c)
        warmer = self.page_cache
        if warmer is not None and local:
            # on a node that has them already, the start-up's chunks still go to the page
            # cache (read from the chunk cache here, in this thread)
            self._warm_from_cache(warmer, local)
        with stats._lock:
            stats.state = "prefetching"
        with self.fetcher.prefetching(sum(c.compressed_size for c in todo)) as big:
            fetched = self._fetch(todo, warmer, big)
        with stats._lock:
            stats.prefetch_done = True
            stats.state = "on-demand"
        log.info("layer %s: prefetched %d chunks, %d bytes", self.target.digest, len(todo),
                 fetched)
        return fetched

    def _fetch(self, todo: list[Chunk], warmer: PageCacheWarmer | None, big: bool) -> int:
        """Fetch ``todo`` (see :meth:`prefetch`); ``big``: a set that waits while smaller
        ones are prefetched on the node (:meth:`ChunkFetcher.wait_small_prefetches`)."""
        stop = self.target.stopped
        fetched = 0
        window: list[Landing] = []
        room = max(1, self.fetcher.pool_size // 2)
        until = time.monotonic() + BIG_PREFETCH_WAIT
        if self._named_apart():
            # the set is scattered over the blob (a gzip index's): its ranges in the order the
            # start-up first read them, one request each, several in flight, each decoded by
            # its own thread as it arrives (a large request is decoded by one thread, after
            # all of it arrived)
            planned = batches(self._access_order(todo), 1)
        else:
            planned = growing_batches(todo, PREFETCH_FIRST, PREFETCH_REQUEST,
                                      growth=PREFETCH_GROWTH)
        for batch in planned:
            if stop.is_set():
                break
            if big:     # the start-up's code and libraries first
                self.fetcher.wait_small_prefetches(until, stop)
            # half the pool at most, node-wide: reads of files outside the set find threads
            self.fetcher.wait_prefetch_room(room, self.read_deadline)
            try:
                landing = Landing(self.fetcher.request(self.target, batch, kind=PREFETCH,
                                                       max_bytes=PREFETCH_REQUEST + PREFETCH_GAP,
                                                       max_gap=PREFETCH_GAP,
                                                       unread=warms(warmer)), warmer)
            except ColdstartError:
                break
            window.append(landing)
            if len(window) >= PREFETCH_STREAMS:
                fetched += settle(window.pop(0), self.read_deadline * 4)
        for landing in window:
            fetched += settle(landing, self.read_deadline * 4)
        return fetched

    def _warm_from_cache(self, warmer: PageCacheWarmer, chunks: list[Chunk]) -> None:
        cache = self.cache
        for c in chunks:
            if self.target.stopped.is_set() or cache is None:
                return
            if c.zeros or not c.digest:
                continue
            try:   # (a chunk the cache keeps encoded stays so: the page cache gets it)
                data = cache.get(c.digest, expected_size=c.chunk_size, keep=False)
            except (ColdstartError, OSError):
                data = None
            if data is not None:
                warmer.put(c, data, wait=True)

    def _touched_chunks(self) -> list[Chunk]:
        """The chunks the prefetch ranges name (the layer's annotation, or for a set named
        apart from the blob's order, a gzip index's, among that set's files), in blob order.
        A layer written with its start-up files first (a landmark) holds them all in its
        prefetch span when the ranges end within it: only those entries are looked at, not
        the whole TOC (building every entry of a large layer costs a start-up about half a
        second)."""
        ranges = self.ranges or []
        toc = self.layer.toc
        if self._named_apart():
            return [c for c in unique_chunks(self.layer, toc.prefetch) if self._touched(c)]
        mark = toc.entries.get(PREFETCH_LANDMARK)
        if toc.prefetch and mark is not None and mark.chunks:
            front = unique_chunks(self.layer, toc.prefetch)
            span = max((c.end_offset for c in front), default=0)
            # the writers that put a landmark (ours, ctr-remote's) store the files before it
            # first, in TOC order: so the blob up to the landmark's own data holds their
            # chunks and no others (checked: the landmark lies past them all)
            if span <= mark.chunks[0].offset and all(hi <= span for _, hi in ranges):
                return [c for c in front if self._touched(c)]
        return [c for c in unique_chunks(self.layer) if self._touched(c)]

    def _named_apart(self) -> bool:
        """Whether the layer names its start-up files apart from its order (a gzip index's
        set: the files lie where the image's producer put them, landmark or not)."""
        return self.layer.prefetch_named_apart and bool(self.layer.toc.prefetch)

    def _access_order(self, chunks: list[Chunk]) -> list[Chunk]:
        """``chunks`` ordered by the first start-up file (``toc.prefetch``, in access order)
        that has a chunk in their compressed range; a range's chunks stay together."""
        rank: dict[int, int] = {}
        entries = self.layer.toc.entries
        for i, name in enumerate(self.layer.toc.prefetch):
            e = entries.get(name)
            for c in e.chunks if e is not None else ():
                rank.setdefault(c.offset, i)
        last = len(self.layer.toc.prefetch)
        return sorted(chunks, key=lambda c: (rank.get(c.offset, last), c.offset, c.inner_offset))

    def _touched(self, c: Chunk) -> bool:
        """Whether the recorded start-up touched chunk ``c`` (True when nothing says)."""
        ranges = self.ranges
        if ranges is None:
            return True
        i = bisect.bisect_right(ranges, (c.offset, 1 << 62)) - 1
        return i >= 0 and ranges[i][1] > c.offset
