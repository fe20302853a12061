"""Parse and validate a safetensors header with every check the reference reader makes.

Each failure is a :class:`FormatError` naming the file, the tensor where there is one, and the
reference reader's own name for the condition (``InvalidOffset``, ``TensorInvalidInfo``, ...), so a
report can be matched against what ``safetensors`` itself would say.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from typing import Any

from coldstart.errors import FormatError
from coldstart.weights.dtypes import BITS

__all__ = ["MAX_HEADER", "Header", "TensorInfo", "parse_header", "parse_length"]

MAX_HEADER = 100_000_000
_USIZE_MAX = 2**64 - 1


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: offsets are relative to the start of the byte buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    """A validated header: ``data_start`` is the file offset of the byte buffer (8 + N)."""

    file: str
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] | None
    data_start: int
    file_size: int
    order: tuple[str, ...] = field(default=())

    def in_file_order(self) -> list[TensorInfo]:
        """Tensors sorted by offset: reading them in this order reads the file front to back."""
        return [self.tensors[n] for n in self.order]


class _Object(dict[str, Any]):
    """A JSON object that keeps what its repeated keys said before their last value."""

    overridden: tuple[tuple[str, Any], ...] = ()


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object(pairs)
    if len(obj) != len(pairs):
        last = {k: i for i, (k, _) in enumerate(pairs)}
        obj.overridden = tuple(p for i, p in enumerate(pairs) if last[p[0]] != i)
    return obj


def _overridden(obj: Any) -> tuple[tuple[str, Any], ...]:
    return getattr(obj, "overridden", ())


#: The reference reads the top level and each tensor into structs, and serde refuses a repeated
#: struct field; a repeated tensor name or metadata key (a map key) is last-wins there, as here,
#: though every value must be valid, the overridden ones included.
_TENSOR_FIELDS = frozenset({"dtype", "shape", "data_offsets"})


def _err(file: str, kind: str, detail: str) -> FormatError:
    return FormatError(f"{file}: invalid safetensors header ({kind}): {detail}")


def parse_length(prefix: bytes, file_size: int, file: str) -> int:
    """Header length ``N`` from the first 8 bytes, checked against the file size.

    >>> parse_length(struct.pack("<Q", 2) + b"{}", 10, "x.safetensors")
    2
    """
    if len(prefix) < 8 or file_size < 8:
        raise _err(file, "HeaderTooSmall", f"file has {file_size} bytes, fewer than 8")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER:
        raise _err(file, "HeaderTooLarge", f"header length {n} exceeds {MAX_HEADER}")
    if n + 8 > file_size:
        raise _err(file, "InvalidHeaderLength",
                   f"header length {n} + 8 runs past the end of the file ({file_size} bytes)")
    return int(n)


def _as_index(value: Any) -> int | None:
    # JSON numbers that the reference (serde, usize) accepts: non-negative integers only.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value > _USIZE_MAX:
        return None
    return value


#: a \u escape of a UTF-16 surrogate (D800-DFFF): only a pair of them is a character
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _has_lone_surrogate(doc: Any) -> bool:
    """Whether a key or string anywhere in ``doc`` holds a surrogate that is not half of a
    pair (json decodes a pair of escapes to one character, a lone one to a surrogate)."""
    todo = [doc]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            strings = [item]
        elif isinstance(item, dict):
            strings = list(item)
            todo.extend(item.values())
            for key, value in _overridden(item):     # a repeated key's earlier values too
                strings.append(key)
                todo.append(value)
        elif isinstance(item, list):
            todo.extend(item)
            continue
        else:
            continue
        for text in strings:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                return True
    return False


def _tensor_info(file: str, name: str, raw: Any) -> TensorInfo:
    where = f"tensor {name!r}"
    if not isinstance(raw, dict):
        raise _err(file, "InvalidHeaderDeserialization", f"{where}: entry is not an object")
    repeated = sorted({k for k, _ in _overridden(raw)} & _TENSOR_FIELDS)
    if repeated:
        raise _err(file, "InvalidHeaderDeserialization",
                   f"{where}: duplicate field {repeated[0]!r}")
    dtype = raw.get("dtype")
    if not isinstance(dtype, str) or dtype not in BITS:
        raise _err(file, "InvalidHeaderDeserialization", f"{where}: unknown dtype {dtype!r}")
    shape_raw = raw.get("shape")
    if not isinstance(shape_raw, list):
        raise _err(file, "InvalidHeaderDeserialization", f"{where}: shape is not a list")
    shape: list[int] = []
    for dim in shape_raw:
        d = _as_index(dim)
        if d is None:
            raise _err(file, "InvalidHeaderDeserialization", f"{where}: bad dimension {dim!r}")
        shape.append(d)
    offsets = raw.get("data_offsets")
    if not isinstance(offsets, list) or len(offsets) != 2:
        raise _err(file, "InvalidHeaderDeserialization",
                   f"{where}: data_offsets must be [BEGIN, END]")
    begin, end = _as_index(offsets[0]), _as_index(offsets[1])
    if begin is None or end is None:
        raise _err(file, "InvalidHeaderDeserialization",
                   f"{where}: bad data_offsets {offsets!r}")
    return TensorInfo(name=name, dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def parse_header(raw: bytes, file_size: int, file: str) -> Header:
    """Validate the header bytes (``raw`` = the first 8 + N bytes of the file, or more).

    Raises :class:`FormatError` for every condition the reference reader rejects.

    >>> import json, struct
    >>> body = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    >>> h = parse_header(struct.pack("<Q", len(body)) + body, 8 + len(body) + 8, "m.safetensors")
    >>> h.tensors["w"].shape
    (2,)
    """
    n = parse_length(raw[:8], file_size, file)
    if len(raw) < 8 + n:
        raise _err(file, "InvalidHeaderLength", f"got {len(raw)} header bytes, need {8 + n}")
    try:
        text = raw[8 : 8 + n].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _err(file, "InvalidHeader", f"header is not UTF-8 ({exc.reason})") from exc
    try:
        doc = json.loads(text, object_pairs_hook=_object)
    except (ValueError, RecursionError) as exc:
        # ValueError: JSONDecodeError, and a number of more than 4300 digits; RecursionError:
        # arrays or objects nested deeper than the interpreter's recursion limit
        raise _err(file, "InvalidHeaderDeserialization", f"bad JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise _err(file, "InvalidHeaderDeserialization", "header is not a JSON object")
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(doc):
        # json takes "\ud800" alone; the reference's parser (serde_json) refuses it
        raise _err(file, "InvalidHeaderDeserialization",
                   "bad JSON: a \\u escape of a lone UTF-16 surrogate")
    for name, entry in _overridden(doc):
        if name == "__metadata__":
            raise _err(file, "InvalidHeaderDeserialization", "duplicate field '__metadata__'")
        _tensor_info(file, name, entry)

    metadata: dict[str, str] | None = None
    tensors: dict[str, TensorInfo] = {}
    for name, entry in doc.items():
        if name == "__metadata__":
            if entry is None:       # the reference reads it as an Option: null is no metadata
                continue
            if not isinstance(entry, dict) or not all(
                isinstance(v, str) for v in [*entry.values(), *(v for _, v in _overridden(entry))]
            ):
                raise _err(file, "InvalidHeaderDeserialization",
                           "__metadata__ must map strings to strings")
            metadata = dict(entry)
            continue
        tensors[name] = _tensor_info(file, name, entry)

    ordered = sorted(tensors.values(), key=lambda t: (t.begin, t.end))
    position = 0
    for info in ordered:
        where = f"tensor {info.name!r}"
        if info.begin != position or info.end < info.begin:
            raise _err(file, f"InvalidOffset({info.name})",
                       f"{where}: data_offsets [{info.begin}, {info.end}] do not follow the "
                       f"previous tensor's end {position} (gap, overlap or END < BEGIN)")
        count = 1
        for dim in info.shape:
            # left to right, stopping at the first overflow, as the reference's checked
            # multiplication does ([0, 2**64-1, 2**64-1] is fine, [2**64-1, 2**64-1, 0] is not);
            # it also keeps a header of a million huge dimensions from a quadratic product
            count *= dim
            if count > _USIZE_MAX:
                break
        bits = count * BITS[info.dtype]
        if count > _USIZE_MAX or bits > _USIZE_MAX:
            raise _err(file, "ValidationOverflow", f"{where}: shape {list(info.shape)} overflows")
        if bits % 8:
            raise _err(file, "MisalignedSlice",
                       f"{where}: {count} x {BITS[info.dtype]} bits is not a whole number of bytes")
        if info.nbytes != bits // 8:
            raise _err(file, "TensorInvalidInfo",
                       f"{where}: {info.nbytes} bytes in data_offsets but shape "
                       f"{list(info.shape)} of {info.dtype} needs {bits // 8}")
        position = info.end
    if position + 8 + n != file_size:
        raise _err(file, "MetadataIncompleteBuffer",
                   f"tensors end at byte {position + 8 + n} but the file has {file_size} bytes")
    return Header(file=file, tensors=tensors, metadata=metadata, data_start=8 + n,
                  file_size=file_size, order=tuple(t.name for t in ordered))
