"""What a machine can do with a lazily pulled file without coldstart in the way: the ceiling
the benchmarks put coldstart's reads against (``bench/bench_fuse.py``,
``bench/bench_weights.py``)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from coldstart.errors import ColdstartError
from coldstart.format.layer import SeekableLayer
from coldstart.format.toc import Chunk
from coldstart.remote import RegistryBlob

__all__ = ["GROUP_BYTES", "WEIGHTS_SUFFIX", "image_limit", "largest_weights", "verified_bytes"]

#: compressed bytes of one range GET
GROUP_BYTES = 8 << 20


def verified_bytes(blob: RegistryBlob, layer: SeekableLayer, name: str, threads: int, *,
                   into: int | None = None) -> int:
    """Bytes of file ``name`` of ``layer`` fetched, decoded and verified the fastest plain way:
    parallel range GETs of its chunks (``GROUP_BYTES`` each, ``threads`` at once), each chunk
    decompressed and checked against its digest (``decode_chunk``). Returns the bytes
    verified (holes, chunks of zeros, are neither fetched nor counted).

    Without ``into`` each chunk is then dropped (no cache, no page cache, nothing handed to a
    reader). ``into``: a descriptor of a file (on tmpfs, say) each verified chunk is written
    into at its place (``pwrite``): the same pipeline with the file's bytes landing in the
    page cache by a CPU copy, as every read through FUSE lands them (one file: the kernel
    takes its writes one at a time, as the FUSE server's page-cache warmer, one thread,
    stores a stream's chunks)."""
    chunks = [c for c in layer.resolve(name).chunks if not c.zeros]
    groups: list[list[Chunk]] = [[]]
    for c in chunks:
        if groups[-1] and c.end_offset - groups[-1][0].offset > GROUP_BYTES:
            groups.append([])
        groups[-1].append(c)

    def one(group: list[Chunk]) -> int:
        lo, hi = group[0].offset, group[-1].end_offset
        data = memoryview(blob.read_at(lo, hi - lo))
        n = 0
        for c in group:
            # a view of each chunk's bytes, as the FUSE server decodes them
            out = layer.decode_chunk(c, data[c.offset - lo : c.end_offset - lo])
            if into is not None:
                view = memoryview(out)
                while view:
                    view = view[os.pwrite(into, view, c.chunk_offset + len(out) - len(view)):]
            n += len(out)
        return n

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(one, groups))


#: the files whose verified-bytes rate ``coldstart bench`` measures: an image's checkpoint
WEIGHTS_SUFFIX = ".safetensors"


def largest_weights(client: Any, ref: Any) -> tuple[RegistryBlob, SeekableLayer, str] | None:
    """The largest ``*.safetensors`` file of the seekable (zstd:chunked, eStargz) image
    ``ref`` (a :class:`~coldstart.oci.reference.Reference`) through ``client`` (a
    :class:`~coldstart.oci.registry.RegistryClient`): its layer's blob, the layer (its TOC
    read) and its name; None when the image holds none. Only the layers' TOCs are read."""
    from coldstart.format.layer import open_layer
    from coldstart.remote import RegistryBlob

    best: tuple[int, RegistryBlob, SeekableLayer, str] | None = None
    for desc in client.resolve(ref).manifest.layers:
        blob = RegistryBlob(client, ref, desc.digest, desc.size)
        try:
            layer = open_layer(blob, annotations=desc.annotations)
        except ColdstartError:      # not a seekable layer: no TOC to look into
            continue
        entries = layer.toc.entries
        for name in [n for n in entries if n.endswith(WEIGHTS_SUFFIX)]:   # names: no Entry built
            entry = entries[name]
            if entry.type == "reg" and (best is None or entry.size > best[0]):
                best = (entry.size, blob, layer, name)
    return None if best is None else best[1:]


def image_limit(found: tuple[RegistryBlob, SeekableLayer, str],
                threads: int) -> tuple[int, float]:
    """:func:`verified_bytes` of the file :func:`largest_weights` found: (bytes, seconds)."""
    blob, layer, name = found
    t0 = time.monotonic()
    n = verified_bytes(blob, layer, name, threads)
    return n, time.monotonic() - t0
