"""Giving back the chunk cache space of a layer nobody mounts any more.

When containerd removes an image's snapshots, the FUSE server unmounts their layers; the
chunks only those layers had are then dead weight in the node's cache until eviction reaches
them. :func:`reclaim_layer` removes them at once, and keeps every chunk that a layer still
mounted also holds (layers share chunks by digest: the same file in two images is stored once).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from coldstart.cache import ChunkCache
from coldstart.format.toc import TOC

__all__ = ["chunk_digests", "reclaim_layer"]

log = logging.getLogger(__name__)


def chunk_digests(toc: TOC) -> set[str]:
    """The digests of every stored chunk of ``toc``'s regular files (holes excluded)."""
    return {c.digest for e in toc.entries.values() if e.type == "reg"
            for c in e.chunks if not c.zeros}


def reclaim_layer(cache: ChunkCache, dropped: TOC,
                  kept: Iterable[TOC] | Callable[[], Iterable[TOC]], *,
                  what: str = "layer") -> tuple[int, int]:
    """Remove from ``cache`` the chunks of ``dropped`` that no TOC of ``kept`` has (a callable:
    asked once the dropped layer's chunks are known, so a layer mounted meanwhile counts);
    returns (chunks removed, bytes the cache no longer counts). A chunk that a layer mounted
    in the last moment needs is fetched again on its first read: the cache is only a cache."""
    t0 = time.monotonic()
    gone = chunk_digests(dropped)
    for toc in kept() if callable(kept) else kept:
        if not gone:
            break
        gone -= chunk_digests(toc)
    before = cache.total_bytes
    removed = cache.reclaim(gone)
    freed = max(0, before - cache.total_bytes)
    log.info("%s: %d chunks of it alone removed from the cache (%d bytes given back) in "
             "%.2f s", what, removed, freed, time.monotonic() - t0)
    return removed, freed
