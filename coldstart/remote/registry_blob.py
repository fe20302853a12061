"""A registry blob as a :class:`~coldstart.remote.source.Source`: HTTP range requests through a
registry client, with coalesced multi-range reads.

The client is taken through :class:`RangeClient`, the two calls this module needs (``oci``'s
``RegistryClient`` is one): remote sits below oci and never imports it. The client owns auth,
mirrors, redirects, retries and deadlines; ``timeout`` here is passed through to each call.

>>> blob = RegistryBlob(client, ref, "sha256:" + "0" * 64, size=1234)    # doctest: +SKIP
>>> blob.read_at(0, 512, timeout=5.0)                                    # doctest: +SKIP
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol, cast

from coldstart.errors import FormatError, InvalidArgument, Unavailable
from coldstart.format.readat import check_range
from coldstart.remote.ranges import coalesce
from coldstart.remote.source import bytes_view, fill_from_chunks

__all__ = ["RangeClient", "RegistryBlob", "coalesce", "open_blob"]


class RangeClient(Protocol):
    """What a registry blob needs of a registry client. ``ref`` is the client's own reference
    type (``coldstart.oci.reference.Reference``), opaque here: typed ``Any`` because a protocol
    parameter typed ``object`` would demand clients that take any object."""

    def blob_size(self, ref: Any, digest: str, *, timeout: float | None = None) -> int: ...

    def read_blob_range(self, ref: Any, digest: str, offset: int, length: int, *,
                        timeout: float | None = None) -> bytes | bytearray: ...


class RegistryBlob:
    """Random access to one blob in a registry: ``read_at``/``read_into``/``size`` over range
    GETs.

    Shares the (thread-safe) client, which it does not close; counts ``requests`` and ``bytes``
    for observability and tests.
    """

    def __init__(self, client: RangeClient, ref: object, digest: str,
                 size: int | None = None, *, timeout: float | None = None) -> None:
        self.client = client
        self.ref = ref
        self.digest = digest
        self.timeout = timeout
        self.name = f"{ref}@{digest}" if "@" not in str(ref) else str(ref)
        self._size = size
        self._lock = threading.Lock()
        self.requests = 0
        self.bytes = 0

    def size(self) -> int:
        """The blob's size (one HEAD request the first time, unless given)."""
        if self._size is None:
            n = int(self.client.blob_size(self.ref, self.digest, timeout=self.timeout))
            with self._lock:
                self._size = n
                self.requests += 1
        return self._size

    def _count(self, n: int) -> None:
        with self._lock:
            self.requests += 1
            self.bytes += n

    def _fetch(self, offset: int, length: int, timeout: float | None) -> bytes:
        data = self.client.read_blob_range(
            self.ref, self.digest, offset, length,
            timeout=self.timeout if timeout is None else timeout)
        self._count(len(data))
        # a bytearray the body was read into in place is handed on as it is, not copied into
        # a bytes (a copy of every fetched byte): read-only like bytes wherever it goes
        # (sliced, viewed, decoded, hashed), never mutated or used as a key
        return cast(bytes, data)

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
        data = self._fetch(offset, length, timeout)
        if len(data) != length:
            if known is not None:
                raise Unavailable(f"blob {self.digest}: asked {length} bytes at {offset}, "
                                  f"registry sent {len(data)}")
            raise FormatError(f"blob {self.digest}: range {offset}..{offset + length} is "
                              f"outside the blob (got {len(data)} bytes)")
        return data

    def read_into(self, offset: int, buffers: Sequence[memoryview], *,
                  timeout: float | None = None) -> None:
        """Fill ``buffers`` back to back from ``offset`` (one range request)."""
        views = [bytes_view(b) for b in buffers]
        total = sum(v.nbytes for v in views)
        if total == 0:
            return
        data = self.read_at(offset, total, timeout=timeout)
        fill_from_chunks(self.name, offset, views, [data])

    def reads_many(self) -> bool:
        """Whether :meth:`read_many` asks several ranges in one request now (the client says
        the registry answers those), rather than a request per range."""
        check = getattr(self.client, "reads_many", None)
        return bool(check is not None and check(self.ref))

    def read_many(self, ranges: Sequence[tuple[int, int]], *,
                  timeout: float | None = None) -> list[bytes]:
        """Exactly the bytes of each range ``(offset, length)`` (non-empty, increasing, apart),
        in one multi-range request where the client and registry answer those, else one
        request each; within ``timeout`` seconds in all (default: the blob's)."""
        known = self._size
        for off, n in ranges:
            if n <= 0:
                raise InvalidArgument(f"bad range: offset {off}, length {n}")
            if known is not None:
                check_range(off, n, known)
            elif off < 0:
                raise InvalidArgument(f"bad range: offset {off}, length {n}")
        many = getattr(self.client, "read_blob_ranges", None)
        if many is None or len(ranges) < 2:
            return [self.read_at(off, n, timeout=timeout) for off, n in ranges]
        got: list[bytes]
        requests: int
        got, requests = many(self.ref, self.digest, ranges,
                             timeout=self.timeout if timeout is None else timeout)
        with self._lock:
            self.requests += requests
            self.bytes += sum(len(b) for b in got)
        for (off, n), data in zip(ranges, got, strict=True):
            if len(data) != n:
                raise Unavailable(f"blob {self.digest}: asked {n} bytes at {off}, registry "
                                  f"sent {len(data)}")
        return got

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

    def close(self) -> None:
        """Nothing to release: the client is shared (its owner closes it)."""


def open_blob(client: RangeClient, ref: object, digest: str, size: int | None = None, *,
              timeout: float | None = None) -> RegistryBlob:
    """A :class:`RegistryBlob` reading ``digest`` of ``ref`` through ``client``.

    >>> blob = open_blob(RegistryClient(), ref, layer.digest, layer.size)  # doctest: +SKIP
    """
    return RegistryBlob(client, ref, digest, size, timeout=timeout)
