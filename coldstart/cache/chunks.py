"""The node-wide chunk cache: decompressed, verified chunks on disk, keyed by their digest.

Layout under ``dir`` (CONVENTIONS §7)::

    sha256/ab/abcdef…   big chunks (> ``pack_threshold``): one file each   (:mod:`.files`)
    packs/<pid>-<unique>.pack
                         small chunks: append-only pack files, one writer process per pack
                                                                         (:mod:`.packs`)
    wip/                 temporary files; a big chunk appears under sha256/ only by rename(2)

Keying by content digest means an identical chunk in two layers (or two images) is fetched and
stored once. :class:`ChunkCache` composes the two stores over one in-memory index
(:mod:`.index`: sizes, locations, LRU, eviction) and adds the writer thread of
:meth:`~ChunkCache.put_async` (until it is written, such a chunk is served from memory).
:meth:`~ChunkCache.put_async_encoded` keeps a chunk as its caller's compressed bytes until then
and decodes it again to write it: a start-up's prefetched chunks, whose writes wait until it
stops reading, then hold only their compressed bytes, and their decoded bytes are freed (and
their memory reused by the next chunks) as soon as the page cache has them.

Start-up (:meth:`ChunkCache._rebuild`) indexes big chunks by ``mtime`` and scans every pack,
re-hashing each record. Chunks another live process stores become visible to this process by
:meth:`ChunkCache.rescan`, which a miss in :meth:`~ChunkCache.read` runs by itself at most every
``_RESCAN_INTERVAL`` seconds. Until then such a chunk is a miss (it is fetched and stored again;
correctness holds, a few bytes are duplicated). :meth:`~ChunkCache.read_local` (the FUSE loop's
fast path) never rescans, stats or opens a pack: it serves what the index says is local, one
``pread``, and says None otherwise.

``remove`` of a packed chunk only drops it from the index (it comes back at the next start, it
is a valid chunk); a pack none of whose records is indexed any more is deleted. Deleting a pack
another process still writes is harmless: its reads keep working on the open descriptor, and it
rolls to a new pack at its next append.

LRU order across restarts: a hit re-stamps the big chunk's file, or the pack of a packed chunk,
at most once a minute (from the writer thread for hits on the FUSE loop); at start, chunks are
ordered by that ``mtime`` (a pack's records by offset).

Trust (``verify``, the config key ``cache.verify``): :meth:`ChunkCache.put` hashes the data
unless the caller says it already verified it (the layer reader does: ``decode_chunk`` checks
every chunk's digest), so what this process writes is trusted. Pack records are re-hashed
whenever a pack is scanned. A big chunk's file this process did not write (found at start, or
stored by another process) is, with the default ``"first-read"``, re-hashed on its first read
in this process (the whole chunk: one sha256, ~1.7 GB/s on a core with SHA extensions), then
trusted; a mismatch drops it (logged, counted in ``stats.corrupt``) and the read is a miss, so
the chunk is fetched again. Until then :meth:`~ChunkCache.read_local` says None for it, so the
hash runs in a worker thread, never on the FUSE loop. ``"always"`` re-hashes every read (the
loop's fast path then always defers to :meth:`~ChunkCache.read`); ``"never"`` trusts the disk.
Every read checks the chunk's size against the size the caller expects.

Write failures (a full disk: ENOSPC, an I/O error) leave nothing behind (a big chunk's temp
file is removed, a pack is truncated back to its last whole record); the chunk stays uncached
and is served from the registry. They are counted (``stats.write_errors``), reported to
``on_error`` (kind :data:`WRITE_ERROR`) and logged (repeats of one errno at most once a
minute, with the count of those not logged).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from coldstart.cache.files import FileStore
from coldstart.cache.index import CacheIndex, CacheStats
from coldstart.cache.packfile import Pack, log, pread_all
from coldstart.cache.packs import PackStore
from coldstart.config import CACHE_VERIFY_MODES, CacheConfig
from coldstart.errors import ColdstartError, IntegrityError, InvalidArgument
from coldstart.files import private_dir

__all__ = ["CORRUPT", "WRITE_ERROR", "CacheStats", "ChunkCache"]

#: ``on_error`` kinds: a chunk that could not be written (not cached), one found corrupt
WRITE_ERROR = "cache_write"
CORRUPT = "cache_corrupt"
# repeated write failures with one errno are logged at most this often (all are counted)
_WRITE_ERROR_LOG_INTERVAL = 60.0

_DIGEST_RE = re.compile(r"^sha256:([0-9a-f]{64})$")
# put_async blocks while this many bytes wait for the writer thread (backpressure); a cold
# start's prefetched set fits (kept encoded: torch's is 65 MB), served from memory while the
# writer catches up. Every byte waiting is memory the server faults in afresh (on a VM with
# free page reporting, memory the host backs again), so it is kept small: with 512 MiB and
# 384 MiB below, a cold 1 GiB read grew the server to 750 MB and spent a fifth of the
# server's CPU faulting it in; with these, 325 MB, and the read ran 23-35 % faster (an mmap
# reader 31-50 %), torch's on-demand start-up 0.8 s sooner (bench/published/pending-2026-12-05).
# The server image's 2.2 GB of weights held the FUSE server at 425 MB with 160 MiB (and 96
# MiB gated below), at 312-321 MB with these, loading no slower (issue 49); torch's prefetched
# set (65 MB) now meets the backpressure at its very end.
_MAX_PENDING = 64 << 20
# ... and while this many chunks wait: a layer of small files fills the backlog with chunks
# of a few hundred bytes, whose dict, key and object cost more than their bytes (200,000
# waiting chunks held some 150 MB that the byte count did not see)
_MAX_PENDING_CHUNKS = 32768
# below this many pending bytes (and a quarter of max_bytes) the writer waits for
# ``write_gate`` (the node's reads to pause) before it writes; above it, it writes at once
_GATED_PENDING = 32 << 20
# the longest a burst of writes waits for a pause; a node still busy then gets its writes
# (the backlog drains without waiting again)
_GATE_WAIT = 5.0
_GATE_STEP = 0.02
# niceness of the writer thread: the disk writes can wait, the start-up reading cannot
WRITER_NICENESS = 10
# chunks of at most this many bytes go to packs (a file costs ~0.2-1 ms, an append ~10 µs)
PACK_THRESHOLD = 256 << 10
# a writer rolls to a new pack past this size (or max_bytes / 16 if smaller)
PACK_BYTES = 64 << 20
# a miss rescans the packs (for chunks other processes wrote) at most this often
_RESCAN_INTERVAL = 2.0


@dataclass(frozen=True, slots=True)
class _Encoded:
    """A pending chunk kept encoded: ``decode()`` gives its ``size`` verified bytes;
    ``held`` is what it keeps in memory meanwhile (its compressed bytes)."""

    size: int
    held: int
    decode: Callable[[], bytes]


def _held(pending: bytes | _Encoded) -> int:
    return pending.held if isinstance(pending, _Encoded) else len(pending)


def _hex_of(digest: str) -> str:
    m = _DIGEST_RE.match(digest)
    if m is None:
        raise InvalidArgument(f"chunk cache: unsupported digest {digest!r} (want sha256:<hex>)")
    return m.group(1)


class ChunkCache:
    """A size-limited, content-addressed, least-recently-used chunk store in a directory.

    Thread-safe; several processes may share one directory. Implements
    :class:`~coldstart.cache.store.ChunkStore`.

    >>> import tempfile, hashlib
    >>> c = ChunkCache(tempfile.mkdtemp(), max_bytes=1 << 20)
    >>> d = "sha256:" + hashlib.sha256(b"abc").hexdigest()
    >>> c.put(d, b"abc"); c.get(d)
    b'abc'
    """

    def __init__(self, directory: str | os.PathLike[str], *, max_bytes: int,
                 durable: bool = False, verify: str = CacheConfig.verify,
                 verify_reads: bool = False,
                 pack_threshold: int = PACK_THRESHOLD, pack_bytes: int = PACK_BYTES,
                 on_error: Callable[[str], object] | None = None) -> None:
        if max_bytes <= 0:
            raise InvalidArgument(f"chunk cache: max_bytes must be positive, not {max_bytes}")
        if verify not in CACHE_VERIFY_MODES:
            raise InvalidArgument(f"chunk cache: verify must be one of "
                                  f"{', '.join(CACHE_VERIFY_MODES)}, not {verify!r}")
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        self.durable = durable
        #: "first-read", "always" or "never" (see the module doc); ``verify_reads``: "always"
        self.verify = "always" if verify_reads else verify
        self.verify_reads = self.verify == "always"
        #: called with :data:`WRITE_ERROR` or :data:`CORRUPT` (e.g. a metrics counter)
        self.on_error = on_error
        #: called (with the longest wait, seconds) before each background write while the
        #: backlog is small: blocks until the node's reads pause (the FUSE server's fetcher:
        #: True) or the wait is over (False: the rest of this backlog is written at once), so
        #: a start-up's cache writes wait until it stops reading; None: write at once
        self.write_gate: Callable[[float], bool] | None = None
        self._flushing = 0
        self._err_logged: tuple[int | None, float] = (None, 0.0)   # errno, when
        self._err_unlogged = 0
        #: chunks of at most this many bytes are appended to packs (0: every chunk is a file)
        self.pack_threshold = pack_threshold
        #: a pack is rolled over past this size
        self.pack_bytes = max(1, min(pack_bytes, max_bytes // 16))
        self._ix = CacheIndex(max_bytes)
        self.stats: CacheStats = self._ix.stats
        self._lock = self._ix.lock
        # the bytes of private images: only the cache's owner may enter where they lie (0700);
        # not ``directory`` itself, which the operator may share (a disk's mount point), but it
        # is made 0700 too when we create it
        for sub in ("sha256", "wip", "packs"):
            private_dir(self.dir / sub, "chunk cache directory")
        self._files = FileStore(self.dir / "sha256", self.dir / "wip", durable=durable)
        self._packs = PackStore(self.dir / "packs", self._ix, pack_bytes=self.pack_bytes,
                                durable=durable)
        self._reclaim_lock = threading.Lock()      # one reclaim (pack compaction) at a time
        self._pending: dict[str, bytes | _Encoded] = {}    # hex -> data not yet on disk
        self._pending_bytes = 0                     # what the pending chunks hold in memory
        self._pending_cv = threading.Condition(self._lock)
        self._queue: deque[str] = deque()
        self._touches: deque[Path] = deque()       # mtimes to re-stamp off the FUSE loop
        self._writer: threading.Thread | None = None
        self._closed = False
        self._rebuild()

    # -- index ---------------------------------------------------------------------------------

    def _rebuild(self) -> None:
        """Index every chunk already on disk (oldest mtime first), scan and verify the packs,
        and drop stale temp files."""
        loose = self._files.scan()
        packed, packs = self._packs.scan()
        self._ix.load(loose + packed, packs, trust_files=self.verify != "first-read")
        self._files.clean_wip()
        self._evict()

    def rescan(self, *, wait: bool = True) -> int:
        """Index the pack records other processes appended since the last scan (verified, like
        at start); forget packs another process deleted. Returns how many chunks became
        visible. A miss runs this by itself at most every ``_RESCAN_INTERVAL`` seconds."""
        added = self._packs.rescan(wait=wait)
        self._evict()
        return added

    def _rescan_due(self) -> bool:
        """On a miss: rescan the packs if the last scan is old enough; True if it ran."""
        if time.monotonic() - self._packs.last_rescan < _RESCAN_INTERVAL:
            return False
        return self.rescan(wait=False) > 0

    def _path(self, hexd: str) -> Path:
        return self._files.path(hexd)

    @property
    def total_bytes(self) -> int:
        """Bytes of chunks (and packs) this process knows to be in the cache."""
        return self._ix.total

    def __len__(self) -> int:
        return len(self._ix.sizes)

    def contains(self, digest: str) -> bool:
        """In the in-memory index or waiting to be written: no I/O (the FUSE loop's check)."""
        m = _DIGEST_RE.match(digest)
        if m is None:
            return False
        hexd = m.group(1)
        with self._lock:
            return hexd in self._ix.sizes or hexd in self._pending

    def __contains__(self, digest: object) -> bool:
        """Stored, also by another process: past the index, a ``stat`` of its file and (when
        due) a rescan of the packs. Not for the FUSE loop (:meth:`contains` is)."""
        m = _DIGEST_RE.match(digest) if isinstance(digest, str) else None
        if m is None:
            return False
        hexd = m.group(1)
        with self._lock:
            if hexd in self._ix.sizes or hexd in self._pending:
                return True
        if self._files.exists(hexd):
            return True
        if self._rescan_due():
            with self._lock:
                return hexd in self._ix.sizes
        return False

    # -- reads ---------------------------------------------------------------------------------

    def get(self, digest: str, expected_size: int | None = None, *,
            keep: bool = True) -> bytes | None:
        """The whole chunk, or None on a miss (a chunk of the wrong size counts as a miss; a
        digest other than sha256 is never cached). ``keep``: see :meth:`read`."""
        return self.read(digest, 0, -1, expected_size=expected_size, keep=keep)

    def read(self, digest: str, offset: int, length: int, *,
             expected_size: int | None = None, keep: bool = True) -> bytes | None:
        """``length`` bytes at ``offset`` of the chunk (``length=-1``: to its end), or None.

        Reading a slice costs one ``pread``: the FUSE read path asks for 128 KiB to 1 MiB of a
        4 MiB chunk at a time. On a miss, finds chunks another process stored (its file; the
        packs, rescanned at most every ``_RESCAN_INTERVAL``). A chunk kept encoded until it is
        written (:meth:`put_async_encoded`) is decoded, and kept decoded for the next reads
        unless ``keep`` is False; one that no longer decodes is dropped (a miss).
        """
        m = _DIGEST_RE.match(digest)
        if m is None:  # not a digest this cache stores (sha512…): never cached
            return None
        hexd = m.group(1)
        with self._lock:
            pending = self._pending.get(hexd)
            if isinstance(pending, bytes):
                return self._pending_hit_locked(pending, offset, length)
            packed = hexd in self._ix.packed
        if pending is not None:
            got = self._decode_pending(digest, pending)
            with self._lock:
                if self._pending.get(hexd) is pending:
                    if got is None:         # not cached after all: the reader fetches it
                        del self._pending[hexd]
                        self._pending_bytes -= pending.held
                        self._pending_cv.notify_all()
                    elif keep:  # read after all: its bytes stay for the next reads (the loop's)
                        self._pending[hexd] = got
                        self._pending_bytes += len(got) - pending.held
                if got is not None:
                    return self._pending_hit_locked(got, offset, length)
        elif packed:
            got = self._read_packed(digest, hexd, offset, length, expected_size)
            if got is not None:
                return got
        else:
            got = self._read_file(digest, hexd, offset, length, expected_size)
            if got is not None:
                return got
            if self._rescan_due():      # another process may have packed it
                with self._lock:
                    packed = hexd in self._ix.packed
                if packed:
                    got = self._read_packed(digest, hexd, offset, length, expected_size)
                    if got is not None:
                        return got
        with self._lock:
            self.stats.misses += 1
        return None

    def read_local(self, digest: str, offset: int, length: int, *,
                   expected_size: int | None = None) -> bytes | None:
        """:meth:`read` from what the in-memory index knows, for the FUSE loop: a pending
        chunk from memory, a packed one by one ``pread`` on its pack's open descriptor, a big
        one by ``open`` + ``pread`` of its file. No rescan, no ``stat``, no LRU re-stamp (the
        writer thread does it), no pack opened. None: ask :meth:`read` (a miss, a pack not
        open yet, a short or odd-sized chunk, a chunk to verify first); nothing is dropped
        here."""
        m = _DIGEST_RE.match(digest)
        if m is None:
            return None
        hexd = m.group(1)
        ix = self._ix
        with self._lock:
            pending = self._pending.get(hexd)
            if isinstance(pending, bytes):
                return self._pending_hit_locked(pending, offset, length)
            if pending is not None:
                return None     # kept encoded: the worker's read() decodes it
            size = ix.sizes.get(hexd)
            if (size is None or self.verify_reads or hexd in ix.unverified
                    or (expected_size is not None and size != expected_size)):
                return None     # not-yet-verified: the worker's read() hashes it
            packed = hexd in ix.packed
        start = min(size, max(0, offset))
        want = max(0, (size if length < 0 else min(size, offset + length)) - start)
        if packed:
            loc = self._packs.locate(hexd, open_it=False)
            if loc is None:
                return None
            pack, fd, base, _ = loc
            try:
                data = pread_all(fd, want, base + start)
            finally:
                self._packs.release(pack)
        else:
            fd2 = self._files.open(hexd)
            if fd2 is None:
                return None
            try:
                data = pread_all(fd2, want, start)
            finally:
                os.close(fd2)
        if len(data) != want:
            return None
        self._hit(hexd, size, want, defer_touch=True)
        return data

    def _decode_pending(self, digest: str, pending: _Encoded) -> bytes | None:
        """The bytes of a chunk kept encoded, decoded again (and verified by its decoder);
        None if that fails (logged: it decoded and verified once, so this is a bug)."""
        try:
            data = pending.decode()
        except Exception:
            log.exception("chunk cache: decoding pending chunk %s again failed", digest)
            return None
        if len(data) != pending.size:
            log.error("chunk cache: pending chunk %s decoded to %d bytes, not %d", digest,
                      len(data), pending.size)
            return None
        return data

    def _pending_hit_locked(self, pending: bytes, offset: int, length: int) -> bytes:
        self.stats.hits += 1
        data = pending[offset:] if length < 0 else pending[offset:offset + length]
        self.stats.hit_bytes += len(data)
        return data

    def _read_file(self, digest: str, hexd: str, offset: int, length: int,
                   expected_size: int | None) -> bytes | None:
        fd = self._files.open(hexd)
        if fd is None:
            self._ix.forget_file(hexd)
            return None
        ix = self._ix
        with self._lock:    # first read of a file we did not write (found at start, or new)
            check = self.verify_reads or (self.verify == "first-read"
                                          and (hexd in ix.unverified or hexd not in ix.sizes))
        try:
            size = os.fstat(fd).st_size
            data = self._read_region(fd, 0, size, digest, hexd, offset, length, expected_size,
                                     "on disk", check)
        finally:
            os.close(fd)
        if data is not None:
            self._hit(hexd, size, len(data))
        return data

    def _read_packed(self, digest: str, hexd: str, offset: int, length: int,
                     expected_size: int | None) -> bytes | None:
        loc = self._packs.locate(hexd)
        if loc is None:
            return None
        pack, fd, base, size = loc
        try:
            data = self._read_region(fd, base, size, digest, hexd, offset, length,
                                     expected_size, f"in {pack.path}", self.verify_reads)
        finally:
            self._packs.release(pack)
        if data is not None:
            self._hit(hexd, size, len(data))
        return data

    def _read_region(self, fd: int, base: int, size: int, digest: str, hexd: str, offset: int,
                     length: int, expected_size: int | None, where: str,
                     check: bool) -> bytes | None:
        """``length`` bytes at ``offset`` of the chunk stored at ``base`` in ``fd`` (``size``
        bytes: a loose file, or a pack record). A wrong size, or with ``check`` a wrong
        digest, drops the chunk and gives None; a chunk that passes ``check`` is trusted
        from then on."""
        if expected_size is not None and size != expected_size:
            log.warning("chunk cache: %s has %d bytes, expected %d; dropping it",
                        digest, size, expected_size)
            self._drop(hexd)
            return None
        if check:
            whole = pread_all(fd, size, base)
            ok = len(whole) == size and hashlib.sha256(whole).hexdigest() == hexd
            with self._lock:
                self.stats.verified += 1
                if ok:
                    self._ix.unverified.discard(hexd)
                else:
                    self.stats.corrupt += 1
            if not ok:
                log.error("chunk cache: %s is corrupt %s; dropping it (it will be fetched "
                          "again)", digest, where)
                self._drop(hexd)
                self._report(CORRUPT)
                return None
            return whole[offset:] if length < 0 else whole[offset:offset + length]
        start = min(size, max(0, offset))
        end = size if length < 0 else min(size, offset + length)
        return pread_all(fd, max(0, end - start), base + start)

    def _hit(self, hexd: str, size: int, nbytes: int, *, defer_touch: bool = False) -> None:
        what = self._ix.hit(hexd, size, nbytes)
        if what is None:
            return
        touch = what.path if isinstance(what, Pack) else self._files.path(what)
        if not defer_touch:
            with contextlib.suppress(OSError):
                os.utime(touch)
            return
        with self._lock:
            if self._closed:
                return
            self._touches.append(touch)
            self._start_writer_locked()

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
            if hexd in self._ix.sizes:
                self._ix.bump_locked(hexd)
                return
        if size <= self.pack_threshold:
            try:
                appended = self._packs.append(hexd, data)
            except OSError:
                self._count_write_error()
                raise
            if appended:
                with self._lock:
                    self.stats.puts += 1
                    self.stats.put_bytes += size
                self._evict(keep=hexd)
            return
        if self._files.exists(hexd):  # another process stored it: hashed on its first read
            self._ix.adopt(hexd, size, trusted=self.verify != "first-read")
            return
        try:
            self._files.write(hexd, data)
        except OSError:
            self._count_write_error()
            raise
        with self._lock:
            self.stats.puts += 1
            self.stats.put_bytes += size
        self._ix.adopt(hexd, size)
        self._evict(keep=hexd)

    def put_async(self, digest: str, data: bytes, *, verified: bool = False) -> None:
        """Like :meth:`put`, but the disk write happens in a writer thread.

        The chunk is readable (from memory) at once; the caller does not wait for the file
        system. Blocks while too many bytes are waiting (backpressure).
        """
        hexd = _hex_of(digest)
        if not verified and hashlib.sha256(data).hexdigest() != hexd:
            raise IntegrityError(f"chunk cache: data does not match {digest}; not cached")
        self._queue_write(hexd, bytes(data))

    def put_async_encoded(self, digest: str, size: int, decode: Callable[[], bytes], *,
                          held: int) -> None:
        """Like :meth:`put_async` for a chunk its caller decoded and verified already, kept
        in its encoded form until it is written: ``decode()`` gives its ``size`` bytes again
        (decoding and verifying them), called by the writer thread and by the first
        :meth:`read` that finds the chunk pending, which keeps the bytes for the reads after it
        (:meth:`read_local` leaves that first one to :meth:`read`). ``held``: the bytes
        ``decode`` keeps alive (its compressed input), counted against the backlog instead of
        ``size``. For chunks nobody is expected to read through the cache soon (a prefetch's,
        which the page cache gets)."""
        self._queue_write(_hex_of(digest), _Encoded(size, held, decode))

    def _queue_write(self, hexd: str, pending: bytes | _Encoded) -> None:
        with self._lock:
            while True:
                if hexd in self._ix.sizes or hexd in self._pending:
                    return
                if (self._pending_bytes <= _MAX_PENDING
                        and len(self._pending) < _MAX_PENDING_CHUNKS) or self._closed:
                    break
                self._pending_cv.wait(1.0)  # (another thread may queue it meanwhile)
            self._pending[hexd] = pending
            self._pending_bytes += _held(pending)
            self._queue.append(hexd)
            self._start_writer_locked()
            self._pending_cv.notify_all()

    def _start_writer_locked(self) -> None:
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                            name="chunk-cache-writer")
            self._writer.start()
        else:
            self._pending_cv.notify_all()

    def _write_loop(self) -> None:
        with contextlib.suppress(OSError, AttributeError):   # Linux: per thread
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
        gated = min(_GATED_PENDING, self.max_bytes // 4)
        # chunks of a backlog that waited its longest at the gate already: written without
        # waiting again (chunks queued after them, a fill's, wait at the gate again)
        ungated = 0
        while True:
            touch: Path | None = None
            hexd = ""
            pending: bytes | _Encoded = b""
            with self._lock:
                while not self._queue and not self._touches:
                    ungated = 0
                    if self._closed or not self._pending_cv.wait(5.0):
                        self._writer = None
                        return
                if self._touches:
                    touch = self._touches.popleft()
                else:
                    hexd = self._queue.popleft()
                    got = self._pending.get(hexd)
                    if got is None:     # dropped meanwhile (it no longer decoded)
                        ungated = max(0, ungated - 1)
                        continue
                    pending = got
                gate = (self.write_gate if not ungated and not self._backlog_full_locked(gated)
                        and not self._flushing and not self._closed else None)
                if touch is None:
                    ungated = max(0, ungated - 1)
            if gate is not None and touch is None:
                if not self._wait_at_gate(gate, gated):
                    with self._lock:
                        ungated = len(self._queue)
                with self._lock:    # a read at that time may have decoded it already
                    pending = self._pending.get(hexd, pending)
            if touch is not None:
                with contextlib.suppress(OSError):
                    os.utime(touch)
                continue
            try:
                data = (pending if isinstance(pending, bytes)
                        else self._decode_pending("sha256:" + hexd, pending))
                if data is not None:
                    self.put("sha256:" + hexd, data, verified=True)
            except (OSError, ColdstartError) as exc:
                self._log_write_error(hexd, exc)
            finally:
                data = None
                with self._lock:
                    # what is pending now: a read may have swapped in the decoded bytes
                    gone = self._pending.pop(hexd, None)
                    if gone is not None:
                        self._pending_bytes -= _held(gone)
                    self._pending_cv.notify_all()
                gone, pending = None, b""       # held no longer than this write

    def _wait_at_gate(self, gate: Callable[[float], bool], gated: int) -> bool:
        """Wait (in short steps) until ``gate`` says the node is quiet: True; False once
        ``_GATE_WAIT`` is over, the backlog has grown past ``gated`` bytes, or a flush or close
        wants the writes now."""
        give_up = time.monotonic() + _GATE_WAIT
        while True:
            left = give_up - time.monotonic()
            if left <= 0:
                return False
            try:
                if gate(min(_GATE_STEP, left)):
                    return True
            except Exception:   # a broken gate must not stop the writes
                log.exception("chunk cache: write gate failed")
                return False
            with self._lock:
                if self._backlog_full_locked(gated) or self._flushing or self._closed:
                    return False

    def _count_write_error(self) -> None:
        with self._lock:
            self.stats.write_errors += 1
        self._report(WRITE_ERROR)

    def _report(self, kind: str) -> None:
        if self.on_error is not None:
            try:
                self.on_error(kind)
            except Exception:  # a telemetry hook must not break the data path
                log.exception("chunk cache: on_error hook failed")

    def _log_write_error(self, hexd: str, exc: BaseException) -> None:
        """Log a failed background write; repeats of one errno at most once a minute (a full
        disk fails every write)."""
        code = exc.errno if isinstance(exc, OSError) else None
        now = time.monotonic()
        with self._lock:
            last_code, last_at = self._err_logged
            if code is not None and code == last_code and \
                    now - last_at < _WRITE_ERROR_LOG_INTERVAL:
                self._err_unlogged += 1
                return
            unlogged, self._err_unlogged = self._err_unlogged, 0
            self._err_logged = (code, now)
        more = f" ({unlogged} more failed writes not logged)" if unlogged else ""
        log.warning("chunk cache %s: writing sha256:%s failed: %s; not cached, served from "
                    "the registry%s", self.dir, hexd, exc, more)

    def _backlog_full_locked(self, gated: int) -> bool:
        """Past this, the writer writes at once (the gate's limits: bytes, and chunks)."""
        return self._pending_bytes >= gated or len(self._pending) >= _MAX_PENDING_CHUNKS // 2

    def backlog(self) -> tuple[int, int]:
        """(bytes, chunks) waiting for the writer thread."""
        with self._lock:
            return self._pending_bytes, len(self._pending)

    def wait_backlog(self, most_bytes: int, most_chunks: int, timeout: float,
                     stop: threading.Event | None = None) -> bool:
        """Block while more than ``most_bytes`` or ``most_chunks`` wait for the writer (a
        background fill lets the writer catch up before it fetches more: the room above is
        the on-demand reads'), at most ``timeout`` seconds; False if still over then or
        ``stop`` is set; True at once once the cache is closed."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._pending_bytes > most_bytes or len(self._pending) > most_chunks:
                if self._closed:        # nothing will be written: nothing to wait for
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or (stop is not None and stop.is_set()):
                    return False
                self._pending_cv.wait(min(left, 0.5))
        return True

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every :meth:`put_async` chunk is on disk; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._flushing += 1       # no waiting at the gate meanwhile
            try:
                while self._pending:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._pending_cv.wait(min(left, 0.5))
            finally:
                self._flushing -= 1
        return True

    def close(self) -> None:
        """Write what is pending, then stop the writer thread, stop appending to the current
        pack and close idle pack descriptors (later reads reopen what they need)."""
        self.flush()
        with self._lock:
            self._closed = True
            self._touches.clear()
            self._pending_cv.notify_all()
        self._packs.stop_appending()

    # -- removal -------------------------------------------------------------------------------

    def _drop(self, hexd: str) -> None:
        with self._lock:
            packed = hexd in self._ix.packed
        empty = self._ix.forget(hexd)
        if empty is not None:
            with contextlib.suppress(OSError):
                os.unlink(empty.path)
        if not packed:
            try:
                self._files.unlink(hexd)
            except OSError as exc:  # a read-only or foreign cache dir: the read is a miss anyway
                log.warning("chunk cache: cannot remove %s: %s", hexd, exc)

    def _evict(self, keep: str | None = None) -> None:
        """Remove least-recently-used chunks and packs until the cache fits its limit (the
        index chooses; the files go here, outside its lock)."""
        files, packs = self._ix.evict(keep)
        for hexd in files:
            self._files.unlink(hexd)
        for path in packs:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def remove(self, digest: str) -> None:
        """Delete one chunk (no error if it is absent). A packed chunk leaves the index; its
        bytes go with its pack."""
        self._drop(_hex_of(digest))

    def reclaim(self, digests: Iterable[str]) -> int:
        """Delete ``digests`` (those present) and give their disk space back; returns how many
        were present.

        A loose chunk's file is unlinked. Packed chunks leave the index, and each pack of this
        process that held one is compacted: the chunks it still holds (other layers') are
        verified and appended to a new pack, then the old pack is unlinked. The pack being
        appended to is sealed first, so it is compacted too. A reader that looks for a moved
        chunk in between finds it a moment later, or misses and fetches it again."""
        with self._reclaim_lock:
            present: list[str] = []
            touched: set[str] = set()
            with self._lock:
                for digest in digests:
                    hexd = _hex_of(digest)
                    if hexd in self._ix.sizes:
                        present.append(hexd)
                        ent = self._ix.packed.get(hexd)
                        if ent is not None and ent[0].own:
                            touched.add(ent[0].name)
                wpack = self._ix.wpack
            if wpack is not None and wpack.name in touched:
                self._packs.stop_appending()
            for hexd in present:
                self._drop(hexd)
            for name in touched:
                self._compact_pack(name)
            return len(present)

    def _compact_pack(self, name: str) -> None:
        """Move the chunks pack ``name`` still indexes to the current pack, then unlink it."""
        with self._lock:
            pack = self._ix.packs.get(name)
            live = list(self._ix.pack_hexes.get(name, ())) if pack is not None else []
        for hexd in live:
            loc = self._packs.locate(hexd)
            if loc is None or loc[0].name != name:
                continue                                   # gone or moved meanwhile
            old, fd, base, size = loc
            try:
                data = pread_all(fd, size, base)
            finally:
                self._packs.release(old)
            empty = self._ix.forget(hexd)
            if empty is not None:
                with contextlib.suppress(OSError):
                    os.unlink(empty.path)
            if len(data) == size and hashlib.sha256(data).hexdigest() == hexd:
                try:
                    self._packs.append(hexd, data)
                except OSError as exc:                     # a full disk: the chunk is refetched
                    self._log_write_error(hexd, exc)
