"""Reading files of a lazily mounted layer: (entry, offset, length) → bytes.

For each chunk the read touches: a hole is zeros, a cached chunk is one ``pread`` of the cache
file, a missing one is fetched through the shared :class:`ChunkFetcher` (coalesced, single
flight, verified, cached). The whole read has a deadline (``fetch.read_deadline``): past it the
read raises :class:`DeadlineExceeded` (the FUSE layer answers ``EIO``) instead of hanging.

:class:`LayerReader` is one served layer: it holds the on-demand read path (the FUSE loop's
:meth:`~LayerReader.read_cached`, a worker's :meth:`~LayerReader.read`) and owns the parts that
fetch ahead of the reads, each an object of its own with its own state and lock, built here
from the layer's :class:`~coldstart.lazyfs.target.FetchTarget` and the fetcher. Round trips
are what cost on a cold start, so:

- a small file (``SMALL_FILE_BYTES``) is fetched whole on its first read, together with the
  small files stored after it, in one request; a reader that goes on into that window gets
  the next window fetched in the background (:attr:`LayerReader.windows`,
  :mod:`~coldstart.lazyfs.windows`);
- a file read sequentially gets its next chunks fetched ahead, in the background, and a big
  file being loaded whole is streamed to its end (:attr:`LayerReader.sequential`,
  :mod:`~coldstart.lazyfs.streams`);
- the TOC's prefetch list is fetched in bulk after mounting (:attr:`LayerReader.prefetcher`,
  :mod:`~coldstart.lazyfs.prefetch`);
- then every other chunk of the layer, in blob order, in large requests, at a bounded rate,
  yielding to on-demand reads, so the node ends with the whole layer local and a start-up
  that reads widely waits on few round trips (:attr:`LayerReader.fill`,
  :mod:`~coldstart.lazyfs.fill`).

:meth:`LayerReader.prefetch_then_rest` is the after-mount schedule of the last two (the FUSE
server runs it in a thread); :meth:`LayerReader.close` stops them all. The helpers they share
(choosing chunks, cutting them into requests, waiting on a window of requests) are in
:mod:`~coldstart.lazyfs.batches`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from coldstart.cache import ChunkStore
from coldstart.config import FetchConfig
from coldstart.errors import ColdstartError, FormatError
from coldstart.format.layer import SeekableLayer
from coldstart.format.toc import Chunk, Entry
from coldstart.lazyfs.fetcher import ChunkFetcher, Span
from coldstart.lazyfs.fill import BackgroundFill
from coldstart.lazyfs.pagecache import PageCacheWarmer
from coldstart.lazyfs.prefetch import Prefetcher
from coldstart.lazyfs.streams import (
    READAHEAD_BYTES,
    READAHEAD_MAX_BYTES,
    STREAM_MIN_FILE,
    SequentialReads,
)
from coldstart.lazyfs.target import FetchTarget, LayerStats
from coldstart.lazyfs.windows import NEIGHBOR_BYTES, NEIGHBOR_MAX_BYTES, SmallFileWindows
from coldstart.prefetch.recorder import AccessRecorder
from coldstart.remote import Source

__all__ = ["SMALL_FILE_BYTES", "LayerReader", "PartialRead"]

log = logging.getLogger(__name__)

#: the read defaults, from the one config tree (CONVENTIONS §9)
_DEFAULTS = FetchConfig()

#: Files of at most this many bytes are fetched whole on their first read (one request).
SMALL_FILE_BYTES = 1 << 20


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
        self.small_file_bytes = small_file_bytes
        self.stats = LayerStats()
        self._stop = threading.Event()      # set by close(): the layer is no longer served
        self._prefetched = threading.Event()  # the prefetch ended (or the layer was closed)
        self.target = FetchTarget(digest, layer, source, self.stats, self._stop)
        #: a small file's neighbours, fetched with it (windows.py)
        self.windows = SmallFileWindows(self.target, fetcher, small_file_bytes=small_file_bytes,
                                        neighbor_bytes=neighbor_bytes,
                                        neighbor_max_bytes=neighbor_max_bytes)
        #: read-ahead of sequential readers, streams of big files loaded whole (streams.py)
        self.sequential = SequentialReads(self.target, fetcher, read_deadline=read_deadline,
                                          readahead_bytes=readahead_bytes,
                                          readahead_max_bytes=readahead_max_bytes)
        #: the start-up set, fetched after the mount (prefetch.py)
        self.prefetcher = Prefetcher(self.target, fetcher, read_deadline=read_deadline)
        #: the rest of the layer, fetched in the background after the start-up (fill.py)
        self.fill = BackgroundFill(self.target, fetcher, small_file_bytes=small_file_bytes,
                                   read_deadline=read_deadline, rate=background_rate)
        #: while recording is on: notes each file read and its ranges (a start-up profile)
        self.recorder: AccessRecorder | None = None
        self._page_cache: PageCacheWarmer | None = None

    @property
    def page_cache(self) -> PageCacheWarmer | None:
        """Where the prefetch and a big file's stream hand each verified chunk: the kernel's
        page cache (the warmer asks whether the layer records: the recorder must see every
        read). Set by the FUSE server after the mount; None: nowhere."""
        return self._page_cache

    @page_cache.setter
    def page_cache(self, warmer: PageCacheWarmer | None) -> None:
        self._page_cache = warmer
        self.prefetcher.page_cache = warmer
        self.sequential.page_cache = warmer

    def close(self) -> None:
        """Stop prefetching, filling and streaming (and warming the page cache); work held
        for the layer (deferred spreads) is dropped."""
        self._stop.set()
        self._prefetched.set()
        self.fetcher.wake()
        if self._page_cache is not None:
            self._page_cache.close()

    def prefetch_then_rest(self) -> None:
        """What the FUSE server runs in a thread after mounting: the prefetch list in bulk
        (:meth:`Prefetcher.prefetch`), then the rest of the layer in the background
        (:meth:`BackgroundFill.after_start_up`)."""
        try:
            if self.prefetcher.wanted:
                self.prefetcher.prefetch()
        finally:
            self._prefetched.set()
        self.fill.after_start_up()

    def wait_start_up(self, after: float, longest: float) -> bool:
        """Block until the layer's start-up has had its turn: ``after`` seconds from now, the
        prefetch ended (where the layer names a start-up set) and no read was served for
        ``QUIET_SECONDS`` (at most ``longest`` seconds for each of these two). False if the
        layer was closed meanwhile. For housekeeping that holds the GIL (compacting the
        TOC): the FUSE loop and the mounts of the image's next layers would wait for it."""
        if self._stop.wait(after):
            return False
        if self.prefetcher.wanted:
            self._prefetched.wait(longest)
        if self._stop.is_set():
            return False
        self.fetcher.wait_quiet(longest, stop=self._stop)
        return not self._stop.is_set()

    # -- reads -----------------------------------------------------------------------------

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
            windows = self.windows
            windows.note_small(chunks)
            windows.follow(chunks)
        elif entry.size >= STREAM_MIN_FILE:
            self.sequential.note_run(entry, offset, end)
        self.sequential.note_read(entry, offset, end, chunks, plan=True)
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
            windows = self.windows

            def more(missed: list[Chunk]) -> list[Chunk]:
                return windows.whole_and_neighbors(entry, missed)[len(missed):]
            windows.note_small(chunks)  # before the fetch: it may join the window's request
        elif entry.size >= STREAM_MIN_FILE:
            self.sequential.note_run(entry, offset, end)  # before the fetch: the stream starts
        got = self.fetcher.get(self.target, spans, deadline, more=more, name=entry.name)
        rec = self.recorder         # once: recording may be switched off meanwhile
        if rec is not None:
            rec.note(entry.name, offset, end)
        if follow:
            self.sequential.note_read(entry, offset, end, chunks, plan=False)
        return done + got
