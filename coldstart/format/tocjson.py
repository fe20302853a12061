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
import bisect
import json
import re
from collections.abc import Mapping
from operator import attrgetter
from typing import Annotated, Any, Literal

import msgspec

from coldstart.errors import FormatError
from coldstart.format.timefmt import format_rfc3339, parse_rfc3339
from coldstart.format.toc import (
    MODE_PERM_MASK,
    PREFETCH_LANDMARK,
    TOC,
    Chunk,
    Entry,
    TOCEntries,
    normalize_name,
)
from coldstart.format.toccolumns import TOCColumns

__all__ = ["MAX_TOC_SIZE", "encode_toc", "entry_json", "parse_toc"]

#: Largest TOC (compressed or not) accepted, as containers/storage does.
MAX_TOC_SIZE = 150 << 20
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}\Z")
_ZERO_TIME = "0001-01-01T00:00:00Z"


def _field(raw: Mapping[str, Any] | _RawEntry, key: str, kind: type, default: Any,
           name: str) -> Any:
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
    typed: list[_RawEntry] | None = None
    try:
        if not data.isascii():
            # the typed decoder skips keys it does not know without reading their text: what
            # json would refuse (bytes that are not UTF-8) must not pass through those
            data.decode("utf-8", "surrogatepass")
        typed = _TYPED.decode(data).entries
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError, RecursionError):
        pass  # anything unusual: decoded as plain JSON below, where the checks name it
    if typed is not None:
        fast = _fast_or_none(typed, format, data_end, exact_frames)
        if fast is not None:
            return fast
    doc = _decode_json(data)
    if not isinstance(doc, dict):
        raise FormatError("TOC JSON is not an object")
    if doc.get("version") != 1:
        raise FormatError(f"TOC version {doc.get('version')!r:.20} is not supported (want 1)")
    raw_entries = doc.get("entries")
    if not isinstance(raw_entries, list):
        raise FormatError("TOC has no 'entries' list")
    if typed is None:
        # JSON the typed decoder refuses may still type-check (surrogates, which json reads)
        fast = _parse_fast_json(raw_entries, format, data_end, exact_frames)
        if fast is not None:
            return fast
    return _parse_strict(raw_entries, format, data_end, exact_frames)


def _parse_fast_json(raw_entries: list[Any], format: str, data_end: int,
                     exact_frames: bool) -> TOC | None:
    """The fast parser on decoded JSON objects: None where one does not type-check as a
    :class:`_RawEntry` or the fast parser returns None (the strict parser decides those)."""
    try:
        typed = msgspec.convert(raw_entries, list[_RawEntry])
    except (msgspec.ValidationError, TypeError, ValueError):
        return None
    return _fast_or_none(typed, format, data_end, exact_frames)


def _fast_or_none(raws: list[_RawEntry], format: str, data_end: int,
                  exact_frames: bool) -> TOC | None:
    try:
        return _parse_fast(raws, format, data_end, exact_frames)
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, FormatError):
        return None  # the strict parser names what is wrong


def _decode_json(data: bytes) -> Any:
    """The TOC document. msgspec decodes plain UTF-8 JSON about twice as fast as the
    standard library (200,000 entries: 0.45 s against 0.8 s), into the same objects; what it
    refuses (lone surrogate escapes, which our writer emits for non-UTF-8 names; raw bytes
    that are not UTF-8; NaN) goes to ``json``, which decides."""
    try:
        return msgspec.json.decode(data)
    except (ValueError, RecursionError):
        # msgspec.DecodeError, and UnicodeDecodeError for bytes that are not UTF-8 (json
        # reads those with surrogatepass): json decides, as it always did
        pass
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"TOC is not valid JSON: {exc}") from None


def _parse_strict(raw_entries: list[Any], format: str, data_end: int,
                  exact_frames: bool) -> TOC:
    """Entry by entry, every rule checked where it applies: the reference parser, and the one
    that names the entry when :func:`_parse_fast` finds anything unusual."""
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


