"""What stands between a lazy mount and wrong bytes, one check per test, through the real FUSE
server, a real registry and a misbehaving proxy.

- A TOC that does not match its annotation: refused by :func:`open_layer` when the layer is
  opened, and by ``check_same_toc`` when a second mount names a layer served already. Each test
  first makes sure which of the two paths it takes (the layer is served or not), so neither
  depends on what another test mounted before.
- A chunk whose bytes are wrong: a flip inside a compressed block is rejected by the zstd
  decoder already; a flip inside a raw (stored) zstd block of incompressible data, and a chunk
  swapped for another valid frame or gzip member of the same size, decode cleanly, so the chunk
  digest (``SeekableLayer.decode_chunk``, called by the fetcher) alone catches them. A flip in
  an eStargz member cannot get past the decoder (gzip ends every member with a CRC-32 of its
  data, which zlib checks), so for eStargz the swapped member is the case the decoder accepts.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import random
from pathlib import Path

import pytest

from coldstart.errors import FailedPrecondition, IntegrityError, NotFound
from coldstart.format.codec import gunzip_member, unzstd_frame
from coldstart.format.layer import ESTARGZ_TOC_DIGEST, ZSTD_CHUNKED_MANIFEST_CHECKSUM, open_layer
from coldstart.format.readat import BytesReadAt
from coldstart.format.toc import Chunk
from coldstart.lazyfs.client import FuseServerClient
from coldstart.lazyfs.mountsys import is_mountpoint
from coldstart.lazyfs.spec import LayerSpec
from tests.fixtures.procs import wait_for
from tests.integration.lazy.lazy_helpers import (
    Server,
    SourceTree,
    convert,
    in_cache,
    metadata_tar,
    push_layer,
    sha,
    tar_of,
)
from tests.integration.lazy.lazy_proxy import Proxy

pytestmark = pytest.mark.integration

FORMATS = ["zstd:chunked", "estargz"]
TOC_KEY = {"estargz": ESTARGZ_TOC_DIGEST, "zstd:chunked": ZSTD_CHUNKED_MANIFEST_CHECKSUM}
WRONG_DIGEST = "sha256:" + "0" * 64


def opaque_tree(seed: int, size: int = 40_000) -> SourceTree:
    """Two files of incompressible bytes (one chunk each; zstd stores them in raw blocks):
    ``opaque.bin``, then ``witness.bin``. Each seed gives a layer no other test mounts."""
    rng = random.Random(seed)
    files = {"opaque.bin": rng.randbytes(size), "witness.bin": rng.randbytes(size)}
    return SourceTree(tar_of(files), files)


def served(client: FuseServerClient) -> set[str]:
    """Digests of the layers the server serves (a layer lives while a mountpoint shows it)."""
    return {s["digest"] for s in client.status()}


def changed(spec: LayerSpec, **changes: object) -> LayerSpec:
    return LayerSpec(**{**json.loads(spec.to_json()), **changes})


def lying_and_unannotated(spec: LayerSpec, fmt: str) -> tuple[LayerSpec, LayerSpec]:
    """``spec`` with a wrong TOC digest annotation, and without one (neither names a manifest,
    so the server must take the spec's annotations)."""
    bad = changed(spec, annotations={**spec.annotations, TOC_KEY[fmt]: WRONG_DIGEST},
                  manifest_digest="")
    unverified = changed(spec, annotations={k: v for k, v in spec.annotations.items()
                                            if k != TOC_KEY[fmt]}, manifest_digest="")
    return bad, unverified


def mountpoint(tmp: Path, name: str) -> Path:
    mp = tmp / name
    mp.mkdir()
    return mp


def only_chunk(blob: bytes, annotations: dict[str, str], name: str) -> Chunk:
    chunks = open_layer(BytesReadAt(blob), annotations=annotations).resolve(name).chunks
    assert len(chunks) == 1 and chunks[0].digest, name
    return chunks[0]


# -- the TOC: on first mount, and on a mount of a layer served already ---------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_toc_not_matching_its_annotation_is_refused_when_the_layer_is_opened(
        server: Server, proxy: Proxy, fmt: str) -> None:
    _, client, tmp = server
    tree = opaque_tree(100 + FORMATS.index(fmt))
    blob, res = convert(tree.tar, fmt)
    spec = push_layer(proxy.upstream_host, f"integrity/open-{fmt[:4]}", blob, res,
                      pull_host=proxy.host)
    # not served: the mounts below open the layer, so open_layer's check is the one tested
    assert spec.digest not in served(client)
    mp = mountpoint(tmp, f"open-{fmt[:4]}")
    # no manifest digest: the server must take the spec's annotations, not the manifest's
    bad, unverified = lying_and_unannotated(spec, fmt)
    with pytest.raises(IntegrityError, match="does not match the annotation"):
        client.mount(str(mp), bad)
    with pytest.raises(FailedPrecondition, match="no TOC digest annotation"):
        client.mount(str(mp), unverified)
    assert not is_mountpoint(str(mp)) and spec.digest not in served(client)
    with pytest.raises(NotFound):
        client.check(str(mp))
    # the same layer with its true annotation mounts: the refusals were about the TOC digest
    client.mount(str(mp), spec)
    assert (mp / "opaque.bin").read_bytes() == tree.files["opaque.bin"]
    client.unmount(str(mp))


