"""A parsed TOC kept as columns: one array per field instead of one object per entry.

A CUDA or PyTorch layer holds hundreds of thousands of files and a container start looks at a
few thousand of them. Keeping each TOC entry as the JSON decoder's dict (about a kilobyte with
its strings) made a 200,000-file layer cost the FUSE server some 300 MB; kept as columns
(integers in ``array``s of the smallest type that holds them, digests as 32 raw bytes, repeated
strings shared) it costs a fraction of that, and an :class:`~coldstart.format.toc.Entry` is
made from them on demand (:class:`~coldstart.format.toc.TOCEntries` keeps the recent ones).

Making the columns takes a few tenths of a second for 200,000 entries, which a mount should
not wait for: until :meth:`TOCColumns.compact` is called (the FUSE server does, in a thread,
once the layer is mounted), entries are made from the decoder's objects, as they always were.
Only the fast parser (:mod:`coldstart.format.tocjson`) builds these, from entries it has
checked (every integer field fits in 64 bits); both ways make equal entries.
"""

from __future__ import annotations

import bisect
import threading
from array import array
from collections.abc import Callable
from typing import Any

from coldstart.format.toc import MODE_PERM_MASK, Chunk, Entry

__all__ = ["TOCColumns"]

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

    ``raws``: the checked JSON objects of the entries (not chunk continuations), ``types``
    their types; ``len(raws)`` of them, followed by ``len(names) - len(raws)`` synthesized
    directories. ``cols``: columns of ``raws`` the parser read already (reused, not read
    again); ``links``: hardlinks' normalized targets; ``chunks``: the chunks of files with
    chunk entries; ``starts``: the sorted blob offsets of all chunks (eStargz gives no end).
    """

    __slots__ = ("_chunk_digest", "_chunks", "_cols", "_data_end", "_dev", "_digest", "_end",
                 "_exact_frames", "_gid", "_gnames", "_has_chunk_digest", "_has_digest",
                 "_inner", "_keys", "_links", "_lock", "_m", "_make", "_mode", "_mtime",
                 "_mtimes", "_names", "_offset", "_raws", "_size", "_starts", "_types", "_uid",
                 "_unames", "_xattrs", "_zero_time", "_zeros")

    def __init__(self, raws: list[dict[str, Any]], names: list[str], types: list[str], *,
                 keys: set[str], cols: dict[str, list[Any]], mtimes: dict[str, int],
                 zero_time: str, unames: list[str] | None, gnames: list[str] | None,
                 links: dict[int, str], xattrs: dict[int, dict[str, bytes]],
                 chunks: dict[int, list[Chunk]], starts: list[int], data_end: int,
                 exact_frames: bool) -> None:
        self._m = len(raws)
        self._raws: list[dict[str, Any]] | None = raws
        self._names = names
        self._types = types
        self._keys = keys
        self._cols = cols
        self._mtimes = mtimes
        self._zero_time = zero_time
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
        get = r.get
        size = 0
        digest = None
        cs: list[Chunk] = []
        if t == "reg":
            size = get("size", 0)
            digest = get("digest")
            multi = self._chunks.get(i)
            if multi is not None:
                cs = list(multi)
            elif size > 0:
                if get("chunkType") == "zeros":
                    cs = [Chunk(0, 0, 0, size, get("chunkDigest") or "", 0, True, False, name)]
                else:
                    off = get("offset", 0)
                    end = get("endOffset", 0)
                    inner = get("innerOffset", 0)
                    cs = [Chunk(off, end or self._next_start(off), 0, size, r["chunkDigest"],
                                inner, False, self._exact_frames and end != 0 and inner == 0,
                                name)]
        x = self._xattrs.get(i)
        return Entry(
            name, t, size, get("mode", 0) & MODE_PERM_MASK, get("uid", 0), get("gid", 0),
            self._unames[i] if self._unames is not None else "",
            self._gnames[i] if self._gnames is not None else "",
            self._mtimes[get("modtime", self._zero_time)],
            self._links[i] if i in self._links else get("linkName", ""), get("devMajor", 0),
            get("devMinor", 0), dict(x) if x is not None else {}, digest, cs)

    def compact(self) -> None:
        """Make the columns and let go of the decoder's objects (once; thread-safe)."""
        with self._lock:
            raws = self._raws
            if raws is None:
                return
            self._fill(raws)
            self._make = self._from_columns
            self._raws = None
            self._cols = {}

    def _fill(self, raws: list[dict[str, Any]]) -> None:
        keys, cols, m = self._keys, self._cols, self._m

        def column(key: str, default: Any = 0) -> list[Any]:
            got = cols.get(key)
            return got if got is not None else [r.get(key, default) for r in raws]

        def ints(key: str) -> array[int]:
            # a key no entry has: all zeros, with no pass over the entries
            return _ints(column(key)) if key in keys else array("B", bytes(m))

        self._size = ints("size")
        self._mode = (_ints([v & MODE_PERM_MASK for v in column("mode")]) if "mode" in keys
                      else array("B", bytes(m)))
        self._uid = ints("uid")
        self._gid = ints("gid")
        # a list, not an array: Go's zero time is before 1678, past 64 bits of nanoseconds;
        # the list's items are the few distinct times' objects, shared
        self._mtime = list(map(self._mtimes.__getitem__, column("modtime", self._zero_time)))
        if self._unames is not None:
            self._unames = _shared(self._unames)
        if self._gnames is not None:
            self._gnames = _shared(self._gnames)
        # sparse: link names (hardlinks' normalized ones are in ``links`` already) and the
        # device numbers of char and block devices
        links = dict(self._links)
        if "linkName" in keys:
            for i, link in enumerate(column("linkName", "")):
                if link and i not in links:
                    links[i] = link
        self._dev = {}
        if "devMajor" in keys or "devMinor" in keys:
            self._dev = {i: (r.get("devMajor", 0), r.get("devMinor", 0))
                         for i, r in enumerate(raws) if "devMajor" in r or "devMinor" in r}
        digests = column("digest", None) if "digest" in keys else [None] * m
        self._digest, self._has_digest = _digests(digests)
        # the one chunk of a single-chunk file (files with chunk entries are in ``chunks``)
        self._offset = ints("offset")
        self._end = ints("endOffset")
        self._inner = ints("innerOffset")
        self._zeros = bytes(m)
        if "chunkType" in keys:
            self._zeros = bytes([t == "zeros" for t in column("chunkType", "")])
        # only where an entry has one chunk of its own: the parser checked no others
        multi, sizes = self._chunks, self._size
        chunk_digests: list[str | None] = [None] * m
        if "chunkDigest" in keys:
            chunk_digests = [d if t == "reg" and n > 0 and i not in multi else None
                             for i, (d, t, n) in enumerate(zip(column("chunkDigest", None),
                                                               self._types, sizes, strict=False))]
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
