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
and that read is answered by the FUSE loop. The thread ends when it has had nothing to do for
a while (a layer's prefetch is one burst), and comes back with the next chunk. Stores are
hints: the bytes queued are bounded (past the bound a chunk is dropped, and read through FUSE
as usual), and so is the time a chunk may wait.

Whole pages only: the kernel takes a partial page only where it ends the file, so the page
that straddles two chunks whose boundary is not page-aligned is left to FUSE (our writer's
chunks are page-aligned; content-defined ones are not).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import queue
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from coldstart.format.toc import Chunk

if TYPE_CHECKING:
    from coldstart.lazyfs.target import LayerStats

__all__ = ["PageCacheWarmer"]

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
#: decoded bytes waiting to be stored, at most (more are dropped: the start-up reads them
#: through FUSE, as without the warmer)
MAX_QUEUED = 256 << 20
#: a chunk that waited longer than this is dropped (the start-up has read it by then)
MAX_AGE = 30.0
#: the thread ends after this long with nothing to store
IDLE_EXIT = 5.0

#: ``(inode, offset, data)``: FuseFS.store_pages, or a test's stand-in
Store = Callable[[int, int, memoryview], None]

_Item = tuple[Chunk, bytes, float] | threading.Event | None


class PageCacheWarmer:
    """Pushes verified chunks of one layer into the page cache of its files.

    ``root`` is the layer's directory on the FUSE mount; ``sizes`` gives a file's size by
    name (a partial last page is stored only when it ends the file); ``store`` puts bytes
    into an inode's page cache (:meth:`coldstart.lazyfs.fusefs.FuseFS.store_pages`); ``stats``
    counts the bytes stored (``page_cache_bytes``); ``enabled`` is asked before each store
    (a layer that records must see every read, so it gets nothing pushed). A file the kernel
    cannot take (gone, not a regular file) is skipped, its reads go through FUSE as usual.
    """

    def __init__(self, root: Path, sizes: Callable[[str], int | None], store: Store, *,
                 stats: LayerStats | None = None,
                 enabled: Callable[[], bool] = lambda: True,
                 max_queued: int = MAX_QUEUED) -> None:
        self.root = root
        self.sizes = sizes
        self.store = store
        self.stats = stats
        self.enabled = enabled
        self.max_queued = max_queued
        self.bytes_stored = 0
        self.dropped = 0
        self._inodes: dict[str, int | None] = {}
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._queued = 0
        self._thread: threading.Thread | None = None
        self._lock = threading.Condition()
        self._off = False

    def takes(self) -> bool:
        """Whether the warmer takes chunks now (it is on, the layer does not record); one
        may still be dropped (no owner, the queue full, too old)."""
        return not self._off and self.enabled()

    def put(self, chunk: Chunk, data: bytes, *, wait: bool = False) -> bool:
        """Queue a verified chunk (any thread); False if it was dropped. Past ``max_queued``
        bytes a chunk is dropped, or with ``wait`` (a thread that may block) waits for room."""
        if self._off or not chunk.owner:
            return False
        with self._lock:
            while self._queued + len(data) > self.max_queued and self._queued:
                if not wait or self._off:
                    self.dropped += 1
                    return False
                self._lock.wait(1.0)
            self._queued += len(data)
            # queued under the lock: a thread that found the queue empty and is ending has
            # cleared _thread first, so this starts the next one
            self._queue.put((chunk, data, time.monotonic()))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"pagecache-{self.root.name}")
                self._thread.start()
        return True

    def close(self) -> None:
        """Stop (what is queued is dropped); the layer is going away."""
        with self._lock:
            self._off = True
            self._lock.notify_all()
        self._queue.put(None)

    def join(self, timeout: float | None = None) -> bool:
        """Wait until every chunk queued so far is handled (or the thread ended); False if
        it timed out."""
        with self._lock:
            thread = self._thread
        if thread is None:
            return True
        done = threading.Event()
        self._queue.put(done)
        end = None if timeout is None else time.monotonic() + timeout
        while not done.is_set() and thread.is_alive():
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return False
            done.wait(0.05 if left is None else min(0.05, left))
        return True

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=IDLE_EXIT)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():     # a put that races this starts a new thread
                        self._thread = None
                        return
                continue
            if isinstance(item, threading.Event):
                item.set()
                continue
            if item is None:
                return
            chunk, data, queued_at = item
            with self._lock:
                self._queued -= len(data)
                self._lock.notify_all()
            if self._off:
                continue
            if not self.enabled() or time.monotonic() - queued_at > MAX_AGE:
                self.dropped += 1
                continue
            try:
                self._push(chunk, data)
            except OSError as exc:
                if exc.errno == errno.ENOSYS:   # a kernel without NOTIFY_STORE
                    log.info("the kernel does not take page cache stores: %s", exc)
                    self._off = True
                    continue
                log.debug("page cache of %s: %s", chunk.owner, exc)
            except Exception:   # never let the warmer take a read down; it is only a hint
                log.exception("page cache warmer of %s stopped", self.root)
                self._off = True

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
