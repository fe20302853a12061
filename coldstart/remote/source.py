"""The one protocol every byte source meets, and the helpers sources share.

:class:`Source`:

- ``size()``: the blob's length in bytes;
- ``read_at(offset, length, *, timeout=None) -> bytes``: exactly ``length`` bytes;
- ``read_into(offset, buffers, *, timeout=None)``: fills ``buffers`` (memoryviews) back to back
  with the bytes from ``offset``: the caller's own memory (tensors, pinned staging), so local
  files are read straight into it with ``preadv`` and network bodies are copied in as they arrive;
- ``close()``: releases descriptors and connections.

Both reads raise :class:`~coldstart.errors.FormatError` (the range is outside the blob),
:class:`~coldstart.errors.Unavailable` (the source failed, retries spent) or
:class:`~coldstart.errors.DeadlineExceeded` (not served within ``timeout`` seconds, retries
included; ``None`` is the source's own default). Without the keyword ``read_at`` is exactly
``coldstart.format.readat.ReadAt``, so format readers read any source. Every source is safe to
read from many threads at once.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from coldstart.errors import Unavailable
from coldstart.format.readat import ReadAt, check_range

__all__ = ["ManyRangeSource", "ReadAtSource", "Source", "as_source", "bytes_view",
           "fill_from_chunks", "read_at_into", "read_many"]


@runtime_checkable
class Source(Protocol):
    """Random access to an immutable blob, each read with its own deadline."""

    def size(self) -> int: ...

    def read_at(self, offset: int, length: int, *, timeout: float | None = None) -> bytes: ...

    def read_into(self, offset: int, buffers: Sequence[memoryview], *,
                  timeout: float | None = None) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class ManyRangeSource(Protocol):
    """A source that may read several ranges in one request (an HTTP multi-range GET):
    ``reads_many()`` says whether it does now; ``read_many(ranges, *, timeout=None) ->
    list[bytes]``, each range exactly as asked, in increasing order and apart, falls back to a
    request per range by itself where the server does not answer those."""

    def reads_many(self) -> bool: ...

    def read_many(self, ranges: Sequence[tuple[int, int]], *,
                  timeout: float | None = None) -> list[bytes]: ...


def read_many(source: Source, ranges: Sequence[tuple[int, int]], *,
              timeout: float | None = None) -> list[bytes]:
    """The bytes of each range ``(offset, length)`` of ``source``: in one request where the
    source reads several at once (:class:`ManyRangeSource`), else one ``read_at`` each."""
    if len(ranges) > 1 and isinstance(source, ManyRangeSource):
        return source.read_many(ranges, timeout=timeout)
    return [source.read_at(off, n, timeout=timeout) for off, n in ranges]


def bytes_view(buf: memoryview) -> memoryview:
    """``buf`` as a flat view of bytes (tensors' views may have another format or shape)."""
    return buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")


def fill_from_chunks(name: str, offset: int, buffers: Sequence[memoryview],
                     chunks: Iterable[bytes | memoryview]) -> None:
    """Copy byte chunks into ``buffers`` in order; :class:`Unavailable` if they end early or
    run long (a body that does not match what was asked for)."""
    idx, pos = 0, 0
    for chunk in chunks:
        view = memoryview(chunk)
        while view.nbytes:
            while idx < len(buffers) and pos == buffers[idx].nbytes:
                idx, pos = idx + 1, 0
            if idx == len(buffers):
                raise Unavailable(f"{name}: server sent more bytes than asked at offset {offset}")
            take = min(view.nbytes, buffers[idx].nbytes - pos)
            buffers[idx][pos : pos + take] = view[:take]
            pos += take
            view = view[take:]
    while idx < len(buffers) and pos == buffers[idx].nbytes:
        idx, pos = idx + 1, 0
    if idx != len(buffers):
        raise Unavailable(f"{name}: short read at offset {offset} (connection closed early)")


def read_at_into(source: Source, offset: int, length: int, timeout: float | None) -> bytes:
    """``read_at`` for a source whose primitive is ``read_into``: the range checked against
    its size (FormatError outside), read into one fresh buffer."""
    check_range(offset, length, source.size())
    buf = bytearray(length)
    if length:
        source.read_into(offset, [memoryview(buf)], timeout=timeout)
    return bytes(buf)


class ReadAtSource:
    """A local :class:`ReadAt` (bytes, file) as a Source; local reads do not wait, so the
    timeout does not apply."""

    def __init__(self, inner: ReadAt) -> None:
        self.inner = inner
        self.name = f"{type(inner).__name__}"

    def read_at(self, offset: int, length: int, *, timeout: float | None = None) -> bytes:
        return self.inner.read_at(offset, length)

    def read_into(self, offset: int, buffers: Sequence[memoryview], *,
                  timeout: float | None = None) -> None:
        views = [bytes_view(b) for b in buffers]
        data = self.inner.read_at(offset, sum(v.nbytes for v in views))
        fill_from_chunks(self.name, offset, views, [data])

    def size(self) -> int:
        return self.inner.size()

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if callable(close):
            close()


def as_source(blob: ReadAt | Source) -> Source:
    """``blob`` itself when its ``read_at`` already takes a timeout, else wrapped in
    :class:`ReadAtSource`."""
    if isinstance(blob, ReadAtSource):
        return blob
    try:
        if "timeout" in inspect.signature(blob.read_at).parameters:
            return blob  # type: ignore[return-value]
    except (TypeError, ValueError):
        pass
    return ReadAtSource(blob)
