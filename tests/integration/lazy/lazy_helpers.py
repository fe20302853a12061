"""Helpers for the lazy data plane tests: build layers (test data, here), push them and run the
FUSE server (real daemons: :mod:`coldstart.stack`, re-exported under their old names)."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from coldstart.cache import ChunkCache
from coldstart.format.writer import LayerResult, convert_layer
from coldstart.lazyfs.client import FuseServerClient
from coldstart.stack.images import realistic_bytes
from coldstart.stack.mounts import unmount_under
from coldstart.stack.registry import push_layer
from coldstart.stack.snapshotter import fuse_server
from coldstart.stack.snapshotter import fuse_server_config as write_config

__all__ = ["MTIME", "REPO_ROOT", "Server", "SourceTree", "convert", "fuse_server", "in_cache",
           "metadata_tar", "push_layer", "realistic_bytes", "sha", "tar_of", "unmount_under",
           "write_config"]

REPO_ROOT = Path(__file__).resolve().parents[3]
#: what the ``server`` fixture yields: (process, control client, its temp dir)
Server = tuple[subprocess.Popen[bytes], FuseServerClient, Path]
MTIME = 1_700_000_000


def _info(name: str, type_: bytes, mode: int, *, uid: int = 0, gid: int = 0,
          size: int = 0, linkname: str = "") -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = type_
    ti.mode = mode
    ti.uid, ti.gid = uid, gid
    ti.uname, ti.gname = ("user" if uid else "root"), ("group" if gid else "root")
    ti.mtime = MTIME
    ti.size = size
    ti.linkname = linkname
    return ti


@dataclass
class SourceTree:
    tar: bytes
    files: dict[str, bytes]      # regular files' content by path


def metadata_tar(big_size: int = 5 << 20, seed: int = 0) -> SourceTree:
    """A layer with every entry type, odd modes and owners, xattrs, whiteouts, a big file.

    Different ``seed``s share no chunk (the cache dedups identical chunks across layers)."""
    files: dict[str, bytes] = {}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        def add(ti: tarfile.TarInfo, data: bytes | None = None,
                xattrs: dict[str, str] | None = None) -> None:
            if xattrs:
                ti.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in xattrs.items()}
            if data is not None:
                ti.size = len(data)
                files[ti.name] = data
                tf.addfile(ti, io.BytesIO(data))
            else:
                tf.addfile(ti)
        add(_info("etc", tarfile.DIRTYPE, 0o755))
        add(_info("etc/os-release", tarfile.REGTYPE, 0o644), b"NAME=coldstart %d\n" % seed)
        add(_info("etc/shadow", tarfile.REGTYPE, 0o640, gid=42), b"root:*:%d:0:::::\n" % seed)
        add(_info("usr", tarfile.DIRTYPE, 0o755))
        add(_info("usr/bin", tarfile.DIRTYPE, 0o755))
        add(_info("usr/bin/sudo", tarfile.REGTYPE, 0o4755),
            realistic_bytes(70_000, 1 + 1000 * seed))
        add(_info("usr/bin/tool", tarfile.REGTYPE, 0o755, uid=1000, gid=1001),
            realistic_bytes(3000, 2 + 1000 * seed), xattrs={"user.origin": "test",
                                              "security.capability": "caps"})
        add(_info("usr/bin/tool-link", tarfile.LNKTYPE, 0o755, uid=1000, gid=1001,
                  linkname="usr/bin/tool"))
        add(_info("usr/bin/python", tarfile.SYMTYPE, 0o777, linkname="python3.11"))
        add(_info("usr/lib", tarfile.DIRTYPE, 0o755))
        add(_info("usr/lib/big.so", tarfile.REGTYPE, 0o644),
            realistic_bytes(big_size, 3 + 1000 * seed))
        add(_info("usr/lib/empty", tarfile.REGTYPE, 0o644), b"")
        add(_info("usr/lib/zeros", tarfile.REGTYPE, 0o644), bytes(300_000))
        add(_info("dev", tarfile.DIRTYPE, 0o755))
        ti = _info("dev/null", tarfile.CHRTYPE, 0o666)
        ti.devmajor, ti.devminor = 1, 3
        add(ti)
        ti = _info("dev/sda", tarfile.BLKTYPE, 0o660, gid=6)
        ti.devmajor, ti.devminor = 8, 0
        add(ti)
        add(_info("dev/pipe", tarfile.FIFOTYPE, 0o600))
        add(_info("tmp", tarfile.DIRTYPE, 0o1777))
        add(_info("var", tarfile.DIRTYPE, 0o755))
        add(_info("var/cache", tarfile.DIRTYPE, 0o755))
        add(_info("var/cache/.wh..wh..opq", tarfile.REGTYPE, 0o644), b"")
        add(_info("var/cache/fresh", tarfile.REGTYPE, 0o644), b"fresh %d\n" % seed)
        add(_info("var/.wh.old", tarfile.REGTYPE, 0o644), b"")
        for i in range(30):
            add(_info(f"usr/share/doc/f{i:03d}.txt", tarfile.REGTYPE, 0o644),
                realistic_bytes(100 + 997 * i, 100 + i + 1000 * seed))
    files.pop("var/cache/.wh..wh..opq")
    files.pop("var/.wh.old")
    return SourceTree(buf.getvalue(), files)


def tar_of(files: dict[str, bytes]) -> bytes:
    """An uncompressed layer tar of ``files``, each a 0644 regular file (directories
    implied), in the dict's order."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime = len(data), 0o644, MTIME
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def convert(tar: bytes, fmt: str, chunk_size: int = 64 << 10,
            prefetch: list[str] | None = None) -> tuple[bytes, LayerResult]:
    out = io.BytesIO()
    result = convert_layer(io.BytesIO(tar), out, format=fmt, chunk_size=chunk_size,
                           prefetch=prefetch)
    return out.getvalue(), result


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def in_cache(cache_dir: Path, digest: str) -> bool:
    """Whether the node cache on disk holds the chunk (a file, or a record in a pack)."""
    cache = ChunkCache(cache_dir, max_bytes=1 << 50)
    try:
        return digest in cache
    finally:
        cache.close()


