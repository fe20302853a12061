"""The node-wide chunk cache: decompressed, verified chunks on disk, keyed by their digest.

Layout under ``dir`` (CONVENTIONS §7)::

    sha256/ab/abcdef…   big chunks (> ``pack_threshold``): one file each, named by the digest
    packs/<pid>-<unique>.pack
                         small chunks: append-only pack files, one writer process per pack
    wip/                 temporary files; a big chunk appears under sha256/ only by rename(2)

Keying by content digest means an identical chunk in two layers (or two images) is fetched and
stored once. Big chunks are written two-phase (temp file in ``wip/``, then an atomic rename).

Small chunks (most chunks of a layer of small files) would cost a file creation each (0.2 to
1 ms); they are appended to a pack instead, one ``pwritev`` each. A pack record is::

    b"CSK1" | 32 raw sha256 bytes | u32 length (little endian) | data

A pack is written only by the process that created it (its pid is in the name), so writes of
two processes never interleave. A record enters the in-memory index (hex → pack, offset, size)
only after its bytes are written, so a reader never sees a partial chunk (until then a
:meth:`~ChunkCache.put_async` chunk is served from memory). The writer rolls to a new pack at
``pack_bytes`` (64 MiB, less for a small cache) or when its pack was deleted under it.

Start-up (:meth:`ChunkCache._rebuild`) indexes big chunks by ``mtime`` and scans every pack
sequentially, re-hashing each record: a record whose sha256 does not match is skipped (logged,
never served); a truncated record or a bad header ends that pack's scan (a writer that crashed
mid-append). Chunks another live process appends to its own packs become visible to this
process by :meth:`ChunkCache.rescan`, which a miss runs by itself at most every
``_RESCAN_INTERVAL`` seconds; it scans only bytes not yet scanned. Until then such a chunk is a
miss (it is fetched and stored again; correctness holds, a few bytes are duplicated).

Size limit: ``total_bytes`` counts big-chunk files and whole pack files (headers and dead
records included). Eviction is least-recently-used over units: a big chunk (its file is
unlinked) or a whole pack, as recent as its most recently read or appended record (the pack is
deleted and all its records leave the index; a pack's bytes are only freed as a whole). Packs
holding no indexed record (duplicates, removed chunks) go first. The pack being appended to is
never evicted by its own append, so the cache may exceed its limit by up to one pack
(``pack_bytes`` is at most ``max_bytes / 16``). ``remove`` of a packed chunk only drops it from the
index (it comes back at the next start, it is a valid chunk); a pack none of whose records is
indexed any more is deleted. Deleting a pack another process still writes is harmless: its
reads keep working on the open descriptor, and it rolls to a new pack at its next append.

LRU order across restarts: a hit re-stamps the big chunk's file, or the pack of a packed chunk,
at most once a minute; at start, chunks are ordered by that ``mtime`` (a pack's records by
offset).

Trust: :meth:`ChunkCache.put` hashes the data unless the caller says it already verified it
(the layer reader does: ``decode_chunk`` checks every chunk's digest). Reads check the chunk's
size against the size the caller expects but do not re-hash (``verify_reads=True`` re-hashes
every read for paranoid setups); pack records are re-hashed whenever a pack is scanned.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import secrets
import struct
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path

from coldstart.errors import ColdstartError, IntegrityError, InvalidArgument

__all__ = ["CacheStats", "ChunkCache"]

log = logging.getLogger(__name__)

_DIGEST_RE = re.compile(r"^sha256:([0-9a-f]{64})$")
_HEX_RE = re.compile(r"^[0-9a-f]{64}$")
_PACK_RE = re.compile(r"^[0-9]+-[0-9a-f-]+\.pack$")
# a hit re-stamps the file's mtime (for LRU order across restarts) at most this often
_TOUCH_INTERVAL = 60.0
# temp files older than this are leftovers of a crashed writer
_WIP_MAX_AGE = 3600.0
# put_async blocks while this many bytes wait for the writer thread (backpressure)
_MAX_PENDING = 64 << 20
# chunks of at most this many bytes go to packs (a file costs ~0.2-1 ms, an append ~10 µs)
PACK_THRESHOLD = 256 << 10
# a writer rolls to a new pack past this size (or max_bytes / 16 if smaller)
PACK_BYTES = 64 << 20
# a miss rescans the packs (for chunks other processes wrote) at most this often
_RESCAN_INTERVAL = 2.0
# pack descriptors kept open for reads; idle ones beyond this are closed
_MAX_OPEN_PACKS = 256

_MAGIC = b"CSK1"
_PACK_KEY = "pack:"
_HDR = struct.Struct("<4s32sI")
_HDR_SIZE = _HDR.size


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


def _hex_of(digest: str) -> str:
    m = _DIGEST_RE.match(digest)
    if m is None:
        raise InvalidArgument(f"chunk cache: unsupported digest {digest!r} (want sha256:<hex>)")
    return m.group(1)


class _Pack:
    """One pack file. All fields are guarded by the cache's lock."""

    __slots__ = ("bytes", "dead", "fd", "live", "mtime", "name", "own", "path", "scanned",
                 "touched", "users")

    def __init__(self, path: Path, *, own: bool, mtime: float) -> None:
        self.path = path
        self.name = path.name
        self.own = own            # written by this process (the current or a rolled pack)
        self.fd = -1              # opened on first use; closed when idle and dead
        self.users = 0            # threads using fd right now
        self.bytes = 0            # bytes counted in the cache's total (the file's size)
        self.scanned = 0          # records before this offset are indexed (or skipped)
        self.live = 0             # indexed records
        self.dead = False         # deleted: no new users, fd closes when users drops to 0
        self.mtime = mtime
        self.touched = mtime


