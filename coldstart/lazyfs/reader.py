"""Reading files of a lazily mounted layer: (entry, offset, length) → bytes.

For each chunk the read touches: a hole is zeros, a cached chunk is one ``pread`` of the cache
file, a missing one is fetched through the shared :class:`ChunkFetcher` (coalesced, single
flight, verified, cached). The whole read has a deadline (``fetch.read_deadline``): past it the
read raises :class:`DeadlineExceeded` (the FUSE layer answers ``EIO``) instead of hanging.

Round trips are what cost on a cold start, so:

- a small file (``SMALL_FILE_BYTES``) is fetched whole on its first read, together with the
  small files stored after it (``NEIGHBOR_BYTES``), in one request; a reader that goes on
  into that window gets the next window fetched in the background;
- a file read sequentially gets its next chunks fetched ahead, in the background;
- :meth:`LayerReader.prefetch` fetches the TOC's prefetch list in bulk after mounting;
- :meth:`LayerReader.fetch_rest` then fetches every other chunk of the layer in blob order, in
  large requests, at a bounded rate, yielding to on-demand reads, so the node ends with the
  whole layer local and a start-up that reads widely waits on few round trips.
"""

from __future__ import annotations

import bisect
import functools
import logging
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

from coldstart.cache import ChunkStore
from coldstart.config import FetchConfig
from coldstart.errors import ColdstartError, FormatError
from coldstart.format.layer import SeekableLayer
from coldstart.format.toc import PREFETCH_LANDMARK, Chunk, Entry
from coldstart.lazyfs.fetcher import (
    FILL,
    PREFETCH,
    ChunkFetcher,
    FetchTarget,
    LayerStats,
    Span,
    lower_priority,
)
from coldstart.lazyfs.pagecache import PageCacheWarmer
from coldstart.prefetch.recorder import AccessRecorder
from coldstart.remote import Source

__all__ = ["LayerReader", "PartialRead"]

log = logging.getLogger(__name__)

#: the read defaults, from the one config tree (CONVENTIONS §9)
_DEFAULTS = FetchConfig()

#: Files of at most this many bytes are fetched whole on their first read (one request).
SMALL_FILE_BYTES = 1 << 20
#: Compressed bytes fetched ahead of a sequential reader.
READAHEAD_BYTES = 8 << 20
#: A file read sequentially for long gets a wider window: it doubles every two chunks the
#: reader enters in order, up to this many compressed bytes (a multi-GB weights file streams
#: at the link's rate instead of waiting at each window's start); a jump starts over.
READAHEAD_MAX_BYTES = 64 << 20
#: Read-ahead is split into requests of about this size, fetched and decoded in parallel.
READAHEAD_REQUEST = 1 << 20
#: A small file's miss also fetches the small files stored after it, up to this many
#: compressed bytes, in the same request (a package's modules are read together). The window
#: adapts: at each miss it doubles (up to ``NEIGHBOR_MAX_BYTES``) when at least half the files
#: the previous window brought were read since, and halves back (never below
#: ``NEIGHBOR_BYTES``) when fewer than a tenth were.
NEIGHBOR_BYTES = _DEFAULTS.neighbor_bytes
NEIGHBOR_MAX_BYTES = _DEFAULTS.neighbor_max_bytes
#: Compressed bytes of the first prefetch request; each next one is ``PREFETCH_GROWTH`` times
#: as large, up to ``PREFETCH_REQUEST``; at most ``PREFETCH_STREAMS`` per layer are in flight.
PREFETCH_FIRST = 4 << 20
PREFETCH_REQUEST = 64 << 20
PREFETCH_STREAMS = 4
PREFETCH_GROWTH = 4
#: Chunks of the prefetch set this many compressed bytes apart share a request (the bytes of
#: the untouched chunks between them are fetched and dropped): fewer round trips. A source
#: that reads several ranges in one request (a registry answering multi-range requests)
#: is asked the runs apart instead, the bytes between them left out
#: (:data:`~coldstart.lazyfs.fetcher.MULTI_BYTES`).
PREFETCH_GAP = 1 << 20
#: Compressed bytes per request of the background fetch of the rest of a layer: large enough
#: that requests are few, small enough that a read waiting on one is not held up long.
BACKGROUND_REQUEST = 4 << 20
#: A read-ahead that finds its whole window local checks up to this many chunks further (in
#: memory), so a sequential read of a warm file asks the planner thread only now and then.
_LOOK_FURTHER = 64
#: The background fetch keeps this many requests outstanding.
BACKGROUND_DEPTH = 2
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
#: a big file (a shared library's pages) make no such run.
STREAM_MIN_FILE = 256 << 20
STREAM_TRIGGER = 32 << 20
STREAM_SLACK = 2 << 20
STREAM_REQUEST = 8 << 20
STREAM_STREAMS = 4


