"""Which pages of a file the kernel holds, asked without reading or allocating any:
``mincore`` of a mapping made for the question (mapping a file reads nothing)."""

from __future__ import annotations

import ctypes
import mmap
import os

__all__ = ["PAGE", "resident"]

PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_MAP_FAILED = ctypes.c_void_p(-1).value
_LOW_BIT = bytes(b & 1 for b in range(256))


def resident(fd: int, offset: int, length: int) -> bytes:
    """One byte per page of ``[offset, offset+length)`` of the file ``fd`` (``offset`` a
    multiple of :data:`PAGE`, ``length`` > 0): 1 where the kernel holds the page, 0 where it
    does not (a hole, a page not read or swapped out). OSError if it cannot be asked."""
    addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
    if addr in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    try:
        vec = ctypes.create_string_buffer(-(-length // PAGE))
        if _libc.mincore(addr, length, vec) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return vec.raw.translate(_LOW_BIT)     # bit 0: resident; the others are reserved
    finally:
        _libc.munmap(addr, length)
