"""The table of contents of a seekable layer, independent of its compression.

Both eStargz and zstd:chunked describe a layer with the same JSON entries; this module holds the
model every other part of coldstart reads (the snapshotter's FUSE layer answers lookup, getattr
and readdir from it) and the rules that make a TOC from an untrusted blob safe to use: names are
normalized and may not escape the layer, parents are synthesized, duplicates are refused.
"""

from __future__ import annotations

import bisect
import posixpath
import threading
from array import array
from collections.abc import Callable, ItemsView, Iterator, Mapping, ValuesView
from dataclasses import dataclass, field
from typing import NamedTuple

from coldstart.errors import FormatError

__all__ = [
    "ENTRY_TYPES",
    "NO_PREFETCH_LANDMARK",
    "OPAQUE_WHITEOUT",
    "PREFETCH_LANDMARK",
    "TOC",
    "WHITEOUT_PREFIX",
    "Chunk",
    "Entry",
    "Stat",
    "TOCEntries",
    "normalize_name",
]

ENTRY_TYPES = frozenset({"dir", "reg", "symlink", "hardlink", "char", "block", "fifo"})
#: a layer's whiteouts (OCI image spec): ``.wh.NAME`` removes NAME of the layers below;
#: ``.wh..wh..opq`` hides everything below in its directory
WHITEOUT_PREFIX = ".wh."
OPAQUE_WHITEOUT = ".wh..wh..opq"
PREFETCH_LANDMARK = ".prefetch.landmark"
NO_PREFETCH_LANDMARK = ".no.prefetch.landmark"
#: Permission bits kept in ``Entry.mode`` (rwx for all, plus suid, sgid, sticky).
MODE_PERM_MASK = 0o7777
#: Entries a :class:`TOCEntries` keeps once made (each is about half a kilobyte).
KEEP_ENTRIES = 4096


@dataclass(frozen=True, slots=True)
class Chunk:
    """One independently decompressible piece of a regular file.

    ``blob[offset:end_offset]`` is a gzip member or zstd frame; decompressing it and taking
    ``[inner_offset, inner_offset + chunk_size)`` gives the file's bytes at ``chunk_offset``.
    """

    offset: int
    end_offset: int
    chunk_offset: int
    chunk_size: int
    digest: str
    inner_offset: int = 0
    zeros: bool = False
    #: True when the member/frame holds nothing but this chunk's bytes (our writer and
    #: containers/storage write such frames): decompressing more than the chunk is then an error.
    exact: bool = False
    #: The entry the chunk belongs to (for messages; not part of the chunk's identity).
    owner: str = field(default="", compare=False, repr=False)

    @property
    def compressed_size(self) -> int:
        """Bytes to fetch for this chunk (0 for a hole)."""
        return 0 if self.zeros else self.end_offset - self.offset


@dataclass(slots=True)
class Entry:
    """One file system object of the layer (a whiteout is an ordinary entry named ``.wh.*``)."""

    name: str
    type: str
    size: int = 0
    mode: int = 0
    uid: int = 0
    gid: int = 0
    uname: str = ""
    gname: str = ""
    mtime_ns: int = 0
    link_name: str = ""
    dev_major: int = 0
    dev_minor: int = 0
    xattrs: dict[str, bytes] = field(default_factory=dict)
    digest: str | None = None
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def basename(self) -> str:
        """The last path component ("" for the root)."""
        return self.name.rpartition("/")[2]

    @property
    def parent(self) -> str:
        """The parent directory's name ("" for top-level entries and the root)."""
        return self.name.rpartition("/")[0]


