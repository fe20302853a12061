"""Synthetic content for the bench images: deterministic, streamed, shaped like the real thing.

- weights: safetensors files of bf16 tensors named and shaped like a Llama-style decoder's
  (:func:`llama_tensors`), values normal(0, 0.02) (:func:`bf16_pool`, numpy), streamed in
  1 MiB runs (:func:`safetensors_chunks`) so no file is ever whole in memory;
- shared libraries: ELF-like bytes about as compressible as CUDA's (:func:`lib_chunks`);
- Python modules: valid sources of a given size, mostly docstrings (:func:`module_source`).

Everything follows from its seed: the same arguments give the same bytes.
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from coldstart.errors import FailedPrecondition

__all__ = ["Tensor", "bf16_pool", "lib_chunks", "lib_pools", "llama_tensors", "module_source",
           "safetensors_chunks", "safetensors_size", "text_pool"]

MiB = 1 << 20


def text_pool(seed: int, size: int) -> bytes:
    """Word soup: letters, spaces and newlines (no quotes or backslashes: safe in a docstring)."""
    rng = random.Random(seed)
    words = [bytes(rng.choice(b"abcdefghijklmnopqrstuvwxyz_") for _ in range(rng.randint(2, 10)))
             for _ in range(4000)]
    out = bytearray()
    while len(out) < size:
        out += b" ".join(rng.choices(words, k=10)) + b"\n"
    return bytes(out[:size])


def bf16_pool(seed: int, elements: int) -> Any:
    """``elements`` bf16 bit patterns of normal(0, 0.02) values (a numpy uint16 array)."""
    try:
        import numpy as np
    except ImportError as exc:
        raise FailedPrecondition("generating weights needs numpy (pip install numpy)") from exc
    values = np.random.default_rng(seed).standard_normal(elements, dtype=np.float32)
    values *= np.float32(0.02)
    return (values.view(np.uint32) >> 16).astype(np.uint16)     # bf16: float32's top half


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 2
        for d in self.shape:
            n *= d
        return n


def llama_tensors(hidden: int, intermediate: int, layers: range, vocab: int, *,
                  embed: bool, head: bool) -> list[Tensor]:
    """Tensor names and shapes of a Llama-style decoder (or a shard of one)."""
    out = [Tensor("model.embed_tokens.weight", (vocab, hidden))] if embed else []
    for i in layers:
        p = f"model.layers.{i}."
        out += [Tensor(p + "input_layernorm.weight", (hidden,))]
        out += [Tensor(p + f"self_attn.{k}_proj.weight", (hidden, hidden)) for k in "qkvo"]
        out += [Tensor(p + "post_attention_layernorm.weight", (hidden,)),
                Tensor(p + "mlp.gate_proj.weight", (intermediate, hidden)),
                Tensor(p + "mlp.up_proj.weight", (intermediate, hidden)),
                Tensor(p + "mlp.down_proj.weight", (hidden, intermediate))]
    if head:
        out += [Tensor("model.norm.weight", (hidden,)), Tensor("lm_head.weight", (vocab, hidden))]
    return out


def _safetensors_header(tensors: list[Tensor]) -> bytes:
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        meta[t.name] = {"dtype": "BF16", "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    body = json.dumps(meta, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def safetensors_size(tensors: list[Tensor]) -> int:
    return len(_safetensors_header(tensors)) + sum(t.nbytes for t in tensors)


def safetensors_chunks(tensors: list[Tensor], pool: Any, seed: int) -> Iterator[bytes]:
    """A safetensors file, streamed: weights are 1 MiB runs of ``pool`` at random offsets, each
    XORed with a random 7-bit mantissa mask (no two runs alike, the value distribution kept);
    norms are ones."""
    import numpy as np

    rng = random.Random(seed)
    yield _safetensors_header(tensors)
    run = MiB // 2                      # elements
    for t in tensors:
        n = t.nbytes // 2
        if "norm" in t.name:
            yield np.full(n, 0x3F80, dtype=np.uint16).tobytes()     # bf16 1.0
            continue
        for pos in range(0, n, run):
            k = min(run, n - pos)
            start = rng.randrange(0, len(pool) - k)
            yield (pool[start:start + k] ^ np.uint16(rng.randrange(128))).tobytes()


def lib_pools(seed: int) -> tuple[bytes, bytes]:
    """(uniformly random bytes, skewed bytes like machine code: 3.2 bits of entropy a byte)."""
    rng = random.Random(seed)
    rand = rng.randbytes(64 * MiB)
    weights = {0x00: 100, 0xFF: 20, 0x48: 20, 0x89: 16, 0x8B: 16, 0xE8: 12, 0x0F: 12,
               0x24: 12, 0x44: 10, 0x85: 8, 0xC0: 8, 0x83: 8, 0x01: 6, 0x08: 4, 0x10: 4}
    table = b"".join(bytes([v]) * n for v, n in weights.items())
    skewed = rng.randbytes(64 * MiB).translate(table)
    return rand, skewed


def lib_chunks(size: int, pools: tuple[bytes, bytes], seed: int) -> Iterator[bytes]:
    """A shared library's worth of bytes, ~2.8x compressible: an ELF-like header, then runs of
    random bytes (15%), skewed "code" bytes (47%) and zeros (38%)."""
    rand, skewed = pools
    rng = random.Random(seed)
    zeros = bytes(32 * 1024)
    head = b"\x7fELF\x02\x01\x01" + bytes(57)
    out = bytearray(head)
    left = size
    while left > 0:
        while len(out) < 4 * MiB:
            x = rng.random()
            n = rng.randint(1024, 32 * 1024)
            if x < 0.15:
                o = rng.randrange(len(rand) - n)
                out += rand[o:o + n]
            elif x < 0.62:
                o = rng.randrange(len(skewed) - n)
                out += skewed[o:o + n]
            else:
                out += zeros[:n]
        take = min(left, len(out))
        yield bytes(out[:take])
        left -= take
        del out[:take]


def module_source(i: int, size: int, pool: bytes, rng: random.Random) -> bytes:
    """A valid Python module of about ``size`` bytes, mostly docstrings (they compile fast, as
    the bytecode a real site-packages tree ships would load fast)."""
    funcs = "".join(f"def f{k}(x, y={k}):\n    \"\"\"Step {k}.\"\"\"\n    return x * {k} + y - {i}"
                    f"\n\n\n" for k in range(min(40, size // 1500 + 1)))
    code = (f'\n"""\n\nfrom __future__ import annotations\n\nVERSION = {i}\n\n\n{funcs}'
            f"class C{i}:\n    def __call__(self, x):\n        return f0(x)\n").encode()
    head = f'"""Module {i}.\n\n'.encode()
    n = max(0, size - len(head) - len(code))
    o = rng.randrange(0, len(pool) - n)
    return head + pool[o:o + n] + code
