"""Fuzz layer opening (footer, TOC) and reading: converted layers, mutated every way we can.

Five ways in, each starting from valid eStargz and zstd:chunked layers (the legacy footer and a
prefetch landmark included):

* the TOC edited as JSON (hostile values, another entry's values, repeated keys, deletions) and
  re-signed, so that only the structural checks stand between it and the reader;
* the TOC's JSON text mutated as bytes, re-signed;
* the whole blob mutated as bytes, opened verified (the manifest's digest) or unverified;
* the footer rewritten with lying offsets and lengths;
* the manifest's annotations (TOC digests, positions) edited.

The property (:func:`check_layer`): opening raises a ColdstartError, or gives a layer whose TOC
is internally consistent (normalized names, parents that are directories, chunks that tile each
file and lie in the data area) and whose every file reads back with its declared size and
digest, or raises a ColdstartError; a range read is the same bytes as the whole file's. A
verified TOC must also give back the original bytes. Nothing else, and no hang.
:func:`check_parsers_agree`: the TOC's fast and strict parsers accept the same documents and
build the same entries.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import io
import json
import struct
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coldstart.errors import ColdstartError, FormatError, IntegrityError
from coldstart.format import BytesReadAt, SeekableLayer, open_layer
from coldstart.format import layer as layer_mod
from coldstart.format.footer import estargz_footer, skippable_frame
from coldstart.format.toc import ENTRY_TYPES, TOC, normalize_name
from coldstart.format.tocjson import (
    _decode_json,
    _parse_fast_json,
    _parse_strict,
    encode_toc,
    parse_toc,
)
from tests.unit.format.layers import Converted, add, convert, toc_doc, with_toc
from tests.unit.fuzz.common import (
    INTS,
    JsonEdit,
    Mutation,
    Nudge,
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

#: Reads of more than this are skipped (a TOC may honestly declare a 1 GiB chunk or file; the
#: format allows it, and materializing it here would only measure this machine's memory).
READ_CAP = 1 << 20

_KEYS = ["name", "type", "size", "mode", "uid", "gid", "userName", "groupName", "modtime",
         "linkName", "devMajor", "devMinor", "xattrs", "digest", "offset", "endOffset",
         "chunkOffset", "chunkSize", "chunkDigest", "chunkType", "innerOffset", "version",
         "entries"]
_STRINGS = [*ENTRY_TYPES, "chunk", "zeros", "socket", "d", "d/multi", "d/small", "d/empty",
            "d/hard", "stargz.index.json", ".prefetch.landmark", "user.x", "AAAA", "@@",
            "sha256:" + hashlib.sha256(b"").hexdigest(), "sha256:" + hashlib.sha256(b"small")
            .hexdigest()]
_VALUES = json_values(_STRINGS, _KEYS)


def _tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        add(tf, "d/", type=tarfile.DIRTYPE, mode=0o755)
        add(tf, "d/multi", bytes(range(256)) * 55)          # 14,080 bytes: four 4 KiB chunks
        add(tf, "d/small", b"small", uid=1000)
        add(tf, "d/empty", b"")
        add(tf, "d/zeros", bytes(5000))
        add(tf, "d/attr", b"x", xattrs={"user.x": "y"})
        add(tf, "d/hard", type=tarfile.LNKTYPE, link="d/small")
        add(tf, "d/sym", type=tarfile.SYMTYPE, link="../elsewhere")
        add(tf, "dev/null", type=tarfile.CHRTYPE, dev=(1, 3))
        add(tf, "run/fifo", type=tarfile.FIFOTYPE)
    return buf.getvalue()


#: (format, convert_layer keywords) of each base layer
BASES: list[tuple[str, dict[str, Any]]] = [
    ("estargz", {}),
    ("zstd:chunked", {}),
    ("zstd:chunked", {"legacy_footer": True}),
    ("estargz", {"prefetch": ["d/small"]}),
]


@functools.cache
def base(i: int) -> tuple[Converted, dict[str, bytes]]:
    """Base layer ``i`` and the contents of its regular files."""
    fmt, kw = BASES[i % len(BASES)]
    c = convert(_tar(), fmt, chunk_size=4096, threads=1, **kw)
    files = {n: c.layer.read_file(n) for n, e in c.layer.toc.entries.items() if e.type == "reg"}
    return c, files


# -- the property -------------------------------------------------------------------------------


def check_toc(layer: SeekableLayer) -> None:
    """The TOC's invariants: what the FUSE layer relies on without checking again."""
    toc = layer.toc
    assert "" in toc.entries and toc.entries[""].type == "dir"
    for name, e in toc.entries.items():
        assert e.name == name and normalize_name(name) == name, name
        assert e.type in ENTRY_TYPES, e
        if name:
            parent = toc.entries.get(e.parent)
            assert parent is not None and parent.type == "dir", name
        if e.type != "reg":
            assert not e.chunks and e.size == 0, e
            continue
        pos = 0
        for c in e.chunks:
            assert c.chunk_offset == pos and c.chunk_size > 0, (name, c)
            if not c.zeros:
                assert 0 <= c.offset < c.end_offset <= layer.toc_offset, (name, c)
            pos += c.chunk_size
        assert pos == e.size, (name, pos, e.size)
    for name in toc.order:
        assert name in toc.entries


