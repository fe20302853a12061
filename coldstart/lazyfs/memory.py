"""How the FUSE server asks glibc to treat its memory: keep freed chunk buffers for the next
chunks, and give back what a big TOC's parsing left behind."""

from __future__ import annotations

import ctypes
import logging
import os

__all__ = ["give_back_freed_memory", "keep_freed_memory"]

log = logging.getLogger(__name__)

#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8


def keep_freed_memory() -> None:
    """Let glibc keep the memory of freed chunks for the next ones.

    The data path allocates and frees a few MiB per chunk (compressed bytes, decoded bytes).
    By default glibc maps blocks this large with ``mmap`` and gives freed heap tops back to the
    kernel, so every chunk lands in fresh pages that fault in one by one (and, on a VM with free
    page reporting, are backed by the host again). Kept: blocks up to 32 MiB come from the
    heap (glibc's limit for the threshold is 32 MiB), and up to 256 MiB of freed heap stays with
    the process.

    One heap for all threads (``M_ARENA_MAX`` 1): the GIL serializes nearly every allocation
    anyway, and each extra per-thread heap keeps its freed top for good (``malloc_trim`` does
    not shrink those): parsing a 200,000-file TOC in a worker thread left some 50 MB resident
    that way (measured with ``bench/bench_pull.py``). ``COLDSTART_MALLOC_TUNE=0`` leaves
    glibc's defaults. Not glibc (musl): nothing to do.
    """
    if os.environ.get("COLDSTART_MALLOC_TUNE", "1") == "0":
        return
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    for param, value in ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 256 << 20),
                         (_M_TOP_PAD, 16 << 20), (_M_ARENA_MAX, 1)):
        if not mallopt(ctypes.c_int(param), ctypes.c_int(value)):
            log.warning("glibc refused mallopt(%d, %d): chunk buffers may be mapped afresh "
                        "each time", param, value)


def give_back_freed_memory() -> None:
    """Return the free memory of the heap to the kernel (``malloc_trim``).

    Parsing a layer's TOC makes and frees about a kilobyte of objects per file; with the
    thresholds :func:`keep_freed_memory` sets, glibc would keep those pages (a 200,000-file
    layer: some 100 MB) for good. Called once a mounted layer's TOC is compacted; a few
    milliseconds."""
    try:
        ctypes.CDLL(None).malloc_trim(ctypes.c_size_t(0))
    except (OSError, AttributeError):
        pass
