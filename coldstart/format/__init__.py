"""coldstart.format: the seekable layer formats (eStargz, zstd:chunked). Pure: stdlib + zstandard.

Read: ``open_layer(blob, annotations=...)`` -> :class:`SeekableLayer` (verified TOC, chunk
mapping, verified chunk decoding). Write: ``convert_layer(src, dst, format=...)``.
"""

from coldstart.format.layer import (
    ESTARGZ_TOC_DIGEST,
    ESTARGZ_UNCOMPRESSED_SIZE,
    MEDIA_TYPE_GZIP,
    MEDIA_TYPE_ZSTD,
    ZSTD_CHUNKED_MANIFEST_CHECKSUM,
    ZSTD_CHUNKED_MANIFEST_POSITION,
    ZSTD_CHUNKED_TARSPLIT_POSITION,
    SeekableLayer,
    is_seekable,
    open_layer,
)
from coldstart.format.readat import BytesReadAt, CountingReadAt, FileReadAt, ReadAt
from coldstart.format.toc import TOC, Chunk, Entry, normalize_name
from coldstart.format.writer import DEFAULT_CHUNK_SIZE, LayerResult, convert_layer

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "ESTARGZ_TOC_DIGEST",
    "ESTARGZ_UNCOMPRESSED_SIZE",
    "MEDIA_TYPE_GZIP",
    "MEDIA_TYPE_ZSTD",
    "TOC",
    "ZSTD_CHUNKED_MANIFEST_CHECKSUM",
    "ZSTD_CHUNKED_MANIFEST_POSITION",
    "ZSTD_CHUNKED_TARSPLIT_POSITION",
    "BytesReadAt",
    "Chunk",
    "CountingReadAt",
    "Entry",
    "FileReadAt",
    "LayerResult",
    "ReadAt",
    "SeekableLayer",
    "convert_layer",
    "is_seekable",
    "normalize_name",
    "open_layer",
]