def _readable(layer: SeekableLayer, name: str, offset: int, length: int) -> bool:
    try:
        entry = layer.resolve(name)
    except ColdstartError:
        return True                # reading raises what resolve raised: fine to try
    if entry.type != "reg":
        return True
    return all(c.inner_offset + c.chunk_size <= READ_CAP
               for c in layer.chunks_for(entry, offset, length))


def check_reads(layer: SeekableLayer, probe: tuple[int, int],
                expect: Mapping[str, bytes] | None = None) -> None:
    """Every regular file (and hardlink) reads back with its size and digest, or raises a
    ColdstartError; a range read agrees with the whole file; ``expect``: the original bytes."""
    for name, e in list(layer.toc.entries.items()):
        if e.type not in ("reg", "hardlink") or not _readable(layer, name, 0, 1 << 62):
            continue
        try:
            data = layer.read_file(name)
        except ColdstartError as exc:
            outcome(f"layers: read refused ({type(exc).__name__})")
            continue
        target = layer.resolve(name)
        assert len(data) == target.size, (name, len(data), target.size)
        if target.digest:
            assert "sha256:" + hashlib.sha256(data).hexdigest() == target.digest, name
        if expect is not None and target.name in expect:
            assert data == expect[target.name], name
        outcome("layers: read")
        off, ln = probe[0] % (len(data) + 1), probe[1]
        if _readable(layer, name, off, ln):
            try:
                part = layer.read_file(name, off, ln)
            except ColdstartError:
                continue
            assert part == data[off : off + ln], (name, off, ln)


def check_layer(blob: bytes, annotations: Mapping[str, str], probe: tuple[int, int], *,
                allow_unverified: bool = False, expect: Mapping[str, bytes] | None = None,
                tail_read: int = 512 << 10) -> None:
    """Open ``blob``: a ColdstartError, or a consistent layer whose files read back right."""
    with time_limit():
        try:
            layer = open_layer(BytesReadAt(blob), annotations=annotations,
                               allow_unverified=allow_unverified, tail_read=tail_read)
        except ColdstartError as exc:
            outcome(f"layers: refused ({type(exc).__name__})")
            return
        outcome("layers: opened")
        check_toc(layer)
        check_reads(layer, probe, expect if layer.verified else None)


_probes = st.tuples(st.integers(0, 20_000), st.integers(0, 9000))
_bases = st.integers(0, len(BASES) - 1)


# -- the TOC, edited as JSON --------------------------------------------------------------------


@dataclass(frozen=True)
class TocEditCase:
    """Base layer ``base`` with its TOC document edited and re-signed."""

    base: int
    edits: list[JsonEdit]
    probe: tuple[int, int] = (0, 0)

    def toc_json(self) -> bytes:
        c, _ = base(self.base)
        return emit(apply_edits(to_pairs(toc_doc(c)), self.edits)).encode()


