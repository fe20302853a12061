"""The TOC's JSON form (shared by eStargz and zstd:chunked): strict parsing and encoding.

The JSON comes from an untrusted blob. Parsing checks every field's type, normalizes names,
resolves chunk sizes and compressed extents, and checks that a file's chunks tile it exactly and
lie inside the blob's data area; every failure is a FormatError that names the entry.

Non-UTF-8 names: JSON strings cannot hold arbitrary bytes. A tar name that is not UTF-8 is
decoded with ``surrogateescape`` (as ``os.fsdecode`` does) and written to the JSON as ``\\udcXX``
escapes, so coldstart reads back the exact bytes (``os.fsencode(entry.name)``); readers in other
languages see U+FFFD in its place.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping
from typing import Any

from coldstart.errors import FormatError
from coldstart.format.timefmt import format_rfc3339, parse_rfc3339
from coldstart.format.toc import MODE_PERM_MASK, TOC, Chunk, Entry, normalize_name

__all__ = ["MAX_TOC_SIZE", "encode_toc", "entry_json", "parse_toc"]

#: Largest TOC (compressed or not) accepted, as containers/storage does.
MAX_TOC_SIZE = 150 << 20
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}\Z")
_ZERO_TIME = "0001-01-01T00:00:00Z"


def _field(raw: Mapping[str, Any], key: str, kind: type, default: Any, name: str) -> Any:
    value = raw.get(key, default)
    if value is None:
        return default
    # bool is an int in Python; JSON true must not pass as a size.
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise FormatError(f"entry {name!r}: field {key!r} is not an integer: {value!r:.40}")
    if kind is str and not isinstance(value, str):
        raise FormatError(f"entry {name!r}: field {key!r} is not a string: {value!r:.40}")
    if kind is int and value < 0:
        raise FormatError(f"entry {name!r}: field {key!r} is negative ({value})")
    return value


def _digest(value: str, name: str, key: str) -> str:
    if not _DIGEST.match(value):
        raise FormatError(f"entry {name!r}: {key} {value[:80]!r} is not a sha256 digest")
    return value


class _RawChunk:
    __slots__ = ("chunk_offset", "chunk_size", "digest", "end", "inner", "offset", "zeros")

    def __init__(self, offset: int, end: int, chunk_offset: int, chunk_size: int,
                 digest: str, inner: int, zeros: bool) -> None:
        self.offset = offset
        self.end = end
        self.chunk_offset = chunk_offset
        self.chunk_size = chunk_size
        self.digest = digest
        self.inner = inner
        self.zeros = zeros


def parse_toc(data: bytes, *, format: str, data_end: int, exact_frames: bool = False) -> TOC:
    """Parse and validate TOC JSON.

    ``data_end`` is where the blob's data area ends (the TOC's compressed offset): every chunk
    must lie before it. ``exact_frames`` says the format guarantees one chunk per frame (our
    zstd:chunked and containers/storage's), which lets decoding refuse a frame that holds more.
    """
    if len(data) > MAX_TOC_SIZE:
        raise FormatError(f"TOC is {len(data)} bytes, over the {MAX_TOC_SIZE} byte limit")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"TOC is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise FormatError("TOC JSON is not an object")
    if doc.get("version") != 1:
        raise FormatError(f"TOC version {doc.get('version')!r:.20} is not supported (want 1)")
    raw_entries = doc.get("entries")
    if not isinstance(raw_entries, list):
        raise FormatError("TOC has no 'entries' list")

    entries: list[Entry] = []
    raw_chunks: dict[str, list[_RawChunk]] = {}
    last_reg: Entry | None = None
    # The eStargz writer omits userName/groupName when they repeat the previous name seen
    # for the same uid/gid; carry them forward the same way.
    unames: dict[int, str] = {}
    gnames: dict[int, str] = {}
    for i, raw in enumerate(raw_entries):
        if not isinstance(raw, dict):
            raise FormatError(f"TOC entry #{i} is not an object")
        rawname = raw.get("name")
        if not isinstance(rawname, str):
            raise FormatError(f"TOC entry #{i} has no string 'name'")
        name = normalize_name(rawname, what="TOC entry")
        etype = _field(raw, "type", str, "", name)
        if etype == "chunk":
            if last_reg is None or last_reg.name != name:
                raise FormatError(f"entry {name!r}: chunk entry does not follow its file")
            raw_chunks[name].append(_chunk(raw, name, last_reg.size))
            continue
        size = _field(raw, "size", int, 0, name)
        xattrs: dict[str, bytes] = {}
        raw_x = raw.get("xattrs") or {}
        if not isinstance(raw_x, dict):
            raise FormatError(f"entry {name!r}: xattrs is not an object")
        for k, v in raw_x.items():
            if not isinstance(v, str):
                raise FormatError(f"entry {name!r}: xattr {k!r} is not a base64 string")
            try:
                xattrs[k] = base64.b64decode(v, validate=True)
            except (binascii.Error, ValueError):
                raise FormatError(f"entry {name!r}: xattr {k!r} is not valid base64") from None
        link = _field(raw, "linkName", str, "", name)
        if etype == "hardlink":
            link = normalize_name(link, what=f"hardlink {name!r} target")
        modtime = _field(raw, "modtime", str, _ZERO_TIME, name)
        digest = raw.get("digest")
        if digest is not None:
            digest = _digest(_field(raw, "digest", str, "", name), name, "digest")
        uid = _field(raw, "uid", int, 0, name)
        gid = _field(raw, "gid", int, 0, name)
        uname = _field(raw, "userName", str, "", name) or unames.get(uid, "")
        gname = _field(raw, "groupName", str, "", name) or gnames.get(gid, "")
        unames[uid] = uname
        gnames[gid] = gname
        entry = Entry(
            name=name,
            type=etype,
            size=size if etype == "reg" else 0,
            mode=_field(raw, "mode", int, 0, name) & MODE_PERM_MASK,
            uid=uid,
            gid=gid,
            uname=uname,
            gname=gname,
            mtime_ns=parse_rfc3339(modtime, what=f"entry {name!r}: modtime"),
            link_name=link,
            dev_major=_field(raw, "devMajor", int, 0, name),
            dev_minor=_field(raw, "devMinor", int, 0, name),
            xattrs=xattrs,
            digest=digest if etype == "reg" else None,
        )
        if etype == "reg" and entry.size > 0:
            raw_chunks[name] = [_chunk(raw, name, entry.size)]
            last_reg = entry
        else:
            last_reg = None
        entries.append(entry)

    toc = TOC.build(format, entries)
    _check_links(toc)
    _resolve_chunks(toc, raw_chunks, data_end, exact_frames)
    return toc


def _chunk(raw: Mapping[str, Any], name: str, file_size: int) -> _RawChunk:
    ctype = _field(raw, "chunkType", str, "", name)
    if ctype not in ("", "zeros"):
        raise FormatError(f"entry {name!r}: unknown chunkType {ctype!r}")
    zeros = ctype == "zeros"
    cdigest = raw.get("chunkDigest")
    if cdigest is None or cdigest == "":
        if not zeros:
            raise FormatError(f"entry {name!r}: chunk at {raw.get('chunkOffset', 0)!r:.20} "
                              "has no chunkDigest")
        cdigest = ""
    else:
        cdigest = _digest(_field(raw, "chunkDigest", str, "", name), name, "chunkDigest")
    chunk_offset = _field(raw, "chunkOffset", int, 0, name)
    if chunk_offset >= file_size:
        raise FormatError(f"entry {name!r}: chunkOffset {chunk_offset} is not inside the file "
                          f"({file_size} bytes)")
    return _RawChunk(
        offset=_field(raw, "offset", int, 0, name),
        end=_field(raw, "endOffset", int, 0, name),
        chunk_offset=chunk_offset,
        chunk_size=_field(raw, "chunkSize", int, 0, name),
        digest=cdigest,
        inner=_field(raw, "innerOffset", int, 0, name),
        zeros=zeros,
    )


def _check_links(toc: TOC) -> None:
    for e in toc.entries.values():
        if e.type == "hardlink":
            target = toc.entries.get(e.link_name)
            if target is None or e.link_name == e.name:
                raise FormatError(
                    f"hardlink {e.name!r}: target {e.link_name!r} is not in the layer")
            if target.type == "dir":
                raise FormatError(f"hardlink {e.name!r}: target {e.link_name!r} is a {target.type}")


def _resolve_chunks(toc: TOC, raw_chunks: dict[str, list[_RawChunk]], data_end: int,
                    exact_frames: bool) -> None:
    for name, raws in raw_chunks.items():
        for i, rc in enumerate(raws):
            if not rc.zeros and rc.offset >= data_end:
                raise FormatError(f"entry {name!r}: chunk #{i} at compressed offset "
                                  f"{rc.offset} is outside the data area (ends {data_end})")
    # eStargz has no endOffset: a member ends where the next distinct member starts.
    starts = sorted({c.offset for cs in raw_chunks.values() for c in cs if not c.zeros})
    next_start: dict[int, int] = {}
    for a, b in zip(starts, [*starts[1:], data_end], strict=False):
        next_start[a] = b
    for name, raws in raw_chunks.items():
        entry = toc.entries[name]
        chunks: list[Chunk] = []
        pos = 0
        for i, rc in enumerate(raws):
            if rc.chunk_offset != pos:
                raise FormatError(f"entry {name!r}: chunk #{i} starts at {rc.chunk_offset}, "
                                  f"expected {pos} (chunk sizes do not add up)")
            following = raws[i + 1].chunk_offset if i + 1 < len(raws) else entry.size
            size = following - rc.chunk_offset
            if size <= 0:
                raise FormatError(f"entry {name!r}: chunk #{i} has size {size}")
            if rc.chunk_size not in (0, size):
                raise FormatError(f"entry {name!r}: chunk #{i} declares chunkSize "
                                  f"{rc.chunk_size} but spans {size} bytes (sizes do not add up)")
            if rc.zeros:
                chunks.append(Chunk(0, 0, rc.chunk_offset, size, rc.digest, 0, True))
            else:
                if rc.offset >= data_end:
                    raise FormatError(f"entry {name!r}: chunk #{i} at compressed offset "
                                      f"{rc.offset} is outside the data area (ends {data_end})")
                end = rc.end or next_start[rc.offset]
                if not rc.offset < end <= data_end:
                    raise FormatError(f"entry {name!r}: chunk #{i} range {rc.offset}..{end} is "
                                      f"outside the data area (ends {data_end})")
                exact = exact_frames and rc.end != 0 and rc.inner == 0
                chunks.append(Chunk(rc.offset, end, rc.chunk_offset, size, rc.digest,
                                    rc.inner, False, exact))
            pos += size
        entry.chunks = chunks


def entry_json(e: Entry, *, offset: int = 0, end_offset: int | None = None) -> dict[str, Any]:
    """The JSON object for ``e`` (without chunk fields; the writer adds those)."""
    out: dict[str, Any] = {"name": e.name, "type": e.type}
    if e.type == "reg":
        out["size"] = e.size
    out["modtime"] = format_rfc3339(e.mtime_ns)
    if e.link_name:
        out["linkName"] = e.link_name
    # Zero values are left out, as Go's omitempty does: the reader's defaults are zero.
    for key, value in (("mode", e.mode), ("uid", e.uid), ("gid", e.gid)):
        if value:
            out[key] = value
    if e.uname:
        out["userName"] = e.uname
    if e.gname:
        out["groupName"] = e.gname
    if e.type in ("char", "block"):
        out["devMajor"] = e.dev_major
        out["devMinor"] = e.dev_minor
    if e.xattrs:
        out["xattrs"] = {k: base64.b64encode(v).decode("ascii") for k, v in e.xattrs.items()}
    if e.digest:
        out["digest"] = e.digest
    return out


def encode_toc(entries: list[dict[str, Any]], **extra: Any) -> bytes:
    """Serialize a TOC document (``{"version": 1, "entries": [...], **extra}``)."""
    doc: dict[str, Any] = {"version": 1, "entries": entries, **extra}
    # ensure_ascii keeps surrogate-escaped (non-UTF-8) names encodable.
    return json.dumps(doc, ensure_ascii=True, separators=(",", ":")).encode("ascii")
