"""coldstart.unpack.fullpull: parallel range fetch that resumes, decompression, and the check
against the chain ID containerd asked for."""

from __future__ import annotations

import gzip
import hashlib
import threading
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
    # rapidgzip hands out what it could inflate and no error: the tar's end marker and the
    # diffID catch it
    with pytest.raises((FormatError, IntegrityError), match=r"truncated|diffID"):
        pull_layer(Blob(blob), digest=_digest(blob), size=len(blob), dest=dest,
                   workdir=tmp_path / "dl", expect_chain=_digest(tar))