class _SmallChunks:
    """The chunks of a layer's small files (``size <= limit``) in blob order, as three arrays
    (blob offset, entry position, chunk number): a few bytes per file where a list of Chunk
    objects cost a few hundred; :meth:`between` makes the chunks asked for."""

    __slots__ = ("_entries", "_k", "_offsets", "_positions")

    def __init__(self, layer: SeekableLayer, limit: int) -> None:
        self._entries = entries = layer.toc.entries
        found = sorted(entries.small_chunks(limit))
        self._offsets = array("q", [f[0] for f in found])
        self._positions = array("q", [f[2] for f in found])
        self._k = array("q", [f[3] for f in found])

    def __len__(self) -> int:
        return len(self._offsets)

    def between(self, start: int, end: int) -> Iterator[Chunk]:
        """The chunks whose blob offset is in ``[start, end)``, in blob order."""
        offsets, at = self._offsets, self._entries.at
        i = bisect.bisect_left(offsets, start)
        while i < len(offsets) and offsets[i] < end:
            yield at(self._positions[i]).chunks[self._k[i]]
            i += 1


@dataclass(slots=True)
class PartialRead:
    """A read the FUSE loop could not serve from the cache alone: its chunks (mapped once)
    and the leading pieces it already read, for :meth:`LayerReader.read` to finish."""

    entry: Entry
    offset: int
    end: int
    chunks: list[Chunk]
    pieces: list[bytes]


