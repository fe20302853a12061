"""What the chunk cache trusts on disk (``cache.verify``) and what a failed write leaves behind.

With the production default (``verify = "first-read"``) a big chunk's file that this process
did not write (found at start, or stored by another process) is hashed on its first read, then
trusted; a rotted one is dropped and the read is a miss. Chunks this process wrote are never
re-hashed. A write that fails (a full disk) is counted, reported, logged once per burst, and
leaves no file behind.
"""

from __future__ import annotations

import errno
import hashlib
import inspect
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import coldstart.cache.files as files_mod
import coldstart.cache.packs as packs_mod
from coldstart.cache import ChunkCache
from coldstart.cache.chunks import CORRUPT, PACK_THRESHOLD, WRITE_ERROR
from coldstart.config import CacheConfig, Config, FuseConfig, from_dict
from coldstart.errors import InvalidArgument
from coldstart.lazyfs.metrics import ERRORS

#: a big chunk (a loose file under sha256/, not a pack record) with the default layout
BIG = PACK_THRESHOLD + 4096


def dg(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def chunk(seed: int, n: int = BIG) -> bytes:
    return hashlib.sha256(str(seed).encode()).digest() * (n // 32) + bytes(n % 32)


def loose_file(directory: Path, digest: str) -> Path:
    hexd = digest.split(":")[1]
    return directory / "sha256" / hexd[:2] / hexd


def rot(path: Path) -> None:
    """Flip bytes in the middle of a file, keeping its length (bit rot, not truncation)."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, mid + 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


class HashCounter:
    """Counts ``hashlib.sha256`` calls (every hash the cache computes goes through it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real: Callable[..., Any] = hashlib.sha256

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(hashlib, "sha256", counting)


def test_default_is_first_read() -> None:
    assert CacheConfig().verify == "first-read"
    assert inspect.signature(ChunkCache).parameters["verify"].default == CacheConfig().verify
    assert from_dict(Config, {"cache": {"verify": "always"}}).cache.verify == "always"
    with pytest.raises(InvalidArgument, match=r"cache\.verify"):
        CacheConfig(verify="sometimes")
    with pytest.raises(InvalidArgument, match="verify"):
        ChunkCache("/nonexistent-unused", max_bytes=1, verify="sometimes")


def test_rotted_chunk_found_at_start_is_a_miss_and_dropped(tmp_path: Path) -> None:
    data = chunk(1)
    d = dg(data)
    c = ChunkCache(tmp_path, max_bytes=1 << 30)          # production defaults
    c.put(d, data)
    c.close()
    rot(loose_file(tmp_path, d))
    kinds: list[str] = []
    c2 = ChunkCache(tmp_path, max_bytes=1 << 30, on_error=kinds.append)
    assert c2.contains(d)                                 # indexed, but not trusted yet
    assert c2.read_local(d, 0, 4096, expected_size=len(data)) is None   # not on the loop
    assert c2.read(d, 0, 4096, expected_size=len(data)) is None         # never bad bytes
    assert c2.stats.corrupt == 1 and kinds == [CORRUPT]
    assert not loose_file(tmp_path, d).exists() and not c2.contains(d)
    c2.put(d, data)                                       # fetched again: cached again
    assert c2.get(d, expected_size=len(data)) == data
    assert loose_file(tmp_path, d).read_bytes() == data


def test_good_chunk_found_at_start_is_hashed_once_then_served_on_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = chunk(2)
    d = dg(data)
    c = ChunkCache(tmp_path, max_bytes=1 << 30)
    c.put(d, data)
    c.close()
    c2 = ChunkCache(tmp_path, max_bytes=1 << 30)
    hashes = HashCounter(monkeypatch)
    assert c2.read_local(d, 0, 100) is None               # the worker verifies first
    assert hashes.calls == 0
    assert c2.read(d, 100, 200) == data[100:300]          # the first read: one whole hash
    assert hashes.calls == 1 and c2.stats.verified == 1
    for _ in range(5):
        assert c2.read(d, 0, 50) == data[:50]
        assert c2.read_local(d, 1000, 10, expected_size=len(data)) == data[1000:1010]
    assert c2.get(d) == data
    assert hashes.calls == 1 and c2.stats.verified == 1   # trusted from then on


def test_chunk_this_process_wrote_is_not_rehashed(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    c = ChunkCache(tmp_path, max_bytes=1 << 30)
    written = [(dg(data), data) for data in (chunk(10 + i) for i in range(4))]
    hashes = HashCounter(monkeypatch)
    for d, data in written[:3]:
        c.put(d, data, verified=True)                     # the reader checked it already
    c.put_async(*written[3], verified=True)
    assert c.flush()
    assert hashes.calls == 0
    for _ in range(4):
        for d, data in written:
            assert c.read_local(d, 0, 4096) == data[:4096]
            assert c.read(d, 5, 10) == data[5:15]
    assert hashes.calls == 0 and c.stats.verified == 0


def test_chunk_another_process_stored_is_verified_on_first_read(tmp_path: Path) -> None:
    mine = ChunkCache(tmp_path, max_bytes=1 << 30)
    other = ChunkCache(tmp_path, max_bytes=1 << 30)       # another process, same directory
    good, bad = chunk(30), chunk(31)
    other.put(dg(good), good)
    other.put(dg(bad), bad)
    rot(loose_file(tmp_path, dg(bad)))
    assert mine.read_local(dg(good), 0, 10) is None       # not in this process's index
    assert mine.get(dg(good)) == good and mine.stats.verified == 1
    assert mine.read_local(dg(good), 0, 10) == good[:10]
    assert mine.get(dg(bad)) is None and mine.stats.corrupt == 1
    assert not loose_file(tmp_path, dg(bad)).exists()
    # a put of a chunk whose file another process stored adopts that file: verified first
    third = chunk(32)
    other.put(dg(third), third)
    rot(loose_file(tmp_path, dg(third)))
    mine.put(dg(third), third)
    assert mine.read_local(dg(third), 0, 10) is None
    assert mine.get(dg(third)) is None and mine.stats.corrupt == 2


@pytest.mark.parametrize("mode", ["always", "never"])
def test_always_and_never(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    data = chunk(40)
    d = dg(data)
    c = ChunkCache(tmp_path, max_bytes=1 << 30)
    c.put(d, data)
    c.close()
    c2 = ChunkCache(tmp_path, max_bytes=1 << 30, verify=mode)
    hashes = HashCounter(monkeypatch)
    for _ in range(3):
        assert c2.read(d, 0, 10) == data[:10]
    if mode == "always":
        assert hashes.calls == 3 and c2.read_local(d, 0, 10) is None
    else:
        assert hashes.calls == 0 and c2.read_local(d, 0, 10) == data[:10]
    rot(loose_file(tmp_path, d))
    got = c2.read(d, 0, -1)
    if mode == "always":
        assert got is None
    else:                                                 # what "never" means
        assert got is not None and got != data


def _enospc() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


def _pwrite_part_then_fail(fd: int, bufs: list[bytes], offset: int) -> None:
    """A full disk under a pack append: part of the record lands, then ENOSPC."""
    os.pwrite(fd, b"".join(bufs)[:40], offset)
    raise _enospc()


class _FullDiskOs:
    """``os`` for :mod:`coldstart.cache.files` on a full disk: a write lands in part (a short
    write), the next one fails with ENOSPC."""

    def __init__(self) -> None:
        self._short: set[int] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def write(self, fd: int, data: memoryview) -> int:
        if fd in self._short:
            raise _enospc()
        self._short.add(fd)
        return os.write(fd, data[:len(data) // 2])


@pytest.mark.parametrize("size", [1000, BIG], ids=["packed", "loose"])
def test_failed_writes_are_counted_logged_once_and_leave_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        size: int) -> None:
    kinds: list[str] = []
    c = ChunkCache(tmp_path, max_bytes=1 << 30, on_error=kinds.append)
    keep = chunk(50, 1000)
    c.put(dg(keep), keep)                                 # a pack with a good record
    monkeypatch.setattr(packs_mod, "pwrite_all", _pwrite_part_then_fail)  # the disk is full
    monkeypatch.setattr(files_mod, "os", _FullDiskOs())
    lost = [chunk(60 + i, size) for i in range(5)]
    caplog.set_level(logging.WARNING, logger="coldstart.cache.chunks")
    fds = len(os.listdir("/proc/self/fd"))
    for data in lost:
        c.put_async(dg(data), data, verified=True)
    assert c.flush()
    assert c.stats.write_errors == 5 and kinds == [WRITE_ERROR] * 5
    failures = [r for r in caplog.records if "No space left" in r.getMessage()]
    assert len(failures) == 1                             # one burst, one line
    for data in lost:
        assert c.get(dg(data)) is None and not c.contains(dg(data))
    assert list((tmp_path / "wip").iterdir()) == []
    assert not any((tmp_path / "sha256").rglob("*/*"))
    assert [p.stat().st_size > 0 for p in (tmp_path / "packs").iterdir()] == [True]
    assert len(os.listdir("/proc/self/fd")) <= fds        # no descriptor per failure
    monkeypatch.undo()                                    # space freed
    c.put(dg(lost[0]), lost[0])
    assert c.get(dg(lost[0])) == lost[0] and c.get(dg(keep)) == keep
    c.close()
    c2 = ChunkCache(tmp_path, max_bytes=1 << 30)
    assert c2.get(dg(lost[0])) == lost[0] and c2.get(dg(keep)) == keep
    assert all(c2.get(dg(d)) is None for d in lost[1:])


def test_fuse_server_builds_its_cache_from_the_config(tmp_path: Path) -> None:
    from coldstart.lazyfs.server import FuseServer

    cfg = Config(root=str(tmp_path), cache=CacheConfig(verify="never", max_bytes=1 << 20),
                 fuse=FuseConfig(socket=str(tmp_path / "f.sock")))
    srv = FuseServer(cfg)
    try:
        assert srv.cache.verify == "never" and srv.cache.max_bytes == 1 << 20
        assert srv.cache.on_error is not None
        srv.cache.on_error(WRITE_ERROR)
        assert srv.metrics.registry.get_sample_value(
            ERRORS + "_total", {"kind": WRITE_ERROR}) == 1
    finally:
        srv.fetcher.close()
        srv.cache.close()
        srv.client.close()
        srv._release_root()
    srv2 = FuseServer(Config(root=str(tmp_path / "b"),
                             fuse=FuseConfig(socket=str(tmp_path / "g.sock"))))
    try:
        assert srv2.cache.verify == "first-read"
    finally:
        srv2.fetcher.close()
        srv2.cache.close()
        srv2.client.close()
        srv2._release_root()


def test_with_verify_never_an_adopted_file_is_served_on_the_loop(tmp_path: Path) -> None:
    # "never" trusts the disk: a chunk file another process stored, adopted by a put, must not
    # stay marked unverified (nothing would ever clear it: every read would leave the loop)
    mine = ChunkCache(tmp_path, max_bytes=1 << 30, verify="never")
    other = ChunkCache(tmp_path, max_bytes=1 << 30)
    data = chunk(40)
    other.put(dg(data), data)
    mine.put(dg(data), data)
    assert mine.read_local(dg(data), 0, 10) == data[:10]
    assert mine.stats.verified == 0


def test_a_corrupt_chunk_that_cannot_be_removed_is_a_miss_not_an_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = ChunkCache(tmp_path, max_bytes=1 << 30)
    data = chunk(41)
    c.put(dg(data), data)
    c.close()
    rot(loose_file(tmp_path, dg(data)))
    c2 = ChunkCache(tmp_path, max_bytes=1 << 30)

    def refuse(path: object) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("os.unlink", refuse)
    assert c2.get(dg(data)) is None and c2.stats.corrupt == 1
