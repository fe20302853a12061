"""A layer's TOC as an inode tree: what the FUSE file system shows of one layer.

:class:`LayerTree` is the inode table of one mounted layer, built lazily from its verified TOC
(:class:`~coldstart.format.toc.TOCEntries`), and the answers worked out from it: a directory's
children, link count and sorted listing, an inode's extended attributes (and the attributes the
file system made, :attr:`LayerTree.attrs`), each kept up to ``KEEP_ANSWERS`` items so a walk of a
layer of hundreds of thousands of files keeps the server's memory bounded. Whiteouts are shown
the way overlayfs expects in a lower directory: ``.wh.<name>`` is a 0/0 character device
``<name>``, ``.wh..wh..opq`` sets ``trusted.overlay.opaque=y`` on its directory; both ``.wh.``
entries and the prefetch landmarks are hidden, and hardlinks show their target.

No FUSE here but the protocol's types: :class:`~coldstart.lazyfs.fusefs.FuseFS` holds a tree
per served layer and answers the kernel's requests from it; the tree holds the layer's
:class:`~coldstart.lazyfs.reader.LayerReader` for the file contents. The tree also says whether
the layer shows any extended attribute (:meth:`LayerTree.shows_xattrs`): a layer that shows none
is served from the connection that answers no getxattr (:attr:`LayerTree.plain`).
"""

from __future__ import annotations

import logging
import os
import threading
from array import array
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from coldstart.errors import ColdstartError
from coldstart.format.toc import (
    NO_PREFETCH_LANDMARK,
    OPAQUE_WHITEOUT,
    PREFETCH_LANDMARK,
    WHITEOUT_PREFIX,
    Entry,
    Stat,
)
from coldstart.lazyfs.filewire import FILE_XATTR, NODE_XATTR, TOKEN_SUFFIXES
from coldstart.lazyfs.fusewire import ROOT_INODE, Attr
from coldstart.lazyfs.reader import LayerReader

__all__ = ["KEEP_ANSWERS", "LayerTree", "build_tree"]

log = logging.getLogger(__name__)

_WHITEOUT = WHITEOUT_PREFIX
_OPAQUE = OPAQUE_WHITEOUT
_OPAQUE_XATTR = b"trusted.overlay.opaque"
_TOKEN_XATTRS = (FILE_XATTR.encode(), NODE_XATTR.encode())
_HIDDEN = {PREFETCH_LANDMARK, NO_PREFETCH_LANDMARK}
#: What a layer keeps of the answers it worked out (attributes, directory children and
#: listings, xattrs): this many items each, then it starts again. The kernel caches what it
#: was told for as long as the timeouts say; these bound the server's memory when something
#: walks a layer of hundreds of thousands of files.
KEEP_ANSWERS = 8192

_V = TypeVar("_V")


