"""Positional reads: the one way the format layer reads a blob.

A blob may be a local file, an in-memory buffer, or (outside this package) a registry blob
fetched with HTTP range requests. The format code only ever asks for ``(offset, length)``
ranges, so it can be tested on bytes and counted (how many round trips does opening a layer
cost?) without a network.
"""

from __future__ import annotations

import os
import threading
from typing import Protocol, runtime_checkable

from coldstart.errors import FormatError, InvalidArgument

__all__ = ["BytesReadAt", "CountingReadAt", "FileReadAt", "ReadAt", "check_range"]


@runtime_checkable
class ReadAt(Protocol):
    """A blob of known size that can be read at any offset.

    ``read_at`` returns exactly ``length`` bytes, or raises :class:`~coldstart.errors.FormatError`
    (the range is outside the blob) or :class:`~coldstart.errors.Unavailable` (the source failed).
    """

    def read_at(self, offset: int, length: int) -> bytes: ...

    def size(self) -> int: ...


def check_range(offset: int, length: int, size: int) -> None:
    """Raise FormatError unless ``[offset, offset+length)`` lies inside a blob of ``size`` bytes."""
    if offset < 0 or length < 0:
        raise InvalidArgument(f"bad range: offset {offset}, length {length}")
    if offset + length > size:
        raise FormatError(
            f"range {offset}..{offset + length} is outside the blob ({size} bytes)"
        )


class BytesReadAt:
    """A blob held in memory.

    >>> BytesReadAt(b"hello").read_at(1, 3)
    b'ell'
    """

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._data = bytes(data)

    def read_at(self, offset: int, length: int) -> bytes:
        """Return ``length`` bytes from ``offset``."""
        check_range(offset, length, len(self._data))
        return self._data[offset : offset + length]

    def size(self) -> int:
        """The blob's size in bytes."""
        return len(self._data)


class FileReadAt:
    """A blob in a local file, read with ``os.pread`` (safe from many threads at once).

    The file is opened on construction; call :meth:`close` (or use ``with``) when done.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = os.fspath(path)
        self._fd = os.open(self._path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._size = os.fstat(self._fd).st_size

    def read_at(self, offset: int, length: int) -> bytes:
        """Return ``length`` bytes from ``offset``."""
        check_range(offset, length, self._size)
        parts: list[bytes] = []
        done = 0
        while done < length:
            got = os.pread(self._fd, length - done, offset + done)
            if not got:
                raise FormatError(f"{self._path}: file shrank while reading at {offset + done}")
            parts.append(got)
            done += len(got)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def size(self) -> int:
        """The file's size when it was opened."""
        return self._size

    def close(self) -> None:
        """Close the file descriptor (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> FileReadAt:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CountingReadAt:
    """Wraps a ReadAt and counts requests and bytes (for tests and benchmarks)."""

    def __init__(self, inner: ReadAt) -> None:
        self.inner = inner
        self.requests = 0
        self.bytes_read = 0
        self.ranges: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def read_at(self, offset: int, length: int) -> bytes:
        """Read through to the inner blob, counting the request."""
        with self._lock:
            self.requests += 1
            self.bytes_read += length
            self.ranges.append((offset, length))
        return self.inner.read_at(offset, length)

    def size(self) -> int:
        """The inner blob's size (not counted as a request)."""
        return self.inner.size()

    def reset(self) -> None:
        """Zero the counters."""
        with self._lock:
            self.requests = 0
            self.bytes_read = 0
            self.ranges.clear()
