"""What the fuzzers share: settings, byte and JSON mutations, a hang guard, outcome counts.

Inputs start valid and are then mutated, so that most examples get past the first check and
reach the deeper ones: :class:`Mutation` edits bytes (flip, set, insert, delete, truncate, copy
a piece elsewhere), :class:`JsonEdit` edits a JSON document (replace a value with a hostile one
or with another node's value, delete it, repeat a key, add one). Both are plain dataclasses, so
a falsifying example prints as a readable recipe.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

__all__ = [
    "EXAMPLES_ENV",
    "HANG_SECONDS",
    "OUTCOMES",
    "CopyOf",
    "Hang",
    "JsonEdit",
    "Lit",
    "Mutation",
    "Nudge",
    "Pairs",
    "Property",
    "Raw",
    "apply_edits",
    "byte_mutations",
    "emit",
    "examples",
    "fuzz_settings",
    "json_edits",
    "json_values",
    "mutate_bytes",
    "outcome",
    "time_limit",
    "to_pairs",
]

#: Environment variable that raises every bounded fuzz test to this many examples.
EXAMPLES_ENV = "COLDSTART_FUZZ_EXAMPLES"
#: One example that runs longer than this is a hang (inputs are a few KiB).
HANG_SECONDS = 30.0
#: How examples ended, by label (``bench/fuzz.py`` prints them: are the deep paths reached?).
OUTCOMES: collections.Counter[str] = collections.Counter()


def outcome(label: str) -> None:
    """Count one example's outcome under ``label``."""
    OUTCOMES[label] += 1


def examples(default: int) -> int:
    """``default``, or the number in ``$COLDSTART_FUZZ_EXAMPLES``."""
    raw = os.environ.get(EXAMPLES_ENV, "").strip()
    return int(raw) if raw else default


def fuzz_settings(default_examples: int) -> settings:
    """Bounded, reproducible settings: the same examples on every run (CI included)."""
    return settings(max_examples=examples(default_examples), deadline=None, derandomize=True,
                    database=None, suppress_health_check=list(HealthCheck), print_blob=False)


@dataclass(frozen=True)
class Property:
    """One fuzzed property: a strategy for its inputs and the check that must hold for each."""

    name: str
    strategy: Callable[[], st.SearchStrategy[Any]]
    check: Callable[[Any], None]


# -- a hang guard -----------------------------------------------------------------------------


class Hang(Exception):
    """An example ran past :data:`HANG_SECONDS` (raised by :func:`time_limit`)."""