def _in_entries(edit: JsonEdit) -> JsonEdit:
    return JsonEdit(edit.op, (1, *edit.walk), edit.value, edit.key)


def toc_edit_cases() -> st.SearchStrategy[TocEditCase]:
    """Up to four edits, most of them inside the entries list."""
    edits = json_edits(_VALUES, _KEYS, depth=3)
    aimed = edits.map(lambda es: [_in_entries(e) for e in es])
    return st.builds(TocEditCase, _bases, aimed | aimed | edits, _probes)


def check_toc_edits(case: TocEditCase) -> None:
    """A re-signed, edited TOC: :func:`check_layer`."""
    c, _ = base(case.base)
    blob, annotations = with_toc(c, case.toc_json())
    check_layer(blob, annotations, case.probe)


def _strict_toc(text: bytes, fmt: str, end: int, exact: bool) -> TOC | None:
    """What the strict parser alone makes of TOC text (json decides what JSON is), or None."""
    try:
        doc = _decode_json(text)
    except FormatError:
        return None
    if not isinstance(doc, dict) or doc.get("version") != 1:
        return None
    entries = doc.get("entries")
    if not isinstance(entries, list):
        return None
    try:
        return _parse_strict(entries, fmt, end, exact)
    except FormatError:
        return None


def check_text_agrees(c: Converted, text: bytes) -> None:
    """``parse_toc`` on the text (typed decoding first) accepts exactly what the strict parser
    accepts, with the same entries."""
    fmt, end, exact = c.layer.format, c.layer.toc_offset, c.layer.format != "estargz"
    try:
        got: TOC | None = parse_toc(text, format=fmt, data_end=end, exact_frames=exact)
    except FormatError:
        got = None
    strict = _strict_toc(text, fmt, end, exact)
    if strict is None:
        assert got is None, "parse_toc accepted what the strict parser refuses"
        return
    assert got is not None, "parse_toc refused what the strict parser accepts"
    assert got.order == strict.order and got.prefetch == strict.prefetch
    assert set(got.entries) == set(strict.entries) and got.total_size == strict.total_size
    for name, e in strict.entries.items():
        assert got.entries[name] == e, name


def check_parsers_agree(case: TocEditCase) -> None:
    """The fast parser returns nothing (the strict one decides), or what the strict one does;
    parse_toc on the text agrees with the strict parser."""
    c, _ = base(case.base)
    check_text_agrees(c, case.toc_json())
    try:
        doc = _decode_json(case.toc_json())
    except FormatError:
        return
    entries = doc.get("entries") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        return
    fmt, end, exact = c.layer.format, c.layer.toc_offset, c.layer.format != "estargz"
    fast = _parse_fast_json(copy.deepcopy(entries), fmt, end, exact)
    try:
        strict: TOC | None = _parse_strict(copy.deepcopy(entries), fmt, end, exact)
    except FormatError:
        strict = None
    if fast is None:
        outcome("parsers: strict decides")
        return
    assert strict is not None, "the fast parser accepted what the strict one refuses"
    assert fast.order == strict.order and fast.prefetch == strict.prefetch
    assert set(fast.entries) == set(strict.entries)
    assert fast.total_size == strict.total_size
    for name, e in strict.entries.items():
        assert fast.entries[name] == e, name
    outcome("parsers: fast path")


# -- the TOC's text, mutated as bytes -----------------------------------------------------------


@dataclass(frozen=True)
class TocBytesCase:
    """Base layer ``base`` with its TOC's JSON text mutated as bytes and re-signed."""

    base: int
    mutations: list[Mutation]
    probe: tuple[int, int] = (0, 0)


def toc_bytes_cases() -> st.SearchStrategy[TocBytesCase]:
    """Up to four byte edits of the TOC text."""
    return st.builds(TocBytesCase, _bases, byte_mutations(), _probes)


