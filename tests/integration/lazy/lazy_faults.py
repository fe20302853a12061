"""The fault-injection workload, shared by ``test_lazy_faults.py`` and ``bench/bench_faults.py``:
a layer of many files, a FUSE server whose registry client retries, a reader that reads every
file through the mount and says what it got, and a check of the chunk cache on disk.

A read is one file read whole, in ``pread`` calls of ``PIECE`` bytes; it returns the right
bytes, or fails (EIO expected: any other errno is a bug, and so is a single wrong byte).
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from coldstart.cache import ChunkCache
from coldstart.format.layer import open_layer
from coldstart.format.readat import BytesReadAt
from coldstart.lazyfs.client import FuseServerClient
from coldstart.stack.images import realistic_bytes
from coldstart.stack.snapshotter import fuse_server

__all__ = ["PIECE", "CacheCheck", "ReadReport", "ServerTimes", "check_cache", "fault_server",
           "fault_tree", "read_tree"]

#: bytes asked per ``pread``
PIECE = 128 << 10


def fault_tree(seed: int, *, small: int = 300, big: int = 4,
               big_size: int = 640 << 10) -> dict[str, bytes]:
    """``small`` small files (50 B to 6 KB) and ``big`` files of ``big_size`` bytes (several
    chunks each), by path. Half of them are random bytes (zstd stores those in raw blocks, so
    a flipped byte there decodes cleanly and only the chunk digest catches it), half are
    compressible. Different seeds share no chunk."""
    rng = random.Random(seed)
    files: dict[str, bytes] = {}
    for i in range(small):
        size = rng.randint(50, 6000)
        data = rng.randbytes(size) if i % 2 else realistic_bytes(size, seed * 100_003 + i)
        files[f"lib/pkg{i // 25:02d}/mod{i:03d}.py"] = data
    for i in range(big):
        data = rng.randbytes(big_size) if i % 2 else \
            realistic_bytes(big_size, seed * 100_003 + 90_000 + i)
        files[f"usr/lib/big{i}.so"] = data
    return files


@dataclass(frozen=True)
class ServerTimes:
    """The FUSE server's retry and deadline settings (``registry.*`` and ``fetch.*``).

    ``registry_timeout`` bounds one attempt's wait for the registry (a stall is cut off then
    and the request tried again, ``retries`` times at most); ``request_timeout`` bounds one
    range request with its retries; ``read_deadline`` one FUSE read."""

    retries: int = 3
    registry_timeout: float = 1.0
    request_timeout: float = 5.0
    read_deadline: float = 6.0


@contextlib.contextmanager
def fault_server(tmp: Path, *, registry_host: str, times: ServerTimes = ServerTimes(),
                 neighbor_bytes: int = 0, log_level: str = "info"
                 ) -> Iterator[tuple[subprocess.Popen[bytes], FuseServerClient, Path]]:
    """``coldstart fuse-server`` on ``tmp/root`` (log ``tmp/fuse-server.log``), reading
    through ``registry_host`` with ``times``' retries and deadlines, no background fill;
    yields ``(process, control client, root)``; stops it and unmounts everything under
    ``tmp`` after. ``neighbor_bytes`` 0: a small file's read fetches that file alone, so the
    workload makes many requests (and meets many faults)."""
    tmp.mkdir(parents=True, exist_ok=True)
    with fuse_server(tmp, registry_host=registry_host, retries=times.retries,
                     registry_timeout=times.registry_timeout,
                     request_timeout=times.request_timeout, read_deadline=times.read_deadline,
                     concurrency=8, neighbor_bytes=neighbor_bytes,
                     log_level=log_level) as served:
        yield served


@dataclass
class ReadReport:
    """What reading a tree through a mount gave: ``reads`` files read whole, ``ok`` of them
    right, ``eio`` failed with EIO; ``other_errors`` any other failure (a bug); ``wrong_reads``
    reads that returned bytes other than the source's, ``wrong_bytes`` how many (must be 0);
    ``slowest``: the longest single ``pread``, seconds."""

    reads: int = 0
    preads: int = 0
    ok: int = 0
    eio: int = 0
    other_errors: list[str] = field(default_factory=list)
    wrong_reads: int = 0
    wrong_bytes: int = 0
    slowest: float = 0.0
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, name: str, outcome: str, preads: int, wrong: int, slowest: float) -> None:
        self.reads += 1
        self.preads += preads
        self.slowest = max(self.slowest, slowest)
        if wrong:
            self.wrong_reads += 1
            self.wrong_bytes += wrong
        if outcome == "ok":
            self.ok += 1 if not wrong else 0
        elif outcome == "EIO":
            self.eio += 1
            self.failed.append(name)
        else:
            self.other_errors.append(f"{name}: {outcome}")
            self.failed.append(name)


def _differing(got: bytes, want: bytes) -> int:
    if got == want:
        return 0
    return sum(a != b for a, b in zip(got, want, strict=False)) + abs(len(got) - len(want))


def read_file(path: Path, want: bytes) -> tuple[str, int, int, float]:
    """Read ``path`` whole in ``PIECE``-byte ``pread``s, comparing each with ``want``:
    ``(outcome, preads, wrong bytes, slowest pread)``; outcome ``ok``, ``EIO`` or what else
    failed. The read stops at its first error."""
    preads = wrong = 0
    slowest = 0.0
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        return f"open: {errno.errorcode.get(exc.errno or 0, exc.errno)}", 0, 0, 0.0
    try:
        off = 0
        while True:
            t0 = time.monotonic()
            try:
                got = os.pread(fd, PIECE, off)
            except OSError as exc:
                slowest = max(slowest, time.monotonic() - t0)
                name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
                return name, preads + 1, wrong, slowest
            slowest = max(slowest, time.monotonic() - t0)
            preads += 1
            wrong += _differing(got, want[off:off + len(got)])
            if not got:
                break
            off += len(got)
        if off != len(want):
            wrong += abs(len(want) - off)
        return "ok", preads, wrong, slowest
    finally:
        os.close(fd)


def read_tree(mp: Path, files: dict[str, bytes], *, threads: int = 8, seed: int = 0,
              names: list[str] | None = None) -> ReadReport:
    """Read ``names`` (default: every file, in a seeded shuffled order) under ``mp`` with
    ``threads`` readers at once; compare with ``files``."""
    order = list(files) if names is None else list(names)
    if names is None:
        random.Random(seed).shuffle(order)
    report = ReadReport()
    t0 = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        results = pool.map(lambda n: (n, read_file(mp / n, files[n])), order)
        for name, (outcome, preads, wrong, slowest) in results:
            report.add(name, outcome, preads, wrong, slowest)
    report.seconds = time.monotonic() - t0
    return report


@dataclass
class CacheCheck:
    """The layer's chunks found in the chunk cache on disk, and those whose bytes there are
    not the source's (must be none)."""

    chunks: int = 0
    cached: int = 0
    bad: list[str] = field(default_factory=list)


def check_cache(cache_dir: Path, blob: bytes, annotations: dict[str, str],
                files: dict[str, bytes]) -> CacheCheck:
    """Compare every cached chunk of the layer with the source bytes it stands for (read raw:
    the cache does not verify, or drop, anything here)."""
    layer = open_layer(BytesReadAt(blob), annotations=annotations)
    out = CacheCheck()
    cache = ChunkCache(cache_dir, max_bytes=1 << 50, verify="never")
    try:
        for name, data in files.items():
            for c in layer.resolve(name).chunks:
                if c.zeros or not c.digest:
                    continue
                out.chunks += 1
                got = cache.get(c.digest)
                if got is None:
                    continue
                out.cached += 1
                if got != data[c.chunk_offset:c.chunk_offset + c.chunk_size]:
                    out.bad.append(f"{name} chunk {c.digest} at {c.chunk_offset}")
    finally:
        cache.close()
    return out
