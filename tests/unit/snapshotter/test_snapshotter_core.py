"""The Snapshotter over a temp root: directory ordering, cleanup, and the remote handshake.

The handshake is driven here by a :class:`LayerMounter` that bind-mounts a local directory (a
real mount, no network): the FUSE server's end-to-end path is in tests/integration/snapshotter.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldstart.errors import AlreadyExists, FailedPrecondition, IntegrityError, NotFound
from coldstart.lazyfs.mountsys import is_mountpoint
from coldstart.lazyfs.spec import (
    REMOTE_DIGEST,
    REMOTE_REFERENCE,
    REMOTE_SNAPSHOT,
    TARGET_SNAPSHOT_REF,
    LayerSpec,
)
from coldstart.snapshotter.mounter import LayerMounter
from coldstart.snapshotter.snapshotter import Snapshotter, disk_usage
from coldstart.snapshotter.store import Kind, Store


class LocalDirMounter:
    """Bind-mounts ``layers[spec.digest]`` read-only; unknown digests fail like a bad TOC."""

    def __init__(self, layers: dict[str, Path]) -> None:
        self.layers = layers
        self.calls: list[tuple[str, str]] = []

    def mount(self, mountpoint: str, spec: LayerSpec) -> None:
        self.calls.append(("mount", mountpoint))
        src = self.layers.get(spec.digest)
        if src is None:
            raise IntegrityError(f"TOC of {spec.digest} does not match its digest")
        subprocess.run(["mount", "--bind", "-o", "ro", str(src), mountpoint], check=True)

    def check(self, mountpoint: str) -> None:
        if not is_mountpoint(mountpoint):
            raise NotFound(mountpoint)

    def unmount(self, mountpoint: str) -> None:
        self.calls.append(("unmount", mountpoint))
        subprocess.run(["umount", mountpoint], check=True)


def labels_for(digest: str, chain: str) -> dict[str, str]:
    return {TARGET_SNAPSHOT_REF: chain, REMOTE_REFERENCE: "127.0.0.1:1/r:v1",
            REMOTE_DIGEST: digest}


@pytest.fixture
def layer(tmp_path: Path) -> Path:
    d = tmp_path / "layer"
    d.mkdir()
    (d / "hello").write_text("lazy\n")
    return d


@pytest.fixture
def mounter(layer: Path) -> LocalDirMounter:
    return LocalDirMounter({"sha256:good": layer})


@pytest.fixture
def sn(tmp_path: Path, mounter: LocalDirMounter) -> Iterator[Snapshotter]:
    root = tmp_path / "root"
    store = Store(root / "metadata.db")
    s = Snapshotter(root, store, mounter)
    try:
        yield s
    finally:
        with open("/proc/self/mountinfo") as f:
            points = [ln.split()[4] for ln in f if ln.split()[4].startswith(str(tmp_path))]
        for p in sorted(points, key=len, reverse=True):
            subprocess.run(["umount", "-l", p], check=False)
        store.close()


def snapshot_dirs(sn: Snapshotter) -> list[str]:
    return sorted(os.listdir(sn.snapshots_dir))


def test_directories_follow_the_records(sn: Snapshotter) -> None:
    m = sn.prepare("a", "", {})
    fs = Path(m[0].source)
    assert fs.is_dir() and (fs.parent / "work").is_dir()
    (fs / "file").write_bytes(b"x" * 5000)
    sn.commit("a-c", "a", {})
    assert sn.usage("a-c").inodes == 2
    with pytest.raises(AlreadyExists):
        sn.view("a-c", "", {})
    assert snapshot_dirs(sn) == [fs.parent.name]  # the failed create left no directory
    sn.view("v", "a-c", {})
    with pytest.raises(FailedPrecondition):
        sn.remove("a-c")
    assert fs.is_dir()
    sn.remove("v")
    sn.remove("a-c")
    assert snapshot_dirs(sn) == []


def test_cleanup_removes_only_orphans(sn: Snapshotter) -> None:
    keep = Path(sn.prepare("a", "", {})[0].source).parent
    os.makedirs(os.path.join(sn.snapshots_dir, "new-left-by-a-crash", "fs"))
    os.makedirs(os.path.join(sn.snapshots_dir, "999", "fs"))
    sn.cleanup()
    assert snapshot_dirs(sn) == [keep.name]


def test_a_servable_layer_is_committed_under_its_chain_id(sn: Snapshotter,
                                                          mounter: LocalDirMounter) -> None:
    with pytest.raises(AlreadyExists, match="sha256:chain1"):
        sn.prepare("ns/1/extract-1 sha256:chain1", "", labels_for("sha256:good",
                                                                  "sha256:chain1"))
    info = sn.stat("sha256:chain1")
    assert (info.kind, info.parent) == (Kind.COMMITTED, "")
    assert info.labels[REMOTE_SNAPSHOT] == "remote snapshot"
    with pytest.raises(NotFound):
        sn.stat("ns/1/extract-1 sha256:chain1")
    found = sn.walk(['labels."containerd.io/snapshot.ref"==sha256:chain1,parent==""'])
    assert [i.name for i in found] == ["sha256:chain1"]
    (view,) = sn.view("v", "sha256:chain1", {})
    assert (Path(view.source) / "hello").read_text() == "lazy\n"

    # another namespace asks for the same layer: answered without mounting again
    calls = len(mounter.calls)
    with pytest.raises(AlreadyExists):
        sn.prepare("ns/2/extract-7 sha256:chain1", "", labels_for("sha256:good",
                                                                  "sha256:chain1"))
    assert len(mounter.calls) == calls

    # removing it unmounts first, then removes the directory
    sn.remove("v")
    fs = view.source
    assert is_mountpoint(fs)
    sn.remove("sha256:chain1")
    assert ("unmount", fs) in mounter.calls
    assert not os.path.exists(fs)
    assert snapshot_dirs(sn) == []


def test_any_mounter_failure_falls_back_to_a_plain_active_snapshot(
        sn: Snapshotter) -> None:
    (m,) = sn.prepare("ns/1/extract-2 sha256:c2", "", labels_for("sha256:bad-toc",
                                                               "sha256:c2"))
    assert (m.type, m.options) == ("bind", ("rw", "rbind"))
    assert sn.stat("ns/1/extract-2 sha256:c2").kind == Kind.ACTIVE
    assert not is_mountpoint(m.source) and os.listdir(m.source) == []
    with pytest.raises(NotFound):
        sn.stat("sha256:c2")


def test_without_a_mounter_or_ref_label_layers_are_never_lazy(tmp_path: Path,
                                                              sn: Snapshotter) -> None:
    labels = labels_for("sha256:good", "sha256:c3")
    del labels[TARGET_SNAPSHOT_REF]
    assert sn.prepare("k1", "", labels)[0].options == ("rw", "rbind")
    plain = Snapshotter(tmp_path / "other", Store(tmp_path / "other.db"), None)
    assert plain.prepare("k2", "", labels_for("sha256:good", "sha256:c3"))[0].type == "bind"


def test_the_mounter_protocol_is_what_the_fuse_client_implements() -> None:
    from coldstart.lazyfs.client import FuseServerClient

    assert isinstance(FuseServerClient("/nonexistent.sock", 1.0), LayerMounter)
    assert isinstance(LocalDirMounter({}), LayerMounter)


def test_disk_usage_counts_hard_links_once(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"y" * 10000)
    os.link(tmp_path / "f", tmp_path / "g")
    u = disk_usage(str(tmp_path))
    assert u.inodes == 2
    assert u.size >= 10000