@pytest.mark.parametrize("fmt", FORMATS)
def test_toc_not_matching_its_annotation_is_refused_when_the_layer_is_served_already(
        server: Server, proxy: Proxy, fmt: str) -> None:
    _, client, tmp = server
    tree = opaque_tree(110 + FORMATS.index(fmt))
    blob, res = convert(tree.tar, fmt)
    spec = push_layer(proxy.upstream_host, f"integrity/again-{fmt[:4]}", blob, res,
                      pull_host=proxy.host)
    first = mountpoint(tmp, f"again-{fmt[:4]}-1")
    client.mount(str(first), spec)
    # served: a second mount is not opened again, so check_same_toc is the one tested
    assert spec.digest in served(client)
    second = mountpoint(tmp, f"again-{fmt[:4]}-2")
    bad, unverified = lying_and_unannotated(spec, fmt)
    with pytest.raises(IntegrityError, match="does not match the served layer's TOC"):
        client.mount(str(second), bad)
    with pytest.raises(FailedPrecondition, match="no TOC digest annotation"):
        client.mount(str(second), unverified)
    assert not is_mountpoint(str(second))
    with pytest.raises(NotFound):
        client.check(str(second))
    client.check(str(first))                       # the first mount is left alone
    # the true annotation shares the served layer
    client.mount(str(second), spec)
    assert (second / "opaque.bin").read_bytes() == tree.files["opaque.bin"]
    client.unmount(str(second))
    client.unmount(str(first))


# -- chunks: what the decoder rejects, and what only the chunk digest can catch ------------------


def assert_read_refused_and_nothing_cached(server: Server, spec: LayerSpec, mp: Path,
                                           tree: SourceTree, bad: Chunk, witness: Chunk) -> None:
    """``opaque.bin`` reads fail with EIO (twice: the wrong bytes were not kept in memory
    either), the error names the chunk, and its digest never reaches the cache on disk."""
    _, client, tmp = server
    for _ in range(2):
        with pytest.raises(OSError) as exc:
            (mp / "opaque.bin").read_bytes()
        assert exc.value.errno == errno.EIO
    st = next(s for s in client.status() if s["digest"] == spec.digest)
    assert "IntegrityError" in st["last_error"] and bad.digest in st["last_error"]
    # the cache writes in one thread, in order: once a chunk fetched after the bad one is on
    # disk, the bad one would be too, had it been put
    assert (mp / "witness.bin").read_bytes() == tree.files["witness.bin"]
    wait_for(lambda: in_cache(tmp / "root/cache", witness.digest), timeout=30,
             what="the witness chunk written to the cache")
    assert not in_cache(tmp / "root/cache", bad.digest)


def test_corrupted_chunk_is_eio_not_cached_and_logged(server: Server, proxy: Proxy) -> None:
    """A flip inside a compressed zstd block: the decoder already rejects it."""
    _, client, tmp = server
    tree = metadata_tar(big_size=1 << 20, seed=2)
    blob, res = convert(tree.tar, "zstd:chunked")
    spec = push_layer(proxy.upstream_host, "integrity/corrupt", blob, res, pull_host=proxy.host)
    mp = mountpoint(tmp, "corrupt")
    client.mount(str(mp), spec)
    chunk = only_chunk(blob, spec.annotations, "usr/share/doc/f020.txt")
    proxy.flip = (chunk.offset + 3, chunk.offset + 40)
    try:
        with pytest.raises(OSError) as exc:
            (mp / "usr/share/doc/f020.txt").read_bytes()
        assert exc.value.errno == errno.EIO
    finally:
        proxy.flip = None
    assert not in_cache(tmp / "root/cache", chunk.digest)
    st = next(s for s in client.status() if s["digest"] == spec.digest)
    assert chunk.digest in st["last_error"] and spec.digest in st["last_error"]
    log = (tmp / "fuse-server.log").read_text()
    assert any(spec.digest in line and chunk.digest in line and "usr/share/doc/f020.txt" in line
               for line in log.splitlines())
    # the proxy behaves again: the same read now succeeds and is cached
    assert (mp / "usr/share/doc/f020.txt").read_bytes() == tree.files["usr/share/doc/f020.txt"]
    wait_for(lambda: in_cache(tmp / "root/cache", chunk.digest), timeout=30,
             what="the chunk written to the cache")     # written by the cache's writer thread


