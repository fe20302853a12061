"""The pack store: small chunks appended to pack files (``packs/<pid>-<unique>.pack``).

Small chunks (most chunks of a layer of small files) would cost a file creation each (0.2 to
1 ms); they are appended to a pack instead, one ``pwritev`` each (format: :mod:`.packfile`). A
record enters the index only after its bytes are written, so a reader never sees a partial
chunk. The writer rolls to a new pack at ``pack_bytes`` or when its pack was deleted under it
(by another process's eviction: its reads keep working on the open descriptor).

Chunks another live process appends to its own packs become visible by :meth:`PackStore.rescan`,
which scans only bytes not yet scanned (the cache runs it on a miss, rate-limited, never on the
FUSE loop).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from pathlib import Path

from coldstart.cache.index import PACK_KEY, CacheIndex, Found
from coldstart.cache.packfile import HDR, HDR_SIZE, MAGIC, PACK_RE, Pack, pwrite_all, scan_pack

__all__ = ["PackStore"]


class PackStore:
    """The packs under ``directory``, indexed in ``index``."""

    def __init__(self, directory: Path, index: CacheIndex, *, pack_bytes: int,
                 durable: bool) -> None:
        self.dir = directory
        self.index = index
        self.pack_bytes = pack_bytes
        self.durable = durable
        self.dir.mkdir(parents=True, exist_ok=True)
        self._append_lock = threading.Lock()        # one append at a time (offsets)
        self._scan_lock = threading.Lock()          # one rescan at a time
        self.last_rescan = time.monotonic()

    def scan(self) -> tuple[list[Found], list[Pack]]:
        """Every verified record of every pack (for the start-up index), and the packs."""
        found: list[Found] = []
        packs: list[Pack] = []
        with os.scandir(self.dir) as entries:
            for e in entries:
                if not PACK_RE.match(e.name):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                    recs, end, size = scan_pack(Path(e.path), 0)
                except FileNotFoundError:
                    continue
                pack = Pack(Path(e.path), own=False, mtime=st.st_mtime)
                pack.scanned, pack.bytes = end, size
                packs.append(pack)
                found.extend((st.st_mtime, e.name, off, hexd, n, pack) for off, hexd, n in recs)
        return found, packs

    def rescan(self, *, wait: bool = True) -> int:
        """Index the records other processes appended since the last scan (verified, like at
        start); forget packs another process deleted. Returns how many chunks became visible
        (0 at once if another rescan runs and not ``wait``)."""
        if not self._scan_lock.acquire(blocking=wait):
            return 0
        ix = self.index
        added = 0
        try:
            self.last_rescan = time.monotonic()
            try:
                names = {n for n in os.listdir(self.dir) if PACK_RE.match(n)}
            except FileNotFoundError:
                names = set()
            with ix.lock:
                known = dict(ix.packs)
                for p in [p for n, p in known.items() if n not in names and not p.own]:
                    ix.drop_pack_locked(p)
            for name in names:
                seen = known.get(name)
                if seen is not None and (seen.own or seen.dead):
                    continue
                path = self.dir / name
                try:
                    st = os.stat(path)
                    if seen is not None and st.st_size == seen.bytes:
                        continue
                    recs, end, size = scan_pack(path, seen.scanned if seen else 0)
                except FileNotFoundError:
                    continue
                with ix.lock:
                    pack = seen or ix.packs.get(name)
                    if pack is None:
                        pack = Pack(path, own=False, mtime=st.st_mtime)
                        ix.packs[name] = pack
                        ix.lru[PACK_KEY + name] = None
                    elif seen is None:      # created by this process meanwhile
                        continue
                    if pack.dead:
                        continue
                    ix.total += size - pack.bytes
                    pack.bytes, pack.scanned = size, end
                    ix.pack_hexes.setdefault(name, set())
                    for off, hexd, n in recs:
                        if ix.add_packed_locked(hexd, n, pack, off):
                            added += 1
        finally:
            self._scan_lock.release()
        return added

    def locate(self, hexd: str, *, open_it: bool = True) -> tuple[Pack, int, int, int] | None:
        """Where a packed chunk's bytes are: (pack, fd, data offset, size), the pack held in
        use until :meth:`release`; None if it is not packed (or its pack is gone). Unless
        ``open_it``, a pack whose descriptor is not open yet gives None (no ``open`` call)."""
        ix = self.index
        with ix.lock:
            ent = ix.packed.get(hexd)
            if ent is None:
                return None
            pack, base = ent
            fd = ix.use_locked(pack, open_it=open_it)
            if fd < 0:
                return None
            return pack, fd, base, ix.sizes[hexd]

    def release(self, pack: Pack) -> None:
        with self.index.lock:
            self.index.unuse_locked(pack)

    def append(self, hexd: str, data: bytes | bytearray | memoryview) -> bool:
        """Append one record to this process's pack, then index it; False if it was not
        indexed (already there, or the pack was deleted meanwhile)."""
        ix = self.index
        size = len(data)
        header = HDR.pack(MAGIC, bytes.fromhex(hexd), size)
        with self._append_lock:
            with ix.lock:
                pack = ix.wpack
                if pack is None or pack.dead or pack.scanned >= self.pack_bytes:
                    pack = None
                    ix.wpack = None
                else:
                    pack.users += 1
            if pack is None:
                pack = self._new_pack()
            off = pack.scanned
            try:
                pwrite_all(pack.fd, [header, data], off)
                if self.durable:
                    os.fsync(pack.fd)
                unlinked = os.fstat(pack.fd).st_nlink == 0   # deleted by another process
            except BaseException:
                with ix.lock:
                    if ix.wpack is pack:
                        ix.wpack = None      # retire it; what it holds stays valid
                    with contextlib.suppress(OSError):
                        os.ftruncate(pack.fd, off)
                    ix.unuse_locked(pack)
                    # a pack that never got a record (a full disk fails every append, each
                    # in a new pack): delete it, or each failure leaves a file and an fd
                    empty = off == 0 and not ix.pack_hexes.get(pack.name)
                    if empty:
                        ix.drop_pack_locked(pack)
                if empty:
                    with contextlib.suppress(OSError):
                        os.unlink(pack.path)
                raise
            with ix.lock:
                indexed = False
                if not pack.dead:
                    end = off + HDR_SIZE + size
                    ix.total += end - pack.scanned
                    pack.bytes += end - pack.scanned
                    pack.scanned = end
                    ix.lru[PACK_KEY + pack.name] = None
                    ix.lru.move_to_end(PACK_KEY + pack.name)
                    indexed = ix.add_packed_locked(hexd, size, pack, off + HDR_SIZE)
                    if unlinked and ix.wpack is pack:
                        ix.wpack = None
                ix.unuse_locked(pack)
        return indexed

    def _new_pack(self) -> Pack:
        """Create this process's next pack (called with the append lock held); returned in
        use (see :meth:`CacheIndex.use_locked`)."""
        name = f"{os.getpid()}-{time.time_ns():x}-{secrets.token_hex(4)}.pack"
        path = self.dir / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:          # the packs directory was removed
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        pack = Pack(path, own=True, mtime=time.time())
        pack.fd = fd
        ix = self.index
        with ix.lock:
            ix.packs[name] = pack
            ix.open[name] = pack
            pack.users = 1
            ix.wpack = pack
        return pack

    def stop_appending(self) -> None:
        """Stop appending to the current pack (the next append starts a new one); close idle
        descriptors."""
        with self._append_lock, self.index.lock:
            self.index.wpack = None
            self.index.close_idle_locked()