class ReadLoop:
    """Reads every file of ``files`` under ``root`` over and over in a thread (each file's
    page cache dropped first, so every pass reaches the FUSE server), comparing the bytes:
    what a container that keeps reading sees. ``stop()`` returns (reads, failures)."""

    def __init__(self, root: Path, files: dict[str, bytes]) -> None:
        self.root, self.files = root, files
        self.reads = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="read-loop")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, data in self.files.items():
                try:
                    fd = os.open(self.root / name, os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                        got = os.pread(fd, len(data) + 1, 0)
                    finally:
                        os.close(fd)
                    if got != data:
                        self.failures.append(f"{name}: wrong bytes")
                except OSError as exc:
                    self.failures.append(f"{name}: {exc}")
                self.reads += 1

    def wait_reads(self, n: int, timeout: float = 60.0) -> None:
        """Until ``n`` more reads are done (AssertionError if they stall)."""
        target = self.reads + n
        deadline = time.monotonic() + timeout
        while self.reads < target:
            assert time.monotonic() < deadline, f"reads stalled at {self.reads}"
            assert self._thread.is_alive()
            time.sleep(0.02)

    def stop(self, timeout: float = 60.0) -> tuple[int, list[str]]:
        self._stop.set()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "a read never returned"
        return self.reads, self.failures


def _kernel() -> tuple[int, int]:
    major, minor = [*os.uname().release.split("."), "0"][:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


#: a successor that takes over a dead FUSE server's connection needs the kernel to resend
#: the requests the dead one had taken (FUSE_NOTIFY_RESEND, Linux 6.9); before that, a read
#: in flight at the kill waits until interrupted
needs_resend = pytest.mark.skipif(_kernel() < (6, 9),
                                  reason="needs Linux >= 6.9 (FUSE_NOTIFY_RESEND)")