class LayerReader:
    """Reads files of one mounted layer through the node's chunk cache and fetcher.

    >>> reader = LayerReader("sha256:…", layer, source, fetcher)   # doctest: +SKIP
    >>> reader.read(layer.resolve("etc/os-release"), 0, 4096)      # doctest: +SKIP
    """

    def __init__(self, digest: str, layer: SeekableLayer, source: Source,
                 fetcher: ChunkFetcher, *, read_deadline: float = _DEFAULTS.read_deadline,
                 background_rate: int = _DEFAULTS.background_rate,
                 small_file_bytes: int = SMALL_FILE_BYTES,
                 readahead_bytes: int = READAHEAD_BYTES,
                 readahead_max_bytes: int = READAHEAD_MAX_BYTES,
                 neighbor_bytes: int = NEIGHBOR_BYTES,
                 neighbor_max_bytes: int = NEIGHBOR_MAX_BYTES) -> None:
        self.digest = digest
        self.layer = layer
        self.fetcher = fetcher
        self.cache: ChunkStore | None = fetcher.cache
        self.read_deadline = read_deadline
        self.background_rate = max(0, background_rate)
        self.small_file_bytes = small_file_bytes
        self.readahead_bytes = readahead_bytes
        self.readahead_max_bytes = max(readahead_bytes, readahead_max_bytes)
        self.neighbor_bytes = neighbor_bytes
        self.neighbor_max_bytes = max(neighbor_bytes, neighbor_max_bytes)
        #: the adaptive neighbour window now, and what the last miss's window brought: its
        #: blob range, how many small files, and the offsets of those read since
        self.neighbor_window = neighbor_bytes
        self._probe = (0, 0)
        self._probe_files = 0
        self._probe_hits: set[int] = set()
        # the small files' chunks in blob order (neighbour windows), built on first need or by
        # warm_index() in a thread after the mount: building it touches every entry of the
        # TOC, which the mount itself must not pay for (200,000 entries: about a second)
        self._small: _SmallChunks | None = None
        self._small_lock = threading.Lock()
        self.stats = LayerStats()
        self._stop = threading.Event()      # set by close(): the layer is no longer served
        self._prefetched = threading.Event()  # the prefetch ended (or the layer was closed)
        self.target = FetchTarget(digest, layer, source, self.stats, self._stop)
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
        self._window = (0, 0)   # blob range of the last small-file window fetched
        self._lock = threading.Lock()
        #: while recording is on: notes each file read and its ranges (a start-up profile)
        self.recorder: AccessRecorder | None = None
        #: the compressed ranges of the prefetch span the recorded start-up touched (the
        #: layer's prefetch-ranges annotation, or what its index names); None: prefetch the
        #: whole span
        self.prefetch_ranges: list[tuple[int, int]] | None = list(layer.prefetch_ranges) or None
        #: hands each prefetched chunk, once verified, to the kernel's page cache (the
        #: warmer asks whether the layer records: the recorder must see every read)
        self.page_cache: PageCacheWarmer | None = None

    def close(self) -> None:
        """Stop prefetching (and warming the page cache); work held for the layer (deferred
        spreads) is dropped."""
        self._stop.set()
        self._prefetched.set()
        self.fetcher.wake()
        if self.page_cache is not None:
            self.page_cache.close()

    def wait_start_up(self, after: float, longest: float) -> bool:
        """Block until the layer's start-up has had its turn: ``after`` seconds from now, the
        prefetch ended (where the layer names a start-up set) and no read was served for
        ``QUIET_SECONDS`` (at most ``longest`` seconds for each of these two). False if the
        layer was closed meanwhile. For housekeeping that holds the GIL (compacting the
        TOC): the FUSE loop and the mounts of the image's next layers would wait for it."""
        if self._stop.wait(after):
            return False
        if self.wants_prefetch:
            self._prefetched.wait(longest)
        if self._stop.is_set():
            return False
        self.fetcher.wait_quiet(longest, stop=self._stop)
        return not self._stop.is_set()

    # -- reads -----------------------------------------------------------------------------

    def _is_cached(self, c: Chunk) -> bool:
        """Local, also if another process stored it (may ``stat``): worker threads only."""
        return c.zeros or (bool(c.digest) and self.cache is not None and c.digest in self.cache)

    def read_cached(self, entry: Entry, offset: int, length: int) -> bytes | PartialRead | None:
        """The FUSE loop's fast path: the bytes if every chunk they need is local (cache or
        hole), else a :class:`PartialRead` to hand to :meth:`read` in a worker; None if the
        entry is not a regular file. No fetch, no rescan, no ``stat``, no planning here: the
        in-memory index and at most one ``pread`` per chunk (see ``ChunkCache.read_local``).
        """
        if entry.type != "reg":
            return None
        end = min(entry.size, offset + length)
        if offset >= end:
            return b""
        t0 = time.monotonic()
        chunks = self.layer.chunks_for(entry, offset, length)
        cache = self.cache
        pieces: list[bytes] = []
        for c in chunks:
            lo = max(offset, c.chunk_offset) - c.chunk_offset
            hi = min(end, c.chunk_offset + c.chunk_size) - c.chunk_offset
            if c.zeros:
                pieces.append(bytes(hi - lo))
                continue
            data = None
            if c.digest and cache is not None:
                data = cache.read_local(c.digest, lo, hi - lo, expected_size=c.chunk_size)
            if data is None:    # the rest is the worker's: it asks the cache once per chunk
                return PartialRead(entry, offset, end, chunks, pieces)
            pieces.append(data)
        self.fetcher.last_read = t0
        tel = self.fetcher.telemetry
        if tel is not None:
            tel.cache_hit(end - offset)
            tel.read_done(time.monotonic() - t0)
        rec = self.recorder         # once: recording may be switched off meanwhile
        if rec is not None:
            rec.note(entry.name, offset, end)
        if entry.size <= self.small_file_bytes:
            self._note_small(chunks)
            self._follow_window(chunks)
        elif entry.size >= STREAM_MIN_FILE:
            self._note_run(entry, offset, end)
        self._note_read(entry, offset, end, chunks, plan=True)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def read(self, entry: Entry, offset: int, length: int,
             partial: PartialRead | None = None) -> bytes:
        """Bytes ``[offset, offset+length)`` of regular file ``entry`` (short at its end).

        ``partial``: what :meth:`read_cached` found on the loop for this very read (its chunk
        map and the chunks it already read), so the read is mapped to chunks once and no
        chunk is looked up twice. Raises DeadlineExceeded, IntegrityError, Unavailable or
        FormatError; the FUSE layer turns each into its errno.
        """
        pieces = self.read_pieces(entry, offset, length, partial)
        return bytes(pieces[0]) if len(pieces) == 1 else b"".join(pieces)

    def read_pieces(self, entry: Entry, offset: int, length: int,
                    partial: PartialRead | None = None, *,
                    follow: bool = True) -> list[bytes | memoryview]:
        """:meth:`read`, as the pieces of each chunk in order, not joined (a caller that
        writes them somewhere saves a copy of the whole range; a piece of a chunk is a view
        of the chunk's bytes, not a copy: the FUSE answer and the files socket write them as
        they are). ``follow=False``: a caller that asks for whole ranges itself, many at
        once (the files socket): no neighbours, read-ahead or stream started on its behalf,
        nothing put in the page cache."""
        t0 = time.monotonic()
        self.fetcher.note_read()
        try:
            return self._read(entry, offset, length, t0 + self.read_deadline, partial,
                              follow=follow)
        except ColdstartError as exc:
            msg = (f"layer {self.digest}: read {entry.name!r} [{offset}:+{length}] failed: "
                   f"{type(exc).__name__}: {exc}")
            log.error("%s", msg)
            self.stats.record_error(msg)
            if self.fetcher.telemetry is not None:
                self.fetcher.telemetry.error(type(exc).__name__)
            raise
        finally:
            if self.fetcher.telemetry is not None:
                self.fetcher.telemetry.read_done(time.monotonic() - t0)

    def _read(self, entry: Entry, offset: int, length: int, deadline: float,
              partial: PartialRead | None, *,
              follow: bool = True) -> list[bytes | memoryview]:
        if entry.type != "reg":
            raise FormatError(f"{entry.name!r} is a {entry.type}, not a regular file")
        end = min(entry.size, offset + length)
        if offset >= end:
            return []
        if (partial is not None and partial.entry is entry and partial.offset == offset
                and partial.end == end):
            chunks = partial.chunks
            done: list[bytes | memoryview] = list(partial.pieces)
            tel = self.fetcher.telemetry
            if tel is not None:
                for c, p in zip(chunks, done, strict=False):
                    if not c.zeros:
                        tel.cache_hit(len(p))
        else:
            chunks = self.layer.chunks_for(entry, offset, length)
            done = []
        spans: list[Span] = []
        for c in chunks[len(done):]:
            lo = max(offset, c.chunk_offset) - c.chunk_offset
            hi = min(end, c.chunk_offset + c.chunk_size) - c.chunk_offset
            spans.append((c, lo, hi))
        more = None
        if not follow:
            pass
        elif entry.size <= self.small_file_bytes:
            def more(missed: list[Chunk]) -> list[Chunk]:
                return self._whole_and_neighbors(entry, missed)[len(missed):]
            self._note_small(chunks)    # before the fetch: it may join the window's request
        elif entry.size >= STREAM_MIN_FILE:
            self._note_run(entry, offset, end)  # before the fetch: the stream starts now
        got = self.fetcher.get(self.target, spans, deadline, more=more, name=entry.name)
        rec = self.recorder         # once: recording may be switched off meanwhile
        if rec is not None:
            rec.note(entry.name, offset, end)
        if follow:
            self._note_read(entry, offset, end, chunks, plan=False)
        return done + got

    def _whole_and_neighbors(self, entry: Entry, want: list[Chunk]) -> list[Chunk]:
        """A small file's missing chunks, plus the small files' chunks stored after it."""
        seen = set(want)
        out = list(want)
        for c in entry.chunks:
            if c not in seen and not self._is_cached(c):
                seen.add(c)
                out.append(c)
        if self.neighbor_bytes <= 0 or not out:
            return out
        start, end = self._probe
        if all(start <= c.offset < end for c in want):
            return out      # a neighbour the last window is bringing: that window goes on
        last = max(c.end_offset for c in out)
        limit = last + self._adapt_window()
        neighbours = self._small_between(last, limit, seen)
        out += neighbours
        with self._lock:
            self._window = (last, limit)
            self._probe = (last, limit)
            self._probe_files = len({c.offset for c in neighbours})
            self._probe_hits = set()
        return out

    def warm_index(self) -> _SmallChunks:
        """The small files' chunks in blob order (built once)."""
        small = self._small
        if small is None:
            with self._small_lock:
                if self._small is None:
                    self._small = _SmallChunks(self.layer, self.small_file_bytes)
                small = self._small
        return small

    def _note_small(self, chunks: list[Chunk]) -> None:
        """A small file was read: count it if the last miss's window brought it."""
        if not chunks:
            return
        pos = chunks[0].offset
        start, end = self._probe
        if start <= pos < end:
            with self._lock:
                self._probe_hits.add(pos)

    def _adapt_window(self) -> int:
        """The neighbour window for this miss, adapted to how much of the last one was read
        (see ``NEIGHBOR_BYTES``)."""
        with self._lock:
            if self._probe_files:
                used = len(self._probe_hits) / self._probe_files
                if used >= 0.5:
                    self.neighbor_window = min(self.neighbor_max_bytes, self.neighbor_window * 2)
                elif used < 0.1:
                    # back towards the configured window, never below it: a smaller window
                    # saves bytes but costs round trips (measured: torch's import, on demand,
                    # 235 -> 370 requests and +1.4 s when it shrank to 64 KiB)
                    self.neighbor_window = max(self.neighbor_bytes, self.neighbor_window // 2)
            return self.neighbor_window

    def _small_between(self, start: int, end: int, seen: set[Chunk]) -> list[Chunk]:
        """Small files' chunks stored in ``[start, end)`` that are neither cached nor in
        ``seen``."""
        out: list[Chunk] = []
        for c in self.warm_index().between(start, end):
            if c not in seen and not self._is_cached(c):
                seen.add(c)
                out.append(c)
        return out

    def _follow_window(self, chunks: list[Chunk]) -> None:
        """A reader walking through the small files fetched together: once it reads inside
        that window, fetch the next one in the background (a cold ``find | xargs cat`` then
        streams instead of waiting at each window's start). Costs at most one window of
        bytes nobody reads. On the loop: only the window check; the choosing runs in the
        fetcher's planner thread."""
        if self.neighbor_bytes <= 0 or not chunks:
            return
        pos = chunks[0].offset
        with self._lock:
            start, end = self._window
            if not start <= pos < end:
                return
            width = self.neighbor_window
            self._window = (end, end + width)
        new_start, new_end = end, end + width

        def plan() -> None:
            ahead = self._small_between(new_start, new_end, set())
            if ahead:
                try:
                    self.fetcher.request(self.target, ahead)
                except ColdstartError:
                    pass

        self.fetcher.plan(plan)

    def _note_read(self, entry: Entry, offset: int, end: int, chunks: list[Chunk], *,
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

    def _note_run(self, entry: Entry, offset: int, end: int) -> None:
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
            log.warning("layer %s: streaming %r stopped: %s", self.digest, entry.name, exc)
        finally:
            self.fetcher.stream_slot.release()

    def _stream_rest(self, entry: Entry, lo: int, hi: int) -> None:
        after = [c for c in entry.chunks if c.chunk_offset >= hi]
        before = [c for c in entry.chunks if c.chunk_offset + c.chunk_size <= lo]
        todo = [c for c in after + before if not c.zeros]
        if not self._fits_in_cache(todo, "streaming " + repr(entry.name)):
            return
        warmer = self.page_cache
        window: list[_Landing] = []
        fetched = i = 0
        while i < len(todo) and not self._stop.is_set():
            batch: list[Chunk] = []
            size = 0
            while i < len(todo) and size < STREAM_REQUEST:
                c = todo[i]
                i += 1
                if not self._is_cached(c):    # the reader may have fetched it meanwhile
                    batch.append(c)
                    size += c.compressed_size
            if not batch:
                continue
            try:
                # (its chunks are not kept encoded: the writer's second decode of a long
                # stream would run while it streams, measured slower in bench_fuse.py)
                landing = _Landing(self.fetcher.request(self.target, batch,
                                                        max_bytes=STREAM_REQUEST), warmer)
            except ColdstartError:
                break
            window.append(landing)
            if len(window) >= STREAM_STREAMS:
                fetched += _settle(window.pop(0), self.read_deadline * 4)
        for landing in window:
            if self._stop.is_set():
                return      # the layer is going away: its requests end by their own timeouts
            fetched += _settle(landing, self.read_deadline * 4)
        log.info("layer %s: streamed %r after a run of %d bytes: %d bytes", self.digest,
                 entry.name, hi - lo, fetched)

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
        ahead = [c for c in entry.chunks[first:end] if not self._is_cached(c)]
        covered = end
        if not ahead:
            n = len(entry.chunks)
            while (covered < n and covered - first < _LOOK_FURTHER
                   and self._is_cached(entry.chunks[covered])):
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

    # -- prefetch --------------------------------------------------------------------------

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
        A read that needs a chunk in flight joins its fetch. Errors are logged and counted,
        not raised: the chunks they concern are left to on-demand reads.
        """
        if self.prefetch_ranges:
            # the chunks the recorded start-up touched (the layer's prefetch-ranges
            # annotation), wherever they lie: behind a landmark or not
            wanted = self._touched_chunks()
        else:
            wanted = self._unique_chunks(self.layer.toc.prefetch)
        todo: list[Chunk] = []
        local: list[Chunk] = []
        for c in wanted:
            (local if self._is_cached(c) else todo).append(c)
        warmer = self.page_cache
        if warmer is not None and local:
            # on a node that has them already, the start-up's chunks still go to the page
            # cache (read from the chunk cache here, in this thread)
            self._warm_from_cache(warmer, local)
        with self.stats._lock:
            self.stats.state = "prefetching"
        fetched = 0
        window: list[_Landing] = []
        room = max(1, self.fetcher.pool_size // 2)
        if self._named_apart():
            # the set is scattered over the blob (a gzip index's): its ranges in the order the
            # start-up first read them, one request each, several in flight, each decoded by
            # its own thread as it arrives (a large request is decoded by one thread, after
            # all of it arrived)
            batches = _batches(self._access_order(todo), 1)
        else:
            batches = _growing_batches(todo, PREFETCH_FIRST, PREFETCH_REQUEST)
        for batch in batches:
            if self._stop.is_set():
                break
            # half the pool at most, node-wide: reads of files outside the set find threads
            self.fetcher.wait_prefetch_room(room, self.read_deadline)
            try:
                landing = _Landing(self.fetcher.request(self.target, batch, kind=PREFETCH,
                                                        max_bytes=PREFETCH_REQUEST + PREFETCH_GAP,
                                                        max_gap=PREFETCH_GAP,
                                                        unread=_warms(warmer)), warmer)
            except ColdstartError:
                break
            window.append(landing)
            if len(window) >= PREFETCH_STREAMS:
                fetched += _settle(window.pop(0), self.read_deadline * 4)
        for landing in window:
            fetched += _settle(landing, self.read_deadline * 4)
        with self.stats._lock:
            self.stats.prefetch_done = True
            self.stats.state = "on-demand"
        log.info("layer %s: prefetched %d chunks, %d bytes", self.digest, len(todo), fetched)
        return fetched

    def _warm_from_cache(self, warmer: PageCacheWarmer, chunks: list[Chunk]) -> None:
        cache = self.cache
        for c in chunks:
            if self._stop.is_set() or cache is None:
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
        ranges = self.prefetch_ranges or []
        toc = self.layer.toc
        if self._named_apart():
            return [c for c in self._unique_chunks(toc.prefetch) if self._touched(c)]
        mark = toc.entries.get(PREFETCH_LANDMARK)
        if toc.prefetch and mark is not None and mark.chunks:
            front = self._unique_chunks(toc.prefetch)
            span = max((c.end_offset for c in front), default=0)
            # the writers that put a landmark (ours, ctr-remote's) store the files before it
            # first, in TOC order: so the blob up to the landmark's own data holds their
            # chunks and no others (checked: the landmark lies past them all)
            if span <= mark.chunks[0].offset and all(hi <= span for _, hi in ranges):
                return [c for c in front if self._touched(c)]
        return [c for c in self._unique_chunks() if self._touched(c)]

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
        ranges = self.prefetch_ranges
        if ranges is None:
            return True
        i = bisect.bisect_right(ranges, (c.offset, 1 << 62)) - 1
        return i >= 0 and ranges[i][1] > c.offset

    def _unique_chunks(self, names: list[str] | None = None) -> list[Chunk]:
        """The non-hole chunks of ``names`` (default: every regular file), each once, in
        blob order."""
        entries = self.layer.toc.entries
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

    def fill_order(self) -> list[Chunk]:
        """Every chunk of the layer in the order the fill fetches it: the prefetch set first,
        then the small files' chunks, then the big files' (each part in blob order)."""
        first = self._unique_chunks(self.layer.toc.prefetch)
        taken = {(c.offset, c.inner_offset) for c in first}
        big = {(c.offset, c.inner_offset) for e in self.layer.toc.entries.values()
               if e.type == "reg" and e.size > self.small_file_bytes for c in e.chunks}
        small: list[Chunk] = []
        large: list[Chunk] = []
        for c in self._unique_chunks():
            k = (c.offset, c.inner_offset)
            if k in taken:
                continue
            (large if k in big else small).append(c)
        return first + small + large

    def fetch_rest(self, *, clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], object] = time.sleep) -> int:
        """The hybrid fill: fetch every chunk not yet local, in :meth:`fill_order`, at most
        ``background_rate`` bytes a second (0: do nothing); blocks, returns the compressed
        bytes fetched.

        Requests are ``BACKGROUND_REQUEST`` bytes, ``BACKGROUND_DEPTH`` outstanding, run in
        the fetcher's low-priority (niced) thread and wait while on-demand fetches are in
        flight: a read jumps the queue and is never starved. A read that needs a chunk
        already in one of them joins that fetch (single flight) instead of asking again.
        Errors are logged and counted; the chunks they concern are simply left for on-demand
        reads. When every chunk is local the layer's state becomes ``complete``.
        """
        rate = self.background_rate
        if rate <= 0:
            return 0
        todo = self.fill_order()
        total = _range_bytes(todo)
        if not self._fits_in_cache(todo):
            return 0
        with self.stats._lock:
            self.stats.state = "filling"
            self.stats.total_bytes = total
        fetched = 0
        local = 0       # compressed bytes known local: found cached, or fetched by the fill
        counted: set[tuple[int, int]] = set()      # their ranges (a range is counted once)
        start = clock()

        def count(ranges: Iterable[tuple[int, int]]) -> None:
            nonlocal local
            for r in ranges:
                if r not in counted:
                    counted.add(r)
                    local += r[1] - r[0]
            with self.stats._lock:
                self.stats.local_bytes = local

        def settle(nbytes: int, landing: _Landing) -> int:
            count(_ranges(landing.wait(self.read_deadline * 4)))
            return nbytes

        def run(batches: list[list[Chunk]], one_per_span: bool) -> bool:
            """Fetch ``batches`` paced at ``rate``; False if stopped or a request failed."""
            nonlocal fetched
            window: list[tuple[int, _Landing]] = []
            ok = True
            for batch in batches:
                if self._stop.is_set():
                    ok = False
                    break
                want = [c for c in batch if not self._is_cached(c)]
                wanted = _ranges(want)
                count(r for r in _ranges(batch) if r not in wanted)
                if not want:
                    continue
                if one_per_span:
                    want = _first_per_range(want)
                try:
                    landing = _Landing(self.fetcher.request(self.target, want, background=True,
                                                            max_bytes=BACKGROUND_REQUEST,
                                                            kind=FILL))
                except ColdstartError:
                    ok = False
                    break
                window.append((_range_bytes(want), landing))
                if len(window) >= BACKGROUND_DEPTH:
                    nbytes, oldest = window.pop(0)
                    fetched += settle(nbytes, oldest)
                    # token bucket with no burst: never ahead of rate x elapsed
                    ahead = fetched / rate - (clock() - start)
                    if ahead > 0:
                        sleep(ahead)
            for nbytes, landing in window:
                fetched += settle(nbytes, landing)
            return ok

        spreads = self.layer.spreads
        # where decoding one piece of a span caches the others (an indexed gzip layer), one
        # piece per span is asked for; a span handed out before in this mount (its pieces since
        # evicted), or a piece whose digest another fetch had in flight, leaves pieces
        # missing: those are then asked for one by one
        if run(_batches(todo, BACKGROUND_REQUEST), spreads) and spreads:
            left = [c for c in todo if not self._is_cached(c)]
            if left:
                run(_batches(left, BACKGROUND_REQUEST), False)
        complete = not self._stop.is_set() and all(self._is_cached(c) for c in todo)
        with self.stats._lock:
            self.stats.background_done = True
            self.stats.local_bytes = total if complete else self.stats.local_bytes
            self.stats.state = "complete" if complete else "on-demand"
        log.info("layer %s: background fill %s, %d bytes in %.1f s", self.digest,
                 "complete" if complete else "stopped", fetched, clock() - start)
        return fetched

    def _fits_in_cache(self, todo: list[Chunk], what: str = "background fill") -> bool:
        """Whether ``todo`` (a layer's or a file's chunks) fits in the cache at all: a fill
        (or a file's stream) that does not would evict its own chunks and never end (it is
        skipped). Older chunks of other layers are evicted as usual (LRU)."""
        cache = self.cache
        limit = getattr(cache, "max_bytes", None)
        if cache is None or not isinstance(limit, int):
            return True
        total = sum(c.chunk_size for c in todo if not c.zeros)
        if total <= limit:
            return True
        log.warning("layer %s: %s skipped: its %d bytes do not fit in the chunk cache "
                    "(cache.max_bytes %d)", self.digest, what, total, limit)
        self.stats.record_error(f"{what} skipped: it does not fit in the chunk cache "
                                "(raise cache.max_bytes)")
        return False

    def prefetch_then_rest(self) -> None:
        """What the FUSE server runs in a thread after mounting: the prefetch list in bulk,
        then the rest of the layer in the background."""
        try:
            if self.wants_prefetch:
                self.prefetch()
        finally:
            self._prefetched.set()
        if self.background_rate > 0:
            # the rest is background work: this thread yields the CPU from here on, and
            # plans the fill (every entry of the TOC) only once the start-up pauses
            lower_priority()
            self.fetcher.wait_quiet()
            # the spans the prefetch holds are spread first: the fill would fetch them again
            self.fetcher.wait_deferred(stop=self._stop)
            self.fetch_rest()

    @property
    def wants_prefetch(self) -> bool:
        """Whether the layer names a start-up set (a landmark, or touched chunk ranges)."""
        return bool(self.layer.toc.prefetch or self.prefetch_ranges)


def _growing_batches(chunks: list[Chunk], first: int, limit: int, *,
                     within: bool = False) -> list[list[Chunk]]:
    """``chunks`` (in blob order within each part of a fill or prefetch order), cut into
    batches of ``first`` compressed bytes, then ``PREFETCH_GROWTH`` times as many each, up to
    ``limit``: a batch ends at the first range that reaches its size, or with ``within``
    before the range that would take it past its size (a contiguous batch is then one request
    of at most that size; one range larger than that is a batch of its own). Consecutive
    chunks that share one compressed range (an indexed gzip layer's span holds many files'
    pieces) count it once and stay in one batch: a cut between them would fetch that range
    once per batch."""
    out: list[list[Chunk]] = []
    size = want = 0
    last = (-1, -1)
    for c in chunks:
        here = (c.offset, c.end_offset)
        if here != last:
            full = size + c.compressed_size > want if within else size >= want
            if not out or (size and full):
                want = first if not out else min(limit, want * PREFETCH_GROWTH)
                out.append([])
                size = 0
            size += c.compressed_size
            last = here
        out[-1].append(c)
    return out


def _batches(chunks: list[Chunk], limit: int) -> list[list[Chunk]]:
    """The fill's batches: at most ``limit`` compressed bytes each (see
    :func:`_growing_batches`, ``within``)."""
    return _growing_batches(chunks, limit, limit, within=True)


def _hand_over(warmer: PageCacheWarmer, c: Chunk, f: Future[bytes]) -> None:
    """A prefetch future's done-callback (in the thread that decoded the chunk: it never
    waits; past the warmer's bound the chunk is dropped)."""
    if not f.cancelled() and f.exception() is None:
        warmer.put(c, f.result())


def _first_per_range(chunks: list[Chunk]) -> list[Chunk]:
    """The first of ``chunks`` in each compressed range, in order."""
    seen: set[tuple[int, int]] = set()
    out: list[Chunk] = []
    for c in chunks:
        if (c.offset, c.end_offset) not in seen:
            seen.add((c.offset, c.end_offset))
            out.append(c)
    return out


def _ranges(chunks: Iterable[Chunk]) -> set[tuple[int, int]]:
    """The compressed ranges ``chunks`` are fetched with (holes have none)."""
    return {(c.offset, c.end_offset) for c in chunks if not c.zeros}


def _range_bytes(chunks: Iterable[Chunk]) -> int:
    """The compressed bytes of ``chunks``, each range counted once (chunks may share one:
    see :func:`_growing_batches`)."""
    return sum(b - a for a, b in _ranges(chunks))


def _warms(warmer: PageCacheWarmer | None) -> bool:
    """Whether ``warmer`` stores what it is handed now (the fetcher may then keep those
    chunks encoded in the chunk cache: reads are not expected to ask it for them)."""
    return warmer is not None and warmer.takes()


class _Landing:
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


def _settle(landing: _Landing, timeout: float) -> int:
    """Wait for ``landing``; the compressed bytes of the chunks that came (see
    _range_bytes)."""
    return _range_bytes(landing.wait(timeout))