class LayerTree:
    """The inode table of one mounted layer (inodes ``base .. base+len-1``), built lazily.

    Inode ``base`` is the layer's root; inode ``base + 1 + p`` is the TOC entry at position
    ``p`` (:class:`~coldstart.format.toc.TOCEntries`), so numbering needs no pass over the
    entries. A directory's children (and its link count, and its sorted listing) are worked
    out the first time it is looked up; the index of names by parent that this needs is built
    on the first such lookup, not at mount. Only whiteouts and hardlinks, which change what
    other names show, are found when the tree is made (two scans of the names, in C).
    Slots that show nothing (whiteout markers, opaque markers, landmarks, hardlinks, the
    root's own TOC position) are never returned by lookup or readdir.

    ``entries``, ``children``, ``listing``, ``xattrs``, ``nlink`` and ``parents`` index by
    slot or inode like the lists and dicts they once were. What is worked out is kept up to
    :data:`KEEP_ANSWERS` items each (:meth:`remember`), so memory stays bounded.
    """

    def __init__(self, key: str, base: int, reader: LayerReader) -> None:
        self.key = key
        self.base = base
        self.reader = reader
        self.toc = reader.layer.toc
        self.attrs: dict[int, Attr] = {}
        toc_entries = self.toc.entries
        self._names = toc_entries.names
        self._types = toc_entries.types
        self._size = len(self._names) + 1
        root = toc_entries.position("")
        self._hidden: set[int] = set() if root is None else {root + 1}
        #: whiteout marker slot -> the name it hides (shown as a 0/0 char device)
        self._whiteouts: dict[int, str] = {}
        self._opaque: set[str] = set()
        #: hardlink slot -> its target's slot
        self._links: dict[int, int] = {}
        self._extra_links: dict[int, int] = {}
        self._synth: dict[int, Entry] = {}
        self._kids_by_parent: dict[str, array[int]] | None = None
        self._kids: dict[int, dict[bytes, int]] = {}
        self._kids_held = 0
        self._nlink: dict[int, int] = {}
        self._listing: dict[int, list[tuple[bytes, int]]] = {}
        self._xattrs: dict[int, dict[bytes, bytes]] = {}
        self._lock = threading.Lock()
        #: served from the connection that answers no extended attributes (set before
        #: :meth:`~coldstart.lazyfs.fusefs.FuseFS.add`; see :meth:`shows_xattrs`)
        self.plain = False
        self._scan(reader)
        self.entries = _Slots(self)
        self.children = _Children(self)
        self.listing = _ByInode(self, self.listing_of)
        self.xattrs = _ByInode(self, self.xattrs_of)
        self.nlink = _BySlot(self.nlink_of)
        self.parents = _BySlot(self.parent_of)

    def _scan(self, reader: LayerReader) -> None:
        names = self._names
        index = self.toc.entries
        for p in [p for p, n in enumerate(names) if _WHITEOUT in n]:
            parent, _, bn = names[p].rpartition("/")
            if bn == _OPAQUE:
                self._opaque.add(parent)
                self._hidden.add(p + 1)
            elif bn.startswith(_WHITEOUT):
                real = (parent + "/" if parent else "") + bn[len(_WHITEOUT):]
                if real in index or not bn[len(_WHITEOUT):]:
                    self._hidden.add(p + 1)  # the layer deletes and adds the name: it stays
                else:
                    self._whiteouts[p + 1] = real
        for name in _HIDDEN:
            pos = index.position(name)
            if pos is not None:
                self._hidden.add(pos + 1)
        if "hardlink" in self._types:
            for p in [p for p, t in enumerate(self._types) if t == "hardlink"]:
                self._hidden.add(p + 1)
                try:
                    target = reader.layer.resolve(names[p])
                except ColdstartError as exc:
                    log.warning("layer %s: hardlink %r skipped: %s", reader.digest, names[p],
                                exc)
                    continue
                slot = self._slot(target.name)
                if slot is None or slot in self._hidden or slot in self._whiteouts:
                    continue
                self._links[p + 1] = slot
                self._extra_links[slot] = self._extra_links.get(slot, 0) + 1

    def shows_xattrs(self) -> bool:
        """Whether some inode of the layer answers an extended attribute: one in the TOC, an
        opaque directory's ``trusted.overlay.opaque``, or the token of a file a loader reads
        through the node (:data:`~coldstart.lazyfs.filewire.TOKEN_SUFFIXES`). A layer that
        shows none can be served where getxattr is not answered at all."""
        return (bool(self._opaque) or self.toc.entries.any_xattrs()
                or any(n.endswith(TOKEN_SUFFIXES) for n in self._names))

    # -- slots -----------------------------------------------------------------------------

    @property
    def root(self) -> int:
        return self.base

    @property
    def end(self) -> int:
        return self.base + self._size

    @property
    def total_size(self) -> int:
        return self.toc.total_size

    def _slot(self, name: str) -> int | None:
        if not name:
            return 0
        p = self.toc.entries.position(name)
        return None if p is None else p + 1

    def _type(self, slot: int) -> str:
        if slot == 0:
            return "dir"
        if slot in self._whiteouts:
            return "char"
        return self._types[slot - 1]

    def entry(self, slot: int) -> Entry:
        """The entry shown at ``slot`` (= inode - base)."""
        if slot == 0:
            return self.toc.entries.at(self.toc.entries.position("") or 0)
        if not 0 < slot < self._size:
            raise IndexError(slot)
        real = self._whiteouts.get(slot)
        if real is None:
            return self.toc.entries.at(slot - 1)
        e = self._synth.get(slot)
        if e is None:
            marker = self.toc.entries.at(slot - 1)
            e = self._synth[slot] = Entry(name=real, type="char", mode=0, uid=0, gid=0,
                                          mtime_ns=marker.mtime_ns, dev_major=0, dev_minor=0)
        return e

    def stat(self, slot: int) -> Stat:
        """What :meth:`entry` shows at ``slot``, read without making the entry (a listing
        asks it of every entry it shows)."""
        entries = self.toc.entries
        if slot == 0:
            return entries.stat(entries.position("") or 0)
        if not 0 < slot < self._size:
            raise IndexError(slot)
        if slot in self._whiteouts:
            return Stat("char", 0, 0, 0, 0, entries.stat(slot - 1).mtime_ns, "", 0, 0)
        return entries.stat(slot - 1)

    def _shown_name(self, slot: int) -> str:
        return self._whiteouts.get(slot) or (self._names[slot - 1] if slot else "")

    def parent_of(self, slot: int) -> int:
        """The parent directory's inode of ``slot`` (the root's: ROOT_INODE)."""
        if slot == 0:
            return ROOT_INODE
        p = self._slot(self._shown_name(slot).rpartition("/")[0])
        return ROOT_INODE if p is None else self.base + p

    def nlink_of(self, slot: int) -> int:
        if self._type(slot) == "dir":
            n = self._nlink.get(slot)
            if n is None:
                # counted, not built: readdir asks it of every subdirectory it lists, and
                # building their children would push the listed directory's out of the cache
                dirname = self._names[slot - 1] if slot else ""
                n = 2 + sum(1 for s in self._by_parent().get(dirname, ())
                            if s not in self._hidden and s not in self._whiteouts
                            and self._types[s - 1] == "dir")
                self._nlink[slot] = n
            return n
        return 1 + self._extra_links.get(slot, 0)

    # -- directories -----------------------------------------------------------------------

    def _by_parent(self) -> dict[str, array[int]]:
        kids = self._kids_by_parent
        if kids is None:
            with self._lock:
                kids = self._kids_by_parent
                if kids is None:
                    kids = {}
                    for p, n in enumerate(self._names, 1):
                        parent = n.rpartition("/")[0]
                        got = kids.get(parent)
                        if got is None:
                            kids[parent] = array("q", (p,))
                        else:
                            got.append(p)
                    self._kids_by_parent = kids
        return kids

    def kids(self, inode: int) -> dict[bytes, int] | None:
        """Name -> inode of the directory ``inode``'s entries; None if it is no directory."""
        slot = inode - self.base
        kids = self._kids.get(slot)
        if kids is not None:
            return kids
        if not 0 <= slot < self._size or self._type(slot) != "dir" or slot in self._hidden:
            return None
        dirname = self._names[slot - 1] if slot else ""
        kids = {}
        subdirs = 0
        top = not dirname
        for s in self._by_parent().get(dirname, ()):
            if s in self._hidden:
                target = self._links.get(s)
                if target is None:
                    continue
                kids[os.fsencode(self._names[s - 1].rpartition("/")[2])] = self.base + target
                continue
            real = self._whiteouts.get(s)
            bn = (real or self._names[s - 1]).rpartition("/")[2]
            if top and bn in _HIDDEN:
                continue
            kids[os.fsencode(bn)] = self.base + s
            if real is None and self._types[s - 1] == "dir":
                subdirs += 1
        self._nlink[slot] = 2 + subdirs
        self._kids_held += len(kids)
        if self._kids_held > KEEP_ANSWERS:
            self._kids.clear()
            self._listing.clear()
            self._kids_held = len(kids)
        self._kids[slot] = kids
        return kids

    def listing_of(self, inode: int) -> list[tuple[bytes, int]]:
        """The directory's (name, inode) pairs, sorted by name ([] if it is no directory)."""
        got = self._listing.get(inode)
        if got is None:
            got = self._listing[inode] = sorted((self.kids(inode) or {}).items())
        return got

    @staticmethod
    def remember(cache: dict[int, _V], key: int, value: _V) -> _V:
        """``cache[key] = value``, emptying ``cache`` first when it holds KEEP_ANSWERS."""
        if len(cache) >= KEEP_ANSWERS:
            cache.clear()
        cache[key] = value
        return value

    def xattrs_of(self, inode: int) -> dict[bytes, bytes]:
        got = self._xattrs.get(inode)
        if got is None:
            slot = inode - self.base
            e = self.entry(slot)
            # a layer's own attribute of a token's name is never shown: copies (overlayfs'
            # copy-up) would carry it, and the token is ours alone to answer
            got = {k: v for k, v in ((os.fsencode(k), v) for k, v in e.xattrs.items())
                   if k not in _TOKEN_XATTRS}
            if self._type(slot) == "dir" and self._shown_name(slot) in self._opaque:
                got[_OPAQUE_XATTR] = b"y"
            self.remember(self._xattrs, inode, got)
        return got


