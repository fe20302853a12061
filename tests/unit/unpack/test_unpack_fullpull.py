"""coldstart.unpack.fullpull: parallel range fetch that resumes, decompression, and the check
against the chain ID containerd asked for."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zstandard

from coldstart.errors import FormatError, IntegrityError, Unavailable
from coldstart.oci.manifest import chain_id
from coldstart.unpack.fullpull import fetch_blob, pull_layer
from tests.unit.format.layers import every_kind_tar

GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"


class Blob:
    """A registry blob in memory: counts the ranges asked, fails after ``fail_after``."""

    def __init__(self, data: bytes, fail_after: int | None = None) -> None:
        self.data = data
        self.fail_after = fail_after
        self.asked: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def read_at(self, offset: int, length: int, *, timeout: float | None = None) -> bytes:
        with self.lock:
            if self.fail_after is not None and len(self.asked) >= self.fail_after:
                raise Unavailable("registry went away")
            self.asked.append((offset, length))
        return self.data[offset : offset + length]


def _digest(b: bytes) -> str:
    return "sha256:" + hashlib.sha256(b).hexdigest()


def test_fetch_resumes_with_the_parts_still_missing(tmp_path: Path) -> None:
    data = bytes(range(256)) * 4000                  # 1,024,000 bytes, 16 parts of 64 KiB
    path = tmp_path / "blob.part"
    broken = Blob(data, fail_after=5)
    with pytest.raises(Unavailable):
        fetch_blob(broken, len(data), path, jobs=1, part=64 << 10)
    again = Blob(data)
    fetched, resumed = fetch_blob(again, len(data), path, jobs=3, part=64 << 10)
    assert resumed == 5 * (64 << 10) and fetched == len(data) - resumed
    assert len(again.asked) == 16 - 5
    assert path.read_bytes() == data


@pytest.mark.parametrize("codec", ["gzip", "zstd"])
def test_pull_layer_checks_the_chain(tmp_path: Path, codec: str) -> None:
    tar = every_kind_tar(portable=True)
    blob = gzip.compress(tar) if codec == "gzip" else zstandard.ZstdCompressor().compress(tar)
    parent = "sha256:" + "a" * 64
    want = chain_id(parent, _digest(tar))
    dest = tmp_path / "fs"
    dest.mkdir()
    got = pull_layer(Blob(blob), digest=_digest(blob), size=len(blob), dest=dest,
                     workdir=tmp_path / "dl", parent_chain=parent, expect_chain=want, part=512)
    assert got.diff_id == _digest(tar) and got.fetched_bytes == len(blob)
    assert (dest / "etc/hostname").read_bytes() == b"coldstart\n"
    assert not list((tmp_path / "dl").iterdir())          # the parts are gone
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(IntegrityError, match="containerd asked for"):
        pull_layer(Blob(blob), digest=_digest(blob), size=len(blob), dest=other,
                   workdir=tmp_path / "dl", parent_chain=parent,
                   expect_chain=chain_id("sha256:" + "b" * 64, _digest(tar)))
    assert not list((tmp_path / "dl").iterdir())          # a bad blob is not kept to resume


class GatedBlob(Blob):
    """Serves the last part only once ``gate`` holds (or 20 s have passed)."""

    def __init__(self, data: bytes, gate: Callable[[], bool]) -> None:
        super().__init__(data)
        self.gate = gate
        self.gate_held = False

    def read_at(self, offset: int, length: int, *, timeout: float | None = None) -> bytes:
        if offset + length >= len(self.data):
            deadline = time.monotonic() + 20
            while not self.gate() and time.monotonic() < deadline:
                time.sleep(0.01)
            self.gate_held = self.gate()
        return super().read_at(offset, length, timeout=timeout)


def test_the_layer_is_unpacked_as_its_parts_arrive(tmp_path: Path) -> None:
    tar = every_kind_tar(portable=True) + bytes(1 << 20)
    dest = tmp_path / "fs"
    dest.mkdir()
    # the last part is served only once the first file of the layer is on disk
    blob = GatedBlob(tar, lambda: (dest / "etc/hostname").exists())
    got = pull_layer(blob, digest=_digest(tar), size=len(tar), dest=dest,
                     workdir=tmp_path / "dl", jobs=1, part=64 << 10)
    assert blob.gate_held and got.diff_id == _digest(tar)


def test_a_transport_failure_keeps_the_parts_and_the_retry_resumes(tmp_path: Path) -> None:
    tar = every_kind_tar(portable=True) + bytes(1 << 20)
    blob = gzip.compress(tar, 0)                      # stored: about 1.4 MB, 22 parts
    parts = -(-len(blob) // (64 << 10))
    dest = tmp_path / "fs"
    dest.mkdir()
    with pytest.raises(Unavailable, match="went away"):
        pull_layer(Blob(blob, fail_after=4), digest=_digest(blob), size=len(blob), dest=dest,
                   workdir=tmp_path / "dl", expect_chain=_digest(tar), jobs=1,
                   part=64 << 10)
    assert len(list((tmp_path / "dl").iterdir())) == 2    # the file and its ranges
    again = Blob(blob)
    fresh = tmp_path / "fs2"
    fresh.mkdir()
    got = pull_layer(again, digest=_digest(blob), size=len(blob), dest=fresh,
                     workdir=tmp_path / "dl", expect_chain=_digest(tar), jobs=2,
                     part=64 << 10)
    assert got.resumed_bytes == 4 * (64 << 10) and len(again.asked) == parts - 4
    assert (fresh / "etc/hostname").read_bytes() == b"coldstart\n"


def test_without_a_chain_the_blob_digest_is_checked(tmp_path: Path) -> None:
    blob = gzip.compress(every_kind_tar(portable=True))
    dest = tmp_path / "fs"
    dest.mkdir()
    with pytest.raises(IntegrityError, match="the blob fetched is"):
        pull_layer(Blob(blob), digest="sha256:" + "0" * 64, size=len(blob), dest=dest,
                   workdir=tmp_path / "dl")


def test_a_truncated_gzip_stream_is_refused(tmp_path: Path) -> None:
    tar = every_kind_tar(portable=True) + bytes(1 << 20)
    blob = gzip.compress(tar)[:-2000]
    dest = tmp_path / "fs"
    dest.mkdir()
    # ISA-L says the stream ended early; rapidgzip (many cores) hands out what it could
    # inflate and no error: the tar's end marker and the diffID catch it
    with pytest.raises((FormatError, IntegrityError), match=r"truncated|diffID"):
        pull_layer(Blob(blob), digest=_digest(blob), size=len(blob), dest=dest,
                   workdir=tmp_path / "dl", expect_chain=_digest(tar))


@pytest.mark.parametrize("cores", [2, 16], ids=["isal", "rapidgzip"])
def test_either_gzip_reader_inflates_the_whole_stream_and_refuses_a_cut_one(
        tmp_path: Path, cores: int) -> None:
    from coldstart.unpack.fullpull import gzip_reader

    tar = every_kind_tar(portable=True) + bytes(3 << 20)
    blob = gzip.compress(tar)
    with gzip_reader(io.BytesIO(blob), cores) as f:
        assert f.read() == tar
    # a stream cut short: an error, or fewer bytes than the tar (never the whole tar)
    try:
        with gzip_reader(io.BytesIO(blob[:-2000]), cores) as f:
            got = f.read()
    except Exception:  # each library has its own error type
        got = b""
    assert len(got) < len(tar)


def test_many_cores_inflate_with_rapidgzip_as_the_parts_arrive(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # rapidgzip seeks in what it reads: the file that follows the fetch must allow it
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    tar = every_kind_tar(portable=True) + os.urandom(3 << 20)
    blob = gzip.compress(tar, 1)
    dest = tmp_path / "fs"
    dest.mkdir()
    got = pull_layer(Blob(blob), digest=_digest(blob), size=len(blob), dest=dest,
                     workdir=tmp_path / "dl", expect_chain=_digest(tar), jobs=3,
                     part=256 << 10)
    assert got.diff_id == _digest(tar)
    assert (dest / "etc/hostname").read_bytes() == b"coldstart\n"


def _bad_then_big() -> bytes:
    """A layer whose first entry escapes the root, then 40 MiB that do not compress."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in (("../escape", b"x"), ("big", os.urandom(40 << 20))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_a_failed_unpack_stops_the_fetch_and_drops_the_parts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)    # ISA-L: it reads 8 MiB ahead
    blob = gzip.compress(_bad_then_big(), 1)
    parts = -(-len(blob) // (1 << 20))                   # 41

    class Slow(Blob):
        def read_at(self, offset: int, length: int, *, timeout: float | None = None) -> bytes:
            time.sleep(0.02)
            return super().read_at(offset, length, timeout=timeout)

    source = Slow(blob)
    dest = tmp_path / "fs"
    dest.mkdir()
    with pytest.raises(FormatError, match="escape"):
        pull_layer(source, digest=_digest(blob), size=len(blob), dest=dest,
                   workdir=tmp_path / "dl", jobs=1, part=1 << 20)
    # no request after the failure but those the inflate had read ahead (8 MiB)
    assert len(source.asked) < parts // 2
    assert not list((tmp_path / "dl").iterdir())


class ShortBlob(Blob):
    """Answers part ``bad`` with fewer bytes than asked (a registry that lies)."""

    def __init__(self, data: bytes, bad: int, part: int) -> None:
        super().__init__(data)
        self.bad_offset = bad * part

    def read_at(self, offset: int, length: int, *, timeout: float | None = None) -> bytes:
        data = super().read_at(offset, length, timeout=timeout)
        if offset == self.bad_offset:
            raise IntegrityError(f"range at {offset}: {len(data) - 1} bytes, not {len(data)}")
        return data


def test_a_fetch_that_fails_for_a_bad_answer_is_the_error_and_drops_the_parts(
        tmp_path: Path) -> None:
    tar = every_kind_tar(portable=True) + os.urandom(2 << 20)
    blob = gzip.compress(tar, 1)
    dest = tmp_path / "fs"
    dest.mkdir()
    with pytest.raises(IntegrityError, match="range at"):
        pull_layer(ShortBlob(blob, 3, 128 << 10), digest=_digest(blob), size=len(blob),
                   dest=dest, workdir=tmp_path / "dl", expect_chain=_digest(tar), jobs=1,
                   part=128 << 10)
    assert not list((tmp_path / "dl").iterdir())


def test_a_negative_entry_size_is_refused_without_reading_the_layer(tmp_path: Path) -> None:
    from coldstart.unpack.applier import apply_tar

    header = tarfile.TarInfo("././@PaxHeader")
    header.type = tarfile.XHDTYPE
    block = bytearray(header.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict"))
    block[124:136] = b"-0000001001\0"                   # size -513
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    stream = io.BytesIO(bytes(block) + bytes(64 << 20))
    with pytest.raises(FormatError, match="negative size"):
        apply_tar(stream, tmp_path)
    assert stream.tell() <= 2 << 20                     # not the whole stream


def test_a_negative_size_in_a_pax_record_is_refused(tmp_path: Path) -> None:
    from coldstart.unpack.applier import apply_tar

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        info = tarfile.TarInfo("a")
        info.size = 1
        info.pax_headers = {"size": "-600"}
        tf.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(FormatError, match="negative size"):
        apply_tar(io.BytesIO(buf.getvalue() + bytes(1 << 20)), tmp_path)
