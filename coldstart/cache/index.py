"""The chunk cache's in-memory index: which chunks are local, where, and in what LRU order.

One :class:`CacheIndex` is shared by the cache's two stores (loose files, packs); its tables
are guarded by one lock (``lock``), held only for dictionary work, never across I/O. The
methods named ``*_locked`` expect the caller to hold it; the others take it themselves.

Size limit: ``total`` counts big-chunk files and whole pack files (headers and dead records
included). Eviction is least-recently-used over units: a big chunk (its file is unlinked) or a
whole pack, as recent as its most recently read or appended record (the pack is deleted and
all its records leave the index; a pack's bytes are only freed as a whole). Packs holding no
indexed record (duplicates, removed chunks) go first. The pack being appended to is never
evicted by its own append, so the cache may exceed its limit by up to one pack
(``pack_bytes`` is at most ``max_bytes / 16``). :meth:`CacheIndex.evict` only chooses and
unindexes the victims; the cache unlinks their files, outside the lock.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from coldstart.cache.packfile import Pack, log

__all__ = ["PACK_KEY", "CacheIndex", "CacheStats"]

#: LRU key prefix of a pack (a big chunk's key is its hex digest)
PACK_KEY = "pack:"
# a hit re-stamps the file's mtime (for LRU order across restarts) at most this often
TOUCH_INTERVAL = 60.0
# pack descriptors kept open for reads; idle ones beyond this are closed
MAX_OPEN_PACKS = 256

#: what a start-up scan found: (mtime, file name, data offset, hex, size, pack or None)
Found = tuple[float, str, int, str, int, Pack | None]


@dataclass
class CacheStats:
    """Counters since this process opened the cache."""

    hits: int = 0
    misses: int = 0
    hit_bytes: int = 0
    put_bytes: int = 0
    puts: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    #: loose chunks hashed on a read (verify "first-read": once each per process; "always")
    verified: int = 0
    #: chunks found corrupt on a read (dropped; the read is a miss and refetches)
    corrupt: int = 0
    #: chunk writes that failed (a full disk: ENOSPC, EIO...); the chunk is not cached
    write_errors: int = 0


class CacheIndex:
    """The tables of one cache directory as this process knows them (see the module doc)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.lock = threading.Lock()
        self.stats = CacheStats()
        self.sizes: dict[str, int] = {}                  # hex -> size, every chunk
        # eviction units, least recently used first: a big chunk's hex, or PACK_KEY + name
        self.lru: OrderedDict[str, None] = OrderedDict()
        self.touched: dict[str, float] = {}              # big chunk -> last mtime stamp
        # big chunks whose file this process neither wrote nor has hashed yet (verify
        # "first-read": found at start or adopted from another process); never served
        # before a read re-hashes them
        self.unverified: set[str] = set()
        self.total = 0
        self.packed: dict[str, tuple[Pack, int]] = {}    # hex -> (pack, offset of the data)
        self.pack_hexes: dict[str, set[str]] = {}        # pack name -> its indexed digests
        self.packs: dict[str, Pack] = {}                 # name -> live (not deleted) pack
        self.open: OrderedDict[str, Pack] = OrderedDict()  # packs with an open fd, LRU
        self.wpack: Pack | None = None                   # the pack this process appends to

    def load(self, found: list[Found], packs: list[Pack], *, trust_files: bool = True) -> None:
        """Replace the tables by what a start-up scan found (oldest first; a chunk that is
        both a file and a pack record is indexed as the file). Unless ``trust_files``, the
        big chunks' files are marked :attr:`unverified` (pack records were hashed by the
        scan)."""
        in_files = {x[3] for x in found if x[5] is None}
        found = sorted(found, key=lambda x: (x[0], x[1], x[2]))
        with self.lock:
            self.sizes.clear()
            self.lru.clear()
            self.unverified.clear()
            self.total = 0
            for mtime, _, off, hexd, size, owner in found:
                if owner is None:
                    self.sizes[hexd] = size
                    if not trust_files:
                        self.unverified.add(hexd)
                    self.lru[hexd] = None
                    self.touched[hexd] = mtime
                    self.total += size
                    continue
                self.lru[PACK_KEY + owner.name] = None   # where its first record sorts
                if hexd not in in_files and hexd not in self.sizes:
                    self.sizes[hexd] = size
                    self.packed[hexd] = (owner, off)
                    self.pack_hexes.setdefault(owner.name, set()).add(hexd)
            for pack in packs:      # (one holding no indexed chunk goes first when over)
                self.packs[pack.name] = pack
                self.total += pack.bytes
                self.lru.setdefault(PACK_KEY + pack.name)

    # -- entries -------------------------------------------------------------------------------

    def add_packed_locked(self, hexd: str, size: int, pack: Pack, off: int) -> bool:
        """Index a pack record (False if the chunk is indexed already)."""
        if hexd in self.sizes:
            return False
        self.sizes[hexd] = size
        self.packed[hexd] = (pack, off)
        self.pack_hexes.setdefault(pack.name, set()).add(hexd)
        return True

    def adopt(self, hexd: str, size: int, *, trusted: bool = True) -> None:
        """Index a big chunk whose file is in place (or mark it used if indexed); not
        ``trusted`` (another process wrote the file): :attr:`unverified` until a read
        hashes it."""
        with self.lock:
            if hexd not in self.sizes:
                self.sizes[hexd] = size
                self.lru[hexd] = None
                self.total += size
                if not trusted:
                    self.unverified.add(hexd)
            else:
                self.bump_locked(hexd)
            self.touched[hexd] = time.time()

    def bump_locked(self, hexd: str) -> None:
        """Mark an indexed chunk (its pack, if packed) most recently used."""
        ent = self.packed.get(hexd)
        key = hexd if ent is None else PACK_KEY + ent[0].name
        if key in self.lru:
            self.lru.move_to_end(key)

    def hit(self, hexd: str, size: int, nbytes: int) -> Pack | str | None:
        """Count a read of ``nbytes`` and make the chunk most recent; index a big chunk another
        process wrote since we started. Returns what to re-stamp (a pack, a big chunk's hex,
        at most once per ``TOUCH_INTERVAL``) or None."""
        now = time.time()
        with self.lock:
            self.stats.hits += 1
            self.stats.hit_bytes += nbytes
            ent = self.packed.get(hexd)
            if ent is not None:
                key = PACK_KEY + ent[0].name
                if key in self.lru:
                    self.lru.move_to_end(key)
                pack = ent[0]
                if now - pack.touched > TOUCH_INTERVAL:
                    pack.touched = now
                    return pack
                return None
            if hexd in self.sizes:
                if hexd in self.lru:
                    self.lru.move_to_end(hexd)
            else:  # written by another process since we started
                self.sizes[hexd] = size
                self.lru[hexd] = None
                self.total += size
            if now - self.touched.get(hexd, 0.0) > TOUCH_INTERVAL:
                self.touched[hexd] = now
                return hexd
            return None

    def forget(self, hexd: str) -> Pack | None:
        """Drop a chunk from the index. A packed chunk's bytes stay in its pack; a pack left
        with no indexed chunk (and not being appended to) is dropped and returned (for the
        caller to unlink)."""
        empty: Pack | None = None
        with self.lock:
            size = self.sizes.pop(hexd, None)
            self.touched.pop(hexd, None)
            self.unverified.discard(hexd)
            ent = self.packed.pop(hexd, None)
            if ent is not None:
                pack = ent[0]
                hexes = self.pack_hexes.get(pack.name)
                if hexes is not None:
                    hexes.discard(hexd)
                    if not hexes and pack is not self.wpack:
                        self.drop_pack_locked(pack)
                        empty = pack
            elif size is not None:
                self.total -= size
                self.lru.pop(hexd, None)
        return empty

    def forget_file(self, hexd: str) -> None:
        """A chunk's own file is missing: drop its index entry, unless it is a packed chunk.
        (A reader that found the chunk neither pending nor packed looks for its file; a writer
        may pack it in between, and that entry must stay.)"""
        with self.lock:
            if hexd in self.packed:
                return
            size = self.sizes.pop(hexd, None)
            self.touched.pop(hexd, None)
            self.unverified.discard(hexd)
            if size is not None:
                self.total -= size
                self.lru.pop(hexd, None)

    # -- packs ---------------------------------------------------------------------------------

    def drop_pack_locked(self, pack: Pack) -> tuple[int, int]:
        """Forget a pack and every chunk indexed in it (the caller unlinks the file). Returns
        (chunks, bytes) dropped from the index."""
        if pack.dead:
            return 0, 0
        pack.dead = True
        n = nbytes = 0
        for hexd in self.pack_hexes.pop(pack.name, ()):
            size = self.sizes.pop(hexd, None)
            self.packed.pop(hexd, None)
            if size is not None:
                n += 1
                nbytes += size
        self.total -= pack.bytes
        pack.bytes = 0
        self.packs.pop(pack.name, None)
        self.lru.pop(PACK_KEY + pack.name, None)
        if self.wpack is pack:
            self.wpack = None
        if pack.users == 0 and pack.fd >= 0:
            os.close(pack.fd)
            pack.fd = -1
            self.open.pop(pack.name, None)
        return n, nbytes

    def use_locked(self, pack: Pack, *, open_it: bool = True) -> int:
        """``pack``'s fd, held until :meth:`unuse_locked`; opened if need be (unless not
        ``open_it``: then -1 when it is not open); -1 if the pack is gone."""
        if pack.dead:
            return -1
        if pack.fd < 0:
            if not open_it:
                return -1
            try:
                pack.fd = os.open(pack.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                log.warning("chunk cache: pack %s is gone (%s); forgetting its chunks",
                            pack.path, exc)
                self.drop_pack_locked(pack)
                return -1
            if len(self.open) >= MAX_OPEN_PACKS:
                for idle in [p for p in self.open.values()
                             if p.users == 0 and p is not self.wpack][:len(self.open) // 4 + 1]:
                    os.close(idle.fd)
                    idle.fd = -1
                    del self.open[idle.name]
        self.open[pack.name] = pack
        self.open.move_to_end(pack.name)
        pack.users += 1
        return pack.fd

    def unuse_locked(self, pack: Pack) -> None:
        pack.users -= 1
        if pack.dead and pack.users == 0 and pack.fd >= 0:
            os.close(pack.fd)
            pack.fd = -1
            self.open.pop(pack.name, None)

    def close_idle_locked(self) -> None:
        """Close every pack descriptor nobody uses (later reads reopen what they need)."""
        for pack in [p for p in self.open.values() if p.users == 0]:
            os.close(pack.fd)
            pack.fd = -1
            del self.open[pack.name]

    # -- eviction ------------------------------------------------------------------------------

    def evict(self, keep: str | None = None) -> tuple[list[str], list[Path]]:
        """Unindex least-recently-used units until the cache fits its limit: big chunks and
        whole packs (a pack is as recent as its most recently used record; never the pack
        ``keep`` was just appended to). Returns (big chunks' hexes, pack paths) to unlink."""
        files: list[str] = []
        packs: list[Path] = []
        with self.lock:
            if self.total <= self.max_bytes:
                return files, packs
            keep_ent = self.packed.get(keep) if keep is not None else None
            keep_pack = keep_ent[0] if keep_ent is not None else None
            # packs holding no indexed chunk (duplicates, removed chunks) go first
            for pack in [p for p in self.packs.values()
                         if p.name not in self.pack_hexes and p.bytes and p is not self.wpack]:
                if self.total <= self.max_bytes:
                    break
                self.drop_pack_locked(pack)
                packs.append(pack.path)
            skipped = 0
            while self.total > self.max_bytes and self.lru:
                key = next(iter(self.lru))
                if key.startswith(PACK_KEY):
                    victim = self.packs.get(key[len(PACK_KEY):])
                    if victim is None:
                        del self.lru[key]
                        continue
                    if victim is keep_pack:
                        break       # over by at most one pack of at most max_bytes / 16
                    n, nbytes = self.drop_pack_locked(victim)
                    self.stats.evictions += n
                    self.stats.evicted_bytes += nbytes
                    packs.append(victim.path)
                    continue
                hexd = key
                if hexd == keep:
                    skipped += 1
                    if len(self.lru) == 1 or skipped > 1:
                        break
                    self.lru.move_to_end(hexd)
                    continue
                del self.lru[hexd]
                size = self.sizes.pop(hexd, 0)
                self.touched.pop(hexd, None)
                self.unverified.discard(hexd)
                self.total -= size
                self.stats.evictions += 1
                self.stats.evicted_bytes += size
                files.append(hexd)
        return files, packs