class Stat(NamedTuple):
    """What a file system shows of an entry without its contents: the fields of
    :class:`Entry` that ``stat`` and a directory listing need (no chunks, digests, names or
    extended attributes). ``size`` is a regular file's (0 for every other type), as in
    :class:`Entry`."""

    type: str
    mode: int
    uid: int
    gid: int
    size: int
    mtime_ns: int
    link_name: str
    dev_major: int
    dev_minor: int

    @classmethod
    def of(cls, e: Entry) -> Stat:
        return cls(e.type, e.mode, e.uid, e.gid, e.size, e.mtime_ns, e.link_name, e.dev_major,
                   e.dev_minor)


def normalize_name(raw: str, *, what: str = "entry") -> str:
    """Normalize a path from a tar header or TOC; refuse one that could escape the layer.

    ``./a/b/``, ``a//b`` and ``a/./b`` become ``a/b``; ``.``, ``./`` and ``""`` are the root
    (``""``). Absolute paths, ``..`` components and NUL bytes raise FormatError.

    >>> normalize_name("./usr/bin/")
    'usr/bin'
    """
    if "\x00" in raw:
        raise FormatError(f"{what} name {raw!r} contains a NUL byte")
    if raw.startswith("/"):
        raise FormatError(f"{what} name {raw!r} is absolute")
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise FormatError(f"{what} name {raw!r} contains '..'")
    return "/".join(parts)


