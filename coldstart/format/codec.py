"""Decompression with a hard output cap: a lying size can never make us allocate more.

zlib and zstandard release the GIL while they work, so callers may decode chunks from many
threads at once. Contexts are not thread-safe: each call makes its own, except the zstd one-shot
path, which keeps one per thread.
"""

from __future__ import annotations

import io
import threading
import zlib

import zstandard

from coldstart.errors import FormatError

__all__ = ["gunzip_member", "unzstd_frame"]

_STEP = 1 << 20
_local = threading.local()


def _dctx() -> zstandard.ZstdDecompressor:
    d: zstandard.ZstdDecompressor | None = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def gunzip_member(data: bytes | memoryview, limit: int, *, what: str) -> tuple[bytes, bool]:
    """Inflate the gzip member at the start of ``data``, producing at most ``limit`` bytes.

    Returns ``(output, more)`` where ``more`` says the member holds bytes past ``limit``.
    A truncated or corrupt member raises FormatError naming ``what``.
    """
    d = zlib.decompressobj(wbits=31)
    out = bytearray()
    buf = data
    try:
        while len(out) < limit:
            before = len(buf)
            piece = d.decompress(buf, min(_STEP, limit - len(out)))
            out += piece
            buf = d.unconsumed_tail
            if d.eof:
                return bytes(out), False
            if not piece and (not buf or len(buf) == before):
                # No input left, or none consumed: the member ends early (never spin).
                raise FormatError(f"{what}: gzip member is truncated "
                                  f"({len(out)} of at least {limit} bytes)")
        more = bool(d.decompress(buf, 1)) if not d.eof else False
    except zlib.error as exc:
        raise FormatError(f"{what}: corrupt gzip data: {exc}") from None
    return bytes(out), more


def unzstd_frame(data: bytes | memoryview, limit: int, *, what: str) -> tuple[bytes, bool]:
    """Decompress the zstd frame at the start of ``data``, producing at most ``limit`` bytes.

    Returns ``(output, more)`` like :func:`gunzip_member`. Never reads past the first frame.
    A frame whose header states a size within ``limit`` (what our writer and containers/storage
    write) is decompressed in one call, about three times faster than streaming; it must then
    produce exactly that size.
    """
    try:
        size = zstandard.frame_content_size(data)
    except zstandard.ZstdError:
        size = -1          # not a frame header: the streaming path says what is wrong
    if 0 <= size <= limit:
        try:
            out = _dctx().decompress(data, max_output_size=size)
        except zstandard.ZstdError as exc:
            raise FormatError(f"{what}: corrupt zstd data: {exc}") from None
        if len(out) != size:
            raise FormatError(f"{what}: zstd frame decompresses to {len(out)} bytes, its "
                              f"header says {size}")
        return out, False
    dctx = zstandard.ZstdDecompressor()
    try:
        with dctx.stream_reader(io.BytesIO(data), read_across_frames=False) as reader:
            parts: list[bytes] = []
            got = 0
            while got < limit:
                piece = reader.read(min(_STEP, limit - got))
                if not piece:
                    break
                parts.append(piece)
                got += len(piece)
            more = bool(reader.read(1)) if got >= limit else False
    except zstandard.ZstdError as exc:
        raise FormatError(f"{what}: corrupt zstd data: {exc}") from None
    return b"".join(parts), more
