"""Small-file windows: a small file's miss brings the small files stored after it.

Round trips are what cost on a cold start: a package's modules are read together, and they lie
together in the blob. So a small file (``SMALL_FILE_BYTES``,
:data:`coldstart.lazyfs.reader.SMALL_FILE_BYTES`) is fetched whole on its first read, together
with the small files stored after it (``NEIGHBOR_BYTES``), in the same request; a reader that
goes on into that window gets the next window fetched in the background.

:class:`SmallFileWindows` holds one layer's windows: the adaptive window size, what the last
miss's window brought and how much of it was read since, and the index of the small files'
chunks in blob order (:class:`SmallChunks`, built once per layer, off the mount's path). The
:class:`~coldstart.lazyfs.reader.LayerReader` owns one and calls it on each read of a small
file: :meth:`SmallFileWindows.note_small` and :meth:`SmallFileWindows.follow` from the FUSE loop
(in-memory checks only; choosing the next window runs in the fetcher's planner thread),
:meth:`SmallFileWindows.whole_and_neighbors` from a worker whose read missed.
"""

from __future__ import annotations

import bisect
import threading
from array import array
from collections.abc import Iterator

from coldstart.config import FetchConfig
from coldstart.errors import ColdstartError
from coldstart.format.layer import SeekableLayer
from coldstart.format.toc import Chunk, Entry
from coldstart.lazyfs.batches import is_local
from coldstart.lazyfs.fetcher import ChunkFetcher
from coldstart.lazyfs.target import FetchTarget

__all__ = ["NEIGHBOR_BYTES", "NEIGHBOR_MAX_BYTES", "SmallChunks", "SmallFileWindows"]

#: the window defaults, from the one config tree (CONVENTIONS §9)
_DEFAULTS = FetchConfig()

#: A small file's miss also fetches the small files stored after it, up to this many
#: compressed bytes, in the same request (a package's modules are read together). The window
#: adapts: at each miss it doubles (up to ``NEIGHBOR_MAX_BYTES``) when at least half the files
#: the previous window brought were read since, and halves back (never below
#: ``NEIGHBOR_BYTES``) when fewer than a tenth were.
NEIGHBOR_BYTES = _DEFAULTS.neighbor_bytes
NEIGHBOR_MAX_BYTES = _DEFAULTS.neighbor_max_bytes


class SmallChunks:
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


class SmallFileWindows:
    """The neighbour windows of one layer's small files (see the module docstring).

    ``neighbor_bytes`` 0 switches them off (a small file is still fetched whole)."""

    def __init__(self, target: FetchTarget, fetcher: ChunkFetcher, *, small_file_bytes: int,
                 neighbor_bytes: int = NEIGHBOR_BYTES,
                 neighbor_max_bytes: int = NEIGHBOR_MAX_BYTES) -> None:
        self.target = target
        self.layer = target.layer
        self.fetcher = fetcher
        self.cache = fetcher.cache
        self.small_file_bytes = small_file_bytes
        self.neighbor_bytes = neighbor_bytes
        self.neighbor_max_bytes = max(neighbor_bytes, neighbor_max_bytes)
        #: the adaptive neighbour window now, and what the last miss's window brought: its
        #: blob range, how many small files, and the offsets of those read since
        self.neighbor_window = neighbor_bytes
        self._probe = (0, 0)
        self._probe_files = 0
        self._probe_hits: set[int] = set()
        self._window = (0, 0)   # blob range of the last small-file window fetched
        self._lock = threading.Lock()
        # the small files' chunks in blob order, built on first need or by warm_index() in a
        # thread after the mount: building it touches every entry of the TOC, which the mount
        # itself must not pay for (200,000 entries: about a second)
        self._small: SmallChunks | None = None
        self._small_lock = threading.Lock()

    def warm_index(self) -> SmallChunks:
        """The small files' chunks in blob order (built once)."""
        small = self._small
        if small is None:
            with self._small_lock:
                if self._small is None:
                    self._small = SmallChunks(self.layer, self.small_file_bytes)
                small = self._small
        return small

    def whole_and_neighbors(self, entry: Entry, want: list[Chunk]) -> list[Chunk]:
        """A small file's missing chunks (``want`` first), plus the small files' chunks
        stored after it (a worker's read that missed: may ``stat``)."""
        seen = set(want)
        out = list(want)
        for c in entry.chunks:
            if c not in seen and not is_local(self.cache, c):
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

    def note_small(self, chunks: list[Chunk]) -> None:
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
            if c not in seen and not is_local(self.cache, c):
                seen.add(c)
                out.append(c)
        return out

    def follow(self, chunks: list[Chunk]) -> None:
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
