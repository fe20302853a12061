"""A parsed TOC kept as columns: one array per field instead of one object per entry.

A CUDA or PyTorch layer holds hundreds of thousands of files and a container start looks at a
few thousand of them. Keeping each TOC entry as the JSON decoder's dict (about a kilobyte with
its strings) made a 200,000-file layer cost the FUSE server some 300 MB; kept as columns
(integers in ``array``s of the smallest type that holds them, digests as 32 raw bytes, repeated
strings shared) it costs a fraction of that, and an :class:`~coldstart.format.toc.Entry` is
made from them on demand (:class:`~coldstart.format.toc.TOCEntries` keeps the recent ones).

Making the columns takes a few tenths of a second for 200,000 entries, which a mount should
not wait for: until :meth:`TOCColumns.compact` is called (the FUSE server does, in a thread,
once the mounted layer's start-up has had its turn), entries are made from the decoder's
objects, as they always were.
Only the fast parser (:mod:`coldstart.format.tocjson`) builds these, from the typed entries it
has checked (every integer field fits in 64 bits); both ways make equal entries. What this
module reads of those entries is :class:`RawEntry`, so it does not import the parser.
"""

from __future__ import annotations

import bisect
import threading
from array import array
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any, Protocol

from coldstart.format.toc import MODE_PERM_MASK, Chunk, Entry, Stat

__all__ = ["RawEntry", "TOCColumns"]

#: what a directory the parser synthesized (a missing parent) shows
_SYNTH_DIR = Stat("dir", 0o755, 0, 0, 0, 0, "", 0, 0)


class RawEntry(Protocol):
    """The fields of a TOC entry's typed JSON object that the columns are made from, named as
    in the JSON (the fast parser's decoded entries, checked: integers fit in 64 bits, digests
    are None, "" or ``sha256:`` digests)."""

    @property
    def size(self) -> int: ...
    @property
    def modtime(self) -> str: ...
    @property
    def mode(self) -> int: ...
    @property
    def uid(self) -> int: ...
    @property
    def gid(self) -> int: ...
    @property
    def linkName(self) -> str: ...
    @property
    def devMajor(self) -> int: ...
    @property
    def devMinor(self) -> int: ...
    @property
    def digest(self) -> str | None: ...
    @property
    def offset(self) -> int: ...
    @property
    def endOffset(self) -> int: ...
    @property
    def chunkDigest(self) -> str | None: ...
    @property
    def chunkType(self) -> str: ...
    @property
    def innerOffset(self) -> int: ...


_ZERO_HEX = "0" * 64


def _ints(values: list[int]) -> array[int]:
    """A column in the smallest array type that holds ``values`` (checked: 64 bits do)."""
    if not values:
        return array("B")
    lo, hi = min(values), max(values)
    if lo < 0:
        return array("q", values)
    for code in ("B", "H", "I"):
        if hi < 1 << (8 * array(code).itemsize):
            return array(code, values)
    return array("q", values)


def _shared(values: list[str]) -> list[str]:
    """``values`` with equal strings made one object (the decoder makes one per occurrence)."""
    seen: dict[str, str] = {}
    return [seen.setdefault(v, v) for v in values]


def _digests(values: list[str | None]) -> tuple[bytes, bytes]:
    """(32 raw bytes per item, a byte per item: 1 where it has a digest). Items are None, ""
    or checked ``sha256:`` digests."""
    raw = bytes.fromhex("".join([v[7:] if v else _ZERO_HEX for v in values]))
    return raw, bytes(map(bool, values))