def _chunk(raw: Mapping[str, Any] | _RawEntry, name: str, file_size: int) -> _RawChunk:
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
    starts = sorted(c.offset for cs in raw_chunks.values() for c in cs if not c.zeros)
    for name, raws in raw_chunks.items():
        entry = toc.entries[name]
        entry.chunks = _chunks_of(name, entry.size, raws, data_end, exact_frames, starts)


def _next_start(starts: list[int], offset: int, data_end: int) -> int:
    """eStargz has no endOffset: a member ends where the next distinct member starts."""
    i = bisect.bisect_right(starts, offset)
    return starts[i] if i < len(starts) else data_end


def _chunks_of(name: str, size: int, raws: list[_RawChunk], data_end: int, exact_frames: bool,
               starts: list[int]) -> list[Chunk]:
    chunks: list[Chunk] = []
    pos = 0
    for i, rc in enumerate(raws):
        if rc.chunk_offset != pos:
            raise FormatError(f"entry {name!r}: chunk #{i} starts at {rc.chunk_offset}, "
                              f"expected {pos} (chunk sizes do not add up)")
        following = raws[i + 1].chunk_offset if i + 1 < len(raws) else size
        csize = following - rc.chunk_offset
        if csize <= 0:
            raise FormatError(f"entry {name!r}: chunk #{i} has size {csize}")
        if rc.chunk_size not in (0, csize):
            raise FormatError(f"entry {name!r}: chunk #{i} declares chunkSize "
                              f"{rc.chunk_size} but spans {csize} bytes (sizes do not add up)")
        if rc.zeros:
            chunks.append(Chunk(0, 0, rc.chunk_offset, csize, rc.digest, 0, True, owner=name))
        else:
            if rc.offset >= data_end:
                raise FormatError(f"entry {name!r}: chunk #{i} at compressed offset "
                                  f"{rc.offset} is outside the data area (ends {data_end})")
            end = rc.end or _next_start(starts, rc.offset, data_end)
            if not rc.offset < end <= data_end:
                raise FormatError(f"entry {name!r}: chunk #{i} range {rc.offset}..{end} is "
                                  f"outside the data area (ends {data_end})")
            exact = exact_frames and rc.end != 0 and rc.inner == 0
            chunks.append(Chunk(rc.offset, end, rc.chunk_offset, csize, rc.digest,
                                rc.inner, False, exact, owner=name))
        pos += csize
    return chunks


# -- the fast path ------------------------------------------------------------------------------
#
# A TOC of 200,000 files must open in well under a second. msgspec decodes the usual TOC straight
# into typed entries (:class:`_RawEntry`: every field's type and every integer's range checked in
# C as it decodes), the rest is checked column by column (one comprehension per field), and the
# entries are built only when first looked up (TOCEntries). Anything the types or the columns do
# not show to be clean (a name to normalize, a null field, a duplicate, a chunk that does not
# tile its file...) returns None, and the strict parser decides, and names the entry. So both
# paths accept exactly the same TOCs and build the same entries.

_INT_END = 1 << 63
_U63 = Annotated[int, msgspec.Meta(ge=0, le=_INT_END - 1)]
_HEX = b"0123456789abcdef"


class _RawEntry(msgspec.Struct, gc=False):
    """A TOC entry's JSON object, typed: a field left out holds what the strict parser reads
    in its place. ``type`` and ``chunkType`` are the Literal's own strings, shared by every
    entry. Unknown keys are ignored, as the strict parser ignores them."""

    name: str
    type: Literal["dir", "reg", "symlink", "hardlink", "char", "block", "fifo", "chunk"]
    size: _U63 = 0
    modtime: str = _ZERO_TIME
    mode: _U63 = 0
    uid: _U63 = 0
    gid: _U63 = 0
    linkName: str = ""
    userName: str = ""
    groupName: str = ""
    devMajor: _U63 = 0
    devMinor: _U63 = 0
    xattrs: dict[str, str] | None = None
    digest: str | None = None
    offset: _U63 = 0
    endOffset: _U63 = 0
    chunkOffset: _U63 = 0
    chunkSize: _U63 = 0
    chunkDigest: str | None = None
    chunkType: Literal["", "zeros"] = ""
    innerOffset: _U63 = 0

    def get(self, key: str, default: Any = None) -> Any:
        """The field ``key``, read as the strict parser reads a dict's (:func:`_chunk`).
        ``default`` only stands for a key that is no field: a field left out holds its own,
        which is what every caller passes."""
        return getattr(self, key, default)


