"""Header validation: every condition the reference reader rejects, crafted by hand.

Each crafted file is also fed to ``safetensors`` itself, so a case that the reference accepts
cannot sneak in as "invalid".
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import safetensors
import torch

from coldstart.errors import FormatError
from coldstart.weights import load, parse_header, read_header
from coldstart.weights.header import MAX_HEADER
from coldstart.weights.sources import LocalSource
from tests.unit.weights.weights_data import raw_file


def _t(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# (case id, file bytes, reference error kind, tensor name the message must carry or None)
CASES: list[tuple[str, bytes, str, str | None]] = [
    ("too-small", b"\x01\x00\x00", "HeaderTooSmall", None),
    ("too-large", struct.pack("<Q", MAX_HEADER + 1) + b"{}" + b" " * 64, "HeaderTooLarge", None),
    ("length-past-end", raw_file({}, length=4096), "InvalidHeaderLength", None),
    ("not-utf8", raw_file(None, header_bytes=b'{"\xff\xfe": 1}'), "InvalidHeader", None),
    ("bad-json", raw_file(None, header_bytes=b'{"a": '), "InvalidHeaderDeserialization", None),
    ("not-an-object", raw_file(None, header_bytes=b"[1, 2]"), "InvalidHeaderDeserialization",
     None),
    ("unknown-dtype", raw_file({"w": _t("F128", [1], 0, 16)}, b"\0" * 16),
     "InvalidHeaderDeserialization", "w"),
    ("negative-dim", raw_file({"w": _t("U8", [-1], 0, 1)}, b"\0"),
     "InvalidHeaderDeserialization", "w"),
    ("metadata-not-strings", raw_file({"__metadata__": {"k": 1}, "w": _t("U8", [1], 0, 1)},
                                      b"\0"), "InvalidHeaderDeserialization", None),
    ("offsets-not-pair", raw_file({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0]}},
                                  b"\0"), "InvalidHeaderDeserialization", "w"),
    ("gap", raw_file({"a": _t("U8", [2], 0, 2), "b": _t("U8", [2], 4, 6)}, b"\0" * 6),
     "InvalidOffset", "b"),
    ("overlap", raw_file({"a": _t("U8", [4], 0, 4), "b": _t("U8", [4], 2, 6)}, b"\0" * 6),
     "InvalidOffset", "b"),
    ("not-from-zero", raw_file({"a": _t("U8", [2], 2, 4)}, b"\0" * 4), "InvalidOffset", "a"),
    ("end-before-begin", raw_file({"a": _t("U8", [0], 0, 0), "b": _t("U8", [0], 0, 0),
                                   "c": _t("U8", [2], 0, 2), "d": _t("U8", [0], 2, 1)},
                                  b"\0" * 2), "InvalidOffset", "d"),
    ("overflow", raw_file({"w": _t("F32", [2**40, 2**40], 0, 4)}, b"\0" * 4),
     "ValidationOverflow", "w"),
    ("misaligned-bits", raw_file({"w": _t("F4", [3], 0, 2)}, b"\0" * 2), "MisalignedSlice", "w"),
    ("size-mismatch", raw_file({"w": _t("F32", [2], 0, 4)}, b"\0" * 4), "TensorInvalidInfo",
     "w"),
    ("trailing-bytes", raw_file({"w": _t("U8", [2], 0, 2)}, b"\0" * 3),
     "MetadataIncompleteBuffer", None),
    ("truncated-data", raw_file({"w": _t("F32", [4], 0, 16)}, b"\0" * 10),
     "MetadataIncompleteBuffer", None),
]


@pytest.mark.parametrize(("case", "data", "kind", "tensor"), CASES, ids=[c[0] for c in CASES])
def test_invalid_header_rejected_like_the_reference(tmp_path: Path, case: str, data: bytes,
                                                    kind: str, tensor: str | None) -> None:
    path = tmp_path / f"{case}.safetensors"
    path.write_bytes(data)
    # The reference raises its own kinds (SafetensorError, OverflowError...).
    with pytest.raises(Exception), safetensors.safe_open(str(path), framework="pt") as f:  # noqa: B017
        for k in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            f.get_tensor(k)
    with pytest.raises(FormatError) as info:
        read_header(LocalSource(path))
    message = str(info.value)
    assert str(path) in message
    assert kind in message
    if tensor is not None:
        assert repr(tensor) in message
    # The loader refuses the same file the same way (and loads nothing).
    with pytest.raises(FormatError, match=kind):
        load(path)


def test_valid_header_fields(tmp_path: Path) -> None:
    header = {"__metadata__": {"format": "pt"}, "b": _t("BF16", [2, 2], 8, 16),
              "a": _t("F32", [2], 0, 8), "s": _t("I64", [], 16, 24),
              "e": _t("F16", [0, 3], 24, 24)}
    data = raw_file(header, b"\0" * 24, pad=True)
    h = parse_header(data, len(data), "x.safetensors")
    assert h.metadata == {"format": "pt"}
    assert h.order[:3] == ("a", "b", "s")
    assert h.tensors["s"].shape == ()
    assert h.tensors["e"].nbytes == 0
    assert h.data_start % 8 == 0


def test_unpadded_header_and_odd_offsets_load(tmp_path: Path) -> None:
    """A writer that did not pad: the buffer starts at an odd offset; still loads identically."""
    a = torch.arange(3, dtype=torch.uint8)
    b = torch.tensor([1.5, -2.25, 3.0], dtype=torch.float32)  # at buffer offset 3: misaligned
    c = torch.tensor([7, -9], dtype=torch.int64)
    header = {"a": _t("U8", [3], 0, 3), "b": _t("F32", [3], 3, 15), "c": _t("I64", [2], 15, 31)}
    body = json.dumps(header).encode()
    if (len(body) + 8) % 2 == 0:
        body += b" "  # make 8 + N odd so every tensor is misaligned in the file too
    data = struct.pack("<Q", len(body)) + body + a.numpy().tobytes() + b.numpy().tobytes() \
        + c.numpy().tobytes()
    path = tmp_path / "odd.safetensors"
    path.write_bytes(data)
    from safetensors.torch import load_file

    ref = load_file(str(path))
    for mode in ("read", "mmap"):
        got = load(path, chunk_bytes=4096, cpu_mode=mode)
        for name in ("a", "b", "c"):
            assert torch.equal(got[name], ref[name])
            assert got[name].data_ptr() % got[name].element_size() == 0
        assert torch.equal(got["b"], b) and torch.equal(got["c"], c)


def test_f6_dtypes_parse_but_torch_cannot_hold_them(tmp_path: Path) -> None:
    data = raw_file({"w": _t("F6_E2M3", [4], 0, 3)}, b"\0" * 3)
    path = tmp_path / "f6.safetensors"
    path.write_bytes(data)
    assert read_header(LocalSource(path)).tensors["w"].dtype == "F6_E2M3"
    with pytest.raises(FormatError, match="F6_E2M3 has no torch equivalent"):
        load(path)
