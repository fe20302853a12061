"""coldstart.weights.load_file / safe_open: safetensors' API, same names, order and bytes.

Each check runs the real ``safetensors`` on the same file and compares."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

from coldstart.errors import InvalidArgument
from coldstart.weights import load_file, safe_open
from tests.unit.weights.weights_data import assert_identical, every_dtype, save


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(every_dtype(seed=3), tmp_path_factory.mktemp("compat") / "m.safetensors")


def test_load_file_is_safetensors_load_file(model: Path) -> None:
    want = safetensors.torch.load_file(str(model))
    got = load_file(model)
    assert list(got) == list(want)                      # the same order, too
    assert_identical(want, got)


def test_safe_open_answers_as_safetensors_does(model: Path) -> None:
    with safetensors.safe_open(str(model), framework="pt") as ref, \
            safe_open(model, framework="pt") as f:
        names = ref.keys()
        assert f.keys() == names
        assert f.offset_keys() == ref.offset_keys()
        assert f.metadata() == ref.metadata() == {"format": "pt"}
        for name in names:
            assert_identical({name: ref.get_tensor(name)}, {name: f.get_tensor(name)})
        got = f.get_tensors()
        assert list(got) == ref.offset_keys()
        assert_identical({n: ref.get_tensor(n) for n in names}, got)


@pytest.mark.parametrize("index", [
    (slice(None), slice(1, 4)), 1, slice(2, None), (Ellipsis, slice(0, 2)),
    (slice(None, None, 2), 0), (), slice(1, 1),
], ids=["cols", "row", "rows", "ellipsis", "step", "all", "none"])
@pytest.mark.parametrize("name", ["t.F32", "t.BF16", "t.I64", "t.U8", "big.F32"])
def test_a_slice_reads_what_safetensors_slice_reads(model: Path, name: str,
                                                    index: object) -> None:
    with safetensors.safe_open(str(model), framework="pt") as ref, \
            safe_open(model, framework="pt") as f:
        want, got = ref.get_slice(name), f.get_slice(name)
        assert got.get_shape() == want.get_shape()
        assert got.get_dtype() == want.get_dtype()
        assert_identical({name: want[index]}, {name: got[index]})


def test_misaligned_tensors_come_back_aligned_and_identical(tmp_path: Path) -> None:
    b = torch.tensor([1.5, -2.25, 3.0], dtype=torch.float32)
    header = {"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
              "b": {"dtype": "F32", "shape": [3], "data_offsets": [3, 15]}}
    body = json.dumps(header).encode()
    if (len(body) + 8) % 2 == 0:
        body += b" "                                    # every tensor misaligned in the file
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body + bytes([1, 2, 3])
                     + b.numpy().tobytes())
    with safe_open(path, framework="pt") as f:
        got = f.get_tensor("b")
    assert torch.equal(got, b) and got.data_ptr() % 4 == 0
    assert_identical(safetensors.torch.load_file(str(path)), load_file(path))


def test_what_it_refuses(model: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="local file"):
        safe_open("s3://bucket/m.safetensors", framework="pt")
    with pytest.raises(InvalidArgument, match="local file"):
        load_file("http://host/m.safetensors")
    with pytest.raises(InvalidArgument, match="framework 'np'"):
        safe_open(model, framework="np")
    with safe_open(model, framework="pt") as f, \
            pytest.raises(InvalidArgument, match="no tensor named 'nope'"):
        f.get_tensor("nope")
    with pytest.raises(FileNotFoundError):             # what safetensors raises
        safe_open(tmp_path / "missing.safetensors", framework="pt")
    with pytest.raises(InvalidArgument, match="backend"):
        load_file(model, backend="uring")
    with pytest.raises(InvalidArgument, match="not a device"):
        load_file(model, device=True)


def test_what_it_hands_out_outlives_the_file_object(model: Path) -> None:
    with safe_open(model, framework="pt", backend="pread") as f:
        tensor = f.get_tensor("big.F32")
        part = f.get_slice("big.F32")
    want = safetensors.torch.load_file(str(model))["big.F32"]
    assert_identical({"t": want}, {"t": tensor})        # a view of the map, kept alive
    # a slice taken inside, read after
    assert_identical({"t": want[:3, 5:9]}, {"t": part[:3, 5:9]})


def test_a_file_object_dropped_without_close_closes_its_file(model: Path) -> None:
    import gc

    before = len(os.listdir("/proc/self/fd"))
    for _ in range(300):
        assert safe_open(model, framework="pt").keys()
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before + 2
