"""The TOC's two parsers: the column-wise fast path must accept exactly what the strict parser
accepts and build the same entries; anything unusual goes to the strict one."""

from __future__ import annotations

import copy
import io
import json
import random
import tarfile
import typing
from pathlib import Path
from typing import Any

import pytest

from coldstart.errors import FormatError
from coldstart.format.toc import ENTRY_TYPES, TOC, Stat, normalize_name
from coldstart.format.tocjson import (
    _TYPED,
    _clean_names,
    _parse_fast_json,
    _parse_strict,
    _RawEntry,
    parse_toc,
)
from tests.unit.format.layers import FORMATS, Converted, add, convert, every_kind_tar, toc_doc

H = "0123456789abcdef" * 4


def _same(a: TOC, b: TOC) -> None:
    assert list(a.entries) == list(b.entries) or set(a.entries) == set(b.entries)
    assert a.order == b.order and a.prefetch == b.prefetch and a.format == b.format
    assert len(a.entries) == len(b.entries) and a.total_size == b.total_size
    for name, eb in b.entries.items():
        ea = a.entries[name]
        assert ea == eb, name
        assert [c.owner for c in ea.chunks] == [c.owner for c in eb.chunks] == \
            [name] * len(eb.chunks), name
        assert a.entries.types[a.entries.position(name) or 0] == eb.type
    for d in ("", *(n for n, e in b.entries.items() if e.type == "dir")):
        assert a.children(d) == b.children(d)


def _same_compacted(fast: TOC, strict: TOC) -> None:
    """``fast`` builds the strict parser's entries from the decoder's objects, and again from
    its columns once compacted."""
    _same(fast, strict)
    fast.compact()
    _same(fast, strict)
    assert fast.entries.get("no/such/name") is None and "no/such/name" not in fast.entries


def _both(c: Converted, doc: dict[str, Any]) -> tuple[TOC | None, TOC | BaseException]:
    """(fast result or None, strict result or its exception) for ``doc`` on ``c``'s blob."""
    fmt, end, exact = c.layer.format, c.layer.toc_offset, c.layer.format != "estargz"
    fast = _parse_fast_json(copy.deepcopy(doc["entries"]), fmt, end, exact)
    strict: TOC | BaseException
    try:
        strict = _parse_strict(copy.deepcopy(doc["entries"]), fmt, end, exact)
    except FormatError as exc:
        strict = exc
    return fast, strict


def _layers(tmp: Path) -> list[Converted]:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        add(tf, "app/", type=tarfile.DIRTYPE, mode=0o755)
        for i in range(40):
            add(tf, f"app/m{i}.py", f"print({i})\n".encode() * (i + 1), uid=i % 3)
        add(tf, "app/big.bin", bytes(range(256)) * 300)          # several chunks
        add(tf, "app/.hidden", b"dot")
        add(tf, "deep/a/b/c/file", b"x")                          # parents synthesized
    many = buf.getvalue()
    out = []
    for fmt in FORMATS:
        (tmp / fmt).mkdir(exist_ok=True)
        out.append(convert(every_kind_tar(tmp / fmt), fmt, chunk_size=8192))
        out.append(convert(many, fmt, chunk_size=8192, prefetch=["app/m3.py", "app/big.bin"]))
    return out


def test_the_fast_path_takes_ordinary_layers_and_builds_the_same_entries(tmp_path: Path) -> None:
    for c in _layers(tmp_path):
        fast, strict = _both(c, toc_doc(c))
        assert fast is not None, c.layer.format       # the ordinary TOC takes the fast path
        assert isinstance(strict, TOC)
        _same_compacted(fast, strict)
        # and what open_layer gave (parse_toc) is the same again
        _same_compacted(c.layer.toc, strict)


