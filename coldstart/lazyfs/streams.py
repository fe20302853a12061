"""Sequential reads: a file read in order gets its next chunks fetched ahead, and a big file
being loaded whole is streamed to its end.

Two patterns, one bookkeeping (where each file's recent runs of reads end):

- **read-ahead**: a file read sequentially gets its next chunks fetched ahead, in the
  background (``READAHEAD_BYTES``, widening while the reader keeps going in order, up to
  ``READAHEAD_MAX_BYTES``); from the FUSE loop the choosing runs in the fetcher's planner
  thread, and a window known local or requested already is not planned again;
- **streams**: a big file (``STREAM_MIN_FILE``) with a long run of adjacent reads is being
  loaded whole (a weights loader): the rest of it is fetched in file order, a few large
  requests in flight, in a thread of its own (one stream at a time on the node:
  :attr:`~coldstart.lazyfs.fetcher.ChunkFetcher.stream_slot`); each verified chunk also goes
  to the page cache.

:class:`SequentialReads` holds one layer's state for both (per file: where its runs end, its
streak, its chunk starts, how far ahead it is planned; per big file: its run, whether it was
streamed). The :class:`~coldstart.lazyfs.reader.LayerReader` owns one and calls
:meth:`SequentialReads.note_read` after each read and :meth:`SequentialReads.note_run` on each
read of a big file. ``readahead_bytes`` 0 switches both off.
"""

from __future__ import annotations

import bisect
import logging
import threading

from coldstart.errors import ColdstartError
from coldstart.format.toc import Chunk, Entry
from coldstart.lazyfs.batches import Landing, fits_in_cache, is_local, settle
from coldstart.lazyfs.fetcher import ChunkFetcher
from coldstart.lazyfs.pagecache import PageCacheWarmer
from coldstart.lazyfs.target import FetchTarget

__all__ = ["READAHEAD_BYTES", "READAHEAD_MAX_BYTES", "STREAM_MIN_FILE", "SequentialReads"]

log = logging.getLogger(__name__)

#: Compressed bytes fetched ahead of a sequential reader.
READAHEAD_BYTES = 8 << 20
#: A file read sequentially for long gets a wider window: it doubles every two chunks the
#: reader enters in order, up to this many compressed bytes (a multi-GB weights file streams
#: at the link's rate instead of waiting at each window's start); a jump starts over.
READAHEAD_MAX_BYTES = 64 << 20
#: Read-ahead is split into requests of about this size, fetched and decoded in parallel.
READAHEAD_REQUEST = 1 << 20
#: A read-ahead that finds its whole window local checks up to this many chunks further (in
#: memory), so a sequential read of a warm file asks the planner thread only now and then.
_LOOK_FURTHER = 64
#: Sequential runs tracked per file: torch copies a big tensor out of a mapping with one
#: thread per core, which reads the file as that many interleaved runs.
RUNS_PER_FILE = 4
#: A file of at least ``STREAM_MIN_FILE`` bytes with a run of adjacent reads (within
#: ``STREAM_SLACK``, forward or backward: a ``memcpy`` out of a mapping may fault its pages in
#: from the end down; one of ``RUNS_PER_FILE`` interleaved runs) of ``STREAM_TRIGGER`` bytes
#: is being loaded whole (a weights loader, walking its tensors in name order, not file
#: order): the rest of the file is then fetched in file order, ``STREAM_STREAMS`` requests of
#: ``STREAM_REQUEST`` compressed bytes in flight, at the link's rate. A read elsewhere in the
#: file joins its chunk's fetch or fetches it itself, ahead of the stream. Scattered reads of
#: a big file (a shared library's pages) make no such run. (``STREAM_MIN_FILE`` is checked by
#: the reader, which calls :meth:`SequentialReads.note_run` only for files that large.)
STREAM_MIN_FILE = 256 << 20
STREAM_TRIGGER = 32 << 20
STREAM_SLACK = 2 << 20
STREAM_REQUEST = 8 << 20
STREAM_STREAMS = 4


