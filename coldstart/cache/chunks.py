"""The node-wide chunk cache: decompressed, verified chunks on disk, keyed by their digest.

Layout under ``dir`` (CONVENTIONS §7)::

    sha256/ab/abcdef…   one file per chunk, named by the hex of its content digest
    wip/                 temporary files; a chunk appears under sha256/ only by rename(2)

Keying by content digest means an identical chunk in two layers (or two images) is fetched and
stored once. Writes are two-phase (temp file in ``wip/``, then an atomic rename), so a reader in
this or any other process sees a whole chunk or nothing; two processes writing the same chunk
both rename the same bytes into place, which is harmless. The index (digest → size, in LRU
order) lives in memory and is rebuilt from disk at start, oldest ``mtime`` first; a hit bumps
the file's ``mtime`` (at most once a minute) so the order survives restarts.

Trust: :meth:`ChunkCache.put` hashes the data unless the caller says it already verified it
(the layer reader does: ``decode_chunk`` checks every chunk's digest). Reads check the file's
size against the size the caller expects but do not re-hash (a chunk is only ever renamed into
place whole; ``verify_reads=True`` re-hashes every read for paranoid setups).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
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
# a hit re-stamps the file's mtime (for LRU order across restarts) at most this often
_TOUCH_INTERVAL = 60.0
# temp files older than this are leftovers of a crashed writer
_WIP_MAX_AGE = 3600.0
# put_async blocks while this many bytes wait for the writer thread (backpressure)
_MAX_PENDING = 64 << 20


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
                 durable: bool = False, verify_reads: bool = False) -> None:
        if max_bytes <= 0:
            raise InvalidArgument(f"chunk cache: max_bytes must be positive, not {max_bytes}")
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        self.durable = durable
        self.verify_reads = verify_reads
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # hex -> size, oldest first
        self._touched: dict[str, float] = {}
        self._total = 0
        self._objects = self.dir / "sha256"
        self._wip = self.dir / "wip"
        self._objects.mkdir(parents=True, exist_ok=True)
        self._wip.mkdir(parents=True, exist_ok=True)
        self._pending: dict[str, bytes] = {}       # hex -> data not yet on disk
        self._pending_bytes = 0
        self._pending_cv = threading.Condition(self._lock)
        self._queue: deque[str] = deque()
        self._writer: threading.Thread | None = None
        self._closed = False
        self._rebuild()

    # -- index ---------------------------------------------------------------------------------

    def _rebuild(self) -> None:
        """Index every chunk already on disk (oldest mtime first) and drop stale temp files."""
        found: list[tuple[float, str, int]] = []
        with os.scandir(self._objects) as shards:
            for shard in shards:
                if not shard.is_dir(follow_symlinks=False):
                    continue
                with os.scandir(shard.path) as files:
                    for f in files:
                        if not _HEX_RE.match(f.name) or f.name[:2] != shard.name:
                            continue
                        try:
                            st = f.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        found.append((st.st_mtime, f.name, st.st_size))
        found.sort()
        now = time.time()
        with self._lock:
            self._index.clear()
            self._total = 0
            for mtime, hexd, size in found:
                self._index[hexd] = size
                self._touched[hexd] = mtime
                self._total += size
        with os.scandir(self._wip) as wips:
            for w in wips:
                with contextlib.suppress(OSError):
                    if now - w.stat(follow_symlinks=False).st_mtime > _WIP_MAX_AGE:
                        os.unlink(w.path)
        self._evict()

    def _path(self, hexd: str) -> Path:
        return self._objects / hexd[:2] / hexd

    @property
    def total_bytes(self) -> int:
        """Bytes of chunks this process knows to be in the cache."""
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
        return self._path(hexd).exists()

    # -- reads ---------------------------------------------------------------------------------

    def get(self, digest: str, expected_size: int | None = None) -> bytes | None:
        """The whole chunk, or None on a miss (a file of the wrong size counts as a miss; a
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
        path = self._path(hexd)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._forget(hexd)
            with self._lock:
                self.stats.misses += 1
            return None
        try:
            size = os.fstat(fd).st_size
            if expected_size is not None and size != expected_size:
                log.warning("chunk cache: %s has %d bytes, expected %d; dropping it",
                            digest, size, expected_size)
                self._drop(hexd)
                with self._lock:
                    self.stats.misses += 1
                return None
            if self.verify_reads:
                whole = _pread_all(fd, size, 0)
                if hashlib.sha256(whole).hexdigest() != hexd:
                    log.error("chunk cache: %s is corrupt on disk; dropping it", digest)
                    self._drop(hexd)
                    with self._lock:
                        self.stats.misses += 1
                    return None
                data = whole[offset:] if length < 0 else whole[offset:offset + length]
            else:
                end = size if length < 0 else min(size, offset + length)
                data = _pread_all(fd, max(0, end - offset), offset)
        finally:
            os.close(fd)
        self._hit(hexd, size, len(data))
        return data

    def _hit(self, hexd: str, size: int, nbytes: int) -> None:
        now = time.time()
        touch = False
        with self._lock:
            self.stats.hits += 1
            self.stats.hit_bytes += nbytes
            if hexd in self._index:
                self._index.move_to_end(hexd)
            else:  # written by another process since we started
                self._index[hexd] = size
                self._total += size
            if now - self._touched.get(hexd, 0.0) > _TOUCH_INTERVAL:
                self._touched[hexd] = now
                touch = True
        if touch:
            with contextlib.suppress(OSError):
                os.utime(self._path(hexd))

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
                self._index.move_to_end(hexd)
                return
        path = self._path(hexd)
        if path.exists():  # another process stored it
            self._adopt(hexd, size)
            return
        path.parent.mkdir(exist_ok=True)
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

    def put_async(self, digest: str, data: bytes, *, verified: bool = False) -> None:
        """Like :meth:`put`, but the disk write happens in a writer thread.

        The chunk is readable (from memory) at once; the caller does not wait for the file
        system (creating a file costs 0.2 to 1 ms on a busy disk, more than fetching a small
        chunk). Blocks while too many bytes are waiting (backpressure).
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
        """Write what is pending, then stop the writer thread."""
        self.flush()
        with self._lock:
            self._closed = True
            self._pending_cv.notify_all()

    def _adopt(self, hexd: str, size: int) -> None:
        with self._lock:
            if hexd not in self._index:
                self._index[hexd] = size
                self._total += size
            else:
                self._index.move_to_end(hexd)
            self._touched[hexd] = time.time()

    def _forget(self, hexd: str) -> None:
        with self._lock:
            size = self._index.pop(hexd, None)
            self._touched.pop(hexd, None)
            if size is not None:
                self._total -= size

    def _drop(self, hexd: str) -> None:
        self._forget(hexd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(hexd))

    def _evict(self, keep: str | None = None) -> None:
        """Remove least-recently-used chunks until the cache fits its limit."""
        victims: list[str] = []
        with self._lock:
            while self._total > self.max_bytes and self._index:
                hexd, size = next(iter(self._index.items()))
                if hexd == keep:
                    if len(self._index) == 1:
                        break
                    self._index.move_to_end(hexd)
                    continue
                del self._index[hexd]
                self._touched.pop(hexd, None)
                self._total -= size
                self.stats.evictions += 1
                self.stats.evicted_bytes += size
                victims.append(hexd)
        for hexd in victims:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(hexd))

    def remove(self, digest: str) -> None:
        """Delete one chunk (no error if it is absent)."""
        self._drop(_hex_of(digest))


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
