"""Mapped local loads ask the kernel for the reads ahead of the one they populate
(``LocalFileBlob.advise``, WILLNEED): every read asked for once, before it is populated, no
further ahead than the loader's budget; and the hint really puts the range in the page cache
(the kernel's word: ``mincore``)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from coldstart.errors import FormatError
from coldstart.remote import local
from coldstart.remote.local import LocalFileBlob
from coldstart.weights import load, loader
from tests.fixtures.pages import PAGE, resident_pages
from tests.unit.weights.weights_data import assert_identical, every_dtype, save_sharded

MiB = 1 << 20


class _Events:
    """What the loader asked of its local files, in order: ("advise" | "populate", file,
    offset, length)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, str, int, int]] = []
        self._lock = threading.Lock()
        advise, populate = LocalFileBlob.advise, LocalFileBlob.populate

        def record_advise(blob: LocalFileBlob, offset: int, length: int) -> None:
            with self._lock:
                self.events.append(("advise", blob.name, offset, length))
            advise(blob, offset, length)

        def record_populate(blob: LocalFileBlob, offset: int, length: int) -> None:
            with self._lock:
                self.events.append(("populate", blob.name, offset, length))
            populate(blob, offset, length)

        monkeypatch.setattr(LocalFileBlob, "advise", record_advise)
        monkeypatch.setattr(LocalFileBlob, "populate", record_populate)

    def of(self, kind: str) -> list[tuple[str, int, int]]:
        return [e[1:] for e in self.events if e[0] == kind]


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    return every_dtype()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory, tensors: dict[str, torch.Tensor]) -> Path:
    return save_sharded(tensors, tmp_path_factory.mktemp("ra") / "model", shards=3)


def _reference(index: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(index.parent.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("concurrency", [1, 4])
def test_every_read_is_asked_for_once_before_it_is_populated(
        sharded: Path, monkeypatch: pytest.MonkeyPatch, concurrency: int) -> None:
    events = _Events(monkeypatch)
    budget = 3 * 8192
    monkeypatch.setattr(loader, "POPULATE_AHEAD", budget)
    got = load(sharded, cpu_mode="mmap", chunk_bytes=8192, concurrency=concurrency)
    assert_identical(_reference(sharded), got)

    populated, advised = events.of("populate"), events.of("advise")
    assert len(populated) > 6 and len({p[0] for p in populated}) == 3   # every shard
    assert sorted(advised) == sorted(populated)     # each read asked for, exactly once
    if concurrency == 1:
        # one thread (with more, another thread may populate a read a moment before the one
        # that took it asks for it): each read asked for before it is populated, and what
        # was asked beyond it fits the budget (the reads starting within it after its end)
        asked: set[tuple[str, int, int]] = set()
        done: set[tuple[str, int, int]] = set()
        longest = max(p[2] for p in populated)
        for kind, *rest in events.events:
            read = (rest[0], rest[1], rest[2])
            if kind == "advise":
                asked.add(read)
                continue
            assert read in asked, f"{read} populated before it was asked for"
            done.add(read)
            assert sum(r[2] for r in asked - done) <= budget + longest


def test_a_failing_hint_fails_nothing(sharded: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(blob: LocalFileBlob, offset: int, length: int) -> None:
        raise FormatError(f"{blob.name}: no hints today")

    monkeypatch.setattr(LocalFileBlob, "advise", refuse)
    got = load(sharded, cpu_mode="mmap", chunk_bytes=8192)
    assert_identical(_reference(sharded), got)


def test_reads_into_tensors_ask_nothing(sharded: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events = _Events(monkeypatch)
    got = load(sharded, cpu_mode="read", chunk_bytes=8192)
    assert_identical(_reference(sharded), got)
    assert events.events == []


def test_a_long_range_is_asked_for_in_steps(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "blob.bin"
    path.write_bytes(bytes(8 * MiB))
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(local, "advise_step", lambda fd: MiB)
    monkeypatch.setattr(os, "posix_fadvise",
                        lambda fd, offset, length, advice: calls.append((offset, length, advice)))
    blob = LocalFileBlob(path)
    try:
        calls.clear()           # opening the blob asks for sequential reads
        blob.advise(MiB + 5, 3 * MiB + MiB // 2)
    finally:
        blob.close()
    assert calls == [(MiB + 5, MiB, os.POSIX_FADV_WILLNEED),
                     (2 * MiB + 5, MiB, os.POSIX_FADV_WILLNEED),
                     (3 * MiB + 5, MiB, os.POSIX_FADV_WILLNEED),
                     (4 * MiB + 5, MiB // 2, os.POSIX_FADV_WILLNEED)]


def test_the_step_is_what_one_hint_may_read(tmp_path: Path) -> None:
    for where in (tmp_path, Path("/dev/shm")):
        fd = os.open(where, os.O_RDONLY)
        try:
            step = local.advise_step(fd)
        finally:
            os.close(fd)
        assert 128 << 10 <= step <= 16 * MiB and step % 4096 == 0, (where, step)
    fd = os.open("/dev/shm", os.O_RDONLY)
    try:
        assert local.advise_step(fd) == 128 << 10      # tmpfs: no block device, the default
    finally:
        os.close(fd)


def _evicted(path: Path) -> bool:
    """Drop ``path``'s clean pages from the page cache; True if the kernel did."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return resident_pages(path)[0] == 0


def _honours_hints(probe: Path) -> bool:
    """Whether this file system drops clean pages on DONTNEED and reads on WILLNEED, asked
    with the system calls themselves (not the code under test)."""
    probe.write_bytes(os.urandom(MiB))
    if not _evicted(probe):
        return False
    fd = os.open(probe, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, MiB, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)
    deadline = time.monotonic() + 5
    while resident_pages(probe)[0] == 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_advise_puts_the_range_in_the_page_cache(tmp_path: Path) -> None:
    path = tmp_path / "blob.bin"
    if not _honours_hints(tmp_path / "probe.bin"):
        pytest.skip(f"{tmp_path}: its page cache keeps files (tmpfs?) or ignores WILLNEED; "
                    "residency says nothing here")
    path.write_bytes(os.urandom(48 * MiB))
    assert _evicted(path)
    blob = LocalFileBlob(path)
    try:
        # longer than one hint reads on any device (16 MiB at most): asked for in steps
        blob.advise(4 * MiB, 40 * MiB)
        want = 40 * MiB // PAGE
        deadline = time.monotonic() + 10
        while (got := resident_pages(path, 4 * MiB, 40 * MiB)[0]) < want:
            if time.monotonic() > deadline:
                # WILLNEED is a hint: read-ahead allocates without retrying and may drop
                # pages when memory is short (a VM whose host took its free pages back, as a
                # CI run met): most of the range must have come, and its far end (the last
                # step, so every step was asked for)
                assert got >= 0.9 * want, f"the advised range never arrived ({got}/{want})"
                assert resident_pages(path, 40 * MiB, 4 * MiB)[0] > 0, "its last step did not"
                break
            time.sleep(0.01)
        assert resident_pages(path, 46 * MiB, 2 * MiB)[0] == 0   # only what was asked
        assert blob.bytes_read == 0 and blob.requests == 0        # a hint, not a read
        blob.advise(0, 0)                                         # nothing asked: nothing
        with pytest.raises(FormatError):
            blob.advise(47 * MiB, 2 * MiB)                        # past the end
    finally:
        blob.close()
