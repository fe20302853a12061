"""The bench model server's weights: copies (safetensors) or views of the files' maps
(coldstart.weights), and bringing mapped ones back into memory after a restore."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from coldstart.benchmark.server_app import PAGE, load_weights, populate


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def _span(t: Any) -> tuple[int, int]:
    start = t.data_ptr() // PAGE * PAGE
    return start, t.data_ptr() + t.numel() * t.element_size() - start


def _resident(t: Any) -> float:
    """The share of ``t``'s pages in memory (mincore of its map)."""
    start, length = _span(t)
    vec = (ctypes.c_ubyte * ((length + PAGE - 1) // PAGE))()
    assert _libc().mincore(start, length, vec) == 0
    return sum(v & 1 for v in vec) / len(vec)


@pytest.fixture()
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(512, 1024), "b": torch.randn(999).to(torch.bfloat16)}, str(path))
    return path


def test_safetensors_copies_and_coldstart_maps(checkpoint: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVER_LOADER", "safetensors")
    copied, mapped = load_weights([checkpoint])
    assert not mapped and copied["w"].shape == (512, 1024)
    monkeypatch.setenv("SERVER_LOADER", "coldstart")
    views, mapped = load_weights([checkpoint])
    assert mapped and torch.equal(views["w"], copied["w"])


def test_populate_brings_every_page_of_mapped_weights_back(checkpoint: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVER_LOADER", "coldstart")
    views, _ = load_weights([checkpoint])
    want = views["w"].clone()
    # as in a process restored from a snapshot on a node that never read the file: the map is
    # there, none of its pages
    start, length = _span(views["w"])
    assert _libc().madvise(start, length, 4) == 0               # MADV_DONTNEED
    fd = os.open(checkpoint, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert _resident(views["w"]) < 0.5
    assert populate(views) >= length
    assert _resident(views["w"]) == 1.0
    assert torch.equal(views["w"], want)