class TOCEntries(Mapping[str, Entry]):
    """The entries of a TOC by name: a read-only mapping that builds each :class:`Entry` the
    first time it is asked for.

    A layer can hold hundreds of thousands of files and a container start looks up a few
    thousand: the TOC keeps its names (in layer order, then the synthesized parents) and one
    builder per position, and makes an Entry (with its chunks) only on ``[]``, ``get`` or
    ``values()``. Every entry was validated when the TOC was parsed; building one cannot fail.
    The last ``keep`` entries made are kept (so memory stays bounded however many are read:
    a ``find`` over the layer makes them all); entries given already built are all kept.
    Thread-safe: two threads asking at once get the same object.

    >>> es = TOCEntries(["", "a"], lambda i: Entry(name=["", "a"][i], type="dir"))
    >>> "a" in es, es["a"].type, len(es)
    (True, 'dir', 2)
    """

    __slots__ = ("_any_xattrs", "_built", "_compact", "_compact_lock", "_index", "_keep",
                 "_lock", "_made", "_make", "_order", "_small_chunks", "_sorted", "_stat",
                 "names", "types")

    def __init__(self, names: list[str], make: Callable[[int], Entry],
                 types: list[str] | None = None, *, index: dict[str, int] | None = None,
                 built: list[Entry | None] | None = None, keep: int = KEEP_ENTRIES,
                 compact: Callable[[], None] | None = None,
                 small_chunks: Callable[[int], list[tuple[int, int, int, int]]] | None = None,
                 any_xattrs: bool | None = None,
                 stat: Callable[[int], Stat] | None = None) -> None:
        #: every name, by position (the inode order of the FUSE layer)
        self.names = names
        self._index: dict[str, int] | None = (
            index if index is not None else {n: i for i, n in enumerate(names)})
        # after compact(): the names sorted, and each one's position
        self._sorted: list[str] = []
        self._order: array[int] = array("q")
        self._compact = compact
        self._small_chunks = small_chunks
        self._any_xattrs = any_xattrs
        self._stat = stat
        self._compact_lock = threading.Lock()
        self._make = make
        self._built = built
        self._made: dict[int, Entry] = {}
        self._keep = keep
        self._lock = threading.Lock()
        #: each position's entry type, known without building the entry
        self.types: list[str] = types if types is not None else [self.at(i).type
                                                                  for i in range(len(names))]

    @classmethod
    def of(cls, entries: dict[str, Entry]) -> TOCEntries:
        """Wrap entries built already (a TOC made from Entry objects)."""
        names = list(entries)
        built: list[Entry | None] = list(entries.values())
        return cls(names, built.__getitem__,  # type: ignore[arg-type]
                   [e.type for e in entries.values()], built=built)

    def position(self, name: str) -> int | None:
        """The position of ``name`` (an index into :attr:`names`), or None."""
        index = self._index
        if index is not None:
            return index.get(name)
        srt = self._sorted
        j = bisect.bisect_left(srt, name)
        return self._order[j] if j < len(srt) and srt[j] == name else None

    def compact(self) -> None:
        """Trade speed the mount needed for memory the node keeps: the builder's compact form
        (:class:`~coldstart.format.toccolumns.TOCColumns`), and a sorted name index in place of
        the dict (two pointers' worth per name instead of about ten). Once; thread-safe;
        a few tenths of a second for 200,000 entries."""
        with self._compact_lock:
            index = self._index
            if index is None:
                return
            if self._compact is not None:
                self._compact()
            srt = sorted(index)
            self._order = array("q", map(index.__getitem__, srt))
            self._sorted = srt
            self._index = None

    def small_chunks(self, limit: int) -> list[tuple[int, int, int, int]]:
        """(blob offset, inner offset, position, chunk number) of each chunk that is not a hole
        of each regular file of at most ``limit`` bytes, in no order. The builder's own
        (``small_chunks``) reads its columns without making the entries."""
        if self._small_chunks is not None:
            return self._small_chunks(limit)
        return [(c.offset, c.inner_offset, p, k) for p, e in enumerate(self.values())
                if e.type == "reg" and e.size <= limit
                for k, c in enumerate(e.chunks) if not c.zeros]

    def any_xattrs(self) -> bool:
        """Whether some entry has extended attributes (the builder may know it without making
        the entries: ``any_xattrs``)."""
        if self._any_xattrs is None:
            self._any_xattrs = any(e.xattrs for e in self.values())
        return self._any_xattrs

    def stat(self, i: int) -> Stat:
        """What a listing shows of the entry at position ``i``, read from the builder's
        columns where it has them (``stat``), without making the entry: a ``find`` over a
        200,000-file layer lists every entry once and reads no file."""
        e = self._made.get(i) if self._built is None else self._built[i]
        if e is None and self._stat is not None:
            if not 0 <= i < len(self.names):
                raise IndexError(i)
            return self._stat(i)
        return Stat.of(e if e is not None else self.at(i))

    def made(self, i: int) -> Entry:
        """The entry at position ``i``, made afresh and not kept (one kept already is given
        as it is): a pass over every entry (the background fill's plan) leaves the entries
        the file system asked for in the cache."""
        if self._built is not None:
            return self._built[i]  # type: ignore[return-value]
        e = self._made.get(i)
        return e if e is not None else self._fresh(i)

    def _fresh(self, i: int) -> Entry:
        if not 0 <= i < len(self.names):
            raise IndexError(i)
        return self._make(i)

    def at(self, i: int) -> Entry:
        """The entry at position ``i``."""
        if self._built is not None:
            return self._built[i]  # type: ignore[return-value]
        e = self._made.get(i)
        if e is None:
            made = self._fresh(i)
            with self._lock:
                e = self._made.get(i)
                if e is None:
                    if len(self._made) >= self._keep:
                        self._made.clear()  # start again: a cheap, bounded cache
                    e = self._made[i] = made
        return e

    def __getitem__(self, name: str) -> Entry:
        i = self.position(name)
        if i is None:
            raise KeyError(name)
        return self.at(i)

    def get(self, name: str, default: Entry | None = None) -> Entry | None:  # type: ignore[override]
        i = self.position(name)
        return default if i is None else self.at(i)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.position(name) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def values(self) -> ValuesView[Entry]:
        return _Values(self)

    def items(self) -> ItemsView[str, Entry]:
        return _Items(self)


class _Values(ValuesView[Entry]):
    _mapping: TOCEntries

    def __iter__(self) -> Iterator[Entry]:
        at = self._mapping.at
        return (at(i) for i in range(len(self._mapping)))


