"""coldstart.cache: the node-wide, content-addressed chunk cache (CONVENTIONS §7).

:class:`ChunkCache` is the cache of a node (a directory); :class:`ChunkStore` is the protocol
the FUSE side is typed against. Modules: ``chunks`` (the cache: composition, writer thread),
``index`` (in-memory index, LRU, eviction), ``packs`` and ``packfile`` (small chunks in
append-only packs), ``files`` (big chunks, one file each), ``store`` (the protocol).
"""

from coldstart.cache.chunks import ChunkCache
from coldstart.cache.index import CacheStats
from coldstart.cache.store import ChunkStore

__all__ = ["CacheStats", "ChunkCache", "ChunkStore"]