@pytest.mark.parametrize("mutate", [
    lambda d: d["entries"][1].update(name="./" + d["entries"][1]["name"]),
    lambda d: d["entries"][1].update(name=d["entries"][1]["name"] + "/")
    if d["entries"][1].get("type") == "dir" else d["entries"][1].update(mode=None),
    lambda d: d["entries"][1].update(uid=None),
    lambda d: d["entries"].insert(0, {"name": "./", "type": "dir", "mode": 493}),
])
def test_what_the_fast_path_leaves_the_strict_one_still_accepts(tmp_path: Path,
                                                               mutate: Any) -> None:
    c = _layers(tmp_path)[1]
    doc = toc_doc(c)
    mutate(doc)
    fast, strict = _both(c, doc)
    assert fast is None and isinstance(strict, TOC)
    blob_toc = parse_toc(json.dumps(doc).encode(), format=c.layer.format,
                         data_end=c.layer.toc_offset, exact_frames=c.layer.format != "estargz")
    _same(blob_toc, strict)


_VALUES: list[Any] = [
    -1, -(2**70), True, False, None, 1.5, "12", "", "sha256:" + H, "sha256:" + H.upper(),
    "sha256:" + H[:-1], [], {}, {"user.x": "@@"}, {"user.x": 5}, 2**62, 2**63, 0, "zeros",
    "chunk", "hardlink", "dir", "reg", "a/../b", "/abs", "a//b", ".", "..", "x\x00y",
    "1970-01-01T00:00:00Z", "yesterday", "1970-13-01T00:00:00Z",
]
_KEYS = ["name", "type", "size", "mode", "uid", "gid", "userName", "groupName", "modtime",
         "linkName", "devMajor", "devMinor", "xattrs", "digest", "offset", "endOffset",
         "chunkOffset", "chunkSize", "chunkDigest", "chunkType", "innerOffset"]


def test_the_fast_path_never_accepts_what_the_strict_one_refuses(tmp_path: Path) -> None:
    rnd = random.Random(7)
    layers = _layers(tmp_path)
    docs = [(c, toc_doc(c)) for c in layers]
    refused = 0
    for _ in range(1500):
        c, base = rnd.choice(docs)
        doc = copy.deepcopy(base)
        entries = doc["entries"]
        for _ in range(rnd.choice([1, 1, 2])):
            e = rnd.choice(entries)
            op = rnd.random()
            if op < 0.7:
                e[rnd.choice(_KEYS)] = rnd.choice(_VALUES)
            elif op < 0.8:
                e.pop(rnd.choice(_KEYS), None)
            elif op < 0.9:
                entries.append(copy.deepcopy(e))                  # a duplicate
            else:
                other = rnd.choice(entries)
                e["name"] = other["name"] + "/child"              # below something
        fast, strict = _both(c, doc)
        if isinstance(strict, BaseException):
            refused += 1
            assert fast is None, (strict, doc)
        elif fast is not None:
            _same_compacted(fast, strict)
    assert refused > 300          # the mutations do reach the checks


def test_json_that_msgspec_refuses_is_decided_by_json(tmp_path: Path) -> None:
    """The fast decoder refuses raw bytes that are not UTF-8 and surrogates (written as an
    escape or as raw bytes); json decides those, exactly as before it: a clean FormatError
    for bytes that are not UTF-8, the same entries for a surrogate however written."""
    c = _layers(tmp_path)[1]
    kw: dict[str, Any] = {"format": c.layer.format, "data_end": c.layer.toc_offset,
                          "exact_frames": c.layer.format != "estargz"}
    doc = toc_doc(c)
    small = next(e for e in doc["entries"] if e["type"] == "reg")
    raw = json.dumps(doc).encode()
    name = json.dumps(small["name"]).encode()
    with pytest.raises(FormatError, match="JSON"):
        parse_toc(raw.replace(name, name[:-1] + b'\xff"', 1), **kw)
    escaped = parse_toc(raw.replace(name, name[:-1] + b'\\udcff"', 1), **kw)
    as_bytes = parse_toc(raw.replace(name, name[:-1] + b'\xed\xb3\xbf"', 1), **kw)
    assert small["name"] + "\udcff" in escaped.entries
    _same(as_bytes, escaped)


