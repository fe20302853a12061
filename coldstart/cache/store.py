"""What the lazy reader and fetcher need from a chunk cache (CONVENTIONS §3).

:class:`~coldstart.cache.ChunkCache` (a directory on the node) implements it; the FUSE side is
typed against :class:`ChunkStore` only, so a test can wrap or replace the cache.

Two kinds of look-up, for two kinds of caller:

- :meth:`ChunkStore.read_local` and :meth:`ChunkStore.contains` answer from the in-memory
  index only (no ``stat``, no rescan of other processes' packs, no descriptor opened but a big
  chunk's own file): what the FUSE loop may call;
- :meth:`ChunkStore.read`, :meth:`ChunkStore.get` and ``in`` also find chunks another process
  stored (a ``stat``, a rate-limited rescan): worker threads only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

__all__ = ["ChunkStore"]


class ChunkStore(Protocol):
    """A content-addressed store of verified chunks, keyed by ``sha256:<hex>``."""

    def get(self, digest: str, expected_size: int | None = None, *,
            keep: bool = True) -> bytes | None:
        """The whole chunk, or None on a miss (``keep``: see :meth:`read`)."""
        ...

    def read(self, digest: str, offset: int, length: int, *,
             expected_size: int | None = None, keep: bool = True) -> bytes | None:
        """``length`` bytes at ``offset`` of the chunk (``-1``: to its end), or None.
        ``keep=False``: a chunk kept encoded until it is written stays encoded (the caller
        reads it once)."""
        ...

    def read_local(self, digest: str, offset: int, length: int, *,
                   expected_size: int | None = None) -> bytes | None:
        """Like :meth:`read`, from what the in-memory index knows only; None means "ask
        :meth:`read` in a worker", not necessarily a miss."""
        ...

    def contains(self, digest: str) -> bool:
        """In the in-memory index (or waiting to be written)."""
        ...

    def __contains__(self, digest: object) -> bool:
        """Stored, also by another process (may ``stat`` and rescan)."""
        ...

    def put(self, digest: str, data: bytes | bytearray | memoryview, *,
            verified: bool = False) -> None:
        """Store a chunk now (its sha256 is checked unless ``verified``)."""
        ...

    def put_async(self, digest: str, data: bytes, *, verified: bool = False) -> None:
        """Store a chunk in the background; readable at once."""
        ...

    def put_async_encoded(self, digest: str, size: int, decode: Callable[[], bytes], *,
                          held: int) -> None:
        """Like :meth:`put_async` for a chunk verified already but kept encoded until it is
        written: ``decode()`` gives its ``size`` bytes again; ``held``: the bytes it keeps."""
        ...
