"""The one protocol every byte source meets, and the adapter for in-memory and local blobs.

``read_at(offset, length, *, timeout=None)`` returns exactly ``length`` bytes or raises:
:class:`~coldstart.errors.FormatError` (the range is outside the blob),
:class:`~coldstart.errors.Unavailable` (the source failed, retries spent),
:class:`~coldstart.errors.DeadlineExceeded` (not served within ``timeout`` seconds, retries
included; ``None`` is the source's own default). ``size()`` is the blob's length. Without the
keyword this is exactly ``coldstart.format.readat.ReadAt``, so format readers read any source.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from coldstart.format.readat import ReadAt

__all__ = ["ReadAtSource", "Source", "as_source"]


@runtime_checkable
class Source(Protocol):
    """Random access to an immutable blob, each read with its own deadline."""

    def read_at(self, offset: int, length: int, *, timeout: float | None = None) -> bytes: ...

    def size(self) -> int: ...


class ReadAtSource:
    """A local :class:`ReadAt` (bytes, file) as a Source; local reads do not wait, so the
    timeout does not apply."""

    def __init__(self, inner: ReadAt) -> None:
        self.inner = inner

    def read_at(self, offset: int, length: int, *, timeout: float | None = None) -> bytes:
        return self.inner.read_at(offset, length)

    def size(self) -> int:
        return self.inner.size()


def as_source(blob: ReadAt | Source) -> Source:
    """``blob`` itself when it already takes a timeout, else wrapped in :class:`ReadAtSource`."""
    if isinstance(blob, ReadAtSource):
        return blob
    try:
        import inspect

        if "timeout" in inspect.signature(blob.read_at).parameters:
            return blob  # type: ignore[return-value]
    except (TypeError, ValueError):
        pass
    return ReadAtSource(blob)