def check_toc_bytes(case: TocBytesCase) -> None:
    """A re-signed TOC with mutated text: parsed as the strict parser would
    (:func:`check_text_agrees`), and :func:`check_layer`."""
    c, _ = base(case.base)
    doc = toc_doc(c)
    text = encode_toc(doc["entries"], **{k: v for k, v in doc.items()
                                         if k not in ("version", "entries")})
    mutated = mutate_bytes(text, case.mutations)
    check_text_agrees(c, mutated)
    blob, annotations = with_toc(c, mutated)
    check_layer(blob, annotations, case.probe)


# -- the whole blob, mutated as bytes -----------------------------------------------------------


@dataclass(frozen=True)
class BlobCase:
    """Base layer ``base`` mutated as bytes; opened against its annotations or unverified."""

    base: int
    mutations: list[Mutation]
    verified: bool = True
    tail_read: int = 512 << 10
    probe: tuple[int, int] = (0, 0)


def blob_cases() -> st.SearchStrategy[BlobCase]:
    """Up to four byte edits anywhere (negative positions: from the end, where footer and TOC
    are); a tail read that holds the TOC, or one that does not."""
    return st.builds(BlobCase, _bases, byte_mutations(), st.booleans(),
                     st.sampled_from([512 << 10, 200, 80]), _probes)


def check_blob(case: BlobCase) -> None:
    """A mutated blob: :func:`check_layer`; a verified TOC gives back the original bytes."""
    c, files = base(case.base)
    blob = mutate_bytes(c.blob, case.mutations)
    if case.verified:
        check_layer(blob, c.result.annotations, case.probe, expect=files,
                    tail_read=case.tail_read)
    else:
        check_layer(blob, {}, case.probe, allow_unverified=True, tail_read=case.tail_read)


# -- the footer, rewritten ----------------------------------------------------------------------


@dataclass(frozen=True)
class FooterCase:
    """Base layer ``base`` with a footer whose fields (None: the true value) lie."""

    base: int
    fields: list[int | None] = field(default_factory=list)
    legacy: bool = False


_field_values = st.none() | st.sampled_from([i for i in INTS if 0 <= i < 2**64]) | \
    st.integers(0, 1 << 16) | st.integers(-64, 64)


def footer_cases() -> st.SearchStrategy[FooterCase]:
    """Seven footer fields, each the truth, an edge value, a small number or a nudge."""
    return st.builds(FooterCase, _bases, st.lists(_field_values, min_size=7, max_size=7),
                     st.booleans())


def footer_blob(case: FooterCase) -> bytes:
    """The base layer's data area and TOC frame, then the lying footer."""
    c, _ = base(case.base)
    layer = c.layer
    f = layer.footer
    if layer.format == "estargz":
        off = case.fields[0]
        truth = f.toc_offset
        value = truth if off is None else (truth + off if -64 <= off <= 64 else off)
        return c.blob[: len(c.blob) - f.size] + estargz_footer(value % 2**64)
    truth_fields = [f.toc_offset, f.toc_length, f.toc_uncompressed, 1, f.tarsplit_offset,
                    f.tarsplit_length, f.tarsplit_uncompressed]
    values = []
    for t, v in zip(truth_fields, case.fields, strict=True):
        value = t if v is None else (t + v if -64 <= v <= 64 else v)
        values.append(value % 2**64)
    if case.legacy:
        payload = struct.pack("<4Q", *values[:4]) + b"GnUlInUx"
    else:
        payload = struct.pack("<7Q", *values) + b"GNUlInUx"
    return c.blob[: len(c.blob) - f.size] + skippable_frame(payload)


def check_footer(case: FooterCase) -> None:
    """A lying footer: :func:`check_layer`, unverified (so that the TOC it points at is used)."""
    check_layer(footer_blob(case), {}, (0, 0), allow_unverified=True)


# -- the manifest's annotations, edited ---------------------------------------------------------


