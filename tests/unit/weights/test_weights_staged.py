"""The staged pipeline a CUDA load runs, driven on a fake asynchronous device.

No GPU on this machine, so :class:`FakeAsyncDevice` stands in for CUDA (a fake, named as one:
the CUDA calls themselves run only in the tests marked ``gpu`` and ``bench/gpu_weights.py``, on
a machine with a GPU: ``bench/gpu_check.sh``, passed on an H200 in
``bench/published/gpu-2026-12-04``). What it keeps of a GPU is what the pipeline's
correctness rests on: copies run later, on a "stream" per submitting thread, in order within a
stream, and read the staging buffer when they run, not when they are queued. So reusing a staging
buffer before its copy finished, handing out a tensor before its copies landed, or staging more
host memory than ``max_host_bytes`` shows up here as wrong bytes or a failed bound.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from coldstart.errors import Unavailable
from coldstart.weights import LoadStats, Slice, iter_load, load
from coldstart.weights import loader as loader_module
from tests.unit.weights.weights_data import assert_identical, every_dtype, save


class FakeAsyncDevice:
    """Asynchronous copies on per-thread "streams" (single-thread executors), each copy delayed."""

    def __init__(self, delay: float = 0.002) -> None:
        self.delay = delay
        self.staged: list[int] = []
        self.submitted = 0
        self.copies = 0  # finished
        self.syncs = 0
        self.pending_after_last_sync = -1
        self._streams: dict[int, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()

    def staging_buffer(self, size: int) -> torch.Tensor:
        self.staged.append(size)
        return torch.empty(size, dtype=torch.uint8)

    def _stream(self) -> ThreadPoolExecutor:
        with self._lock:
            key = threading.get_ident()
            if key not in self._streams:
                self._streams[key] = ThreadPoolExecutor(1, thread_name_prefix="fake-stream")
            return self._streams[key]

    def copy_async(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Future[None]:
        with self._lock:
            self.submitted += 1

        def run() -> None:
            time.sleep(self.delay)  # the "device" is busy: the copy reads the buffer later
            for dst, src in pairs:
                dst.copy_(src)
            with self._lock:
                self.copies += 1

        return self._stream().submit(run)

    def host_wait(self, event: Future[None]) -> None:
        event.result()

    def device_wait(self, events: list[Future[None]]) -> None:
        for ev in events:
            ev.result()

    def synchronize(self) -> None:
        with self._lock:
            streams = list(self._streams.values())
            self.syncs += 1
        for s in streams:
            s.submit(lambda: None).result()
        with self._lock:
            self.pending_after_last_sync = self.submitted - self.copies

    def close(self) -> None:
        for s in self._streams.values():
            s.shutdown(wait=True)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Any:
    dev = FakeAsyncDevice()
    monkeypatch.setattr(loader_module, "_copies_for", lambda _dev: dev)
    yield dev
    dev.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(every_dtype(3), tmp_path_factory.mktemp("staged") / "model.safetensors")


def test_staged_load_is_bit_identical_and_bounded(model: Path, fake: FakeAsyncDevice) -> None:
    stats = LoadStats()
    # 8 KiB host budget: 4 KiB chunks, two staging buffers for ~1 MB of data, so buffers are
    # reused hundreds of times while earlier copies out of them are still queued.
    got = load(model, chunk_bytes=65536, max_host_bytes=8192, concurrency=4, stats=stats)
    assert_identical(load_file(str(model)), got)
    assert stats.path.startswith("cpu: pinned staging")
    assert sum(fake.staged) <= 8192 and len(fake.staged) >= 2
    assert max(fake.staged) == 4096  # chunk_bytes shrunk to the smallest buffer
    assert fake.copies == stats.reads > 200
    assert stats.staging_bytes == sum(fake.staged)


@pytest.mark.parametrize(("chunk", "budget"), [(10_000, 1 << 20), (65536, 50_000),
                                                (3 << 20, 7 << 20)])
def test_staging_blocks_are_powers_of_two_within_the_budget(
        model: Path, fake: FakeAsyncDevice, chunk: int, budget: int) -> None:
    # torch's pinned allocator rounds each block up to a power of two: a block of any other
    # size would hold more pinned memory than asked for, and more than the budget
    stats = LoadStats()
    got = load(model, chunk_bytes=chunk, max_host_bytes=budget, concurrency=4, stats=stats)
    assert_identical(load_file(str(model)), got)
    assert fake.staged and all(s & (s - 1) == 0 and s <= chunk for s in fake.staged)
    assert sum(fake.staged) == stats.staging_bytes <= budget


def test_a_small_checkpoint_stages_no_more_buffers_than_reads(
        tmp_path: Path, fake: FakeAsyncDevice) -> None:
    path = save({"a": torch.arange(1000, dtype=torch.float32)}, tmp_path / "small.safetensors")
    stats = LoadStats()
    got = load(path, max_host_bytes=1 << 20, concurrency=4, stats=stats)
    assert_identical(load_file(str(path)), got)
    # 4000 bytes: one read, one buffer of 4 KiB, not the budget's 16 buffers of 64 KiB (pinning
    # costs)
    assert stats.reads == 1 and fake.staged == [4096] and stats.staging_bytes == 4096


def test_each_tensor_is_final_when_yielded(model: Path, fake: FakeAsyncDevice) -> None:
    fake.delay = 0.005
    got = {}
    for name, t in iter_load(model, chunk_bytes=4096, max_host_bytes=16384, concurrency=3):
        got[name] = t.clone()  # compared as handed out: a copy landing later would be missed
    assert_identical(load_file(str(model)), got)


def test_dtype_conversion_and_slices_through_staging(tmp_path: Path,
                                                     fake: FakeAsyncDevice) -> None:
    w = torch.randn(64, 48).to(torch.bfloat16)
    path = tmp_path / "m.safetensors"
    save_file({"w": w, "i": torch.arange(10, dtype=torch.int32)}, str(path))
    got = load(path, dtype=torch.float32, chunk_bytes=4096, max_host_bytes=8192)
    assert got["w"].dtype == torch.float32 and torch.equal(got["w"], w.float())
    assert got["i"].dtype == torch.int32
    part = load(path, select=lambda t: Slice(1, 8, 24) if t.name == "w" else False,
                chunk_bytes=4096, max_host_bytes=8192)
    assert torch.equal(part["w"], w[:, 8:24])


def test_misaligned_tensor_through_staging(tmp_path: Path, fake: FakeAsyncDevice) -> None:
    # An odd-sized int8 tensor first puts the float32 one at an offset not divisible by 4.
    t = {"a": torch.arange(3, dtype=torch.int8), "b": torch.randn(1000)}
    path = tmp_path / "m.safetensors"
    save_file(t, str(path))
    assert_identical(load_file(str(path)), load(path, chunk_bytes=4096, max_host_bytes=8192))


def test_early_stop_waits_for_queued_copies(model: Path, fake: FakeAsyncDevice) -> None:
    gen = iter_load(model, chunk_bytes=4096, max_host_bytes=8192, concurrency=2)
    next(gen)
    while fake.copies == 0:  # empty tensors come first, before any read
        next(gen)
    syncs = fake.syncs
    gen.close()
    # Copies into tensors that are about to be freed must have landed first: the last sync
    # came after the last copy was queued (workers stopped first), and nothing is left pending.
    assert fake.syncs > syncs
    assert fake.pending_after_last_sync == 0
    assert fake.copies == fake.submitted > 0


def test_failed_copy_waits_before_the_buffer_is_reused(model: Path, fake: FakeAsyncDevice,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    real = fake.copy_async
    calls = {"n": 0}

    def failing(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Future[None]:
        calls["n"] += 1
        if calls["n"] == 20:
            real(pairs[:1])  # one copy queued, then the device call fails
            raise RuntimeError("injected device error")
        return real(pairs)

    monkeypatch.setattr(fake, "copy_async", failing)
    syncs = fake.syncs
    with pytest.raises(RuntimeError, match="injected"):
        load(model, chunk_bytes=4096, max_host_bytes=8192, concurrency=2)
    assert fake.syncs >= syncs + 2  # the failed worker's wait, then the load's own
    assert fake.pending_after_last_sync == 0


def test_read_error_while_staging_is_raised(model: Path, fake: FakeAsyncDevice,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from coldstart.weights.sources import LocalSource

    real: Callable[..., None] = LocalSource.read_into
    calls = {"n": 0}

    def failing(self: LocalSource, offset: int, buffers: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 40:
            raise Unavailable(f"{self.name}: read at {offset} failed: injected")
        real(self, offset, buffers)

    monkeypatch.setattr(LocalSource, "read_into", failing)
    with pytest.raises(Unavailable, match="injected"):
        load(model, chunk_bytes=4096, max_host_bytes=8192, concurrency=2)
