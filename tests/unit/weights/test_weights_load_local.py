"""Loading local checkpoints: bit-identical to safetensors.torch.load_file, every dtype."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from coldstart.errors import FormatError, InvalidArgument, NotFound
from coldstart.weights import LoadStats, Slice, iter_load, load, tensor_parallel
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


def test_o_direct_path(model: Path, tensors: dict[str, torch.Tensor]) -> None:
    stats = LoadStats()
    assert_identical(tensors, load(model, direct=True, chunk_bytes=16384, stats=stats))
    assert stats.path.startswith("cpu")


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


def test_iter_load_early_stop_closes_cleanly(model: Path) -> None:
    gen = iter_load(model, chunk_bytes=4096, concurrency=2)
    next(gen)
    gen.close()  # workers stop; no exception, no leaked threads blocking exit


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
    with pytest.raises(InvalidArgument, match="no CUDA device"):
        load(model, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU present (CUDA unavailable)")
def test_cuda_load(model: Path, tensors: dict[str, torch.Tensor]) -> None:  # pragma: no cover
    stats = LoadStats()
    got = load(model, device="cuda", chunk_bytes=8192, max_host_bytes=32768, stats=stats)
    assert stats.path.startswith("cuda")
    assert all(t.is_cuda for t in got.values())
    assert_identical(tensors, got)
    conv = load(model, device="cuda", dtype=torch.float32, select=["t.BF16"])
    assert torch.equal(conv["t.BF16"].cpu(), tensors["t.BF16"].float())