class _RawTOC(msgspec.Struct):
    version: Literal[1]
    entries: list[_RawEntry]


_TYPED = msgspec.json.Decoder(_RawTOC)


def _all_digests(ds: list[Any]) -> bool:
    """Every item is ``sha256:`` and 64 lowercase hex digits (what _DIGEST accepts)."""
    if not ds:
        return True
    if set(map(type, ds)) != {str} or set(map(len, ds)) != {71}:
        return False
    try:
        big = "".join(ds).encode("ascii")
    except UnicodeEncodeError:
        return False
    n = len(ds)
    for j, ch in enumerate(b"sha256:"):
        if big[j::71] != bytes([ch]) * n:
            return False
    # every item starts with the prefix (above), whose non-hex letters are "sh:": with the hex
    # digits deleted, exactly those must be left
    return big.translate(None, _HEX) == b"sh:" * n


def _clean_names(joined: str) -> bool:
    """No name in the NUL-joined ``joined`` would change in normalize_name: no empty component
    (leading, trailing or double slash) and no "." or ".." one; one name may be empty (the
    root's own entry). With every component between NULs these are substring tests, which run
    at memory speed (a regular expression that looks around each character took ten times as
    long)."""
    ends = "\0" + joined + "\0"
    root = ends.find("\0\0")            # an empty name: dropped, once
    if root >= 0:
        ends = ends[:root] + ends[root + 1:]
    padded = ends.replace("/", "\0")
    if "\0\0" in padded:
        return False
    if "/." in joined or "\0." in joined or joined.startswith("."):
        return "\0.\0" not in padded and "\0..\0" not in padded
    return True


