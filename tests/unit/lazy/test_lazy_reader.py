"""The layer reader over local blobs: identity, coalescing, single flight, integrity, deadline."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest

from coldstart.cache import ChunkCache
from coldstart.errors import DeadlineExceeded, FormatError, IntegrityError
from coldstart.format.layer import SeekableLayer, open_layer
from coldstart.format.readat import BytesReadAt, CountingReadAt
from coldstart.lazyfs.coalesce import coalesce
from coldstart.lazyfs.fetcher import ChunkFetcher
from coldstart.lazyfs.reader import LayerReader
from coldstart.remote import ReadAtSource
from tests.integration.lazy.lazy_helpers import convert, metadata_tar, realistic_bytes

FORMATS = ["zstd:chunked", "estargz"]


class GatedSource(ReadAtSource):
    """A local blob whose range reads wait for ``gate`` (to hold fetches in flight)."""

    def __init__(self, data: bytes) -> None:
        self.counting = CountingReadAt(BytesReadAt(data))
        super().__init__(self.counting)
        self.gate = threading.Event()
        self.gate.set()
        self.flip: tuple[int, int] | None = None

    def read_at(self, offset: int, length: int, *, timeout: float | None = None) -> bytes:
        if not self.gate.wait(timeout):
            raise DeadlineExceeded("gated source timed out")
        data = bytearray(self.counting.read_at(offset, length))
        if self.flip is not None:
            a, b = self.flip
            for pos in range(max(a, offset), min(b, offset + length)):
                data[pos - offset] ^= 0xFF
        return bytes(data)


def make(tmp: Path, fmt: str, *, tar: bytes | None = None, chunk_size: int = 64 << 10,
         fetcher: ChunkFetcher | None = None, deadline: float = 10.0,
         prefetch: list[str] | None = None, source: type[GatedSource] = GatedSource,
         ) -> tuple[LayerReader, GatedSource, ChunkFetcher]:
    blob, res = convert(tar if tar is not None else metadata_tar().tar, fmt,
                        chunk_size=chunk_size, prefetch=prefetch)
    src = source(blob)
    layer = open_layer(src, annotations=res.annotations)
    src.counting.reset()
    if fetcher is None:
        fetcher = ChunkFetcher(ChunkCache(tmp / "cache", max_bytes=1 << 30), concurrency=4,
                               max_coalesce_bytes=16 << 20, request_timeout=5.0)
    return LayerReader(res.digest, layer, src, fetcher, read_deadline=deadline), src, fetcher


def read_all(reader: LayerReader, name: str, step: int = 128 << 10) -> bytes:
    entry = reader.layer.resolve(name)
    out = bytearray()
    while len(out) < entry.size:
        out += reader.read(entry, len(out), step)
    return bytes(out)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_file_byte_identical_then_served_from_cache(tmp_path: Path, fmt: str) -> None:
    src_tree = metadata_tar()
    reader, src, _ = make(tmp_path, fmt, tar=src_tree.tar)
    for name, data in src_tree.files.items():
        assert read_all(reader, name) == data, name
    fetched = src.counting.requests
    assert fetched > 0
    for name, data in src_tree.files.items():
        assert read_all(reader, name, 4096) == data, name
    assert src.counting.requests == fetched          # second pass: only the cache
    assert read_all(reader, "usr/bin/tool-link") == src_tree.files["usr/bin/tool"]


def test_small_multi_chunk_file_is_fetched_in_one_request(tmp_path: Path) -> None:
    data = realistic_bytes(1 << 20, 5)
    import io
    import tarfile
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        ti = tarfile.TarInfo("f")
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))
    reader, src, _ = make(tmp_path, "zstd:chunked", tar=buf.getvalue(), chunk_size=64 << 10)
    entry = reader.layer.resolve("f")
    assert len(entry.chunks) == 16
    assert reader.read(entry, 0, 4096) == data[:4096]
    assert src.counting.requests == 1                 # all 16 adjacent chunks, coalesced
    assert read_all(reader, "f") == data
    assert src.counting.requests == 1


def test_coalescing_respects_the_byte_limit() -> None:
    from coldstart.format.toc import Chunk
    chunks = [Chunk(i * 100, (i + 1) * 100, i * 200, 200, f"d{i}") for i in range(10)]
    groups = coalesce(chunks, 350)
    assert [len(g) for g in groups] == [3, 3, 3, 1]
    gap = [Chunk(0, 100, 0, 1, "a"), Chunk(150, 200, 1, 1, "b")]
    assert len(coalesce(gap, 1000)) == 2


def test_concurrent_readers_of_one_chunk_share_one_fetch(tmp_path: Path) -> None:
    reader, src, _ = make(tmp_path, "zstd:chunked")
    entry = reader.layer.resolve("usr/lib/big.so")
    src.gate.clear()
    results: list[bytes] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            results.append(reader.read(entry, 1000, 5000))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    while reader.fetcher.inflight() == 0:
        threading.Event().wait(0.01)
    src.gate.set()
    for t in threads:
        t.join(30)
    assert not errors
    assert len(results) == 8 and len(set(results)) == 1
    assert src.counting.requests == 1


def test_corrupt_chunk_is_eio_and_never_cached(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                               ) -> None:
    reader, src, fetcher = make(tmp_path, "zstd:chunked")
    entry = reader.layer.resolve("usr/lib/big.so")
    target = entry.chunks[3]
    src.flip = (target.offset + 5, target.offset + 9)
    # flipped compressed bytes fail either the zstd decoder or the chunk digest
    with pytest.raises((IntegrityError, FormatError)):
        reader.read(entry, target.chunk_offset, 100)
    assert fetcher.cache is not None and target.digest not in fetcher.cache
    assert reader.digest in caplog.text and target.digest in caplog.text
    assert reader.stats.errors >= 1 and target.digest in reader.stats.last_error
    src.flip = None
    data = realistic_bytes(5 << 20, 3)
    assert reader.read(entry, target.chunk_offset, 100) == \
        data[target.chunk_offset:target.chunk_offset + 100]


def test_hanging_source_hits_the_read_deadline(tmp_path: Path) -> None:
    reader, src, _ = make(tmp_path, "estargz", deadline=0.3)
    entry = reader.layer.resolve("etc/os-release")
    src.gate.clear()
    with pytest.raises(DeadlineExceeded):
        reader.read(entry, 0, 100)
    assert "DeadlineExceeded" in reader.stats.last_error
    src.gate.set()


def test_identical_chunks_of_two_layers_are_fetched_once(tmp_path: Path) -> None:
    tree = metadata_tar()
    r1, s1, fetcher = make(tmp_path, "zstd:chunked", tar=tree.tar)
    r2, s2, _ = make(tmp_path, "zstd:chunked", tar=tree.tar, fetcher=fetcher,
                     chunk_size=64 << 10)
    assert read_all(r1, "usr/lib/big.so") == tree.files["usr/lib/big.so"]
    assert read_all(r2, "usr/lib/big.so") == tree.files["usr/lib/big.so"]
    assert s1.counting.requests > 0 and s2.counting.requests == 0


def test_prefetch_fetches_the_landmarked_files(tmp_path: Path) -> None:
    tree = metadata_tar()
    reader, src, _fetcher = make(tmp_path, "zstd:chunked", tar=tree.tar,
                                prefetch=["usr/bin/sudo", "etc/os-release"])
    assert set(reader.layer.toc.prefetch) >= {"usr/bin/sudo", "etc/os-release"}
    assert reader.prefetcher.prefetch() > 0
    assert reader.stats.prefetch_done
    before = src.counting.requests
    assert read_all(reader, "usr/bin/sudo") == tree.files["usr/bin/sudo"]
    assert src.counting.requests == before


def test_digest_mismatch_after_decoding_is_integrity_error(tmp_path: Path) -> None:
    """A chunk that decodes fine but to other bytes: caught by its digest, not cached."""
    import dataclasses

    reader, _src, fetcher = make(tmp_path, "zstd:chunked")
    entry = reader.layer.resolve("etc/os-release")
    real = entry.chunks[0]
    forged = dataclasses.replace(real, digest="sha256:" + hashlib.sha256(b"other").hexdigest())
    entry.chunks[0] = forged
    with pytest.raises(IntegrityError):
        reader.read(entry, 0, 10)
    assert fetcher.cache is not None and forged.digest not in fetcher.cache
    assert isinstance(reader.layer, SeekableLayer)
