"""containerd's filter language, for ``List`` (containerd ``filters`` package semantics).

A request carries several filters, OR-ed. One filter is selectors joined by ``,`` (AND); a
selector is ``fieldpath [op value]`` with ``==``, ``!=``, ``~=`` (regular expression) or no
operator (the field is present). Field paths are ``.``-separated fields, each a word or a quoted
string: ``labels."containerd.io/snapshot.ref"==sha256:…,parent=="sha256:…"``. Values are bare
(up to ``,`` or a space) or quoted with ``"``; a ``~=`` value may also be quoted with ``/`` or
``|``. Snapshot fields are ``name``, ``parent``, ``kind`` (``active``, ``view``, ``committed``)
and ``labels.<key>`` (the rest of the path joined by ``.``).

Example::

    match = parse_all(['kind==committed,labels."a.b"~=^x', "name==foo"])
    match(info)  # -> bool
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coldstart.errors import InvalidArgument
from coldstart.snapshotter.store import Info

__all__ = ["Selector", "field_of", "parse", "parse_all"]

Adaptor = Callable[[list[str]], tuple[str, bool]]

_QUOTES = '"/|'
_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
            "\\": "\\"}


@dataclass(frozen=True)
class Selector:
    fieldpath: tuple[str, ...]
    op: str  # "", "==", "!=", "~="
    value: str = ""
    regexp: re.Pattern[str] | None = None

    def match(self, adaptor: Adaptor) -> bool:
        value, present = adaptor(list(self.fieldpath))
        if self.op == "":
            return present
        if self.op == "==":
            return present and value == self.value
        if self.op == "!=":
            return value != self.value
        assert self.regexp is not None
        return self.regexp.search(value) is not None


class _Parser:
    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0

    def error(self, msg: str) -> InvalidArgument:
        return InvalidArgument(f"filters: parse error: [{self.s}] at {self.i}: {msg}")

    def skip_space(self) -> None:
        while self.i < len(self.s) and self.s[self.i].isspace():
            self.i += 1

    def peek(self) -> str:
        self.skip_space()
        return self.s[self.i] if self.i < len(self.s) else ""

    def quoted(self, alt: bool) -> str:
        quote = self.s[self.i]
        if quote != '"' and not alt:
            raise self.error("invalid quote encountered")
        self.i += 1
        out: list[str] = []
        while True:
            if self.i >= len(self.s) or self.s[self.i] == "\n":
                raise self.error("quoted literal not terminated")
            c = self.s[self.i]
            if c == quote:
                self.i += 1
                return "".join(out)
            if c != "\\":
                out.append(c)
                self.i += 1
                continue
            nxt = self.s[self.i + 1:self.i + 2]
            if nxt in _ESCAPES:
                out.append(_ESCAPES[nxt])
                self.i += 2
            elif nxt == quote:
                out.append(nxt)
                self.i += 2
            elif nxt in ("x", "u", "U"):
                n = {"x": 2, "u": 4, "U": 8}[nxt]
                digits = self.s[self.i + 2:self.i + 2 + n]
                if len(digits) != n or not all(d in "0123456789abcdefABCDEF" for d in digits):
                    raise self.error("illegal escape sequence")
                out.append(chr(int(digits, 16)))
                self.i += 2 + n
            elif nxt and nxt in "01234567":
                digits = self.s[self.i + 1:self.i + 4]
                if len(digits) != 3 or not all(d in "01234567" for d in digits) \
                        or int(digits, 8) > 255:
                    raise self.error("illegal escape sequence")
                out.append(chr(int(digits, 8)))
                self.i += 4
            else:
                raise self.error("illegal escape sequence")

    def field(self) -> str:
        c = self.peek()
        if c in _QUOTES and c:
            return self.quoted(alt=False)
        start = self.i
        while self.i < len(self.s) and (self.s[self.i].isascii()
                                         and (self.s[self.i].isalnum() or self.s[self.i] == "_")):
            self.i += 1
        if start == self.i:
            raise self.error("expected field or quoted")
        return self.s[start:self.i]

    def fieldpath(self) -> tuple[str, ...]:
        parts = [self.field()]
        while self.peek() == ".":
            self.i += 1
            parts.append(self.field())
        return tuple(parts)

    def operator(self) -> str:
        start = self.i
        while self.i < len(self.s) and self.s[self.i] in "=!~":
            self.i += 1
        op = self.s[start:self.i]
        if op not in ("==", "!=", "~="):
            self.i = start
            raise self.error(f'expected an operator ("=="|"!="|"~="), got {op!r}')
        return op

    def value(self, alt: bool) -> str:
        c = self.peek()
        if not c:
            raise self.error("expected value or quoted")
        if c in _QUOTES:
            return self.quoted(alt)
        if c in ",.":
            raise self.error("expected value or quoted")
        start = self.i
        while self.i < len(self.s) and self.s[self.i] != "," and not self.s[self.i].isspace():
            self.i += 1
        return self.s[start:self.i]

    def selector(self) -> Selector:
        path = self.fieldpath()
        c = self.peek()
        if c in ("", ","):
            return Selector(path, "")
        if c not in "=!~":
            raise self.error(f"unexpected input: {c}")
        op = self.operator()
        value = self.value(alt=op == "~=")
        regexp = None
        if op == "~=":
            try:
                regexp = re.compile(value)
            except re.error as exc:
                raise self.error(f"bad regular expression {value!r}: {exc}") from None
        return Selector(path, op, value, regexp)

    def selectors(self) -> list[Selector]:
        out = [self.selector()]
        while True:
            c = self.peek()
            if c == "":
                return out
            if c != ",":
                raise self.error(f"unexpected input: {c}")
            self.i += 1
            out.append(self.selector())


def parse(text: str) -> list[Selector]:
    """One filter: selectors that must all match (an empty filter matches everything)."""
    if text == "":
        return []
    return _Parser(text).selectors()


def field_of(info: Info) -> Adaptor:
    """containerd's snapshot adaptor: the value of a field path and whether it is present."""
    def adaptor(path: list[str]) -> tuple[str, bool]:
        if not path:
            return "", False
        head = path[0]
        if head == "kind":
            return info.kind.word, True
        if head == "name":
            return info.name, True
        if head == "parent":
            return info.parent, True
        if head == "labels":
            if not info.labels:
                return "", False
            key = ".".join(path[1:])
            return (info.labels[key], True) if key in info.labels else ("", False)
        return "", False
    return adaptor


def parse_all(filters: Sequence[str]) -> Callable[[Info], bool]:
    """The OR of ``filters`` as a predicate on :class:`Info` (no filters: everything)."""
    parsed = [parse(f) for f in filters]
    if not parsed:
        return lambda _info: True

    def match(info: Info) -> bool:
        adaptor = field_of(info)
        return any(all(s.match(adaptor) for s in sel) for sel in parsed)
    return match