_ANNOTATION_KEYS = [
    layer_mod.ESTARGZ_TOC_DIGEST, layer_mod.ESTARGZ_UNCOMPRESSED_SIZE,
    layer_mod.ZSTD_CHUNKED_MANIFEST_CHECKSUM, layer_mod.ZSTD_CHUNKED_MANIFEST_POSITION,
    layer_mod.ZSTD_CHUNKED_TARSPLIT_POSITION, layer_mod.ZSTD_CHUNKED_LEGACY_CHECKSUM,
    layer_mod.ZSTD_CHUNKED_LEGACY_POSITION,
]
_POSITION_PARTS = ["0", "1", "", "-1", "+1", " 1", "1.0", "0x10", "²", "١٢", "9" * 5000,
                   str(2**64), "18446744073709551615"]


@dataclass(frozen=True)
class AnnotationCase:
    """Base layer ``base`` opened against its annotations, edited: each (key, value) sets a
    key (None: deletes it); ``position`` (part indexes) builds a position-like value."""

    base: int
    edits: list[tuple[int, str | None]]
    position: list[int] = field(default_factory=list)

    def annotations(self) -> dict[str, str]:
        c, _ = base(self.base)
        out = dict(c.result.annotations)
        for k, v in self.edits:
            key = _ANNOTATION_KEYS[k % len(_ANNOTATION_KEYS)]
            if v is None:
                out.pop(key, None)
            elif v == "<position>":
                truth = out.get(key, "1:2:3:1").split(":")
                parts = [_POSITION_PARTS[p % len(_POSITION_PARTS)] if p >= 0
                         else truth[p % len(truth)] for p in self.position]
                out[key] = ":".join(parts)
            else:
                out[key] = v
        return out


def annotation_cases() -> st.SearchStrategy[AnnotationCase]:
    """Up to three annotation edits: deleted, a hostile string, a position of odd parts."""
    value = st.none() | st.just("<position>") | st.sampled_from(
        ["", "sha256:" + "0" * 64, "sha256:", "1:2:3:1", "²:1:1:1"]) | st.text(max_size=12)
    return st.builds(AnnotationCase, _bases,
                     st.lists(st.tuples(st.integers(0, 20), value), min_size=1, max_size=3),
                     st.lists(st.integers(-4, 20), max_size=5))


def check_annotations(case: AnnotationCase) -> None:
    """Edited annotations: :func:`check_layer`; what opens verified is the original."""
    c, files = base(case.base)
    check_layer(c.blob, case.annotations(), (0, 0), expect=files)


PROPERTIES = [
    Property("layers-toc-edits", toc_edit_cases, check_toc_edits),
    Property("layers-toc-parsers", toc_edit_cases, check_parsers_agree),
    Property("layers-toc-bytes", toc_bytes_cases, check_toc_bytes),
    Property("layers-blob-bytes", blob_cases, check_blob),
    Property("layers-footer", footer_cases, check_footer),
    Property("layers-annotations", annotation_cases, check_annotations),
]


@fuzz_settings(800)
@given(case=toc_edit_cases())
def test_edited_tocs_open_consistently_or_fail_cleanly(case: TocEditCase) -> None:
    """Re-signed TOCs edited as JSON: a consistent layer, or a ColdstartError."""
    check_toc_edits(case)


@fuzz_settings(800)
@given(case=toc_edit_cases())
def test_edited_tocs_parse_the_same_on_both_paths(case: TocEditCase) -> None:
    """Edited TOCs: the fast parser agrees with the strict one."""
    check_parsers_agree(case)


@fuzz_settings(400)
@given(case=toc_bytes_cases())
def test_mutated_toc_text_opens_consistently_or_fails_cleanly(case: TocBytesCase) -> None:
    """Re-signed TOCs mutated as text: a consistent layer, or a ColdstartError."""
    check_toc_bytes(case)


@fuzz_settings(800)
@given(case=blob_cases())
def test_mutated_blobs_open_consistently_or_fail_cleanly(case: BlobCase) -> None:
    """Blobs mutated as bytes: a consistent layer (the original, verified), or an error."""
    check_blob(case)


@fuzz_settings(400)
@given(case=footer_cases())
def test_lying_footers_fail_cleanly(case: FooterCase) -> None:
    """Lying footers: a consistent layer, or a ColdstartError."""
    check_footer(case)


