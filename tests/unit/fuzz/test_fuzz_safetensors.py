"""Fuzz the safetensors header parser: valid files, mutated as JSON and as bytes.

Properties, for any mutated file:

* :func:`check_header`: ``parse_header`` returns a header whose tensors tile the data section
  exactly (in order, from 0 to the end of the file, no gap or overlap) with ``dtype`` x
  ``shape`` = byte length each, or raises FormatError; nothing else, no hang;
* :func:`check_agrees_with_reference`: it accepts exactly the files that the reference reader
  (the ``safetensors`` package's Rust core) accepts.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import safetensors
from hypothesis import given
from hypothesis import strategies as st

from coldstart.errors import FormatError
from coldstart.weights import header as header_module
from coldstart.weights.dtypes import BITS
from coldstart.weights.header import parse_header
from tests.unit.fuzz.common import (
    JsonEdit,
    Mutation,
    Property,
    apply_edits,
    byte_mutations,
    emit,
    fuzz_settings,
    json_edits,
    json_values,
    mutate_bytes,
    outcome,
    time_limit,
    to_pairs,
)

#: the reference reader (safetensors' Rust core): the tensors of a file's bytes, or an exception
_reference: Callable[[bytes], list[tuple[str, dict[str, Any]]]] = safetensors.deserialize

_KEYS = ["dtype", "shape", "data_offsets", "__metadata__", "format", "w", "b"]
_STRINGS = [*BITS, "F128", "f32", "", "__metadata__", "pt"]


@dataclass(frozen=True)
class SafetensorsCase:
    """A valid file (its tensors, metadata, padding), then mutations of it."""

    tensors: list[tuple[str, str, tuple[int, ...]]]
    metadata: dict[str, str] | None = None
    pad: int = 0
    edits: list[JsonEdit] = field(default_factory=list)
    mutations: list[Mutation] = field(default_factory=list)
    #: bytes added to (or, negative, cut from) the end of the data section
    data_delta: int = 0

    def header_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {}
        if self.metadata is not None:
            doc["__metadata__"] = self.metadata
        pos = 0
        for name, dtype, shape in self.tensors:
            n = math.prod(shape) * BITS[dtype] // 8
            doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
            pos += n
        return doc

    def data_size(self) -> int:
        return sum(math.prod(s) * BITS[d] // 8 for _, d, s in self.tensors)

    def file(self) -> bytes:
        """The file's bytes: header (edited), length prefix, data; then the byte mutations."""
        text = emit(apply_edits(to_pairs(self.header_doc()), self.edits)) if self.edits else \
            json.dumps(self.header_doc())
        body = text.encode("utf-8", "surrogatepass") + b" " * self.pad
        data = bytes(range(256)) * (self.data_size() // 256 + 1)
        data = data[: max(0, self.data_size() + self.data_delta)]
        if self.data_delta > 0:
            data += b"\xee" * self.data_delta
        return mutate_bytes(struct.pack("<Q", len(body)) + body + data, self.mutations)


_dtype = st.sampled_from(sorted(BITS))


@st.composite
def _tensor(draw: st.DrawFn) -> tuple[str, str, tuple[int, ...]]:
    dtype = draw(_dtype)
    shape = tuple(draw(st.lists(st.integers(0, 6), max_size=3)))
    if BITS[dtype] % 8 and math.prod(shape) * BITS[dtype] % 8:
        shape = (*shape, 8)  # a whole number of bytes: the file starts out valid
    return draw(st.sampled_from(["w", "b", "layer.0.w", "é", "__x"])) + str(len(shape)), \
        dtype, shape


def cases() -> st.SearchStrategy[SafetensorsCase]:
    """Valid files with up to four tensors, mutated as JSON, as bytes, or both."""
    tensors = st.lists(_tensor(), max_size=4, unique_by=lambda t: t[0])
    metadata = st.none() | st.dictionaries(st.sampled_from(["format", "k"]),
                                           st.sampled_from(["pt", ""]), max_size=2)
    edits = json_edits(json_values(_STRINGS, _KEYS), _KEYS)
    return st.builds(
        SafetensorsCase, tensors, metadata, st.integers(0, 9),
        st.just([]) | edits | edits,
        st.just([]) | byte_mutations(3),
        st.sampled_from([0, 0, 0, -1, 1, 8, -8]),
    )


def check_header(case: SafetensorsCase) -> None:
    """Accepted: the tensors tile ``[data_start, file_size)`` with consistent sizes; refused:
    FormatError. Nothing else, in bounded time."""
    raw = case.file()
    with time_limit():
        try:
            h = parse_header(raw, len(raw), "fuzz.safetensors")
        except FormatError:
            outcome("safetensors: refused")
            return
    outcome("safetensors: accepted")
    (n,) = struct.unpack("<Q", raw[:8])
    assert h.data_start == 8 + n <= h.file_size == len(raw)
    assert sorted(h.order) == sorted(h.tensors)
    pos = 0
    for t in h.in_file_order():
        assert t.dtype in BITS
        assert t.begin == pos <= t.end, (t, pos)
        count = 1
        for d in t.shape:
            assert d >= 0
            count *= d
            assert count < 2**64, t
        assert count * BITS[t.dtype] == 8 * t.nbytes, t
        pos = t.end
    assert h.data_start + pos == h.file_size
    assert h.metadata is None or all(
        isinstance(k, str) and isinstance(v, str) for k, v in h.metadata.items())


def check_agrees_with_reference(case: SafetensorsCase) -> None:
    """``parse_header`` accepts a file exactly when the reference reader does."""
    raw = case.file()
    try:
        with time_limit():
            parse_header(raw, len(raw), "fuzz.safetensors")
        ours = None
    except FormatError as exc:
        ours = str(exc)
    try:
        _reference(raw)
        theirs = None
    except Exception as exc:  # the reference's own error type (and its JSON parser's)
        theirs = f"{type(exc).__name__}: {exc}"
    assert (ours is None) == (theirs is None), f"ours: {ours}; reference: {theirs}"


PROPERTIES = [
    Property("safetensors-header", cases, check_header),
    Property("safetensors-reference", cases, check_agrees_with_reference),
]


@fuzz_settings(600)
@given(case=cases())
def test_mutated_headers_parse_consistently_or_fail_cleanly(case: SafetensorsCase) -> None:
    """Mutated safetensors files: a consistent header or FormatError."""
    check_header(case)


@fuzz_settings(500)
@given(case=cases())
def test_mutated_headers_agree_with_the_reference_reader(case: SafetensorsCase) -> None:
    """Mutated safetensors files: accepted exactly when the reference accepts them."""
    check_agrees_with_reference(case)


# -- regressions: what the fuzzers found, as plain tests -----------------------------------------


def _file(header: str, data: bytes = b"") -> bytes:
    body = header.encode()
    return struct.pack("<Q", len(body)) + body + data


def _refused(raw: bytes, kind: str) -> None:
    with pytest.raises(FormatError, match=re.escape(f"({kind})")):
        parse_header(raw, len(raw), "r.safetensors")
    with pytest.raises(Exception):  # noqa: B017 (the reference's own error type)
        _reference(raw)


@pytest.mark.parametrize("header", [
    "[" * 100_000 + "]" * 100_000,                                       # was RecursionError
    '{"w": {"dtype": "U8", "shape": [' + "9" * 5000 + '], "data_offsets": [0, 1]}}',
    # ^ was ValueError (Python's 4300-digit limit for int())
], ids=["deep-nesting", "5000-digit-number"])
def test_regression_json_that_python_cannot_parse_is_a_format_error(header: str) -> None:
    _refused(_file(header, b"x"), "InvalidHeaderDeserialization")


@pytest.mark.parametrize("header", [
    '{"\\ud800": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',
    '{"__metadata__": {"k": "\\udfff"}}',
    '{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "x": ["\\ud800"]}}',
], ids=["tensor-name", "metadata-value", "in-an-ignored-field"])
def test_regression_a_lone_surrogate_escape_is_refused_as_by_the_reference(header: str) -> None:
    """Was accepted (json decodes a lone "\\ud800"); serde_json refuses it (found by the long
    run, bench/fuzz.py). A pair of escapes is one character, and is read."""
    _refused(_file(header, b"x"), "InvalidHeaderDeserialization")
    raw = _file('{"\\ud83d\\ude00": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',
                b"x")
    assert list(parse_header(raw, len(raw), "r.safetensors").tensors) == ["\U0001f600"]
    assert [name for name, _ in _reference(raw)] == ["\U0001f600"]


def test_regression_null_metadata_is_no_metadata() -> None:
    """Was refused ("__metadata__ must map strings to strings"); the reference reads null as
    no metadata."""
    raw = _file('{"__metadata__": null, "w": {"dtype": "U8", "shape": [2], '
                '"data_offsets": [0, 2]}}', b"ab")
    assert parse_header(raw, len(raw), "r.safetensors").metadata is None
    assert [name for name, _ in _reference(raw)] == ["w"]


@pytest.mark.parametrize("header", [
    '{"__metadata__": {}, "__metadata__": {}}',
    '{"w": {"dtype": "U8", "dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}',
    '{"__metadata__": {"format": -1, "format": "pt"}}',
    '{"w": {"dtype": "F128", "shape": [2], "data_offsets": [0, 2]}, '
    '"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}',
], ids=["metadata-twice", "dtype-twice", "metadata-value-overridden",
        "tensor-overridden"])
def test_regression_repeated_keys_are_refused_where_the_reference_refuses(header: str) -> None:
    """Were accepted (the last value won); serde refuses a repeated struct field, and checks
    every value of a repeated map key."""
    _refused(_file(header, b"ab"), "InvalidHeaderDeserialization")


def test_regression_a_repeated_tensor_name_is_last_wins_as_in_the_reference() -> None:
    raw = _file('{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
                '"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}', b"ab")
    assert parse_header(raw, len(raw), "r.safetensors").tensors["w"].shape == (2,)
    assert [name for name, _ in _reference(raw)] == ["w"]


def test_regression_shape_product_overflows_left_to_right() -> None:
    """Was accepted (the product is 0); the reference multiplies left to right and stops at
    the first overflow. A zero first is fine in both."""
    big = 2**64 - 1
    _refused(_file(f'{{"w": {{"dtype": "U8", "shape": [{big}, {big}, 0], '
                   '"data_offsets": [0, 0]}}'), "ValidationOverflow")
    raw = _file(f'{{"w": {{"dtype": "U8", "shape": [0, {big}, {big}], "data_offsets": [0, 0]}}}}')
    assert parse_header(raw, len(raw), "r.safetensors").tensors["w"].nbytes == 0
    _reference(raw)


class _CountedDim(int):
    """A dimension that counts the multiplications it takes part in."""

    products = 0

    def __mul__(self, other: object) -> int:
        if not isinstance(other, int):
            return NotImplemented
        type(self).products += 1
        return int(self) * int(other)

    __rmul__ = __mul__


def test_regression_a_million_huge_dimensions_are_refused_quickly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The product of a header's every dimension was computed in full before the overflow
    check: quadratic in the number of dimensions (minutes for a 20 MB header). Now it stops
    at the first overflow, as the reference's checked multiplication does: 2**32 * 2**32 is
    past usize at the second of 200,000 dimensions, so two multiplications, not 200,000 of
    ever longer numbers."""
    as_index = header_module._as_index
    monkeypatch.setattr(header_module, "_as_index",
                        lambda v: None if (d := as_index(v)) is None else _CountedDim(d))
    monkeypatch.setattr(_CountedDim, "products", 0)
    header = '{"w": {"dtype": "U8", "shape": [' + ",".join(["4294967296"] * 200_000) + \
        '], "data_offsets": [0, 0]}}'
    raw = _file(header)
    with pytest.raises(FormatError, match="ValidationOverflow"):
        parse_header(raw, len(raw), "r.safetensors")
    assert _CountedDim.products == 2
