"""A failed read names the file and the tensor it was for, and keeps its kind; bytes that do not
match their digest are pinned on the tensor that holds them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from coldstart.errors import IntegrityError, Unavailable
from coldstart.remote.local import LocalFileBlob
from coldstart.weights import load, read_header
from tests.unit.weights.weights_data import save


class Failing(LocalFileBlob):
    """A local file whose reads fail (``kind``) when they cover byte ``bad``."""

    def __init__(self, path: Path, bad: int, kind: type[Exception]) -> None:
        super().__init__(path)
        self.bad, self.kind = bad, kind
        self.name = "bad.safetensors"

    def read_into(self, offset: int, buffers: Sequence[memoryview], *,
                  timeout: float | None = None) -> None:
        if offset <= self.bad < offset + sum(b.nbytes for b in buffers):
            raise self.kind(f"{self.name}: chunk sha256:abc does not match its digest")
        super().read_into(offset, buffers, timeout=timeout)

    head_guess = 8      # the header alone first: the bad byte is a tensor's
    # the mapped path would not call read_into: these tests read
    mapping = None      # type: ignore[assignment]


def _model(tmp_path: Path) -> tuple[Path, int]:
    tensors = {"a": torch.zeros(64, dtype=torch.int32), "b": torch.ones(1000),
               "c": torch.arange(50, dtype=torch.int64)}
    path = save(tensors, tmp_path / "m.safetensors")
    header = read_header(LocalFileBlob(path))
    b = header.tensors["b"]
    return path, header.data_start + b.begin + b.nbytes // 2    # a byte inside "b"


def test_an_integrity_error_names_the_file_and_the_tensor_holding_the_bad_bytes(
        tmp_path: Path) -> None:
    path, bad = _model(tmp_path)
    with pytest.raises(IntegrityError) as exc:
        load(Failing(path, bad, IntegrityError))
    # one read covered all three tensors; the bytes are "b"'s
    assert str(exc.value).startswith("bad.safetensors: tensor 'b': chunk sha256:abc")
    assert isinstance(exc.value.__cause__, IntegrityError)


def test_another_failure_names_every_tensor_of_the_read(tmp_path: Path) -> None:
    path, bad = _model(tmp_path)
    with pytest.raises(Unavailable,
                       match=r"^bad.safetensors: tensor '[abc]' \(and 2 more\): chunk"):
        load(Failing(path, bad, Unavailable))
