"""A registry blob checked against its digest: every byte handed out is covered by the check.

:class:`VerifiedRegistryBlob` hashes ranges in file order as they arrive (early ones held, at most
``hold_bytes``; beyond that only their own hash is kept and they are read again when verifying).
:meth:`~VerifiedRegistryBlob.verify` (the weights loader calls it before handing out any tensor)
reads the ranges that were never asked for, in order, ``_VERIFY_PIECE`` bytes at a time, and
raises :class:`~coldstart.errors.IntegrityError` on a mismatch. A partial read therefore still
reads the whole blob once, to verify it.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence

from coldstart.config import WeightsConfig
from coldstart.errors import IntegrityError, InvalidArgument, Unavailable
from coldstart.remote.registry_blob import RangeClient, RegistryBlob
from coldstart.remote.source import bytes_view, fill_from_chunks

__all__ = ["OrderedDigest", "VerifiedRegistryBlob"]

# Size of each read when verifying the ranges a load did not read.
_VERIFY_PIECE = 8 << 20
_HOLD = WeightsConfig().verify_hold_bytes


class OrderedDigest:
    """A digest over a blob whose byte ranges arrive in any order, from many threads.

    Ranges that start at (or before) the ``next`` cursor are hashed at once; ranges that arrive
    early are held until the cursor reaches them, up to ``hold_bytes`` in all. Past that bound
    an early range is not kept: only its own sha256 is recorded, and :meth:`finish` reads it
    again and checks the second copy is the same bytes as the one that was used. So memory
    stays bounded (``hold_bytes`` plus one read) and every byte handed out is covered.
    """

    def __init__(self, algo: str, hold_bytes: int) -> None:
        self.algo = algo
        self._hasher = hashlib.new(algo)
        self._next = 0
        self._hold_bytes = hold_bytes
        self._held_bytes = 0
        self._held: dict[int, bytes] = {}
        self._recorded: dict[int, tuple[int, str]] = {}  # offset -> (length, piece digest)
        self._lock = threading.Lock()
        self.rereads = 0  # bytes read a second time by finish() (for tests and logs)

    def feed(self, offset: int, data: bytes) -> None:
        with self._lock:
            end = offset + len(data)
            if end <= self._next or not data:
                return
            if offset <= self._next:
                self._hasher.update(memoryview(data)[self._next - offset:])
                self._next = end
                self._drain()
            elif self._held_bytes + len(data) <= self._hold_bytes and offset not in self._held:
                self._held[offset] = data
                self._held_bytes += len(data)
            elif offset not in self._held and (offset not in self._recorded
                                               or self._recorded[offset][0] < len(data)):
                self._recorded[offset] = (len(data), hashlib.new(self.algo, data).hexdigest())

    def _drain(self) -> None:
        while True:
            ready = [o for o in self._held if o <= self._next]
            if not ready:
                return
            for o in sorted(ready):
                data = self._held.pop(o)
                self._held_bytes -= len(data)
                if o + len(data) > self._next:
                    self._hasher.update(memoryview(data)[self._next - o:])
                    self._next = o + len(data)

    def finish(self, size: int, read: Callable[[int, int], bytes], what: str) -> str:
        """Hash whatever was not yet hashed, in file order, reading it with ``read``."""
        with self._lock:
            while True:
                self._drain()
                early = [o for o in self._recorded if o <= self._next]
                if early:
                    o = min(early)
                    length, piece = self._recorded.pop(o)
                    self._reread(o, length, piece, read, what)
                    continue
                if self._next >= size:
                    break
                starts = [*self._held, *self._recorded]
                stop = min([size, self._next + _VERIFY_PIECE, *starts])
                data = read(self._next, stop - self._next)
                if len(data) != stop - self._next:
                    raise Unavailable(f"{what}: verifying, the registry sent {len(data)} of "
                                      f"{stop - self._next} bytes at offset {self._next}")
                self.rereads += len(data)
                self._hasher.update(data)
                self._next = stop
            return f"{self.algo}:{self._hasher.hexdigest()}"

    def _reread(self, offset: int, length: int, piece: str,
                read: Callable[[int, int], bytes], what: str) -> None:
        """Read a range that was used but not kept; it must be the same bytes."""
        check = hashlib.new(self.algo)
        pos = offset
        while pos < offset + length:
            n = min(_VERIFY_PIECE, offset + length - pos)
            data = read(pos, n)
            if len(data) != n:
                raise Unavailable(f"{what}: verifying, the registry sent {len(data)} of {n} "
                                  f"bytes at offset {pos}")
            self.rereads += n
            check.update(data)
            if pos + n > self._next:
                self._hasher.update(memoryview(data)[max(0, self._next - pos):])
                self._next = pos + n
            pos += n
        if check.hexdigest() != piece:
            raise IntegrityError(f"{what}: bytes [{offset}:{offset + length}] changed between "
                                 "two reads of the same blob")


class VerifiedRegistryBlob(RegistryBlob):
    """A :class:`RegistryBlob` whose reads feed an :class:`OrderedDigest`; :meth:`verify`
    checks the whole blob against ``digest``.

    >>> blob = VerifiedRegistryBlob(client, ref, digest, timeout=30.0)  # doctest: +SKIP
    >>> blob.read_into(0, [memoryview(buf)]); blob.verify()              # doctest: +SKIP
    """

    def __init__(self, client: RangeClient, ref: object, digest: str,
                 size: int | None = None, *, timeout: float | None = None,
                 hold_bytes: int = _HOLD, name: str | None = None) -> None:
        super().__init__(client, ref, digest, size, timeout=timeout)
        if name is not None:
            self.name = name
        algo = digest.split(":", 1)[0]
        if algo not in hashlib.algorithms_available:
            raise InvalidArgument(f"{self.name}: digest algorithm {algo!r} is not supported")
        self._digest = OrderedDigest(algo, hold_bytes)
        self._verified = False

    def _exact(self, offset: int, length: int, timeout: float | None) -> bytes:
        data = self._fetch(offset, length, timeout)
        if len(data) != length:
            raise Unavailable(f"{self.name}: registry sent {len(data)} of {length} bytes "
                              f"at offset {offset}")
        self._digest.feed(offset, bytes(data))
        return data

    def read_at(self, offset: int, length: int, *, timeout: float | None = None) -> bytes:
        if offset + length > self.size() or offset < 0 or length < 0:
            return super().read_at(offset, length, timeout=timeout)  # raises
        return self._exact(offset, length, timeout) if length else b""

    def read_into(self, offset: int, buffers: Sequence[memoryview], *,
                  timeout: float | None = None) -> None:
        views = [bytes_view(b) for b in buffers]
        total = sum(v.nbytes for v in views)
        if total == 0:
            return
        fill_from_chunks(self.name, offset, views, [self._exact(offset, total, timeout)])

    def reads_many(self) -> bool:
        """Never: each read feeds the blob's digest through :meth:`read_at`."""
        return False

    def read_many(self, ranges: Sequence[tuple[int, int]], *,
                  timeout: float | None = None) -> list[bytes]:
        return [self.read_at(off, n, timeout=timeout) for off, n in ranges]

    @property
    def reread_bytes(self) -> int:
        """Bytes :meth:`verify` had to read a second time (never asked for, or not held)."""
        return self._digest.rereads

    def verify(self) -> None:
        """Check the blob against its digest; :class:`IntegrityError` if it differs."""
        if self._verified:
            return
        got = self._digest.finish(self.size(), lambda o, n: self._fetch(o, n, None), self.name)
        if got != self.digest:
            raise IntegrityError(f"{self.name}: blob content is {got}, not {self.digest} "
                                 "(tampered or wrong blob)")
        self._verified = True
