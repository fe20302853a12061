"""Test data for the weights tests: tensors of every dtype, crafted files, comparisons."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

# safetensors name -> torch dtype attribute, for every dtype this torch has.
DTYPES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool", "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu", "F4": "float4_e2m1fn_x2",
}


def _random(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    itemsize = torch.empty((), dtype=dtype).element_size() if dtype.itemsize else 1
    n = int(torch.Size(shape).numel()) * itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def every_dtype(seed: int = 0) -> dict[str, torch.Tensor]:
    """A tensor of each dtype torch has (random bits, NaNs included), plus scalars and empties."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, attr in DTYPES.items():
        dt = getattr(torch, attr, None)
        if dt is None:
            continue
        out[f"t.{name}"] = _random(dt, (3, 5, 2), gen)
        out[f"scalar.{name}"] = _random(dt, (), gen) if name != "F4" else _random(dt, (1,), gen)
        out[f"empty.{name}"] = _random(dt, (0, 4), gen)
    out["big.F32"] = _random(torch.float32, (257, 1031), gen)  # ~1 MB: spans several chunks
    return out


def save(tensors: dict[str, torch.Tensor], path: Path) -> Path:
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def save_sharded(tensors: dict[str, torch.Tensor], folder: Path, shards: int = 3) -> Path:
    """Write a sharded checkpoint with an index, like transformers does."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        part = {n: tensors[n] for n in names[i::shards]}
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(folder / fname))
        weight_map.update({n: fname for n in part})
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index


def raw_file(header: Any, data: bytes = b"", *, pad: bool = False, length: int | None = None,
             header_bytes: bytes | None = None) -> bytes:
    """Craft safetensors bytes by hand (for invalid cases the writer would refuse)."""
    body = header_bytes if header_bytes is not None else json.dumps(header).encode()
    if pad:
        body += b" " * (-len(body) % 8)
    n = len(body) if length is None else length
    return struct.pack("<Q", n) + body + data


def assert_identical(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and bytes (NaN payloads included)."""
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        have = got[name]
        assert have.dtype == want.dtype, name
        assert have.shape == want.shape, name
        assert have.device.type == "cpu" or have.is_cuda
        a = want.contiguous().reshape(-1).view(torch.uint8)
        b = have.cpu().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a, b), f"{name}: bytes differ"
