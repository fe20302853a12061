"""Round trips through both writers and the reader, checked against the source tar."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import threading
from pathlib import Path

import pytest
import zstandard

from coldstart.errors import FormatError
from coldstart.format import BytesReadAt, CountingReadAt, convert_layer, open_layer
from coldstart.format.layer import ZSTD_CHUNKED_MANIFEST_POSITION
from coldstart.format.toc import NO_PREFETCH_LANDMARK, PREFETCH_LANDMARK
from tests.unit.format.layers import (
    FORMATS,
    add,
    assert_same_as_tar,
    convert,
    decompress,
    every_kind_tar,
    tar_members,
)


@pytest.fixture(scope="module")
def source_tar(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return every_kind_tar(tmp_path_factory.mktemp("src"))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("compression", ["plain", "gzip", "zstd"])
def test_every_entry_kind_round_trips(source_tar: bytes, fmt: str, compression: str) -> None:
    src = {"plain": source_tar, "gzip": gzip.compress(source_tar),
           "zstd": zstandard.ZstdCompressor().compress(source_tar)}[compression]
    c = convert(src, fmt, chunk_size=64 << 10)
    assert_same_as_tar(c.layer, source_tar)
    assert c.layer.verified
    # The output is an ordinary layer: decompressing it all gives the tar whose digest is the
    # diff_id, and that tar holds the same files.
    plain = decompress(c.blob, fmt)
    assert c.result.diff_id == "sha256:" + hashlib.sha256(plain).hexdigest()
    assert_same_as_tar(c.layer, plain) if fmt == "zstd:chunked" else None
    names = {m.name for m, _ in tar_members(plain)}
    assert "usr/lib/big.bin" in names
    if fmt == "estargz":
        assert "stargz.index.json" in names
        assert c.result.annotations["io.containers.estargz.uncompressed-size"] == str(len(plain))
        assert c.result.media_type.endswith("tar+gzip")
    else:
        assert c.result.media_type.endswith("tar+zstd")


def test_sparse_file_is_expanded(source_tar: bytes) -> None:
    if not shutil.which("tar"):
        pytest.fail("GNU tar is needed to make a sparse archive")
    sparse = [m for m, _ in tar_members(source_tar) if m.name == "holes.img"]
    assert sparse and sparse[0].issparse()
    c = convert(source_tar, "zstd:chunked", chunk_size=1 << 20)
    data = c.layer.read_file("holes.img")
    assert len(data) == (3 << 20) + 3
    assert data[1 << 20 : (1 << 20) + 6] == b"island" and data.endswith(b"end")
    assert data.count(0) == len(data) - 9


@pytest.mark.parametrize("fmt", FORMATS)
def test_plain_tools_unpack_the_layer(source_tar: bytes, fmt: str, tmp_path: Path) -> None:
    c = convert(source_tar, fmt)
    blob = tmp_path / "layer"
    blob.write_bytes(c.blob)
    out = tmp_path / "root"
    out.mkdir()
    tool = "zstd -dc" if fmt == "zstd:chunked" else "gzip -dc"
    subprocess.run(f"{tool} {blob} | tar -x --no-same-owner -C {out} --exclude=dev "
                   "--exclude=run", shell=True, check=True)
    assert (out / "etc/hostname").read_bytes() == b"coldstart\n"
    assert (out / "usr/lib/big.bin").read_bytes() == c.layer.read_file("usr/lib/big.bin")
    assert os.path.islink(out / "usr/bin/sh")
    assert os.path.samefile(out / "usr/lib/hard", out / "usr/lib/libfoo.so")
    assert (out / os.fsdecode(b"name-\xff\xfe.bin")).read_bytes() == b"latin-1 name"


@pytest.mark.parametrize("fmt", FORMATS)
def test_chunking_and_ranges(fmt: str) -> None:
    data = os.urandom(100_000)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        add(tf, "f", data)
    c = convert(buf.getvalue(), fmt, chunk_size=8192)
    e = c.layer.toc.entries["f"]
    assert len(e.chunks) == 13 and sum(ch.chunk_size for ch in e.chunks) == len(data)
    for off, ln in [(0, 1), (8191, 2), (50_000, 30_000), (99_999, 10), (0, 100_000), (100_000, 5)]:
        assert c.layer.read_file("f", off, ln) == data[off : off + ln]
    assert [ch.chunk_offset for ch in c.layer.chunks_for(e, 8000, 300)] == [0, 8192]
    # Reading a range costs one request for adjacent chunks.
    counting = CountingReadAt(BytesReadAt(c.blob))
    layer = open_layer(counting, annotations=c.result.annotations)
    assert counting.requests == 1
    counting.reset()
    assert layer.read_file("f", 20_000, 40_000) == data[20_000:60_000]
    assert counting.requests == 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefetch_files_come_first(fmt: str) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        add(tf, "a", b"A" * 10)
        add(tf, "app/", type=tarfile.DIRTYPE, mode=0o755)
        add(tf, "app/main.py", b"print()")
        add(tf, "b", b"B" * 10)
        add(tf, "app/link", type=tarfile.LNKTYPE, link="b")
    c = convert(buf.getvalue(), fmt, prefetch=["app/link", "a"])
    assert c.layer.toc.order[:5] == ["app", "b", "app/link", "a", PREFETCH_LANDMARK]
    assert c.layer.toc.prefetch == ["app", "b", "app/link", "a"]
    assert c.layer.read_file(PREFETCH_LANDMARK) == b"\x0f"
    assert_same_as_tar(c.layer, buf.getvalue())
    plain = convert(buf.getvalue(), fmt, prefetch=[])
    assert plain.layer.toc.order[0] == NO_PREFETCH_LANDMARK and plain.layer.toc.prefetch == []


def test_zstd_chunked_without_prefetch_adds_no_landmark() -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        add(tf, "a", b"x")
    c = convert(buf.getvalue(), "zstd:chunked")
    assert c.layer.toc.order == ["a"]
    e = convert(buf.getvalue(), "estargz")
    assert e.layer.toc.order == [NO_PREFETCH_LANDMARK, "a"]


def test_children_and_synthesized_parents() -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        add(tf, "x/y/z", b"1")
        add(tf, "x/a", b"2")
    c = convert(buf.getvalue(), "zstd:chunked")
    toc = c.layer.toc
    assert toc.children("") == ["x"] and toc.children("x") == ["x/a", "x/y"]
    assert toc.entries["x/y"].type == "dir" and toc.entries["x/y"].mode == 0o755
    assert toc.entries[""].type == "dir"


def test_large_file_over_8gib_streams() -> None:
    """A 8 GiB + 1 byte file, streamed from a generator (never held in memory or on disk)."""
    size = (8 << 30) + 1

    class Gen(io.RawIOBase):
        def __init__(self) -> None:
            info = tarfile.TarInfo("huge.bin")
            info.size = size
            self.parts = [info.tobuf(tarfile.PAX_FORMAT)]
            self.left = size
            self.tail = bytes(-size % 512) + bytes(1024)

        def readable(self) -> bool:
            return True

        def readinto(self, b: memoryview) -> int:  # type: ignore[override]
            if self.parts:
                p = self.parts.pop()
            elif self.left:
                p = b"\x01" if self.left == 1 else bytes(min(len(b), self.left - 1))
                self.left -= len(p)
            else:
                p, self.tail = self.tail[: len(b)], self.tail[len(b) :]
            n = min(len(b), len(p))
            b[:n] = p[:n]
            if n < len(p):
                self.parts.append(p[n:])
            return n

    out = io.BytesIO()
    res = convert_layer(io.BufferedReader(Gen(), 1 << 20), out, chunk_size=256 << 20, level=1)
    layer = open_layer(BytesReadAt(out.getvalue()), annotations=res.annotations)
    e = layer.toc.entries["huge.bin"]
    assert e.size == size and len(e.chunks) == 33
    assert layer.read_file("huge.bin", size - 2, 10) == b"\x00\x01"


@pytest.mark.parametrize("fmt", FORMATS)
def test_converting_a_converted_layer_again(source_tar: bytes, fmt: str) -> None:
    """An eStargz input's TOC and landmark are rewritten, not copied as files."""
    first = convert(source_tar, "estargz", prefetch=["etc/hostname"])
    again = convert(first.blob, fmt, prefetch=["usr/lib/libfoo.so"])
    assert again.layer.toc.prefetch == ["usr/lib/libfoo.so"]  # no explicit parent dirs
    assert "stargz.index.json" not in again.layer.toc.entries
    assert_same_as_tar(again.layer, source_tar)


