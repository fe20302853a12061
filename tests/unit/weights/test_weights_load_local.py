"""Loading local checkpoints: bit-identical to safetensors.torch.load_file, every dtype."""

from __future__ import annotations

import errno
import gc
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from coldstart.errors import FormatError, InvalidArgument, NotFound
from coldstart.remote.local import bounce_buffers_made
from coldstart.weights import LoadStats, LocalSource, Slice, iter_load, load, tensor_parallel
from tests.unit.weights.weights_data import assert_identical, every_dtype, save, save_sharded


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    return every_dtype()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, tensors: dict[str, torch.Tensor]) -> Path:
    return save(tensors, tmp_path_factory.mktemp("w") / "model.safetensors")


MODES = pytest.mark.parametrize("mode", ["read", "mmap"])


@MODES
def test_every_dtype_bit_identical(model: Path, mode: str) -> None:
    # Small chunks so reads split tensors and join several tensors in one preadv.
    stats = LoadStats()
    got = load(model, concurrency=4, chunk_bytes=8192, cpu_mode=mode, stats=stats)
    assert_identical(load_file(str(model)), got)
    assert ("mmap" in stats.path) == (mode == "mmap")
    assert {t.dtype for t in got.values()} >= {torch.bfloat16, torch.float8_e4m3fn,
                                              torch.float8_e8m0fnu, torch.bool}


