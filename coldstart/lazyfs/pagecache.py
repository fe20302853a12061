"""Warming the kernel's page cache with a layer's prefetched chunks.

A prefetched chunk is verified and cached on the node, but the start-up still reads it through
this process: a FUSE request per 128 KiB, answered in Python, competing for the node's cores
with the start-up itself. :class:`PageCacheWarmer` hands each prefetched chunk to the kernel
instead (FUSE ``NOTIFY_STORE``) as soon as it is verified, so the start-up's reads of the
profile's files (``read(2)`` and the page faults of mapped libraries alike) are page-cache hits
that never leave the kernel. The kernel takes pages only for inodes it knows, so the warmer
first looks each file up through the mount (``stat``): the lookups the start-up would make
anyway, made ahead of it.

It runs in its own thread: a store can wait for a page that a read in flight holds locked,
and that read is answered by the FUSE loop.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from coldstart.format.toc import Chunk

if TYPE_CHECKING:
    from coldstart.lazyfs.fetcher import LayerStats

__all__ = ["PageCacheWarmer"]

log = logging.getLogger(__name__)

PAGE = 4096

#: ``(inode, offset, data)``: fusefs.store_pages, or a test's stand-in
Store = Callable[[int, int, memoryview], None]


class PageCacheWarmer:
    """Pushes verified chunks of one layer into the page cache of its files.

    ``root`` is the layer's directory on the FUSE mount; ``sizes`` gives a file's size by
    name (a partial last page is stored only when it ends the file); ``store`` puts bytes
    into an inode's page cache (:func:`coldstart.lazyfs.fusefs.store_pages`); ``stats``
    counts the bytes stored (``page_cache_bytes``). Stores are hints: a file the kernel
    cannot take (gone, not a regular file) is skipped, its reads go through FUSE as usual.
    """

    def __init__(self, root: Path, sizes: Callable[[str], int | None], store: Store, *,
                 stats: LayerStats | None = None) -> None:
        self.root = root
        self.sizes = sizes
        self.store = store
        self.stats = stats
        self.bytes_stored = 0
        self._inodes: dict[str, int | None] = {}
        self._queue: queue.SimpleQueue[tuple[Chunk, bytes] | threading.Event | None] = (
            queue.SimpleQueue())
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._off = False

    def put(self, chunk: Chunk, data: bytes) -> None:
        """Queue a verified chunk (any thread)."""
        if self._off or not chunk.owner:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"pagecache-{self.root.name}")
                self._thread.start()
        self._queue.put((chunk, data))

    def close(self) -> None:
        """Stop (what is queued is dropped); the layer is going away."""
        self._off = True
        self._queue.put(None)

    def join(self, timeout: float | None = None) -> bool:
        """Wait until every chunk queued so far is handled; False if it timed out."""
        done = threading.Event()
        self._queue.put(done)
        with self._lock:
            running = self._thread is not None and self._thread.is_alive()
        return done.wait(timeout) if running else True

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            if item is None or self._off:
                return
            try:
                self._push(*item)
            except OSError as exc:
                if exc.errno == errno.ENOSYS:   # a kernel without NOTIFY_STORE
                    log.info("the kernel does not take page cache stores: %s", exc)
                    self._off = True
                    return
                log.debug("page cache of %s: %s", item[0].owner, exc)
            except Exception:   # never let the warmer take a read down; it is only a hint
                log.exception("page cache warmer of %s stopped", self.root)
                self._off = True
                return

    def _inode(self, name: str) -> int | None:
        if name in self._inodes:
            return self._inodes[name]
        try:
            st = os.stat(self.root / name, follow_symlinks=False)
            ino: int | None = st.st_ino if stat.S_ISREG(st.st_mode) else None
        except OSError:
            ino = None
        self._inodes[name] = ino
        return ino

    def _push(self, chunk: Chunk, data: bytes) -> None:
        ino = self._inode(chunk.owner)
        if ino is None:
            return
        size = self.sizes(chunk.owner)
        if size is None:
            return
        start = chunk.chunk_offset
        end = start + len(data)
        head = -start % PAGE        # the store must begin on a page
        if end != size:
            end -= end % PAGE       # ... and end on one, unless it ends the file
        if start + head >= end:
            return
        view = memoryview(data)[head : end - start]
        self.store(ino, start + head, view)
        self.bytes_stored += len(view)
        if self.stats is not None:
            with self.stats._lock:
                self.stats.page_cache_bytes += len(view)