def _parse_fast(raws: list[_RawEntry], format: str, data_end: int,
                exact_frames: bool) -> TOC | None:
    n = len(raws)
    if n == 0:
        return None
    joined = "\0".join([r.name for r in raws])
    if joined.count("\0") != n - 1 or not _clean_names(joined):
        return None
    # the names are kept, the decoder's objects are not: made again here, the names sit apart
    # from those objects in memory, which can then be given back to the system
    names = joined.split("\0")
    types: list[str] = [r.type for r in raws]
    tset = set(types)
    modtimes = {r.modtime for r in raws}
    mtimes = {s: parse_rfc3339(s) for s in modtimes}  # FormatError: the strict path names it

    # entries (not chunk continuations) and the continuations of each multi-chunk file
    multi: dict[int, list[int]] = {}        # entry position -> raw indexes of its chunk entries
    if "chunk" in tset:
        epos: list[int] = []
        for j, t in enumerate(types):
            if t != "chunk":
                epos.append(j)
                continue
            if not epos:
                return None
            head = epos[-1]
            if types[head] != "reg" or raws[head].size <= 0 or names[head] != names[j]:
                return None
            multi.setdefault(len(epos) - 1, []).append(j)
        eraws = [raws[j] for j in epos]
        enames = [names[j] for j in epos]
        etypes = [types[j] for j in epos]
    else:
        eraws, enames, etypes = raws, names, types
    m = len(eraws)
    index = dict(zip(enames, range(m), strict=True))
    if len(index) != m:
        return None                         # a duplicate
    root = index.get("")
    if root is not None and etypes[root] != "dir":
        return None
    synth: list[str] = []
    for p in {nm.rpartition("/")[0]: None for nm in enames}:
        while True:
            i = index.get(p)
            if i is None:
                index[p] = m + len(synth)
                synth.append(p)
                if not p:
                    break
                p = p.rpartition("/")[0]
                continue
            if (etypes[i] if i < m else "dir") != "dir":
                return None
            break
    if "" not in index:
        index[""] = m + len(synth)
        synth.append("")

    links: dict[int, str] = {}
    if "hardlink" in tset:
        for i, t in enumerate(etypes):
            if t == "hardlink":
                link = normalize_name(eraws[i].linkName, what="hardlink target")
                ti = index.get(link)
                if ti is None or link == enames[i] or (etypes[ti] if ti < m else "dir") == "dir":
                    return None
                links[i] = link
    xattrs: dict[int, dict[str, bytes]] = {}
    raw_xattrs = [r.xattrs for r in eraws]
    if any(raw_xattrs):
        for i, raw_x in enumerate(raw_xattrs):
            if raw_x:
                xattrs[i] = {k: base64.b64decode(v, validate=True) for k, v in raw_x.items()}
    unames = _carried([r.userName for r in eraws], eraws, "uid")
    gnames = _carried([r.groupName for r in eraws], eraws, "gid")

    # regular files with data: one chunk each unless chunk entries follow
    sizes = [r.size for r in eraws]
    regs = [i for i, t in enumerate(etypes) if t == "reg" and sizes[i] > 0]
    single = [i for i in regs if i not in multi] if multi else regs
    sraws = [eraws[i] for i in single]
    if any([r.chunkOffset for r in sraws]):
        return None
    declared = [r.chunkSize for r in sraws]
    ssizes = [sizes[i] for i in single]
    if declared != ssizes and any(c and c != s for c, s in zip(declared, ssizes, strict=True)):
        return None
    digests = [d for d in [r.digest for r in raws] if d is not None]
    data_raws = [r for r in sraws if r.chunkType != "zeros"]
    if len(data_raws) != len(sraws):
        digests += [r.chunkDigest for r in sraws if r.chunkType == "zeros" and r.chunkDigest]
    chunk_digests = [r.chunkDigest for r in data_raws]
    if None in chunk_digests or "" in chunk_digests:
        return None
    # a file of one chunk has the same digest twice (zstd:chunked): each checked once
    if not _all_digests(digests if chunk_digests == digests else digests + chunk_digests):
        return None
    offsets = [r.offset for r in data_raws]
    if offsets and max(offsets) >= data_end:
        return None
    ends = [r.endOffset for r in data_raws]
    if ends and (max(ends) > data_end
                 or any(e and e <= o for o, e in zip(offsets, ends, strict=True))):
        return None
    starts: list[int] = []
    if not all(ends) or multi:
        starts = offsets
        if multi:
            starts = offsets + [raws[j].offset for js in multi.values() for j in js
                                if raws[j].chunkType != "zeros"]
            starts += [eraws[i].offset for i in multi if eraws[i].chunkType != "zeros"]
        starts.sort()
    chunks: dict[int, list[Chunk]] = {}
    for i, js in multi.items():
        name, size = enames[i], eraws[i].size
        rcs = [_chunk(eraws[i], name, size)] + [_chunk(raws[j], name, size) for j in js]
        chunks[i] = _chunks_of(name, size, rcs, data_end, exact_frames, starts)

    total = sum([sizes[i] for i in regs])
    landmark = index.get(PREFETCH_LANDMARK)
    prefetch = enames[:landmark] if landmark is not None and landmark < m else []
    all_names = enames + synth if synth else list(enames)
    etypes = etypes + ["dir"] * len(synth) if synth else list(etypes)

    columns = TOCColumns(eraws, all_names, etypes, mtimes=mtimes, unames=unames,
                         gnames=gnames, links=links, xattrs=xattrs, chunks=chunks,
                         starts=starts, data_end=data_end, exact_frames=exact_frames)
    return TOC(format, TOCEntries(all_names, columns.entry, etypes, index=index,
                                  compact=columns.compact, small_chunks=columns.small_chunks,
                                  any_xattrs=any(xattrs.values()), stat=columns.stat),
               enames, prefetch,
               total_size=total)


def _carried(col: list[str], eraws: list[_RawEntry], idkey: str) -> list[str] | None:
    """The eStargz writer omits userName/groupName when they repeat the last one seen for the
    same id: carry them forward (``col``: the names as written; ``idkey``: "uid" or "gid";
    None: no entry says one)."""
    if all(col) or not any(col):
        return col if any(col) else None
    last: dict[int, str] = {}
    out: list[str] = []
    for uid, v in zip(map(attrgetter(idkey), eraws), col, strict=True):
        v = v or last.get(uid, "")
        last[uid] = v
        out.append(v)
    return out


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