class _Items(ItemsView[str, Entry]):
    _mapping: TOCEntries

    def __iter__(self) -> Iterator[tuple[str, Entry]]:
        m = self._mapping
        return ((n, m.at(i)) for i, n in enumerate(m.names))


class TOC:
    """A validated table of contents: entries by normalized name, with every parent present.

    Build one with :meth:`TOC.build`, which refuses duplicates and synthesizes missing parent
    directories (mode 0o755, owned by root), including the root ``""``. ``entries`` is a
    :class:`TOCEntries` (a mapping that builds entries on first use).
    """

    __slots__ = ("_children", "_total_size", "entries", "format", "order", "prefetch")

    def __init__(self, format: str, entries: dict[str, Entry] | TOCEntries, order: list[str],
                 prefetch: list[str], *, total_size: int | None = None) -> None:
        self.format = format
        self.entries = entries if isinstance(entries, TOCEntries) else TOCEntries.of(entries)
        #: Names in the order the layer stores them (synthesized parents excluded).
        self.order = order
        self.prefetch = prefetch
        self._children: dict[str, list[str]] | None = None
        self._total_size = total_size

    @property
    def total_size(self) -> int:
        """Bytes of all regular files."""
        if self._total_size is None:
            self._total_size = sum(e.size for e in self.entries.values() if e.type == "reg")
        return self._total_size

    @classmethod
    def build(cls, format: str, entries: list[Entry]) -> TOC:
        """Index ``entries`` (in layer order) and synthesize the missing directories.

        Raises FormatError for a duplicate name, a name whose parent is not a directory, or
        an unknown entry type. ``prefetch`` is every name before the prefetch landmark.
        """
        by_name: dict[str, Entry] = {}
        order: list[str] = []
        prefetch: list[str] = []
        landmark_seen = False
        for e in entries:
            if e.type not in ENTRY_TYPES:
                raise FormatError(f"entry {e.name!r}: unknown type {e.type!r}")
            if e.name in by_name:
                prev = by_name[e.name]
                # The root directory may appear explicitly once after being implied; any
                # other repeat is a layer that says two different things about one path.
                raise FormatError(
                    f"entry {e.name!r} appears twice (as {prev.type} and as {e.type})"
                )
            if e.name == "" and e.type != "dir":
                raise FormatError(f"root entry has type {e.type!r}, not dir")
            by_name[e.name] = e
            order.append(e.name)
            if e.name == PREFETCH_LANDMARK:
                landmark_seen = True
            elif not landmark_seen:
                prefetch.append(e.name)
        if not landmark_seen:
            prefetch = []
        for name in list(by_name):
            parent = by_name[name].parent if name else None
            while parent is not None:
                p = by_name.get(parent)
                if p is None:
                    by_name[parent] = Entry(name=parent, type="dir", mode=0o755)
                elif p.type != "dir":
                    raise FormatError(f"entry {name!r}: parent {parent!r} is a {p.type}, not a dir")
                else:
                    break
                parent = posixpath.dirname(parent) if parent else None
        if "" not in by_name:
            by_name[""] = Entry(name="", type="dir", mode=0o755)
        return cls(format, by_name, order, prefetch)

    def children(self, name: str) -> list[str]:
        """Full names of the direct children of directory ``name``, sorted."""
        if self._children is None:
            children: dict[str, list[str]] = {}
            for n in self.entries.names:
                if n:
                    children.setdefault(n.rpartition("/")[0], []).append(n)
            for names in children.values():
                names.sort()
            self._children = children
        return list(self._children.get(name, ()))

    def get(self, name: str) -> Entry | None:
        """The entry called ``name`` (normalized), or None."""
        return self.entries.get(name)

    def compact(self) -> None:
        """Keep the entries in their compact form from now on (:meth:`TOCEntries.compact`):
        for a TOC that lives long, as a mounted layer's does."""
        self.entries.compact()

    def __len__(self) -> int:
        return len(self.entries)
