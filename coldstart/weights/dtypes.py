"""Safetensors dtype names: their bit widths, and the torch dtype each one loads as.

The bit widths come from the format (``F4`` is 4 bits, ``F6_*`` 6 bits); the torch side is looked
up lazily because older torch builds lack the fp8/fp4 dtypes, and ``import torch`` is slow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Name -> bits per element, the reference reader's table.
BITS: dict[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}

# Name -> attribute of the torch module; absent attributes mean "this torch cannot hold it".
_TORCH_NAMES: dict[str, str] = {
    "BOOL": "bool",
    "F4": "float4_e2m1fn_x2",
    "U8": "uint8",
    "I8": "int8",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "C64": "complex64",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
}


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype a safetensors dtype loads as, or None when this torch has no such dtype.

    >>> import torch
    >>> torch_dtype("BF16") is torch.bfloat16
    True
    """
    import torch

    attr = _TORCH_NAMES.get(name)
    if attr is None:
        return None
    dt = getattr(torch, attr, None)
    return dt if isinstance(dt, torch.dtype) else None


def torch_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The torch shape of a tensor stored with ``shape``: ``F4`` packs two values per byte.

    torch's ``float4_e2m1fn_x2`` counts bytes, so the last dimension halves (as
    ``safetensors.torch`` does).

    >>> torch_shape("F4", (3, 8))
    (3, 4)
    """
    if name == "F4" and shape:
        return (*shape[:-1], shape[-1] // 2)
    return shape