class TOCColumns:
    """The entries of a TOC (by position); :meth:`entry` makes one.

    ``raws``: the typed JSON objects of the entries (not chunk continuations), ``types``
    their types; ``len(raws)`` of them, followed by ``len(names) - len(raws)`` synthesized
    directories. ``links``: hardlinks' normalized targets; ``chunks``: the chunks of files with
    chunk entries; ``starts``: the sorted blob offsets of all chunks (eStargz gives no end).
    """

    __slots__ = ("_chunk_digest", "_chunks", "_data_end", "_dev", "_digest", "_end",
                 "_exact_frames", "_gid", "_gnames", "_has_chunk_digest", "_has_digest",
                 "_inner", "_links", "_lock", "_m", "_make", "_mode", "_mtime", "_mtimes",
                 "_names", "_offset", "_raws", "_size", "_starts", "_types", "_uid", "_unames",
                 "_xattrs", "_zeros")

    def __init__(self, raws: Sequence[RawEntry], names: list[str], types: list[str], *,
                 mtimes: dict[str, int], unames: list[str] | None, gnames: list[str] | None,
                 links: dict[int, str], xattrs: dict[int, dict[str, bytes]],
                 chunks: dict[int, list[Chunk]], starts: list[int], data_end: int,
                 exact_frames: bool) -> None:
        self._m = len(raws)
        self._raws: Sequence[RawEntry] | None = raws
        self._names = names
        self._types = types
        self._mtimes = mtimes
        self._unames = unames
        self._gnames = gnames
        self._links = links
        self._xattrs = xattrs
        self._chunks = chunks
        self._starts: list[int] | array[int] = starts
        self._data_end = data_end
        self._exact_frames = exact_frames
        self._lock = threading.Lock()
        self._make: Callable[[int], Entry] = self._from_raw

    def entry(self, i: int) -> Entry:
        """The entry at position ``i``."""
        return self._make(i)

    def stat(self, i: int) -> Stat:
        """The :class:`~coldstart.format.toc.Stat` of the entry at position ``i`` (its
        fields as :meth:`entry` makes them), with no entry, chunk or digest made."""
        if i >= self._m:
            return _SYNTH_DIR
        raws = self._raws
        t = self._types[i]
        if raws is not None:
            r = raws[i]
            return Stat(t, r.mode & MODE_PERM_MASK, r.uid, r.gid, r.size if t == "reg" else 0,
                        self._mtimes[r.modtime], self._links.get(i, r.linkName), r.devMajor,
                        r.devMinor)
        major, minor = self._dev.get(i, (0, 0))
        return Stat(t, self._mode[i], self._uid[i], self._gid[i],
                    self._size[i] if t == "reg" else 0, self._mtime[i], self._links.get(i, ""),
                    major, minor)

    def _next_start(self, offset: int) -> int:
        """eStargz has no endOffset: a member ends where the next distinct member starts."""
        starts = self._starts
        j = bisect.bisect_right(starts, offset)
        return starts[j] if j < len(starts) else self._data_end

    def _from_raw(self, i: int) -> Entry:
        raws = self._raws
        if raws is None:                    # compacted meanwhile
            return self._from_columns(i)
        name = self._names[i]
        if i >= self._m:
            return Entry(name, "dir", 0, 0o755)
        r = raws[i]
        t = self._types[i]
        size = 0
        digest = None
        cs: list[Chunk] = []
        if t == "reg":
            size = r.size
            digest = r.digest
            multi = self._chunks.get(i)
            if multi is not None:
                cs = list(multi)
            elif size > 0:
                if r.chunkType == "zeros":
                    cs = [Chunk(0, 0, 0, size, r.chunkDigest or "", 0, True, False, name)]
                else:
                    off, end, inner = r.offset, r.endOffset, r.innerOffset
                    exact = self._exact_frames and end != 0 and inner == 0
                    # the parser checked the chunk digest is there
                    cs = [Chunk(off, end or self._next_start(off), 0, size,
                                r.chunkDigest or "", inner, False, exact, name)]
        x = self._xattrs.get(i)
        return Entry(
            name, t, size, r.mode & MODE_PERM_MASK, r.uid, r.gid,
            self._unames[i] if self._unames is not None else "",
            self._gnames[i] if self._gnames is not None else "",
            self._mtimes[r.modtime], self._links.get(i, r.linkName),
            r.devMajor, r.devMinor, dict(x) if x is not None else {}, digest, cs)

    def small_chunks(self, limit: int) -> list[tuple[int, int, int, int]]:
        """:meth:`~coldstart.format.toc.TOCEntries.small_chunks`, read from the decoder's
        objects or the columns, with no entry made."""
        raws = self._raws
        if raws is not None:
            sizes: Sequence[int] = [r.size for r in raws]
            offsets: Sequence[int] = [r.offset for r in raws]
            inners: Sequence[int] = [r.innerOffset for r in raws]
            zeros: Sequence[bool | int] = [r.chunkType == "zeros" for r in raws]
        else:                               # compacted: ``_fill`` made these before
            sizes, offsets, inners, zeros = self._size, self._offset, self._inner, self._zeros
        types, multi = self._types, self._chunks
        out = [(offsets[i], inners[i], i, 0) for i in range(self._m)
               if types[i] == "reg" and 0 < sizes[i] <= limit and not zeros[i]
               and i not in multi]
        for i, cs in multi.items():
            if sizes[i] <= limit:
                out += [(c.offset, c.inner_offset, i, k) for k, c in enumerate(cs) if not c.zeros]
        return out

    def compact(self) -> None:
        """Make the columns and let go of the decoder's objects (once; thread-safe)."""
        with self._lock:
            raws = self._raws
            if raws is None:
                return
            self._fill(raws)
            self._make = self._from_columns
            self._raws = None

    def _fill(self, raws: Sequence[RawEntry]) -> None:
        def column(key: str) -> list[Any]:
            return list(map(attrgetter(key), raws))

        self._size = _ints(column("size"))
        modes = column("mode")
        if modes and max(modes) > MODE_PERM_MASK:
            modes = [v & MODE_PERM_MASK for v in modes]
        self._mode = _ints(modes)
        self._uid = _ints(column("uid"))
        self._gid = _ints(column("gid"))
        # a list, not an array: Go's zero time is before 1678, past 64 bits of nanoseconds;
        # the list's items are the few distinct times' objects, shared
        self._mtime = list(map(self._mtimes.__getitem__, column("modtime")))
        if self._unames is not None:
            self._unames = _shared(self._unames)
        if self._gnames is not None:
            self._gnames = _shared(self._gnames)
        # sparse: link names (hardlinks' normalized ones are in ``links`` already) and the
        # device numbers of char and block devices; most layers have few or none (any() first)
        links = dict(self._links)
        link_names = column("linkName")
        if any(link_names):
            for i, link in enumerate(link_names):
                if link and i not in links:
                    links[i] = link
        majors, minors = column("devMajor"), column("devMinor")
        self._dev = {}
        if any(majors) or any(minors):
            self._dev = {i: dev for i, dev in enumerate(zip(majors, minors, strict=True))
                         if dev[0] or dev[1]}
        digests = column("digest")
        self._digest, self._has_digest = _digests(digests)
        # the one chunk of a single-chunk file (files with chunk entries are in ``chunks``)
        self._offset = _ints(column("offset"))
        self._end = _ints(column("endOffset"))
        self._inner = _ints(column("innerOffset"))
        self._zeros = bytes([t == "zeros" for t in column("chunkType")])
        # only where an entry has one chunk of its own: the parser checked no others
        multi, sizes = self._chunks, self._size
        chunk_digests = [d if t == "reg" and n > 0 and i not in multi else None
                         for i, (d, t, n) in enumerate(zip(column("chunkDigest"), self._types,
                                                           sizes, strict=False))]
        if chunk_digests == digests:    # a file of one chunk: the same digest (zstd:chunked)
            self._chunk_digest, self._has_chunk_digest = self._digest, self._has_digest
        else:
            self._chunk_digest, self._has_chunk_digest = _digests(chunk_digests)
        self._starts = _ints(list(self._starts))
        self._links = links

    def _hex(self, column: bytes, i: int) -> str:
        return "sha256:" + column[32 * i:32 * i + 32].hex()

    def _from_columns(self, i: int) -> Entry:
        name = self._names[i]
        if i >= self._m:
            return Entry(name, "dir", 0, 0o755)
        t = self._types[i]
        size = 0
        digest = None
        cs: list[Chunk] = []
        if t == "reg":
            size = self._size[i]
            digest = self._hex(self._digest, i) if self._has_digest[i] else None
            multi = self._chunks.get(i)
            if multi is not None:
                cs = list(multi)
            elif size > 0:
                cd = self._hex(self._chunk_digest, i) if self._has_chunk_digest[i] else ""
                if self._zeros[i]:
                    cs = [Chunk(0, 0, 0, size, cd, 0, True, False, name)]
                else:
                    off, end, inner = self._offset[i], self._end[i], self._inner[i]
                    cs = [Chunk(off, end or self._next_start(off), 0, size, cd, inner, False,
                                self._exact_frames and end != 0 and inner == 0, name)]
        major, minor = self._dev.get(i, (0, 0))
        x = self._xattrs.get(i)
        return Entry(
            name, t, size, self._mode[i], self._uid[i], self._gid[i],
            self._unames[i] if self._unames is not None else "",
            self._gnames[i] if self._gnames is not None else "",
            self._mtime[i], self._links.get(i, ""), major, minor,
            dict(x) if x is not None else {}, digest, cs)
