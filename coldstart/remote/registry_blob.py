"""A registry blob read with HTTP range requests, with coalesced multi-range reads."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from coldstart.errors import FormatError, InvalidArgument, Unavailable
from coldstart.format.readat import check_range

if TYPE_CHECKING:
    from coldstart.oci.reference import Reference
    from coldstart.oci.registry import RegistryClient

__all__ = ["RegistryBlob", "coalesce"]


def coalesce(ranges: Sequence[tuple[int, int]], max_gap: int,
             max_length: int | None = None) -> list[tuple[int, int]]:
    """Merge ``(offset, length)`` ranges whose gap is at most ``max_gap``; sorted by offset.

    A merge that would make one request longer than ``max_length`` is not done (a single range
    longer than that stays as it is).

    >>> coalesce([(0, 10), (12, 4), (100, 1)], max_gap=2)
    [(0, 16), (100, 1)]
    """
    out: list[tuple[int, int]] = []
    for off, length in sorted(r for r in ranges if r[1] > 0):
        if out and off <= out[-1][0] + out[-1][1] + max_gap:
            start = out[-1][0]
            merged = max(out[-1][0] + out[-1][1], off + length) - start
            if max_length is None or merged <= max_length or off + length <= start + out[-1][1]:
                out[-1] = (start, merged)
                continue
        out.append((off, length))
    return out


class RegistryBlob:
    """Random access to one blob in a registry: ``read_at``/``size`` over range GETs.

    Shares the (thread-safe) client; counts requests and bytes for observability and tests.
    """

    def __init__(self, client: RegistryClient, ref: Reference, digest: str,
                 size: int | None = None, *, timeout: float | None = None) -> None:
        self.client = client
        self.ref = ref
        self.digest = digest
        self.timeout = timeout
        self._size = size
        self._lock = threading.Lock()
        self.requests = 0
        self.bytes = 0

    def size(self) -> int:
        """The blob's size (one HEAD request the first time, unless given)."""
        if self._size is None:
            n = self.client.blob_size(self.ref, self.digest, timeout=self.timeout)
            with self._lock:
                self._size = n
                self.requests += 1
        return self._size

    def _count(self, n: int) -> None:
        with self._lock:
            self.requests += 1
            self.bytes += n

    def read_at(self, offset: int, length: int, *, timeout: float | None = None) -> bytes:
        """Exactly ``length`` bytes from ``offset``, within ``timeout`` seconds (default: the
        blob's). FormatError if the range is outside the blob; Unavailable if the registry
        sends fewer bytes for a range inside a blob of known size."""
        known = self._size
        if known is not None:
            check_range(offset, length, known)
        elif offset < 0 or length < 0:
            raise InvalidArgument(f"bad range: offset {offset}, length {length}")
        if length == 0:
            return b""
        data = self.client.read_blob_range(self.ref, self.digest, offset, length,
                                           timeout=self.timeout if timeout is None else timeout)
        self._count(len(data))
        if len(data) != length:
            if known is not None:
                raise Unavailable(f"blob {self.digest}: asked {length} bytes at {offset}, "
                                  f"registry sent {len(data)}")
            raise FormatError(f"blob {self.digest}: range {offset}..{offset + length} is "
                              f"outside the blob (got {len(data)} bytes)")
        return data

    def read_ranges(self, ranges: Sequence[tuple[int, int]], *, max_gap: int = 64 << 10,
                    max_length: int = 32 << 20) -> list[bytes]:
        """Read several ranges with as few requests as possible; results in input order.

        Ranges closer than ``max_gap`` share one request, up to ``max_length`` bytes each.
        """
        merged = coalesce(ranges, max_gap, max_length)
        fetched = [(off, self.read_at(off, length)) for off, length in merged]
        out: list[bytes] = []
        for off, length in ranges:
            if length == 0:
                out.append(b"")
                continue
            for start, data in fetched:
                if start <= off and off + length <= start + len(data):
                    out.append(data[off - start: off - start + length])
                    break
            else:
                raise FormatError(f"blob {self.digest}: range {off}+{length} beyond its end")
        return out
