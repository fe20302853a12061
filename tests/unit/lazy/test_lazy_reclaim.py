"""A layer nobody mounts any more gives its cache space back; the chunks a mounted layer
shares stay (issue 15, item 3)."""

from __future__ import annotations

import io
import random
import tarfile
from pathlib import Path

from coldstart.cache import ChunkCache
from coldstart.format.layer import open_layer
from coldstart.format.readat import BytesReadAt
from coldstart.format.toc import TOC
from coldstart.lazyfs.reclaim import chunk_digests, reclaim_layer
from tests.integration.lazy.lazy_helpers import convert


def _toc(files: dict[str, bytes]) -> tuple[TOC, BytesReadAt]:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    blob, res = convert(buf.getvalue(), "zstd:chunked", chunk_size=64 << 10)
    return open_layer(BytesReadAt(blob), annotations=res.annotations).toc, BytesReadAt(blob)


def _cache_all(cache: ChunkCache, toc: TOC) -> None:
    for e in toc.entries.values():
        for c in e.chunks:
            if not c.zeros:
                cache.put(c.digest, b"x" * c.chunk_size, verified=True)


def test_the_chunks_only_a_dropped_layer_had_leave_and_shared_ones_stay(tmp_path: Path) -> None:
    rnd = random.Random(15)
    shared = rnd.randbytes(150_000)                       # the same file in both images
    a, _ = _toc({"app/a.bin": rnd.randbytes(300_000), "lib/shared.so": shared,
                 "app/empty": b""})
    b, _ = _toc({"srv/b.bin": rnd.randbytes(200_000), "usr/lib/shared.so": shared})
    cache = ChunkCache(tmp_path, max_bytes=64 << 20, pack_threshold=0)
    _cache_all(cache, a)
    _cache_all(cache, b)
    before = cache.total_bytes
    keep = chunk_digests(b)
    only_a = chunk_digests(a) - keep
    assert only_a and chunk_digests(a) & keep              # the test means something

    removed, freed = reclaim_layer(cache, a, [b])
    assert removed == len(only_a) and freed == 300_000
    assert cache.total_bytes == before - 300_000
    assert not any(cache.contains(d) for d in only_a)
    assert all(cache.contains(d) for d in keep)           # b, and what it shares with a
    assert reclaim_layer(cache, a, [b]) == (0, 0)         # twice: nothing more


def _packs(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "packs").iterdir())


def test_packed_chunks_leave_with_their_packs(tmp_path: Path) -> None:
    rnd = random.Random(16)
    # small chunks are appended to packs of 4 KiB here: 5 files fill one and start the next
    a, _ = _toc({f"f{i}": rnd.randbytes(1500) for i in range(5)})
    cache = ChunkCache(tmp_path, max_bytes=64 << 10)
    assert cache.pack_bytes == 4096
    _cache_all(cache, a)
    cache.flush()
    assert len(_packs(tmp_path)) == 2
    reclaim_layer(cache, a, [])
    assert not any(cache.contains(d) for d in chunk_digests(a))
    assert cache.total_bytes == 0 and not _packs(tmp_path)  # the one being written too


def test_a_pack_shared_with_a_mounted_layer_is_compacted(tmp_path: Path) -> None:
    rnd = random.Random(17)
    a_files = {f"a{i}": rnd.randbytes(3000) for i in range(6)}
    b_files = {f"b{i}": rnd.randbytes(2000) for i in range(6)}
    a, _ = _toc(a_files)
    b, _ = _toc(b_files)
    cache = ChunkCache(tmp_path, max_bytes=64 << 20)       # one pack holds everything
    data: dict[str, bytes] = {}
    for name in [n for pair in zip(a_files, b_files, strict=True) for n in pair]:
        toc, files = (a, a_files) if name in a_files else (b, b_files)
        c = toc.entries[name].chunks[0]
        cache.put(c.digest, files[name], verified=True)     # interleaved, as reads come
        data[c.digest] = files[name]
    cache.flush()
    (old,) = _packs(tmp_path)
    removed, freed = reclaim_layer(cache, a, [b])
    assert removed == 6 and freed >= 6 * 3000
    assert not old.exists()                                # rewritten without a's records
    (new,) = _packs(tmp_path)
    assert new.stat().st_size == cache.total_bytes < 6 * 2000 + 6 * 100
    for d in chunk_digests(b):                             # b's chunks moved, bytes intact
        assert cache.get(d) == data[d]
    assert not any(cache.contains(d) for d in chunk_digests(a))
    # and a fresh process sees the same on disk
    again = ChunkCache(tmp_path, max_bytes=64 << 20)
    assert all(again.contains(d) for d in chunk_digests(b))
    assert not any(again.contains(d) for d in chunk_digests(a))