class ChunkCache:
    """A size-limited, content-addressed, least-recently-used chunk store in a directory.

    Thread-safe; several processes may share one directory.

    >>> import tempfile, hashlib
    >>> c = ChunkCache(tempfile.mkdtemp(), max_bytes=1 << 20)
    >>> d = "sha256:" + hashlib.sha256(b"abc").hexdigest()
    >>> c.put(d, b"abc"); c.get(d)
    b'abc'
    """

    def __init__(self, directory: str | os.PathLike[str], *, max_bytes: int,
                 durable: bool = False, verify_reads: bool = False,
                 pack_threshold: int = PACK_THRESHOLD, pack_bytes: int = PACK_BYTES) -> None:
        if max_bytes <= 0:
            raise InvalidArgument(f"chunk cache: max_bytes must be positive, not {max_bytes}")
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        self.durable = durable
        self.verify_reads = verify_reads
        #: chunks of at most this many bytes are appended to packs (0: every chunk is a file)
        self.pack_threshold = pack_threshold
        #: a pack is rolled over past this size
        self.pack_bytes = max(1, min(pack_bytes, max_bytes // 16))
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._index: dict[str, int] = {}           # hex -> size, every chunk
        # eviction units, least recently used first: a big chunk's hex, or _PACK_KEY + name
        self._lru: OrderedDict[str, None] = OrderedDict()
        self._touched: dict[str, float] = {}
        self._total = 0
        self._objects = self.dir / "sha256"
        self._wip = self.dir / "wip"
        self._packdir = self.dir / "packs"
        for d in (self._objects, self._wip, self._packdir):
            d.mkdir(parents=True, exist_ok=True)
        self._shards: set[str] = set()              # sha256/<xx> directories known to exist
        self._packed: dict[str, tuple[_Pack, int]] = {}   # hex -> (pack, offset of the data)
        self._pack_hexes: dict[str, set[str]] = {}  # pack name -> its indexed digests
        self._packs: dict[str, _Pack] = {}          # name -> live (not deleted) pack
        self._open: OrderedDict[str, _Pack] = OrderedDict()  # packs with an open fd, LRU
        self._wpack: _Pack | None = None            # the pack this process appends to
        self._append_lock = threading.Lock()        # one append at a time (offsets)
        self._scan_lock = threading.Lock()          # one rescan at a time
        self._last_rescan = time.monotonic()
        self._pending: dict[str, bytes] = {}       # hex -> data not yet on disk
        self._pending_bytes = 0
        self._pending_cv = threading.Condition(self._lock)
        self._queue: deque[str] = deque()
        self._writer: threading.Thread | None = None
        self._closed = False
        self._rebuild()

    # -- index ---------------------------------------------------------------------------------

    def _rebuild(self) -> None:
        """Index every chunk already on disk (oldest mtime first), scan and verify the packs,
        and drop stale temp files."""
        loose: list[tuple[float, str, int, str, int, _Pack | None]] = []
        with os.scandir(self._objects) as shards:
            for shard in shards:
                if not shard.is_dir(follow_symlinks=False):
                    continue
                self._shards.add(shard.name)
                with os.scandir(shard.path) as files:
                    for f in files:
                        if not _HEX_RE.match(f.name) or f.name[:2] != shard.name:
                            continue
                        try:
                            st = f.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        loose.append((st.st_mtime, f.name, 0, f.name, st.st_size, None))
        packed: list[tuple[float, str, int, str, int, _Pack | None]] = []
        packs: list[_Pack] = []
        with os.scandir(self._packdir) as entries:
            for e in entries:
                if not _PACK_RE.match(e.name):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                    recs, end, size = _scan_pack(Path(e.path), 0)
                except FileNotFoundError:
                    continue
                pack = _Pack(Path(e.path), own=False, mtime=st.st_mtime)
                pack.scanned, pack.bytes = end, size
                packs.append(pack)
                packed.extend((st.st_mtime, e.name, off, hexd, n, pack) for off, hexd, n in recs)
        in_files = {x[3] for x in loose}
        found = loose + packed
        found.sort(key=lambda x: (x[0], x[1], x[2]))
        now = time.time()
        with self._lock:
            self._index.clear()
            self._lru.clear()
            self._total = 0
            for mtime, _, off, hexd, size, owner in found:
                if owner is None:
                    self._index[hexd] = size
                    self._lru[hexd] = None
                    self._touched[hexd] = mtime
                    self._total += size
                    continue
                self._lru[_PACK_KEY + owner.name] = None   # where its first record sorts
                if hexd not in in_files and hexd not in self._index:
                    self._index[hexd] = size
                    self._packed[hexd] = (owner, off)
                    self._pack_hexes.setdefault(owner.name, set()).add(hexd)
            for pack in packs:      # (one holding no indexed chunk goes first when over)
                self._packs[pack.name] = pack
                self._total += pack.bytes
                self._lru.setdefault(_PACK_KEY + pack.name)
        with os.scandir(self._wip) as wips:
            for w in wips:
                with contextlib.suppress(OSError):
                    if now - w.stat(follow_symlinks=False).st_mtime > _WIP_MAX_AGE:
                        os.unlink(w.path)
        self._evict()

    def rescan(self, *, wait: bool = True) -> int:
        """Index the pack records other processes appended since the last scan (verified, like
        at start); forget packs another process deleted. Returns how many chunks became
        visible. A miss runs this by itself at most every ``_RESCAN_INTERVAL`` seconds."""
        if not self._scan_lock.acquire(blocking=wait):
            return 0
        added = 0
        try:
            self._last_rescan = time.monotonic()
            try:
                names = {n for n in os.listdir(self._packdir) if _PACK_RE.match(n)}
            except FileNotFoundError:
                names = set()
            with self._lock:
                known = dict(self._packs)
                gone = [p for n, p in known.items() if n not in names and not p.own]
                for p in gone:
                    self._drop_pack_locked(p)
            for name in names:
                seen = known.get(name)
                if seen is not None and (seen.own or seen.dead):
                    continue
                path = self._packdir / name
                try:
                    st = os.stat(path)
                    if seen is not None and st.st_size == seen.bytes:
                        continue
                    recs, end, size = _scan_pack(path, seen.scanned if seen else 0)
                except FileNotFoundError:
                    continue
                with self._lock:
                    pack = seen or self._packs.get(name)
                    if pack is None:
                        pack = _Pack(path, own=False, mtime=st.st_mtime)
                        self._packs[name] = pack
                        self._lru[_PACK_KEY + name] = None
                    elif seen is None:      # created by this process meanwhile
                        continue
                    if pack.dead:
                        continue
                    self._total += size - pack.bytes
                    pack.bytes, pack.scanned = size, end
                    hexes = self._pack_hexes.setdefault(name, set())
                    for off, hexd, n in recs:
                        if hexd not in self._index:
                            self._index[hexd] = n
                            self._packed[hexd] = (pack, off)
                            hexes.add(hexd)
                            added += 1
        finally:
            self._scan_lock.release()
        self._evict()
        return added

    def _rescan_due(self) -> bool:
        """On a miss: rescan the packs if the last scan is old enough; True if it ran."""
        if time.monotonic() - self._last_rescan < _RESCAN_INTERVAL:
            return False
        return self.rescan(wait=False) > 0

    def _path(self, hexd: str) -> Path:
        return self._objects / hexd[:2] / hexd

    @property
    def total_bytes(self) -> int:
        """Bytes of chunks (and packs) this process knows to be in the cache."""
        return self._total

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, digest: object) -> bool:
        m = _DIGEST_RE.match(digest) if isinstance(digest, str) else None
        if m is None:
            return False
        hexd = m.group(1)
        with self._lock:
            if hexd in self._index or hexd in self._pending:
                return True
        if self._path(hexd).exists():
            return True
        if self._rescan_due():
            with self._lock:
                return hexd in self._index
        return False

    # -- reads ---------------------------------------------------------------------------------

    def get(self, digest: str, expected_size: int | None = None) -> bytes | None:
        """The whole chunk, or None on a miss (a chunk of the wrong size counts as a miss; a
        digest other than sha256 is never cached)."""
        return self.read(digest, 0, -1, expected_size=expected_size)

    def read(self, digest: str, offset: int, length: int, *,
             expected_size: int | None = None) -> bytes | None:
        """``length`` bytes at ``offset`` of the chunk (``length=-1``: to its end), or None.

        Reading a slice costs one ``pread``: the FUSE read path asks for 128 KiB to 1 MiB of a
        4 MiB chunk at a time.
        """
        m = _DIGEST_RE.match(digest)
        if m is None:  # not a digest this cache stores (sha512…): never cached
            return None
        hexd = m.group(1)
        with self._lock:
            pending = self._pending.get(hexd)
            if pending is not None:
                self.stats.hits += 1
                data = pending[offset:] if length < 0 else pending[offset:offset + length]
                self.stats.hit_bytes += len(data)
                return data
            packed = hexd in self._packed
        if packed:
            got = self._read_packed(digest, hexd, offset, length, expected_size)
            if got is not None:
                return got
        else:
            got = self._read_file(digest, hexd, offset, length, expected_size)
            if got is not None:
                return got
            if self._rescan_due():      # another process may have packed it
                with self._lock:
                    packed = hexd in self._packed
                if packed:
                    got = self._read_packed(digest, hexd, offset, length, expected_size)
                    if got is not None:
                        return got
        with self._lock:
            self.stats.misses += 1
        return None

    def _read_file(self, digest: str, hexd: str, offset: int, length: int,
                   expected_size: int | None) -> bytes | None:
        path = self._path(hexd)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._forget_file(hexd)
            return None
        try:
            size = os.fstat(fd).st_size
            data = self._read_region(fd, 0, size, digest, hexd, offset, length, expected_size,
                                     "on disk")
        finally:
            os.close(fd)
        if data is not None:
            self._hit(hexd, size, len(data))
        return data

    def _read_packed(self, digest: str, hexd: str, offset: int, length: int,
                     expected_size: int | None) -> bytes | None:
        with self._lock:
            ent = self._packed.get(hexd)
            if ent is None:
                return None
            pack, base = ent
            size = self._index[hexd]
            fd = self._use(pack)
        if fd < 0:
            return None
        try:
            data = self._read_region(fd, base, size, digest, hexd, offset, length,
                                     expected_size, f"in {pack.path}")
        finally:
            with self._lock:
                self._unuse(pack)
        if data is not None:
            self._hit(hexd, size, len(data))
        return data

    def _read_region(self, fd: int, base: int, size: int, digest: str, hexd: str, offset: int,
                     length: int, expected_size: int | None, where: str) -> bytes | None:
        """``length`` bytes at ``offset`` of the chunk stored at ``base`` in ``fd`` (``size``
        bytes: a loose file, or a pack record). A wrong size, or with ``verify_reads`` a wrong
        digest, drops the chunk and gives None."""
        if expected_size is not None and size != expected_size:
            log.warning("chunk cache: %s has %d bytes, expected %d; dropping it",
                        digest, size, expected_size)
            self._drop(hexd)
            return None
        if self.verify_reads:
            whole = _pread_all(fd, size, base)
            if len(whole) != size or hashlib.sha256(whole).hexdigest() != hexd:
                log.error("chunk cache: %s is corrupt %s; dropping it", digest, where)
                self._drop(hexd)
                return None
            return whole[offset:] if length < 0 else whole[offset:offset + length]
        start = min(size, max(0, offset))
        end = size if length < 0 else min(size, offset + length)
        return _pread_all(fd, max(0, end - start), base + start)

    def _use(self, pack: _Pack) -> int:
        """Under the lock: pack's fd, opened if need be, held until :meth:`_unuse`; -1 if the
        pack is gone."""
        if pack.dead:
            return -1
        if pack.fd < 0:
            try:
                pack.fd = os.open(pack.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                log.warning("chunk cache: pack %s is gone (%s); forgetting its chunks",
                            pack.path, exc)
                self._drop_pack_locked(pack)
                return -1
            if len(self._open) >= _MAX_OPEN_PACKS:
                for idle in [p for p in self._open.values()
                             if p.users == 0 and p is not self._wpack][:len(self._open) // 4 + 1]:
                    os.close(idle.fd)
                    idle.fd = -1
                    del self._open[idle.name]
        self._open[pack.name] = pack
        self._open.move_to_end(pack.name)
        pack.users += 1
        return pack.fd

    def _unuse(self, pack: _Pack) -> None:
        pack.users -= 1
        if pack.dead and pack.users == 0 and pack.fd >= 0:
            os.close(pack.fd)
            pack.fd = -1
            self._open.pop(pack.name, None)

    def _hit(self, hexd: str, size: int, nbytes: int) -> None:
        now = time.time()
        touch: Path | None = None
        with self._lock:
            self.stats.hits += 1
            self.stats.hit_bytes += nbytes
            ent = self._packed.get(hexd)
            if ent is not None:
                key = _PACK_KEY + ent[0].name
                if key in self._lru:
                    self._lru.move_to_end(key)
            elif hexd in self._index:
                if hexd in self._lru:
                    self._lru.move_to_end(hexd)
            else:  # written by another process since we started
                self._index[hexd] = size
                self._lru[hexd] = None
                self._total += size
            if ent is not None:
                pack = ent[0]
                if now - pack.touched > _TOUCH_INTERVAL:
                    pack.touched = now
                    touch = pack.path
            elif now - self._touched.get(hexd, 0.0) > _TOUCH_INTERVAL:
                self._touched[hexd] = now
                touch = self._path(hexd)
        if touch is not None:
            with contextlib.suppress(OSError):
                os.utime(touch)

    # -- writes --------------------------------------------------------------------------------

    def put(self, digest: str, data: bytes | bytearray | memoryview, *,
            verified: bool = False) -> None:
        """Store a chunk on disk now. Unless ``verified``, its sha256 is checked first
        (IntegrityError)."""
        hexd = _hex_of(digest)
        if not verified and hashlib.sha256(data).hexdigest() != hexd:
            raise IntegrityError(f"chunk cache: data does not match {digest}; not cached")
        size = len(data)
        with self._lock:
            if hexd in self._index:
                self._bump(hexd)
                return
        if size <= self.pack_threshold:
            if self._append(hexd, data):
                with self._lock:
                    self.stats.puts += 1
                    self.stats.put_bytes += size
                self._evict(keep=hexd)
            return
        path = self._path(hexd)
        if path.exists():  # another process stored it
            self._adopt(hexd, size)
            return
        if hexd[:2] not in self._shards:
            path.parent.mkdir(exist_ok=True)
            self._shards.add(hexd[:2])
        tmp = self._wip / f"{hexd}.{os.getpid()}.{threading.get_ident()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if self.durable:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
        os.rename(tmp, path)
        with self._lock:
            self.stats.puts += 1
            self.stats.put_bytes += size
        self._adopt(hexd, size)
        self._evict(keep=hexd)

    def _append(self, hexd: str, data: bytes | bytearray | memoryview) -> bool:
        """Append one record to this process's pack, then index it; False if it was not
        indexed (already there, or the pack was deleted meanwhile)."""
        size = len(data)
        header = _HDR.pack(_MAGIC, bytes.fromhex(hexd), size)
        with self._append_lock:
            with self._lock:
                pack = self._wpack
                if pack is None or pack.dead or pack.scanned >= self.pack_bytes:
                    pack = None
                    self._wpack = None
                else:
                    pack.users += 1
            if pack is None:
                pack = self._new_pack()
            off = pack.scanned
            try:
                _pwrite_all(pack.fd, [header, data], off)
                if self.durable:
                    os.fsync(pack.fd)
                unlinked = os.fstat(pack.fd).st_nlink == 0   # deleted by another process
            except BaseException:
                with self._lock:
                    if self._wpack is pack:
                        self._wpack = None      # retire it; what it holds stays valid
                    with contextlib.suppress(OSError):
                        os.ftruncate(pack.fd, off)
                    self._unuse(pack)
                raise
            with self._lock:
                indexed = False
                if not pack.dead:
                    end = off + _HDR_SIZE + size
                    self._total += end - pack.scanned
                    pack.bytes += end - pack.scanned
                    pack.scanned = end
                    self._lru[_PACK_KEY + pack.name] = None
                    self._lru.move_to_end(_PACK_KEY + pack.name)
                    if hexd not in self._index:
                        self._index[hexd] = size
                        self._packed[hexd] = (pack, off + _HDR_SIZE)
                        self._pack_hexes.setdefault(pack.name, set()).add(hexd)
                        indexed = True
                    if unlinked and self._wpack is pack:
                        self._wpack = None
                self._unuse(pack)
        return indexed

    def _new_pack(self) -> _Pack:
        """Create this process's next pack (called with the append lock held); returned in
        use (see :meth:`_use`)."""
        name = f"{os.getpid()}-{time.time_ns():x}-{secrets.token_hex(4)}.pack"
        path = self._packdir / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:          # the packs directory was removed
            self._packdir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        pack = _Pack(path, own=True, mtime=time.time())
        pack.fd = fd
        with self._lock:
            self._packs[name] = pack
            self._open[name] = pack
            pack.users = 1
            self._wpack = pack
        return pack

    def put_async(self, digest: str, data: bytes, *, verified: bool = False) -> None:
        """Like :meth:`put`, but the disk write happens in a writer thread.

        The chunk is readable (from memory) at once; the caller does not wait for the file
        system. Blocks while too many bytes are waiting (backpressure).
        """
        hexd = _hex_of(digest)
        if not verified and hashlib.sha256(data).hexdigest() != hexd:
            raise IntegrityError(f"chunk cache: data does not match {digest}; not cached")
        with self._lock:
            if hexd in self._index or hexd in self._pending:
                return
            while self._pending_bytes > _MAX_PENDING and not self._closed:
                self._pending_cv.wait(1.0)
            self._pending[hexd] = bytes(data)
            self._pending_bytes += len(data)
            self._queue.append(hexd)
            if self._writer is None or not self._writer.is_alive():
                self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                                name="chunk-cache-writer")
                self._writer.start()
            self._pending_cv.notify_all()

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    if self._closed or not self._pending_cv.wait(5.0):
                        self._writer = None
                        return
                hexd = self._queue.popleft()
                data = self._pending[hexd]
            try:
                self.put("sha256:" + hexd, data, verified=True)
            except (OSError, ColdstartError) as exc:
                log.warning("chunk cache: writing sha256:%s failed: %s", hexd, exc)
            finally:
                with self._lock:
                    self._pending.pop(hexd, None)
                    self._pending_bytes -= len(data)
                    self._pending_cv.notify_all()

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every :meth:`put_async` chunk is on disk; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._pending_cv.wait(min(left, 0.5))
        return True

    def close(self) -> None:
        """Write what is pending, then stop the writer thread, stop appending to the current
        pack and close idle pack descriptors (later reads reopen what they need)."""
        self.flush()
        with self._append_lock, self._lock:
            self._closed = True
            self._pending_cv.notify_all()
            self._wpack = None
            for pack in [p for p in self._open.values() if p.users == 0]:
                os.close(pack.fd)
                pack.fd = -1
                del self._open[pack.name]

    def _adopt(self, hexd: str, size: int) -> None:
        with self._lock:
            if hexd not in self._index:
                self._index[hexd] = size
                self._lru[hexd] = None
                self._total += size
            else:
                self._bump(hexd)
            self._touched[hexd] = time.time()

    def _bump(self, hexd: str) -> None:
        """Under the lock: mark an indexed chunk (its pack, if packed) most recently used."""
        ent = self._packed.get(hexd)
        key = hexd if ent is None else _PACK_KEY + ent[0].name
        if key in self._lru:
            self._lru.move_to_end(key)

    def _forget(self, hexd: str) -> None:
        """Drop a chunk from the index. A packed chunk's bytes stay in its pack; a pack left
        with no indexed chunk (and not being appended to) is deleted."""
        empty: _Pack | None = None
        with self._lock:
            size = self._index.pop(hexd, None)
            self._touched.pop(hexd, None)
            ent = self._packed.pop(hexd, None)
            if ent is not None:
                pack = ent[0]
                hexes = self._pack_hexes.get(pack.name)
                if hexes is not None:
                    hexes.discard(hexd)
                    if not hexes and pack is not self._wpack:
                        self._drop_pack_locked(pack)
                        empty = pack
            elif size is not None:
                self._total -= size
                self._lru.pop(hexd, None)
        if empty is not None:
            with contextlib.suppress(OSError):
                os.unlink(empty.path)

    def _forget_file(self, hexd: str) -> None:
        """A chunk's own file is missing: drop its index entry, unless it is a packed chunk.
        (A reader that found the chunk neither pending nor packed looks for its file; a writer
        may pack it in between, and that entry must stay.)"""
        with self._lock:
            if hexd in self._packed:
                return
            size = self._index.pop(hexd, None)
            self._touched.pop(hexd, None)
            if size is not None:
                self._total -= size
                self._lru.pop(hexd, None)

    def _drop(self, hexd: str) -> None:
        with self._lock:
            packed = hexd in self._packed
        self._forget(hexd)
        if not packed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(hexd))

    def _drop_pack_locked(self, pack: _Pack) -> tuple[int, int]:
        """Under the lock: forget a pack and every chunk indexed in it (the caller unlinks the
        file). Returns (chunks, bytes) dropped from the index."""
        if pack.dead:
            return 0, 0
        pack.dead = True
        n = nbytes = 0
        for hexd in self._pack_hexes.pop(pack.name, ()):
            size = self._index.pop(hexd, None)
            self._packed.pop(hexd, None)
            if size is not None:
                n += 1
                nbytes += size
        self._total -= pack.bytes
        pack.bytes = 0
        self._packs.pop(pack.name, None)
        self._lru.pop(_PACK_KEY + pack.name, None)
        if self._wpack is pack:
            self._wpack = None
        if pack.users == 0 and pack.fd >= 0:
            os.close(pack.fd)
            pack.fd = -1
            self._open.pop(pack.name, None)
        return n, nbytes

    def _evict(self, keep: str | None = None) -> None:
        """Remove least-recently-used units until the cache fits its limit: a big chunk's
        file, or a whole pack (a pack is as recent as its most recently used record; never
        the pack ``keep`` was just appended to)."""
        files: list[str] = []
        packs: list[_Pack] = []
        with self._lock:
            if self._total <= self.max_bytes:
                return
            keep_ent = self._packed.get(keep) if keep is not None else None
            keep_pack = keep_ent[0] if keep_ent is not None else None
            # packs holding no indexed chunk (duplicates, removed chunks) go first
            for pack in [p for p in self._packs.values()
                         if p.name not in self._pack_hexes and p.bytes
                         and p is not self._wpack]:
                if self._total <= self.max_bytes:
                    break
                self._drop_pack_locked(pack)
                packs.append(pack)
            skipped = 0
            while self._total > self.max_bytes and self._lru:
                key = next(iter(self._lru))
                if key.startswith(_PACK_KEY):
                    victim = self._packs.get(key[len(_PACK_KEY):])
                    if victim is None:
                        del self._lru[key]
                        continue
                    if victim is keep_pack:
                        break       # over by at most one pack of at most max_bytes / 16
                    n, nbytes = self._drop_pack_locked(victim)
                    self.stats.evictions += n
                    self.stats.evicted_bytes += nbytes
                    packs.append(victim)
                    continue
                hexd = key
                if hexd == keep:
                    skipped += 1
                    if len(self._lru) == 1 or skipped > 1:
                        break
                    self._lru.move_to_end(hexd)
                    continue
                del self._lru[hexd]
                size = self._index.pop(hexd, 0)
                self._touched.pop(hexd, None)
                self._total -= size
                self.stats.evictions += 1
                self.stats.evicted_bytes += size
                files.append(hexd)
        for hexd in files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(hexd))
        for pack in packs:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(pack.path)

    def remove(self, digest: str) -> None:
        """Delete one chunk (no error if it is absent). A packed chunk leaves the index; its
        bytes go with its pack."""
        self._drop(_hex_of(digest))


