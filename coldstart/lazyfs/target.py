"""One layer as fetching sees it, and what fetching reports.

Every part of the lazy read path (the :class:`~coldstart.lazyfs.fetcher.ChunkFetcher`, the
:class:`~coldstart.lazyfs.reader.LayerReader` and the parts it owns: windows, streams, prefetch,
fill) is handed one layer as a :class:`FetchTarget`: its digest, its
:class:`~coldstart.format.layer.SeekableLayer`, its blob :class:`~coldstart.remote.Source`, its
:class:`LayerStats` (the counters the FUSE server's status shows, CONVENTIONS §12: bytes and
requests by what a fetch is for, ``DEMAND``, ``PREFETCH`` or ``FILL``; the layer's state and last
error) and its ``stopped`` event (set once the layer is no longer served). Node-wide counters go
out through the :class:`FetchTelemetry` hooks (:mod:`~coldstart.lazyfs.metrics` implements them):
the data path holds no metrics library.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from coldstart.format.layer import SeekableLayer
from coldstart.remote import Source

__all__ = ["DEMAND", "FETCH_KINDS", "FILL", "PREFETCH", "FetchTarget", "FetchTelemetry",
           "LayerStats"]


class FetchTelemetry(Protocol):
    """Hooks the fetcher and reader report through (metrics live outside the data path)."""

    def fetched(self, layer: str, nbytes: int, kind: str = ...) -> None: ...

    def cache_hit(self, nbytes: int) -> None: ...

    def cache_miss(self, nbytes: int) -> None: ...

    def error(self, kind: str) -> None: ...

    def read_done(self, seconds: float) -> None: ...


#: what a fetch is for (counted apart in each layer's stats)
DEMAND = "demand"          # a read waits for it (with the neighbours and read-ahead it brings)
PREFETCH = "prefetch"      # the start-up set before the prefetch landmark, at mount
FILL = "fill"              # the rest of the layer, in the background
FETCH_KINDS = (DEMAND, PREFETCH, FILL)


@dataclass
class LayerStats:
    """Per-layer counters shown by the FUSE server's status (CONVENTIONS §12).

    ``state``: ``on-demand`` (no prefetch or fill running), ``prefetching``, ``filling``,
    ``complete`` (every chunk local: the layer never touches the network again)."""

    fetched_bytes: int = 0
    requests: int = 0
    chunks_fetched: int = 0
    #: chunks fetched again after their first bytes failed to decode or verify
    refetched_chunks: int = 0
    errors: int = 0
    last_error: str = ""
    last_error_at: float = 0.0
    prefetch_done: bool = False
    background_done: bool = False
    state: str = "on-demand"
    bytes_by_kind: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FETCH_KINDS, 0))
    requests_by_kind: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(FETCH_KINDS, 0))
    #: compressed bytes of the layer's chunks, and of those known local (set by the fill)
    total_bytes: int = 0
    local_bytes: int = 0
    #: bytes of prefetched chunks handed to the kernel's page cache
    page_cache_bytes: int = 0
    #: FUSE reads of the layer's files (counted by the FUSE loop alone: no lock)
    fuse_reads: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_error(self, message: str) -> None:
        with self._lock:
            self.errors += 1
            self.last_error = message
            self.last_error_at = time.time()

    def as_dict(self) -> dict[str, object]:
        with self._lock:
            return {
                "fetched_bytes": self.fetched_bytes,
                "requests": self.requests,
                "chunks_fetched": self.chunks_fetched,
                "refetched_chunks": self.refetched_chunks,
                "errors": self.errors,
                "last_error": self.last_error,
                "last_error_at": self.last_error_at,
                "prefetch_done": self.prefetch_done,
                "background_done": self.background_done,
                "state": self.state,
                "prefetched_bytes": self.bytes_by_kind[PREFETCH],
                "filled_bytes": self.bytes_by_kind[FILL],
                "on_demand_bytes": self.bytes_by_kind[DEMAND],
                "requests_by_kind": dict(self.requests_by_kind),
                "total_bytes": self.total_bytes,
                "local_bytes": self.local_bytes,
                "page_cache_bytes": self.page_cache_bytes,
                "fuse_reads": self.fuse_reads,
            }


@dataclass
class FetchTarget:
    """One layer as the fetcher sees it (``stopped``: set once the layer is no longer served;
    work held for later, such as a deferred spread, is then dropped)."""

    digest: str
    layer: SeekableLayer
    source: Source
    stats: LayerStats
    stopped: threading.Event = field(default_factory=threading.Event)