class _Slots:
    """``tree.entries[slot]``: the entry shown at a slot."""

    def __init__(self, tree: LayerTree) -> None:
        self._tree = tree

    def __getitem__(self, slot: int) -> Entry:
        return self._tree.entry(slot)

    def __len__(self) -> int:
        return self._tree.end - self._tree.base


class _BySlot:
    def __init__(self, get: Callable[[int], int]) -> None:
        self._get = get

    def __getitem__(self, slot: int) -> int:
        return self._get(slot)


class _ByInode(Generic[_V]):
    def __init__(self, tree: LayerTree, get: Callable[[int], _V]) -> None:
        self._tree = tree
        self._get = get

    def __getitem__(self, inode: int) -> _V:
        return self._get(inode)

    def get(self, inode: int, default: _V) -> _V:
        return self._get(inode)


class _Children:
    """``tree.children[inode]``: a directory's name -> inode (KeyError: not a directory)."""

    def __init__(self, tree: LayerTree) -> None:
        self._tree = tree

    def get(self, inode: int) -> dict[bytes, int] | None:
        return self._tree.kids(inode)

    def __getitem__(self, inode: int) -> dict[bytes, int]:
        kids = self._tree.kids(inode)
        if kids is None:
            raise KeyError(inode)
        return kids

    def __contains__(self, inode: object) -> bool:
        return isinstance(inode, int) and self._tree.kids(inode) is not None

    def values(self) -> Iterator[dict[bytes, int]]:
        """Every directory's children (builds them all: for tests and tools)."""
        t = self._tree
        for ino in range(t.base, t.end):
            kids = t.kids(ino)
            if kids is not None:
                yield kids


def build_tree(key: str, base: int, reader: LayerReader) -> LayerTree:
    """The inode table of a layer's TOC (lazy: see :class:`LayerTree`)."""
    return LayerTree(key, base, reader)