@contextlib.contextmanager
def time_limit(seconds: float = HANG_SECONDS) -> Iterator[None]:
    """Raise :class:`Hang` in the block after ``seconds`` (main thread only; else no guard).

    An interval timer already running (pytest-timeout's) is paused and resumed afterwards.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum: int, frame: FrameType | None) -> None:
        raise Hang(f"no result within {seconds:g} s")

    start = time.monotonic()
    old_handler = signal.signal(signal.SIGALRM, fire)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay:
            left = max(old_delay - (time.monotonic() - start), 0.001)
            signal.setitimer(signal.ITIMER_REAL, left, old_interval)


# -- byte mutations ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Mutation:
    """One edit of a byte string. ``pos`` (and ``src``) are taken modulo the length + 1, so a
    negative one counts from the end: ``Mutation("truncate", -1)`` removes the last byte."""

    op: str  # flip | set | insert | delete | truncate | copy
    pos: int
    arg: int = 0
    data: bytes = b""
    src: int = 0


def mutate_bytes(data: bytes, ops: Sequence[Mutation]) -> bytes:
    """``data`` with every edit of ``ops`` applied in order."""
    buf = bytearray(data)
    for m in ops:
        n = len(buf)
        i = m.pos % (n + 1)
        if m.op == "flip" and n:
            buf[i % n] ^= 1 << (m.arg % 8)
        elif m.op == "set" and n:
            buf[i % n] = m.arg % 256
        elif m.op == "insert":
            buf[i:i] = m.data
        elif m.op == "delete":
            del buf[i : i + max(m.arg, 1)]
        elif m.op == "truncate":
            del buf[i:]
        elif m.op == "copy":
            s = m.src % (n + 1)
            buf[i:i] = buf[s : s + max(m.arg, 1)]
    return bytes(buf)


#: Byte strings the formats give meaning to (magics, footers, blocks).
INTERESTING_BYTES = [
    b"\x00", b"\xff" * 8, b"\x00" * 512, b"\x1f\x8b\x08\x00", b"\x28\xb5\x2f\xfd",
    b"\x50\x2a\x4d\x18", b"STARGZ", b"GNUlInUx", b"GnUlInUx", b"\n", b"{", b"[" * 64, b'"',
    b"\\u", b"\xc3", b"\xed\xb3\xbf", b"0000000", b"\x80" + b"\xff" * 11,
]


def byte_mutations(max_ops: int = 4) -> st.SearchStrategy[list[Mutation]]:
    """One to ``max_ops`` byte edits at any position."""
    pos = st.integers(-(1 << 20), 1 << 20)
    one = st.one_of(
        st.builds(Mutation, st.just("flip"), pos, st.integers(0, 7)),
        st.builds(Mutation, st.just("set"), pos, st.integers(0, 255)),
        st.builds(Mutation, st.just("insert"), pos,
                  data=st.binary(min_size=1, max_size=32) | st.sampled_from(INTERESTING_BYTES)),
        st.builds(Mutation, st.just("delete"), pos, st.integers(1, 600)),
        st.builds(Mutation, st.just("truncate"), pos),
        st.builds(Mutation, st.just("copy"), pos, st.integers(1, 1100), src=pos),
    )
    return st.lists(one, min_size=1, max_size=max_ops)


# -- JSON documents and their mutations -------------------------------------------------------


class Raw:
    """JSON text emitted as it is: what a Python value cannot say (a 5000-digit number, a
    nesting deeper than the encoder's recursion, a lone surrogate escape).

    Its repr is short (a reproducer shows the first characters and the length)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        if len(self.text) <= 40:
            return f"Raw({self.text!r})"
        return f"Raw({self.text[:20]!r} ... {self.text[-20:]!r}, {len(self.text)} chars)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Raw) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)


class Pairs(list[tuple[str, Any]]):
    """A JSON object as a list of (key, value): it may repeat a key."""


def to_pairs(doc: Any) -> Any:
    """``doc`` with every dict turned into :class:`Pairs` (a deep copy)."""
    if isinstance(doc, dict):
        return Pairs((k, to_pairs(v)) for k, v in doc.items())
    if isinstance(doc, list):
        return [to_pairs(v) for v in doc]
    return doc


def emit(v: Any) -> str:
    """JSON text for ``v`` (dicts, :class:`Pairs`, lists, scalars, :class:`Raw`), ASCII only."""
    if isinstance(v, Raw):
        return v.text
    if isinstance(v, Pairs | dict):
        items = v if isinstance(v, Pairs) else v.items()
        return "{" + ",".join(f"{json.dumps(str(k))}:{emit(x)}" for k, x in items) + "}"
    if isinstance(v, list | tuple):
        return "[" + ",".join(emit(x) for x in v) + "]"
    return json.dumps(v)


INTS = [0, 1, -1, 7, 4095, 4096, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
        -(2**63), 10**30]
STRINGS = [
    "", ".", "..", "./", "/", "//", "/etc/passwd", "../escape", "a/../../b", "a/./b", "a//b",
    "a/\x00b", "\x00", "\udcff", "é", "名前", "x" * 5000, "sha256:" + "0" * 64,
    "sha256:" + "ab" * 32, "sha256:", "sha512:" + "0" * 128, "1970-01-01T00:00:00Z",
    "0001-01-01T00:00:00Z", "9999-12-31T23:59:60.999999999-23:59", "2024-02-30T00:00:00Z",
    "0000-00-00T00:00:00Z",
]
RAWS = [
    Raw("9" * 5000), Raw("-" + "9" * 5000), Raw("1e999"), Raw("-0"), Raw("1.0"), Raw("1e2"),
    Raw("NaN"), Raw("-Infinity"), Raw("[" * 3000 + "]" * 3000),
    Raw('{"a":' * 3000 + "1" + "}" * 3000), Raw("[" * 100_000 + "]" * 100_000),
    Raw('"\\ud800"'), Raw('"\\u0000"'), Raw('"\\udcff\\udcfe"'),
]


def json_values(strings: Sequence[str] = (), keys: Sequence[str] = ()
                ) -> st.SearchStrategy[Any]:
    """Hostile JSON values: edge integers, huge and deep raw numbers and arrays, path-like
    and digest-like strings (plus ``strings``), nested lists and objects (keys from ``keys``)."""
    text = st.sampled_from([*STRINGS, *strings]) | st.text(max_size=12)
    scalars = st.one_of(
        st.none(), st.booleans(), st.sampled_from(INTS), st.integers(-3, 70_000),
        st.floats(allow_nan=True, allow_infinity=True), text,
    )
    key = st.sampled_from(list(keys)) | st.text(max_size=8) if keys else st.text(max_size=8)
    nested = st.recursive(
        scalars | st.sampled_from(RAWS),
        lambda inner: st.lists(inner, max_size=3)
        | st.lists(st.tuples(key, inner), max_size=3).map(Pairs),
        max_leaves=6,
    )
    return st.one_of(st.sampled_from(RAWS), scalars, nested)


@dataclass(frozen=True)
class Lit:
    """Replace with this value."""

    value: Any


@dataclass(frozen=True)
class CopyOf:
    """Replace with (a copy of) the value at another walk of the original document: the same
    name twice, one chunk's offsets in another, overlapping ranges."""

    walk: tuple[int, ...]


@dataclass(frozen=True)
class Nudge:
    """An integer moved by ``delta`` (a value that is not an integer becomes ``delta``)."""

    delta: int


@dataclass(frozen=True)
class JsonEdit:
    """One edit at the node that ``walk`` reaches: at each step an object's key (or an array's
    element) number ``i % len``; the walk stops at a scalar or an empty container.

    ``set`` replaces the node, ``delete`` removes it, ``repeat`` repeats its key (or element)
    with ``value``, ``add`` adds ``key`` (or appends to an array) inside the node."""

    op: str  # set | delete | repeat | add
    walk: tuple[int, ...]
    value: Lit | CopyOf | Nudge = Lit(None)
    key: str = ""


@dataclass
class _Place:
    parent: Any = None
    index: int = -1
    node: Any = None
    path: list[Any] = field(default_factory=list)


def _find(doc: Any, walk: Sequence[int]) -> _Place:
    place = _Place(node=doc)
    for step in walk:
        node = place.node
        if isinstance(node, Pairs) and node:
            i = step % len(node)
            place = _Place(node, i, node[i][1])
        elif isinstance(node, list) and not isinstance(node, Pairs) and node:
            i = step % len(node)
            place = _Place(node, i, node[i])
        else:
            break
    return place


def _value(spec: Lit | CopyOf | Nudge, original: Any, current: Any) -> Any:
    if isinstance(spec, Lit):
        return copy.deepcopy(spec.value)  # the example's own value stays as it prints
    if isinstance(spec, CopyOf):
        return to_pairs(_plain(_find(original, spec.walk).node))
    if isinstance(current, int) and not isinstance(current, bool):
        return current + spec.delta
    return spec.delta


def _plain(v: Any) -> Any:
    if isinstance(v, Pairs):
        return {k: _plain(x) for k, x in v}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def apply_edits(doc: Any, edits: Sequence[JsonEdit]) -> Any:
    """A mutated copy of ``doc`` (a :func:`to_pairs` tree; emit it with :func:`emit`)."""
    original = doc
    out = to_pairs(_plain(doc))
    for e in edits:
        place = _find(out, e.walk)
        parent, i = place.parent, place.index
        if e.op == "add":
            node = place.node
            if isinstance(node, Pairs):
                node.append((e.key, _value(e.value, original, None)))
            elif isinstance(node, list):
                node.append(_value(e.value, original, None))
            continue
        if parent is None:
            if e.op == "set":
                out = _value(e.value, original, out)
            continue
        if e.op == "set":
            new = _value(e.value, original, place.node)
            parent[i] = (parent[i][0], new) if isinstance(parent, Pairs) else new
        elif e.op == "delete":
            del parent[i]
        elif e.op == "repeat":
            new = _value(e.value, original, place.node)
            parent.insert(i + 1, (parent[i][0], new) if isinstance(parent, Pairs) else new)
    return out


def json_edits(values: st.SearchStrategy[Any], keys: Sequence[str], *, max_edits: int = 4,
               depth: int = 4) -> st.SearchStrategy[list[JsonEdit]]:
    """One to ``max_edits`` edits; walks of up to ``depth`` steps; added keys from ``keys``."""
    walk = st.lists(st.integers(0, 1 << 16), min_size=1, max_size=depth).map(tuple)
    value = st.one_of(st.builds(Lit, values), st.builds(CopyOf, walk),
                      st.builds(Nudge, st.sampled_from([-1, 1, -4096, 4096, 2**32, 2**64])))
    edit = st.builds(JsonEdit, st.sampled_from(["set", "set", "delete", "repeat", "add"]), walk,
                     value, st.sampled_from(list(keys)) | st.text(max_size=6))
    return st.lists(edit, min_size=1, max_size=max_edits)