def test_ordinary_tocs_decode_straight_into_typed_entries(tmp_path: Path) -> None:
    """The usual TOC type-checks as it decodes (the fast path's first step), and the typed
    entry knows every entry type the strict parser does, and no other."""
    assert set(typing.get_args(typing.get_type_hints(_RawEntry)["type"])) == ENTRY_TYPES | {"chunk"}
    for c in _layers(tmp_path)[1::2]:     # every_kind_tar's names include surrogates: not these
        typed = _TYPED.decode(json.dumps(toc_doc(c)).encode())
        assert [e.name for e in typed.entries] == [e["name"] for e in toc_doc(c)["entries"]]


def _generic_small_chunks(toc: TOC, limit: int) -> list[tuple[int, int, int, int]]:
    return sorted((c.offset, c.inner_offset, p, k) for p, e in enumerate(toc.entries.values())
                  if e.type == "reg" and e.size <= limit
                  for k, c in enumerate(e.chunks) if not c.zeros)


@pytest.mark.parametrize("limit", [0, 100, 8192, 1 << 40])
def test_the_small_chunks_read_from_columns_are_those_of_the_entries(tmp_path: Path,
                                                                     limit: int) -> None:
    """The small-file index read from the typed entries, and from the columns once compacted,
    holds the chunks the entries themselves name (the reader's neighbour windows use it)."""
    multi = False
    for c in _layers(tmp_path):
        fast, strict = _both(c, toc_doc(c))
        assert fast is not None and isinstance(strict, TOC)
        want = _generic_small_chunks(strict, limit)
        assert sorted(strict.entries.small_chunks(limit)) == want     # the generic way
        assert sorted(fast.entries.small_chunks(limit)) == want       # from the raw objects
        fast.compact()
        assert sorted(fast.entries.small_chunks(limit)) == want       # from the columns
        multi = multi or any(k > 0 for _, _, _, k in want)
    assert multi == (limit > 8192)        # app/big.bin's several chunks, once it is small


def test_a_listing_reads_from_columns_what_the_entries_say(tmp_path: Path) -> None:
    """``TOCEntries.stat`` (what readdir and getattr show, read without making entries) holds
    each entry's own fields, from the decoder's objects and from the columns once compacted,
    and ``made`` makes the entry without keeping it."""
    kinds: set[str] = set()
    for c in _layers(tmp_path):
        fast, strict = _both(c, toc_doc(c))
        assert fast is not None and isinstance(strict, TOC)
        want = [Stat.of(e) for e in strict.entries.values()]
        kinds |= {s.type for s in want}
        assert [strict.entries.stat(i) for i in range(len(want))] == want
        for _ in range(2):
            es = fast.entries
            assert [es.stat(i) for i in range(len(want))] == want
            assert [es.made(i) for i in range(len(want))] == list(strict.entries.values())
            fast.compact()
        with pytest.raises(IndexError):
            fast.entries.stat(len(want))
    assert kinds >= {"reg", "dir", "symlink", "char", "hardlink"}, kinds


@pytest.mark.parametrize(("names", "clean"), [
    (["a", "a/b", "a/.hidden", "a/..x", "a/x.", "..."], True),
    (["", "a", "a/b"], True),                 # the root's own entry, first
    (["x", "", "a"], True),                   # or anywhere (eStargz puts its landmark first)
    (["x", "a", ""], True),
    (["", "a", ""], False),                   # two empty names
    (["a", "/b"], False), (["a/", "b"], False), (["a", "b//c"], False), (["/a"], False),
    (["a", "b/"], False), (["a", "./b"], False), (["a", "b/."], False), (["a/../b"], False),
    ([".."], False), (["a", "."], False), (["a/./b", "c"], False),
])
def test_clean_names_finds_every_name_normalize_name_would_change(names: list[str],
                                                                   clean: bool) -> None:
    assert _clean_names("\0".join(names)) is clean
    for name in names:
        if name and clean:
            assert normalize_name(name) == name
