"""Footers at the end of seekable layers: where the TOC is.

* eStargz: a 51-byte empty gzip member whose Extra field holds ``%016x`` TOC offset + ``STARGZ``
  in an ``SG`` subfield; the legacy stargz footer (47 bytes) holds the same 22 bytes bare.
* zstd:chunked: a zstd skippable frame whose payload is eight little-endian uint64 (TOC offset,
  length, uncompressed length, manifest type, tar-split offset, length, uncompressed length,
  ``GNUlInUx``); stargz-snapshotter's older variant has five (no tar-split, magic ``GnUlInUx``).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from coldstart.errors import FormatError

__all__ = [
    "ESTARGZ_FOOTER_SIZE",
    "ESTARGZ_LEGACY_FOOTER_SIZE",
    "SKIPPABLE_MAGIC",
    "ZSTD_CHUNKED_FOOTER_SIZE",
    "ZSTD_CHUNKED_LEGACY_FOOTER_SIZE",
    "Footer",
    "estargz_footer",
    "parse_footer",
    "skippable_frame",
    "zstd_chunked_footer",
    "zstd_chunked_legacy_footer",
]

ESTARGZ_FOOTER_SIZE = 51
ESTARGZ_LEGACY_FOOTER_SIZE = 47
#: Sizes on disk, skippable frame header (8 bytes) included.
ZSTD_CHUNKED_FOOTER_SIZE = 8 + 64
ZSTD_CHUNKED_LEGACY_FOOTER_SIZE = 8 + 40
SKIPPABLE_MAGIC = b"\x50\x2a\x4d\x18"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_CHUNKED_MAGIC = b"GNUlInUx"
_ZSTD_CHUNKED_LEGACY_MAGIC = b"GnUlInUx"
#: containers/storage's manifest type for a TOC in the eStargz-style JSON ("CRFS").
MANIFEST_TYPE_CRFS = 1
_EMPTY_DEFLATE_AND_TRAILER = b"\x01\x00\x00\xff\xff" + b"\x00" * 8
_HEX16_STARGZ = re.compile(rb"[0-9a-f]{16}STARGZ\Z")


@dataclass(frozen=True, slots=True)
class Footer:
    """What a footer says. Offsets are of the TOC payload as the footer states them."""

    format: str  # "estargz" | "zstd:chunked"
    size: int  # bytes the footer occupies at the end of the blob
    toc_offset: int
    toc_length: int = 0  # compressed (zstd:chunked only; eStargz: up to the footer)
    toc_uncompressed: int = 0
    tarsplit_offset: int = 0
    tarsplit_length: int = 0
    tarsplit_uncompressed: int = 0
    legacy: bool = False


def estargz_footer(toc_offset: int) -> bytes:
    """The 51-byte eStargz footer pointing at ``toc_offset``."""
    payload = b"%016xSTARGZ" % toc_offset
    extra = b"SG" + struct.pack("<H", len(payload)) + payload
    header = b"\x1f\x8b\x08\x04" + b"\x00" * 4 + b"\x00\xff" + struct.pack("<H", len(extra))
    return header + extra + _EMPTY_DEFLATE_AND_TRAILER


def skippable_frame(payload: bytes) -> bytes:
    """Wrap ``payload`` in a zstd skippable frame (ignored by ``zstd -d``)."""
    return SKIPPABLE_MAGIC + struct.pack("<I", len(payload)) + payload


def zstd_chunked_footer(toc_offset: int, toc_length: int, toc_uncompressed: int,
                        ts_offset: int, ts_length: int, ts_uncompressed: int) -> bytes:
    """The 64-byte zstd:chunked footer, wrapped in its skippable frame (72 bytes)."""
    payload = struct.pack("<7Q", toc_offset, toc_length, toc_uncompressed, MANIFEST_TYPE_CRFS,
                          ts_offset, ts_length, ts_uncompressed) + _ZSTD_CHUNKED_MAGIC
    return skippable_frame(payload)


def zstd_chunked_legacy_footer(toc_offset: int, toc_length: int, toc_uncompressed: int) -> bytes:
    """stargz-snapshotter's 40-byte zstd:chunked footer, in its skippable frame (48 bytes)."""
    payload = struct.pack("<4Q", toc_offset, toc_length, toc_uncompressed, MANIFEST_TYPE_CRFS)
    return skippable_frame(payload + _ZSTD_CHUNKED_LEGACY_MAGIC)


def _parse_estargz(tail: bytes) -> Footer | None:
    for size, legacy in ((ESTARGZ_FOOTER_SIZE, False), (ESTARGZ_LEGACY_FOOTER_SIZE, True)):
        if len(tail) < size:
            continue
        f = tail[-size:]
        if f[:4] != b"\x1f\x8b\x08\x04" or f[-13:] != _EMPTY_DEFLATE_AND_TRAILER:
            continue
        (xlen,) = struct.unpack_from("<H", f, 10)
        extra = f[12 : 12 + xlen]
        if len(extra) != xlen or 12 + xlen + 13 != size:
            continue
        if legacy:
            payload = extra
        else:
            if extra[:2] != b"SG" or struct.unpack_from("<H", extra, 2)[0] != 22:
                continue
            payload = extra[4:]
        if not _HEX16_STARGZ.match(payload):
            continue
        return Footer("estargz", size, int(payload[:16], 16), legacy=legacy)
    return None


def _parse_zstd(tail: bytes) -> Footer | None:
    if len(tail) >= ZSTD_CHUNKED_FOOTER_SIZE and tail[-8:] == _ZSTD_CHUNKED_MAGIC:
        frame = tail[-ZSTD_CHUNKED_FOOTER_SIZE:]
        if frame[:4] != SKIPPABLE_MAGIC or struct.unpack_from("<I", frame, 4)[0] != 64:
            raise FormatError("zstd:chunked footer is not inside a 64-byte skippable frame")
        v = struct.unpack_from("<7Q", frame, 8)
        if v[3] != MANIFEST_TYPE_CRFS:
            raise FormatError(f"zstd:chunked footer: unsupported manifest type {v[3]}")
        return Footer("zstd:chunked", ZSTD_CHUNKED_FOOTER_SIZE, v[0], v[1], v[2], v[4], v[5], v[6])
    if len(tail) >= 40 and tail[-8:] == _ZSTD_CHUNKED_LEGACY_MAGIC:
        v = struct.unpack_from("<4Q", tail, len(tail) - 40)
        if v[3] != MANIFEST_TYPE_CRFS:
            raise FormatError(f"zstd:chunked footer: unsupported manifest type {v[3]}")
        framed = (len(tail) >= ZSTD_CHUNKED_LEGACY_FOOTER_SIZE
                  and tail[-ZSTD_CHUNKED_LEGACY_FOOTER_SIZE:][:4] == SKIPPABLE_MAGIC)
        size = ZSTD_CHUNKED_LEGACY_FOOTER_SIZE if framed else 40
        return Footer("zstd:chunked", size, v[0], v[1], v[2], legacy=True)
    return None


def parse_footer(tail: bytes) -> Footer:
    """Find the footer at the end of ``tail`` (the blob's last bytes); FormatError if none."""
    found = _parse_zstd(tail) or _parse_estargz(tail)
    if found is None:
        raise FormatError("no eStargz or zstd:chunked footer at the end of the blob")
    return found
