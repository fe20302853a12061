"""The one protocol every blob source meets, and the local-file source.

``read_at(offset, length)`` returns exactly ``length`` bytes, or raises ``FormatError`` when the
range is outside the blob (``Unavailable`` when the source fails); ``size()`` is the blob's length.
This is ``coldstart.format.readat.ReadAt``, so a format reader can read a registry blob, an S3
object or a local file alike.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Protocol, runtime_checkable

from coldstart.errors import FormatError, InvalidArgument, NotFound
from coldstart.format.readat import check_range

__all__ = ["BlobSource", "LocalFileBlob"]


@runtime_checkable
class BlobSource(Protocol):
    """Random access to an immutable blob (same shape as ``coldstart.format.readat.ReadAt``)."""

    def read_at(self, offset: int, length: int) -> bytes: ...

    def size(self) -> int: ...


class LocalFileBlob:
    """A blob in a local file, read with ``pread`` (thread-safe, no shared file position)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self._fd: int | None = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError as exc:
            raise NotFound(f"blob file {self.path} does not exist") from exc
        self._size = os.fstat(self._fd).st_size
        self._lock = threading.Lock()
        self.requests = 0
        self.bytes_read = 0

    def size(self) -> int:
        return self._size

    def read_at(self, offset: int, length: int) -> bytes:
        check_range(offset, length, self._size)
        fd = self._fd
        if fd is None:
            raise InvalidArgument(f"blob file {self.path} is closed")
        parts = []
        end = offset + length
        pos = offset
        while pos < end:
            chunk = os.pread(fd, end - pos, pos)
            if not chunk:
                raise FormatError(f"{self.path}: file shrank while reading at {pos}")
            parts.append(chunk)
            pos += len(chunk)
        data = b"".join(parts)
        with self._lock:
            self.requests += 1
            self.bytes_read += len(data)
        return data

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> LocalFileBlob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