def _scan_pack(path: Path, start: int) -> tuple[list[tuple[int, str, int]], int, int]:
    """The verified records of a pack from offset ``start``: ([(data offset, hex, size)],
    offset after the last whole record, file size). A record whose data does not match its
    digest is skipped (logged); a bad header or a truncated record ends the scan."""
    recs: list[tuple[int, str, int]] = []
    with open(path, "rb", buffering=1 << 20) as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(start)
        off = start
        while off + _HDR_SIZE <= size:
            header = f.read(_HDR_SIZE)
            if len(header) < _HDR_SIZE:
                break
            magic, raw, n = _HDR.unpack(header)
            if magic != _MAGIC:
                log.warning("chunk cache: %s: no record header at offset %d; ignoring the "
                            "%d bytes from there", path, off, size - off)
                break
            if off + _HDR_SIZE + n > size:
                log.info("chunk cache: %s: record at offset %d is truncated (a writer died or "
                         "is still writing); ignoring it", path, off)
                break
            data = f.read(n)
            if len(data) < n:
                break
            if hashlib.sha256(data).digest() == raw:
                recs.append((off + _HDR_SIZE, raw.hex(), n))
            else:
                log.error("chunk cache: %s: record at offset %d (sha256:%s) is corrupt; not "
                          "served", path, off, raw.hex())
            off += _HDR_SIZE + n
    return recs, off, size


def _pwrite_all(fd: int, bufs: list[bytes | bytearray | memoryview], offset: int) -> None:
    total = sum(len(b) for b in bufs)
    done = os.pwritev(fd, bufs, offset)
    if done < total:
        rest = memoryview(b"".join(bufs))[done:]
        while rest:
            n = os.pwrite(fd, rest, offset + done)
            rest = rest[n:]
            done += n


def _pread_all(fd: int, length: int, offset: int) -> bytes:
    parts: list[bytes] = []
    done = 0
    while done < length:
        got = os.pread(fd, length - done, offset + done)
        if not got:
            break
        parts.append(got)
        done += len(got)
    if len(parts) == 1:
        return parts[0]
    return b"".join(parts)
