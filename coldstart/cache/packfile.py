"""The pack file format and the state of one pack: small chunks appended to a shared file.

A pack record is::

    b"CSK1" | 32 raw sha256 bytes | u32 length (little endian) | data

A pack is written only by the process that created it (its pid is in the name,
``<pid>-<unique>.pack``), so writes of two processes never interleave. :func:`scan_pack` reads a
pack sequentially and re-hashes each record: a record whose sha256 does not match is skipped
(logged, never served); a truncated record or a bad header ends the scan (a writer that crashed
mid-append, or one still writing).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
from pathlib import Path

__all__ = ["HDR", "HDR_SIZE", "MAGIC", "PACK_RE", "Pack", "pread_all", "pwrite_all",
           "scan_pack"]

# one logger for the whole chunk cache (operators and tests filter on this name)
log = logging.getLogger("coldstart.cache.chunks")

PACK_RE = re.compile(r"^[0-9]+-[0-9a-f-]+\.pack$")
MAGIC = b"CSK1"
HDR = struct.Struct("<4s32sI")
HDR_SIZE = HDR.size


class Pack:
    """One pack file. All fields are guarded by the index's lock."""

    __slots__ = ("bytes", "dead", "fd", "live", "mtime", "name", "own", "path", "scanned",
                 "touched", "users")

    def __init__(self, path: Path, *, own: bool, mtime: float) -> None:
        self.path = path
        self.name = path.name
        self.own = own            # written by this process (the current or a rolled pack)
        self.fd = -1              # opened on first use; closed when idle and dead
        self.users = 0            # threads using fd right now
        self.bytes = 0            # bytes counted in the cache's total (the file's size)
        self.scanned = 0          # records before this offset are indexed (or skipped)
        self.live = 0             # indexed records
        self.dead = False         # deleted: no new users, fd closes when users drops to 0
        self.mtime = mtime
        self.touched = mtime


def scan_pack(path: Path, start: int) -> tuple[list[tuple[int, str, int]], int, int]:
    """The verified records of a pack from offset ``start``: ([(data offset, hex, size)],
    offset after the last whole record, file size). A record whose data does not match its
    digest is skipped (logged); a bad header or a truncated record ends the scan."""
    recs: list[tuple[int, str, int]] = []
    with open(path, "rb", buffering=1 << 20) as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(start)
        off = start
        while off + HDR_SIZE <= size:
            header = f.read(HDR_SIZE)
            if len(header) < HDR_SIZE:
                break
            magic, raw, n = HDR.unpack(header)
            if magic != MAGIC:
                log.warning("chunk cache: %s: no record header at offset %d; ignoring the "
                            "%d bytes from there", path, off, size - off)
                break
            if off + HDR_SIZE + n > size:
                log.info("chunk cache: %s: record at offset %d is truncated (a writer died or "
                         "is still writing); ignoring it", path, off)
                break
            data = f.read(n)
            if len(data) < n:
                break
            if hashlib.sha256(data).digest() == raw:
                recs.append((off + HDR_SIZE, raw.hex(), n))
            else:
                log.error("chunk cache: %s: record at offset %d (sha256:%s) is corrupt; not "
                          "served", path, off, raw.hex())
            off += HDR_SIZE + n
    return recs, off, size


def pwrite_all(fd: int, bufs: list[bytes | bytearray | memoryview], offset: int) -> None:
    """Write ``bufs`` at ``offset`` (one ``pwritev``, then the rest if it was short)."""
    total = sum(len(b) for b in bufs)
    done = os.pwritev(fd, bufs, offset)
    if done < total:
        rest = memoryview(b"".join(bufs))[done:]
        while rest:
            n = os.pwrite(fd, rest, offset + done)
            rest = rest[n:]
            done += n


def pread_all(fd: int, length: int, offset: int) -> bytes:
    """``length`` bytes at ``offset`` (fewer only at the end of the file)."""
    parts: list[bytes] = []
    done = 0
    while done < length:
        got = os.pread(fd, length - done, offset + done)
        if not got:
            break
        parts.append(got)
        done += len(got)
    if len(parts) == 1:
        return parts[0]
    return b"".join(parts)