class SequentialReads:
    """Read-ahead and whole-file streams of one layer (see the module docstring)."""

    def __init__(self, target: FetchTarget, fetcher: ChunkFetcher, *, read_deadline: float,
                 readahead_bytes: int = READAHEAD_BYTES,
                 readahead_max_bytes: int = READAHEAD_MAX_BYTES) -> None:
        self.target = target
        self.fetcher = fetcher
        self.cache = fetcher.cache
        self.read_deadline = read_deadline
        self.readahead_bytes = readahead_bytes
        self.readahead_max_bytes = max(readahead_bytes, readahead_max_bytes)
        #: where a stream hands each verified chunk (set by the reader's owner after the
        #: mount, see :attr:`~coldstart.lazyfs.reader.LayerReader.page_cache`)
        self.page_cache: PageCacheWarmer | None = None
        # per file: where its recent runs of reads end (a few: a loader copying a tensor
        # with several threads reads it as that many interleaved sequential runs)
        self._last_end: dict[str, list[int]] = {}
        # per big file: the blob-independent (lo, hi) file range of its current run of
        # adjacent reads; the files whose rest is being (or was) streamed
        self._runs: dict[str, list[tuple[int, int]]] = {}
        self._streamed: set[str] = set()
        self._streak: dict[str, int] = {}   # per file: chunks entered in order since a jump
        self._chunk_starts: dict[str, list[int]] = {}
        # per file: (first chunk index of the last read-ahead window, chunk index up to which
        # the chunks after it are known local or requested, the cache's eviction count then);
        # the loop replans only past it, or once the cache has evicted anything since
        self._planned: dict[str, tuple[int, int, int]] = {}
        self._lock = threading.Lock()

    # -- read-ahead --------------------------------------------------------------------------

    def note_read(self, entry: Entry, offset: int, end: int, chunks: list[Chunk], *,
                  plan: bool) -> None:
        """Track the reader's position; a sequential reader entering a new chunk gets the
        next chunks fetched ahead, chosen here (worker) or, from the loop (``plan``), in the
        fetcher's planner thread."""
        if self.readahead_bytes <= 0 or not chunks:
            return
        enters = any(offset <= c.chunk_offset < end for c in chunks)
        with self._lock:
            ends = self._last_end.get(entry.name)
            if ends is None:
                if len(self._last_end) > 4096:
                    self._last_end.clear()
                    self._streak.clear()
                ends = self._last_end[entry.name] = []
            sequential = offset > 0 and offset in ends
            if sequential:
                ends.remove(offset)         # the run goes on: it becomes the newest
            if end in ends:
                ends.remove(end)
            ends.append(end)
            del ends[:-RUNS_PER_FILE]
            if not sequential:
                self._streak.pop(entry.name, None)
            elif enters:
                self._streak[entry.name] = self._streak.get(entry.name, 0) + 1
        if not sequential:
            return
        if plan and not enters:
            return      # still inside the chunk whose read-ahead was planned already
        after = chunks[-1].chunk_offset
        if plan:
            if self._planned_past(entry, after):
                return      # the window ahead is already local or in flight: no thread hop
            self.fetcher.plan(lambda: self._read_ahead(entry, after))
        else:
            self._read_ahead(entry, after)

    def _planned_past(self, entry: Entry, after: int) -> bool:
        """Whether an earlier read-ahead already covered the window after chunk ``after``
        (in-memory only: the loop calls it)."""
        with self._lock:
            planned = self._planned.get(entry.name)
        if planned is None:
            return False
        first, covered, evictions = planned
        if evictions != self._evictions():
            return False
        i = bisect.bisect_right(self._starts(entry), after)
        return first <= i and self._window_end(entry, i) <= covered

    def _evictions(self) -> int:
        stats = getattr(self.cache, "stats", None)
        return int(getattr(stats, "evictions", 0))

    def _window_end(self, entry: Entry, i: int) -> int:
        """Index past the read-ahead window that starts at chunk ``i``: ``readahead_bytes``,
        doubled every two chunks of an unbroken sequential streak, up to the max."""
        with self._lock:
            streak = self._streak.get(entry.name, 0)
        budget = min(self.readahead_bytes << min(streak // 2, 16), self.readahead_max_bytes)
        n = len(entry.chunks)
        while i < n and budget > 0:
            budget -= entry.chunks[i].compressed_size
            i += 1
        return i

    def _read_ahead(self, entry: Entry, after: int) -> None:
        """Sequential reader of a big file: fetch the chunks after the one at ``after``.

        Records how far ahead the file is known local or requested; when the whole window
        was local it looks further (while chunks stay local, up to ``_LOOK_FURTHER``), so a
        warm file is replanned every so many chunks instead of at every chunk."""
        evictions = self._evictions()       # before looking: an eviction meanwhile replans
        first = bisect.bisect_right(self._starts(entry), after)
        end = self._window_end(entry, first)
        cache = self.cache
        ahead = [c for c in entry.chunks[first:end] if not is_local(cache, c)]
        covered = end
        if not ahead:
            n = len(entry.chunks)
            while (covered < n and covered - first < _LOOK_FURTHER
                   and is_local(cache, entry.chunks[covered])):
                covered += 1
        with self._lock:
            if len(self._planned) > 4096:
                self._planned.clear()
            self._planned[entry.name] = (first, covered, evictions)
        if ahead:
            try:
                self.fetcher.request(self.target, ahead, max_bytes=READAHEAD_REQUEST)
            except ColdstartError:
                pass

    def _starts(self, entry: Entry) -> list[int]:
        with self._lock:
            starts = self._chunk_starts.get(entry.name)
            if starts is None:
                starts = [c.chunk_offset for c in entry.chunks]
                if len(self._chunk_starts) > 1024:
                    self._chunk_starts.clear()
                self._chunk_starts[entry.name] = starts
            return starts

    # -- whole-file streams ------------------------------------------------------------------

    def note_run(self, entry: Entry, offset: int, end: int) -> None:
        """Extend the big file's run of adjacent reads; a run of ``STREAM_TRIGGER`` bytes
        starts streaming the rest of the file (once per file and mount)."""
        if self.readahead_bytes <= 0 or entry.name in self._streamed:
            return      # (a set only grows: looked at without the lock, checked again in it)
        with self._lock:
            if entry.name in self._streamed:
                return
            runs = self._runs.get(entry.name)
            if runs is None:
                if len(self._runs) > 1024:
                    self._runs.clear()
                runs = self._runs[entry.name] = []
            lo, hi = offset, end
            for k, (a, b) in enumerate(runs):
                if a - STREAM_SLACK <= end and offset <= b + STREAM_SLACK:
                    lo, hi = min(a, offset), max(b, end)
                    del runs[k]         # extended: it becomes the newest run
                    break
            runs.append((lo, hi))
            del runs[:-RUNS_PER_FILE]
            if hi - lo < STREAM_TRIGGER:
                return
            # one stream at a time on the node: it keeps STREAM_STREAMS requests in the
            # fetch pool, and reads must find threads there (the next run's read tries again)
            if not self.fetcher.stream_slot.acquire(blocking=False):
                return
            self._runs.pop(entry.name, None)
            self._streamed.add(entry.name)
        try:
            threading.Thread(target=self._stream, args=(entry, lo, hi), daemon=True,
                             name="stream").start()
        except BaseException:
            self.fetcher.stream_slot.release()
            raise

    def _stream(self, entry: Entry, lo: int, hi: int) -> None:
        """Fetch the chunks of ``entry`` outside ``[lo, hi)`` (the run that started it: read
        or being read) that are not local, from ``hi`` to the end, then from the start, a
        few large requests in flight; each verified chunk also goes to the page cache."""
        try:
            self._stream_rest(entry, lo, hi)
        except Exception as exc:  # a stream is an optimisation: the reads fetch on demand
            log.warning("layer %s: streaming %r stopped: %s", self.target.digest, entry.name,
                        exc)
        finally:
            self.fetcher.stream_slot.release()

    def _stream_rest(self, entry: Entry, lo: int, hi: int) -> None:
        after = [c for c in entry.chunks if c.chunk_offset >= hi]
        before = [c for c in entry.chunks if c.chunk_offset + c.chunk_size <= lo]
        todo = [c for c in after + before if not c.zeros]
        if not fits_in_cache(self.target, self.cache, todo, "streaming " + repr(entry.name)):
            return
        stop = self.target.stopped
        warmer = self.page_cache
        window: list[Landing] = []
        fetched = i = 0
        while i < len(todo) and not stop.is_set():
            batch: list[Chunk] = []
            size = 0
            while i < len(todo) and size < STREAM_REQUEST:
                c = todo[i]
                i += 1
                if not is_local(self.cache, c):   # the reader may have fetched it meanwhile
                    batch.append(c)
                    size += c.compressed_size
            if not batch:
                continue
            try:
                # (its chunks are not kept encoded: the writer's second decode of a long
                # stream would run while it streams, measured slower in bench_fuse.py)
                landing = Landing(self.fetcher.request(self.target, batch,
                                                       max_bytes=STREAM_REQUEST), warmer)
            except ColdstartError:
                break
            window.append(landing)
            if len(window) >= STREAM_STREAMS:
                fetched += settle(window.pop(0), self.read_deadline * 4)
        for landing in window:
            if stop.is_set():
                return      # the layer is going away: its requests end by their own timeouts
            fetched += settle(landing, self.read_deadline * 4)
        log.info("layer %s: streamed %r after a run of %d bytes: %d bytes", self.target.digest,
                 entry.name, hi - lo, fetched)
