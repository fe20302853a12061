"""The fetcher fetches a chunk whose bytes fail to decode or verify once more (a byte flipped
on the wire is transient; ``fetcher.REFETCHES``), and never serves or caches unverified bytes.

The same through a real FUSE server and a proxy that flips bytes: tests/integration/lazy/
test_lazy_faults.py.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from coldstart.cache import ChunkCache
from coldstart.errors import FormatError, IntegrityError
from coldstart.format.layer import open_layer
from coldstart.format.readat import BytesReadAt
from coldstart.lazyfs.fetcher import ChunkFetcher
from coldstart.lazyfs.reader import LayerReader
from coldstart.remote import ReadAtSource
from tests.integration.lazy.lazy_helpers import convert, tar_of


class FlippingSource(ReadAtSource):
    """A local blob whose next ``flips`` range reads come back with one byte flipped."""

    def __init__(self, blob: bytes) -> None:
        super().__init__(BytesReadAt(blob))
        self.flips = 0
        self.requests = 0

    def read_at(self, offset: int, length: int, *, timeout: float | None = None) -> bytes:
        self.requests += 1
        data = bytearray(super().read_at(offset, length, timeout=timeout))
        if self.flips > 0 and data:
            self.flips -= 1
            data[len(data) // 2] ^= 0x01
        return bytes(data)


@pytest.mark.parametrize("fmt", ["zstd:chunked", "estargz"])
def test_a_flipped_chunk_is_fetched_once_more_then_refused(tmp_path: Path, fmt: str) -> None:
    """One flipped answer: the chunk is fetched again and the read gets the right bytes. Two:
    the read fails with the verification error after exactly two requests, nothing cached."""
    files = {"a.bin": os.urandom(50_000), "b.bin": os.urandom(50_000)}
    blob, res = convert(tar_of(files), fmt)
    src = FlippingSource(blob)
    layer = open_layer(src, annotations=res.annotations)
    cache = ChunkCache(tmp_path / "cache", max_bytes=1 << 30)
    fetcher = ChunkFetcher(cache, concurrency=2, request_timeout=5.0)
    reader = LayerReader(res.digest, layer, src, fetcher, read_deadline=10.0, neighbor_bytes=0)
    try:
        a = layer.resolve("a.bin")
        src.flips, src.requests = 1, 0
        assert reader.read(a, 0, a.size) == files["a.bin"]
        assert src.requests == 2 and reader.stats.refetched_chunks == 1
        assert reader.stats.errors == 0 and reader.stats.last_error == ""
        b = layer.resolve("b.bin")
        src.flips, src.requests = 2, 0
        with pytest.raises((IntegrityError, FormatError)):
            reader.read(b, 0, b.size)
        assert src.requests == 2 and reader.stats.refetched_chunks == 2
        assert cache.flush()
        for c in b.chunks:
            assert c.digest not in cache
        for c in a.chunks:
            got = cache.get(c.digest)
            assert got is not None and "sha256:" + hashlib.sha256(got).hexdigest() == c.digest
    finally:
        fetcher.close()
        cache.close()