def test_flip_in_a_raw_zstd_block_is_caught_by_the_chunk_digest(server: Server,
                                                                 proxy: Proxy) -> None:
    """Bytes inverted in transit inside a raw block: the frame still decodes (zstandard writes
    no content checksum by default), to other bytes of the same length."""
    _, client, tmp = server
    tree = opaque_tree(120)
    blob, res = convert(tree.tar, "zstd:chunked")
    bad = only_chunk(blob, res.annotations, "opaque.bin")
    witness = only_chunk(blob, res.annotations, "witness.bin")
    frame = bytearray(blob[bad.offset : bad.end_offset])
    lo = len(frame) // 2                           # well past the frame and block headers
    for i in range(lo, lo + 32):
        frame[i] ^= 0xFF                           # what the proxy does to these bytes
    # the premise: the decoder accepts the flipped frame, only the digest can tell
    out, more = unzstd_frame(bytes(frame), bad.chunk_size, what="flipped")
    assert len(out) == bad.chunk_size and not more and out != tree.files["opaque.bin"]
    spec = push_layer(proxy.upstream_host, "integrity/raw-flip", blob, res, pull_host=proxy.host)
    mp = mountpoint(tmp, "raw-flip")
    client.mount(str(mp), spec)
    proxy.flip = (bad.offset + lo, bad.offset + lo + 32)
    try:
        assert_read_refused_and_nothing_cached(server, spec, mp, tree, bad, witness)
    finally:
        proxy.flip = None
    # the proxy behaves again: the same read succeeds and is cached
    assert (mp / "opaque.bin").read_bytes() == tree.files["opaque.bin"]
    wait_for(lambda: in_cache(tmp / "root/cache", bad.digest), timeout=30,
             what="the chunk written to the cache")
    client.unmount(str(mp))


@pytest.mark.parametrize("fmt", FORMATS)
def test_chunk_swapped_for_a_valid_one_of_the_same_size_is_caught_by_its_digest(
        server: Server, proxy: Proxy, fmt: str) -> None:
    """A blob whose TOC is the true one (it matches the annotation) but whose chunk is another
    file's: a complete zstd frame, or a gzip member with its own right CRC, of the same size."""
    _, client, tmp = server
    tree = opaque_tree(130 + FORMATS.index(fmt))
    other = opaque_tree(140 + FORMATS.index(fmt))     # same names and sizes, other bytes
    blob, res = convert(tree.tar, fmt)
    other_blob, other_res = convert(other.tar, fmt)
    bad = only_chunk(blob, res.annotations, "opaque.bin")
    witness = only_chunk(blob, res.annotations, "witness.bin")
    swap = only_chunk(other_blob, other_res.annotations, "opaque.bin")
    assert (swap.offset, swap.end_offset) == (bad.offset, bad.end_offset)   # stored: same size
    spliced = (blob[: bad.offset] + other_blob[swap.offset : swap.end_offset]
               + blob[bad.end_offset :])
    # the premise: the swapped frame or member decodes cleanly, to the other file's bytes
    inflate = gunzip_member if fmt == "estargz" else unzstd_frame
    out, _ = inflate(spliced[bad.offset : bad.end_offset], bad.chunk_size, what="swapped")
    assert out == other.files["opaque.bin"]
    open_layer(BytesReadAt(spliced), annotations=res.annotations)   # the TOC still verifies
    res = dataclasses.replace(res, digest="sha256:" + sha(spliced), size=len(spliced))
    spec = push_layer(proxy.upstream_host, f"integrity/swapped-{fmt[:4]}", spliced, res,
                      pull_host=proxy.host)
    mp = mountpoint(tmp, f"swapped-{fmt[:4]}")
    client.mount(str(mp), spec)
    assert_read_refused_and_nothing_cached(server, spec, mp, tree, bad, witness)
    client.unmount(str(mp))