@pytest.mark.parametrize("fmt", FORMATS)
def test_toc_bigger_than_the_tail_read_costs_one_more_request_unless_placed(fmt: str) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for i in range(300):
            add(tf, f"many/file-{i:04d}", b"%d" % i)
    c = convert(buf.getvalue(), fmt)
    # zstd:chunked's position annotation says where the TOC starts: one request of that size
    placed = fmt == "zstd:chunked"
    unplaced = {k: v for k, v in c.result.annotations.items() if "position" not in k}
    for tail, told, want in ((512 << 10, c.result.annotations, 1),
                             (2048, c.result.annotations, 1 if placed else 2),
                             (2048, unplaced, 2)):
        counting = CountingReadAt(BytesReadAt(c.blob))
        layer = open_layer(counting, annotations=told, tail_read=tail)
        assert counting.requests == want
        assert layer.read_file("many/file-0299") == b"299"
    if placed:
        # the one request starts where the annotation puts the TOC: no byte before it
        counting = CountingReadAt(BytesReadAt(c.blob))
        open_layer(counting, annotations=c.result.annotations, tail_read=2048)
        toc_at = int(c.result.annotations[ZSTD_CHUNKED_MANIFEST_POSITION].split(":")[0])
        assert counting.ranges == [(toc_at, len(c.blob) - toc_at)]


