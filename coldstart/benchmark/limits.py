"""What a machine can do with a lazily pulled file without coldstart in the way: the ceiling
the benchmarks put coldstart's reads against (``bench/bench_fuse.py``,
``bench/bench_weights.py``)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from coldstart.format.layer import SeekableLayer
from coldstart.format.toc import Chunk
from coldstart.remote import RegistryBlob

__all__ = ["GROUP_BYTES", "verified_bytes"]

#: compressed bytes of one range GET
GROUP_BYTES = 8 << 20


def verified_bytes(blob: RegistryBlob, layer: SeekableLayer, name: str, threads: int) -> int:
    """Bytes of file ``name`` of ``layer`` fetched, decoded and verified the fastest plain way:
    parallel range GETs of its chunks (``GROUP_BYTES`` each, ``threads`` at once), each chunk
    decompressed and checked against its digest (``decode_chunk``), then dropped (no cache,
    no page cache, nothing handed to a reader). Returns the bytes verified."""
    chunks = [c for c in layer.resolve(name).chunks if not c.zeros]
    groups: list[list[Chunk]] = [[]]
    for c in chunks:
        if groups[-1] and c.end_offset - groups[-1][0].offset > GROUP_BYTES:
            groups.append([])
        groups[-1].append(c)

    def one(group: list[Chunk]) -> int:
        lo, hi = group[0].offset, group[-1].end_offset
        data = blob.read_at(lo, hi - lo)
        # decode_chunk takes bytes: a slice each, as the FUSE server does
        return sum(len(layer.decode_chunk(c, data[c.offset - lo : c.end_offset - lo]))
                   for c in group)

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(one, groups))