@fuzz_settings(400)
@given(case=annotation_cases())
def test_edited_annotations_open_the_original_or_fail_cleanly(case: AnnotationCase) -> None:
    """Edited annotations: the original layer, or a ColdstartError."""
    check_annotations(case)


def test_bases_are_what_the_fuzzers_start_from() -> None:
    """The unmutated bases open, pass every check, and are what the fuzzers assume."""
    for i, (fmt, kw) in enumerate(BASES):
        c, files = base(i)
        assert c.layer.format == fmt and files["d/small"] == b"small"
        assert len(c.layer.toc.entries["d/multi"].chunks) == 4
        check_layer(c.blob, c.result.annotations, (5, 5000), expect=files)
        assert c.layer.footer.legacy == bool(kw.get("legacy_footer"))
    assert json.loads(TocEditCase(0, []).toc_json()) == toc_doc(base(0)[0])


# -- regressions: what the fuzzers found, as plain tests -----------------------------------------


@pytest.mark.parametrize("i", range(len(BASES)))
def test_regression_an_empty_file_is_checked_against_its_digest(i: int) -> None:
    """A whole-file read of an empty file returned b"" without checking the TOC's digest, so a
    (signed) TOC could say "empty, with the digest of 'small'" unnoticed."""
    c, _ = base(i)
    doc = toc_doc(c)
    next(e for e in doc["entries"] if e["name"] == "d/empty")["digest"] = \
        "sha256:" + hashlib.sha256(b"small").hexdigest()
    blob, annotations = with_toc(c, doc)
    layer = open_layer(BytesReadAt(blob), annotations=annotations)
    with pytest.raises(IntegrityError, match="'d/empty': file digest"):
        layer.read_file("d/empty")


def test_regression_minimal_fuzzer_inputs() -> None:
    """The three minimal inputs the fuzzers reported for it (a size nudged to 0, a size
    deleted from the TOC text, a bit flipped in an unverified legacy TOC frame)."""
    check_toc_edits(TocEditCase(3, [JsonEdit("set", (1, 2, 2), Nudge(-1), "name")]))
    check_toc_bytes(TocBytesCase(0, [Mutation("delete", 4203, 9)]))
    check_blob(BlobCase(2, [Mutation("flip", 2230, 0)], verified=False))


@pytest.mark.parametrize("bad", [b'"\xff"', b'"\xe2\x82"', b'["\xc3"]', b'{"\xc3": 1}'])
@pytest.mark.parametrize("where", ["entry", "top"])
def test_regression_bytes_that_are_not_utf8_in_a_key_no_field_reads(bad: bytes,
                                                                     where: str) -> None:
    """Were accepted: the typed decoder skips the value of a key it does not know without
    reading its text, where json refuses bytes that are not UTF-8."""
    c, _ = base(1)
    text = json.dumps(toc_doc(c)).encode()
    if where == "entry":
        text = text.replace(b'"name": ', b'"x-extra": ' + bad + b', "name": ', 1)
    else:
        text = text.replace(b'{"version": 1', b'{"x-extra": ' + bad + b', "version": 1', 1)
    assert b"x-extra" in text
    check_text_agrees(c, text)
    with pytest.raises(FormatError, match="not valid JSON"):
        parse_toc(text, format=c.layer.format, data_end=c.layer.toc_offset)


@pytest.mark.parametrize("position", ["²:1:1:1", "9" * 5000 + ":1:1:1"], ids=["superscript",
                                                                           "5000-digits"])
def test_regression_a_position_annotation_that_int_refuses(position: str) -> None:
    """Was ValueError from int(): "²".isdigit() is true, and int() refuses 4300+ digits."""
    c, _ = base(1)
    annotations = {**c.result.annotations, layer_mod.ZSTD_CHUNKED_MANIFEST_POSITION: position}
    with pytest.raises(FormatError, match="':'-separated numbers"):
        open_layer(BytesReadAt(c.blob), annotations=annotations)
