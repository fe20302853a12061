"""Big chunks go to the cache's files with O_DIRECT (past the page cache), whole and exact."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from coldstart.cache import files as files_mod
from coldstart.cache.files import DIRECT_MIN, FileStore

HEX = "ab" * 32


@pytest.mark.parametrize("size", [DIRECT_MIN, DIRECT_MIN + 1, 4 << 20, (4 << 20) - 4095])
def test_big_chunk_written_direct_is_exact(tmp_path: Path, size: int) -> None:
    store = FileStore(tmp_path / "objects", tmp_path / "wip", durable=False)
    data = os.urandom(size)
    store.write(HEX, data)
    if not store.direct:
        pytest.skip(f"{tmp_path} is on a file system without O_DIRECT (buffered writes)")
    assert store.path(HEX).read_bytes() == data       # not padded to the alignment
    assert list((tmp_path / "wip").iterdir()) == []   # no temp file left
    # a second, smaller chunk on the same thread reuses the aligned buffer: no stale tail
    store.write("cd" * 32, data[: size // 2 + 3])
    assert store.path("cd" * 32).read_bytes() == data[: size // 2 + 3]


def test_file_system_without_o_direct_gets_buffered_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open
    calls: list[int] = []

    def no_direct(path: str | Path, flags: int, mode: int = 0o777) -> int:
        calls.append(flags)
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(files_mod.os, "open", no_direct)
    store = FileStore(tmp_path / "objects", tmp_path / "wip", durable=False)
    data = os.urandom(DIRECT_MIN * 2)
    store.write(HEX, data)
    assert store.path(HEX).read_bytes() == data
    assert not store.direct        # learnt once; the next write does not try again
    n = len(calls)
    store.write("cd" * 32, data)
    assert len(calls) == n + 1 and not calls[-1] & os.O_DIRECT


def test_full_disk_during_a_direct_write_raises_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    store = FileStore(tmp_path / "objects", tmp_path / "wip", durable=False)
    monkeypatch.setattr(files_mod.os, "write", full)
    with pytest.raises(OSError) as exc:
        store.write(HEX, os.urandom(DIRECT_MIN))
    assert exc.value.errno == errno.ENOSPC
    assert store.direct            # a full disk is not a reason to stop writing direct
    assert not store.path(HEX).exists()
    assert list((tmp_path / "wip").iterdir()) == []
