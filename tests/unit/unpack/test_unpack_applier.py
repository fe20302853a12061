"""coldstart.unpack.applier: a layer's tar applied as containerd's overlayfs applier does
(the file-by-file comparison with containerd itself is tests/e2e/test_fullpull_e2e.py)."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from coldstart.errors import FormatError
from coldstart.unpack.applier import apply_tar
from tests.unit.format.layers import add, every_kind_tar


def _tar(build) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        build(tf)
    return buf.getvalue()


def test_every_kind_of_entry(tmp_path: Path) -> None:
    tar = every_kind_tar(portable=True)
    root = tmp_path / "fs"
    root.mkdir()
    lower = tmp_path / "lower"        # over a lower layer: overlay whiteouts
    lower.mkdir()
    got = apply_tar(io.BytesIO(tar), root, lowers=[lower])
    assert got.diff_id == "sha256:" + hashlib.sha256(tar).hexdigest()
    assert got.tar_bytes == len(tar)
    st = os.lstat(root / "etc/setuid")
    assert stat.S_IMODE(st.st_mode) == 0o4755 and st.st_uid == 1000  # set-id kept after chown
    assert st.st_mtime_ns == 1_700_000_000 * 10**9
    assert (root / "etc/hostname").read_bytes() == b"coldstart\n"
    assert os.stat(root / "usr/lib/hard").st_ino == os.stat(root / "usr/lib/libfoo.so").st_ino
    assert os.getxattr(root / "usr/lib/libfoo.so", "user.note") == "hé".encode()
    assert os.readlink(root / "usr/bin/sh") == "/bin/busybox"
    null = os.lstat(root / "dev/null")
    assert stat.S_ISCHR(null.st_mode) and os.major(null.st_rdev) == 1
    assert stat.S_ISBLK(os.lstat(root / "dev/sda").st_mode)
    assert stat.S_ISFIFO(os.lstat(root / "run/fifo").st_mode)
    wh = os.lstat(root / "var/cache")                 # .wh.cache: an overlay whiteout
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == 0
    assert not (root / "var/.wh.cache").exists()
    assert os.getxattr(root / "opt/app", "trusted.overlay.opaque") == b"y"
    assert stat.S_IMODE(os.lstat(root / "opt/app").st_mode) == 0o1777
    long = next(root.rglob("f" * 200))
    assert long.read_bytes() == b"long name"


def test_a_gnu_sparse_file_is_written_with_its_holes_as_zeros(tmp_path: Path) -> None:
    tar = every_kind_tar(tmp_path, portable=True)       # GNU tar's sparse member at the end
    root = tmp_path / "fs"
    root.mkdir()
    got = apply_tar(io.BytesIO(tar), root)
    assert got.diff_id == "sha256:" + hashlib.sha256(tar).hexdigest()
    data = (root / "holes.img").read_bytes()
    assert len(data) == (3 << 20) + 3
    assert data[1 << 20 : (1 << 20) + 6] == b"island" and data.endswith(b"end")
    assert data.count(0) == len(data) - 9
    assert (root / "etc/hostname").read_bytes() == b"coldstart\n"


def test_a_base_layer_takes_whiteouts_naively(tmp_path: Path) -> None:
    # containerd applies a layer without parents on a bind mount, with no overlay conversion:
    # a whiteout removes what the layer wrote, an opaque marker removes what it did not write
    def build(tf: tarfile.TarFile) -> None:
        add(tf, "a/made/file", b"f")                    # a and a/made: parents it had to make
        add(tf, "a/kept", b"k")
        add(tf, "a/.wh..wh..opq", b"")
        add(tf, "b", b"b")
        add(tf, ".wh.b", b"")
        add(tf, ".wh.never", b"")
    root = tmp_path / "fs"
    root.mkdir()
    apply_tar(io.BytesIO(_tar(build)), root)
    assert sorted(os.listdir(root)) == ["a"]
    assert os.listdir(root / "a") == ["kept"]
    assert os.listxattr(root / "a") == []


def test_a_missing_parent_copies_the_lower_layers_directory(tmp_path: Path) -> None:
    lower = tmp_path / "lower"
    (lower / "srv/app").mkdir(parents=True)
    os.chmod(lower / "srv/app", 0o750)
    os.chown(lower / "srv/app", 1000, 1001)
    os.setxattr(lower / "srv/app", "user.kept", b"1")
    os.setxattr(lower / "srv/app", "trusted.overlay.opaque", b"y")
    root = tmp_path / "fs"
    root.mkdir()
    apply_tar(io.BytesIO(_tar(lambda tf: add(tf, "srv/app/new.txt", b"n"))), root,
              lowers=[lower])
    st = os.lstat(root / "srv/app")
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o750, 1000, 1001)
    assert os.getxattr(root / "srv/app", "user.kept") == b"1"
    assert "trusted.overlay.opaque" not in os.listxattr(root / "srv/app")
    assert stat.S_IMODE(os.lstat(root / "srv").st_mode) == 0o755


def test_a_later_entry_replaces_an_earlier_one(tmp_path: Path) -> None:
    def build(tf: tarfile.TarFile) -> None:
        add(tf, "a", type=tarfile.DIRTYPE, mode=0o755)
        add(tf, "a/x", b"x")
        add(tf, "a", b"now a file")
        add(tf, "b", b"first")
        add(tf, "b", b"second", mode=0o600)
    root = tmp_path / "fs"
    root.mkdir()
    apply_tar(io.BytesIO(_tar(build)), root)
    assert (root / "a").read_bytes() == b"now a file"
    assert (root / "b").read_bytes() == b"second"
    assert stat.S_IMODE(os.lstat(root / "b").st_mode) == 0o600


@pytest.mark.parametrize("case", ["through-symlink", "escape", "link-outside", "truncated",
                                  "trusted-xattr"])
def test_what_cannot_be_applied_safely(tmp_path: Path, case: str) -> None:
    root = tmp_path / "fs"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()

    def build(tf: tarfile.TarFile) -> None:
        if case == "through-symlink":
            add(tf, "lib", type=tarfile.SYMTYPE, link=str(outside))
            add(tf, "lib/evil", b"x")
        elif case == "escape":
            add(tf, "../outside/evil", b"x")
        elif case == "link-outside":
            add(tf, "hard", type=tarfile.LNKTYPE, link="../outside/target")
        else:
            add(tf, "big", os.urandom(100_000), xattrs={"trusted.evil": "1", "user.ok": "1"})
    tar = _tar(build)
    if case == "trusted-xattr":       # skipped with a warning, as containerd does
        apply_tar(io.BytesIO(tar), root)
        assert os.listxattr(root / "big") == ["user.ok"]
        return
    if case == "truncated":
        tar = _tar(build)[:60_000]
    (outside / "target").write_bytes(b"t")
    with pytest.raises(FormatError):
        apply_tar(io.BytesIO(tar), root)
    assert sorted(p.name for p in outside.iterdir()) == ["target"]
    assert os.stat(outside / "target").st_nlink == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fs", "outside"]


def test_a_stream_without_its_end_marker_is_truncated(tmp_path: Path) -> None:
    tar = _tar(lambda tf: add(tf, "a", b"a" * 1000))
    end = 512 + 1024                  # header + data blocks, then the zero blocks
    root = tmp_path / "fs"
    root.mkdir()
    with pytest.raises(FormatError, match="end-of-archive"):
        apply_tar(io.BytesIO(tar[:end]), root)