def test_a_lying_toc_position_costs_bytes_never_a_wrong_layer() -> None:
    """The position annotation only sizes the first read: one that says 0 reads the whole
    (small) blob and the layer opens from its footer; one that disagrees with the footer
    is refused; on an eStargz layer it is not looked at."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for i in range(300):
            add(tf, f"many/file-{i:04d}", b"%d" % i)
    c = convert(buf.getvalue(), "zstd:chunked")
    real = c.result.annotations[ZSTD_CHUNKED_MANIFEST_POSITION]
    zero = {**c.result.annotations, ZSTD_CHUNKED_MANIFEST_POSITION: "0:" + real.split(":", 1)[1]}
    counting = CountingReadAt(BytesReadAt(c.blob))
    with pytest.raises(FormatError, match="disagrees with the footer"):
        open_layer(counting, annotations=zero, tail_read=2048)
    assert counting.ranges == [(0, len(c.blob))]
    past = {**c.result.annotations,
            ZSTD_CHUNKED_MANIFEST_POSITION: f"{len(c.blob) * 2}:" + real.split(":", 1)[1]}
    counting = CountingReadAt(BytesReadAt(c.blob))
    with pytest.raises(FormatError, match="disagrees with the footer"):
        open_layer(counting, annotations=past, tail_read=2048)
    assert counting.bytes_read <= 2048          # the default tail read, then refused
    e = convert(buf.getvalue(), "estargz")
    counting = CountingReadAt(BytesReadAt(e.blob))
    told = {**e.result.annotations, ZSTD_CHUNKED_MANIFEST_POSITION: "0:1:1:1"}
    layer = open_layer(counting, annotations=told, tail_read=2048)
    assert counting.ranges[0] == (len(e.blob) - 2048, 2048)      # the default tail read
    assert layer.read_file("many/file-0299") == b"299"


@pytest.mark.parametrize("fmt", FORMATS)
def test_cuts_start_chunks_where_asked_and_every_file_reads_back(fmt: str) -> None:
    """A profiled layer's writer starts chunks at the edges of what a start-up read, and
    every ``chunk_size`` bytes after each start: the layer reads back whole and unpacks the
    same tar; a file with no cuts keeps the fixed grid."""
    import random

    from coldstart.format.writer import chunk_starts

    data = random.Random(3).randbytes(5 * 4096 + 1000)
    other = random.Random(4).randbytes(3 * 8192 + 10)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        add(tf, "lib/big.so", data)
        add(tf, "lib/other.so", other)
        add(tf, "etc/small", b"0123456789")
    tar = buf.getvalue()
    cuts = {"lib/big.so": [4096, 3 * 4096 + 5, 10 ** 9], "etc/small": [5]}
    c = convert(tar, fmt, chunk_size=8192, cuts=cuts)
    big = c.layer.toc.entries["lib/big.so"]
    assert chunk_starts(len(data), 8192, cuts["lib/big.so"]) == [0, 4096, 12288, 12293, 20485]
    assert [ch.chunk_offset for ch in big.chunks] == [0, 4096, 12288, 12293, 20485]
    assert all(ch.chunk_size <= 8192 for ch in big.chunks)
    assert big.digest == "sha256:" + hashlib.sha256(data).hexdigest()
    assert [ch.chunk_offset for ch in c.layer.toc.entries["lib/other.so"].chunks] == \
        [0, 8192, 16384, 24576]
    assert [ch.chunk_offset for ch in c.layer.toc.entries["etc/small"].chunks] == [0, 5]
    assert c.layer.read_file("lib/big.so") == data
    assert c.layer.read_file("etc/small") == b"0123456789"
    assert_same_as_tar(c.layer, tar)
    if fmt == "zstd:chunked":
        # a runtime without coldstart unpacks the same stream (eStargz's TOC is an entry of
        # its stream, and it lists the chunks: there assert_same_as_tar says the rest)
        assert decompress(c.blob, fmt) == decompress(convert(tar, fmt, chunk_size=8192).blob,
                                                      fmt)


def test_source_stream_is_left_alone_after_return() -> None:
    """convert_layer reads src sequentially and no longer once it returns (even on error)."""
    class Src(io.RawIOBase):
        def __init__(self, data: bytes) -> None:
            self.data = data
            self.pos = 0
            self.closed_for_us = False

        def readable(self) -> bool:
            return True

        def readinto(self, b: memoryview) -> int:  # type: ignore[override]
            assert not self.closed_for_us, "read after convert_layer returned"
            n = min(len(b), len(self.data) - self.pos, 7000)
            b[:n] = self.data[self.pos : self.pos + n]
            self.pos += n
            return n

    data = os.urandom(300_000)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        add(tf, "a", data)
    tar = buf.getvalue() + bytes(5 << 20)  # trailing padding the caller may still read
    threads = set(threading.enumerate())
    src = Src(tar)
    out = io.BytesIO()
    result = convert_layer(src, out)  # type: ignore[arg-type]
    src.closed_for_us = True
    blob = out.getvalue()
    assert result.size == len(blob)
    assert open_layer(BytesReadAt(blob), annotations=result.annotations).read_file("a") == data
    # every thread convert_layer started is gone: nothing of it can read src any more
    assert set(threading.enumerate()) == threads
    truncated = Src(tar[:100_000])             # cut inside the file's data
    with pytest.raises(FormatError, match=r"'a'.*end of data"):
        convert_layer(truncated, io.BytesIO())  # type: ignore[arg-type]
    truncated.closed_for_us = True
    assert set(threading.enumerate()) == threads


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_chunk_from_many_threads(fmt: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    data = os.urandom(1 << 20)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        add(tf, "f", data)
    c = convert(buf.getvalue(), fmt, chunk_size=64 << 10)
    chunks = c.layer.toc.entries["f"].chunks * 8

    def decode(ch: object) -> bytes:
        assert ch in chunks
        k = chunks[chunks.index(ch)]
        return c.layer.decode_chunk(k, c.blob[k.offset : k.end_offset])

    with ThreadPoolExecutor(8) as pool:
        out = list(pool.map(decode, chunks))
    for ch, got in zip(chunks, out, strict=True):
        assert got == data[ch.chunk_offset : ch.chunk_offset + ch.chunk_size]