def _supports_o_direct(path: Path) -> bool:
    """Ask the filesystem directly, independently of the loader."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


def test_o_direct_path(model: Path, tensors: dict[str, torch.Tensor]) -> None:
    stats = LoadStats()
    src = LocalSource(model, direct=True)
    assert_identical(tensors, load(src, chunk_bytes=16384, concurrency=2, stats=stats))
    if _supports_o_direct(model):  # ext4, xfs: the O_DIRECT path really ran
        assert src.direct_refused is None
        assert src.direct_reads > 10
        assert stats.path == "cpu: preadv straight into tensors (O_DIRECT)"
    else:  # tmpfs, overlayfs: the fallback is reported, not silent
        assert src.direct_refused and src.direct_reads == 0
        assert "O_DIRECT not used" in stats.path
    # By location too (the Opener's path), and a plain load says nothing about O_DIRECT.
    by_path = LoadStats()
    load(model, direct=True, chunk_bytes=16384, stats=by_path)
    assert "O_DIRECT" in by_path.path
    plain = LoadStats()
    load(model, cpu_mode="read", stats=plain)
    assert "O_DIRECT" not in plain.path


def test_o_direct_bounce_buffers_are_per_thread_not_per_read_or_file(
        tmp_path: Path, tensors: dict[str, torch.Tensor]) -> None:
    index = save_sharded(tensors, tmp_path / "sharded", shards=4)
    if not _supports_o_direct(index.parent / "model-00001-of-00004.safetensors"):
        pytest.skip("this filesystem refuses O_DIRECT (see test_o_direct_refused_is_reported)")
    before = bounce_buffers_made()
    # 8 KiB reads over 4 files: dozens of reads; a reading thread reuses its one buffer for
    # all of them, whichever file they are in.
    stats = LoadStats()
    assert_identical(tensors, load(index, direct=True, chunk_bytes=8192, concurrency=2,
                                   stats=stats))
    assert stats.reads > 40 and "O_DIRECT" in stats.path
    assert bounce_buffers_made() - before <= 3  # 2 workers + this thread (headers)


def test_o_direct_refused_is_reported(model: Path, tensors: dict[str, torch.Tensor],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def no_direct(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    stats = LoadStats()
    src = LocalSource(model, direct=True)
    assert not src.direct and src.direct_refused and "EINVAL" not in src.direct_refused
    assert "refused O_DIRECT (Invalid argument)" in src.direct_refused
    assert_identical(tensors, load(src, chunk_bytes=16384, stats=stats))
    assert src.direct_reads == 0
    assert stats.path.endswith("(O_DIRECT not used: the filesystem refused O_DIRECT (Invalid "
                               "argument); read through the page cache)")


@MODES
def test_sharded_by_index_and_by_folder(tmp_path: Path, tensors: dict[str, torch.Tensor],
                                        mode: str) -> None:
    index = save_sharded(tensors, tmp_path / "sharded")
    ref: dict[str, torch.Tensor] = {}
    for f in sorted((tmp_path / "sharded").glob("*.safetensors")):
        ref.update(load_file(str(f)))
    stats = LoadStats()
    assert_identical(ref, load(index, stats=stats, cpu_mode=mode))
    assert stats.files == 3
    assert_identical(ref, load(tmp_path / "sharded", cpu_mode=mode))


def test_mmap_tensors_outlive_the_file_and_stay_private(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.arange(4096, dtype=torch.float32)}, str(path))
    got = load(path, cpu_mode="mmap")
    path.unlink()  # the mapping keeps the data
    import gc

    gc.collect()
    assert torch.equal(got["w"], torch.arange(4096, dtype=torch.float32))
    save_file({"w": torch.zeros(4)}, str(tmp_path / "n.safetensors"))
    other = load(tmp_path / "n.safetensors", cpu_mode="mmap")
    other["w"][0] = 5.0  # copy-on-write: the file is not changed
    assert float(load(tmp_path / "n.safetensors", cpu_mode="read")["w"][0]) == 0.0


def test_cpu_mode_checks(model: Path) -> None:
    with pytest.raises(InvalidArgument, match="cpu_mode"):
        load(model, cpu_mode="fast")
    with pytest.raises(InvalidArgument, match="mmap needs"):
        load(model, cpu_mode="mmap", direct=True)


def test_folder_without_index_loads_every_file(tmp_path: Path) -> None:
    save_file({"a": torch.ones(3)}, str(tmp_path / "a.safetensors"))
    save_file({"b": torch.zeros(2)}, str(tmp_path / "b.safetensors"))
    assert sorted(load(tmp_path)) == ["a", "b"]


def test_index_pointing_at_missing_tensor(tmp_path: Path) -> None:
    save_file({"a": torch.ones(3)}, str(tmp_path / "s1.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "s1.safetensors", "zz": "s1.safetensors"}}))
    with pytest.raises(FormatError, match="'zz'"):
        load(tmp_path)


def test_index_escaping_the_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "../elsewhere.safetensors"}}))
    with pytest.raises(FormatError, match="leaves"):
        load(tmp_path)


def test_duplicate_tensor_across_files(tmp_path: Path) -> None:
    save_file({"a": torch.ones(3)}, str(tmp_path / "a.safetensors"))
    save_file({"a": torch.zeros(3)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(FormatError, match="in both"):
        load(tmp_path)


@MODES
def test_iter_load_yields_each_tensor_when_complete(model: Path, mode: str) -> None:
    seen: list[str] = []
    got: dict[str, torch.Tensor] = {}
    done_bytes: list[int] = []
    for name, t in iter_load(model, chunk_bytes=4096, concurrency=2, progress=done_bytes.append,
                             cpu_mode=mode):
        seen.append(name)
        got[name] = t.clone()  # a yielded tensor is final: no later write may change it
    assert len(seen) == len(set(seen))
    assert_identical(load_file(str(model)), got)
    assert sum(done_bytes) == sum(t.numel() * t.element_size() for t in got.values())


def _open_fds_on(path: Path) -> list[str]:
    target = os.path.realpath(path)
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == target:
                out.append(fd)
        except OSError:
            pass  # closed meanwhile (the listing's own descriptor)
    return out


def _loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("coldstart-weights")]


@pytest.mark.parametrize("mode", ["read", "mmap", "direct"])
def test_iter_load_early_stop_closes_cleanly(model: Path, tensors: dict[str, torch.Tensor],
                                             mode: str) -> None:
    # Baselines, so a leak elsewhere in the session does not fail (or hide) this one.
    threads_before = set(_loader_threads())
    fds_before = set(_open_fds_on(model))
    kwargs: dict[str, Any] = {"direct": True} if mode == "direct" else {"cpu_mode": mode}
    gen = iter_load(model, chunk_bytes=4096, concurrency=2, **kwargs)
    def workers() -> set[threading.Thread]:
        return set(_loader_threads()) - threads_before

    def fds() -> set[str]:
        return set(_open_fds_on(model)) - fds_before

    # Empty tensors come first, before any read; take items until the workers run.
    name, first = next(gen)
    while not workers():
        name, first = next(gen)
    # Mid-load: workers are running and the file is open.
    assert workers() and fds()
    gen.close()  # workers stop; no exception
    deadline = time.monotonic() + 10
    while (left := workers()) and time.monotonic() < deadline:
        for t in left:
            t.join(max(0.0, deadline - time.monotonic()))
    assert workers() == set(), "worker threads left running after close()"
    if mode != "mmap":
        assert fds() == set(), "file descriptors left open after close()"
    # A mapped load's tensors view the file map, and Python's mmap holds a duplicate
    # descriptor: it stays while they live (and only then).
    # The tensor handed out before close() stays usable: complete, with the checkpoint's bytes
    # (for mmap, read through the file map the loader must keep alive for it).
    assert first.numel() > 0, f"{name}: the loop above stops at a tensor the workers read"
    assert_identical({name: tensors[name]}, {name: first})
    del first, gen
    gc.collect()
    assert fds() == set(), "file descriptors left open after close()"


def test_select_by_names_and_missing_name(model: Path) -> None:
    got = load(model, select=["t.BF16", "scalar.F32"])
    assert sorted(got) == ["scalar.F32", "t.BF16"]
    with pytest.raises(NotFound, match="nope"):
        load(model, select=["t.BF16", "nope"])


def test_dtype_converts_floating_only(model: Path) -> None:
    ref = load_file(str(model))
    got = load(model, dtype=torch.float32, select=["t.BF16", "t.I32", "t.F16"])
    assert got["t.BF16"].dtype == torch.float32
    assert torch.equal(got["t.BF16"], ref["t.BF16"].float())
    assert got["t.I32"].dtype == torch.int32


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3), data=st.data())
def test_slices_match_indexing(tmp_path_factory: pytest.TempPathFactory, shape: list[int],
                               data: st.DataObject) -> None:
    dim = data.draw(st.integers(0, len(shape) - 1))
    start = data.draw(st.integers(0, shape[dim]))
    stop = data.draw(st.integers(start, shape[dim]))
    full = torch.arange(int(torch.Size(shape).numel()), dtype=torch.int32).reshape(shape)
    path = tmp_path_factory.mktemp("s") / "s.safetensors"
    save_file({"pad": torch.ones(5, dtype=torch.int8), "x": full}, str(path))
    for mode in ("read", "mmap"):
        got = load(path, chunk_bytes=4096, cpu_mode=mode,
                   select=lambda t: Slice(dim, start, stop) if t.name == "x" else False)
        assert list(got) == ["x"]
        assert torch.equal(got["x"], full.narrow(dim, start, stop - start))


def test_tensor_parallel_ranks_reassemble(tmp_path: Path) -> None:
    w = torch.randn(8, 6).to(torch.bfloat16)
    o = torch.randn(6, 8)
    norm = torch.randn(6)
    path = tmp_path / "tp.safetensors"
    save_file({"q.weight": w, "o.weight": o, "norm": norm}, str(path))

    def dim_of(info: object) -> int | None:
        name = getattr(info, "name", "")
        return 0 if name == "q.weight" else 1 if name == "o.weight" else None

    parts = [load(path, select=tensor_parallel(r, 2, dim_of), chunk_bytes=4096) for r in (0, 1)]
    assert torch.equal(torch.cat([p["q.weight"] for p in parts], 0), w)
    assert torch.equal(torch.cat([p["o.weight"] for p in parts], 1), o)
    assert all(torch.equal(p["norm"], norm) for p in parts)
    with pytest.raises(InvalidArgument, match="does not split"):
        load(path, select=tensor_parallel(0, 4, lambda i: 1))


def test_missing_file_and_bad_arguments(tmp_path: Path, model: Path) -> None:
    with pytest.raises(NotFound):
        load(tmp_path / "absent.safetensors")
    with pytest.raises(InvalidArgument):
        load(model, concurrency=0)
    with pytest.raises(InvalidArgument, match="device"):
        load(model, device="meta")


def test_file_truncated_is_a_format_error(tmp_path: Path, model: Path) -> None:
    bad = tmp_path / "cut.safetensors"
    bad.write_bytes(model.read_bytes()[:-100])
    with pytest.raises(FormatError, match="MetadataIncompleteBuffer"):
        load(bad)


def test_cuda_without_gpu_is_refused_clearly(model: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present; see test_cuda_load")
    for device in ("cuda", "cuda:0", "cuda:3"):
        with pytest.raises(InvalidArgument, match="CUDA is not available"):
            load(model, device=device)


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "", "   ", "CPU", "cuda:-1"])
def test_unknown_device_is_invalid_argument(model: Path, device: str) -> None:
    with pytest.raises(InvalidArgument, match="use cpu, cuda or cuda:N") as info:
        load(model, device=device)
    assert repr(device) in str(info.value)
    with pytest.raises(InvalidArgument):
        next(iter_load(model, device=device))


def test_torch_device_objects_are_accepted(model: Path) -> None:
    assert load(model, device=torch.device("cpu"), select=["t.F32"])["t.F32"].device.type == "cpu"
    with pytest.raises(InvalidArgument, match="not supported"):
        load(model, device=torch.device("meta"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU present (CUDA unavailable)")
def test_cuda_load(model: Path, tensors: dict[str, torch.Tensor]) -> None:  # pragma: no cover
    stats = LoadStats()
    host_stats = getattr(torch.cuda, "host_memory_stats", None)      # torch >= 2.7
    held = 0
    if host_stats is not None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_host_memory_stats()
        held = host_stats()["active_bytes.current"]     # pinned blocks others hold already
    got = load(model, device="cuda", chunk_bytes=8192, max_host_bytes=32768, stats=stats)
    assert stats.path.startswith("cuda")
    assert all(t.is_cuda for t in got.values())
    assert_identical(tensors, got)
    assert 0 < stats.staging_bytes <= 32768
    if host_stats is not None:  # the pinned bytes in use at once, as torch's allocator saw them
        assert 0 < host_stats()["active_bytes.peak"] - held <= 32768
    conv = load(model, device="cuda", dtype=torch.float32, select=["t.BF16"])
    assert torch.equal(conv["t.BF16"].cpu(), tensors["t.BF16"].float())


def test_a_source_object_needs_only_size_read_into_and_close(
        model: Path, tensors: dict[str, torch.Tensor]) -> None:
    # the loader's own contract: an object written to it (no read_at) is a source, not a path
    class Minimal:
        def __init__(self, path: Path) -> None:
            self.inner = LocalSource(path)
            self.name = str(path)

        def size(self) -> int:
            return self.inner.size()

        def read_into(self, offset: int, buffers: Any, *, timeout: float | None = None) -> None:
            self.inner.read_into(offset, buffers)

        def close(self) -> None:
            self.inner.close()

    src = Minimal(model)
    try:
        assert_identical(load(src, cpu_mode="read"), tensors)  # type: ignore[arg-type]
    finally:
        src.close()
