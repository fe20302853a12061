"""coldstart.cache: the node-wide, content-addressed chunk cache (CONVENTIONS §7)."""

from coldstart.cache.chunks import CacheStats, ChunkCache

__all__ = ["CacheStats", "ChunkCache"]
