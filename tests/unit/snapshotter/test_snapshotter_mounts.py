"""Mount lists: containerd overlayfs snapshotter's rules, as a pure function."""

from __future__ import annotations

from coldstart.snapshotter.mounts import Mount, mounts_for
from coldstart.snapshotter.store import Kind, Snapshot

R = "/r"


def test_no_parent_is_a_bind_of_its_own_fs() -> None:
    assert mounts_for(Snapshot("1", Kind.ACTIVE), R) == [
        Mount("bind", "/r/snapshots/1/fs", ("rw", "rbind"))]
    assert mounts_for(Snapshot("1", Kind.VIEW), R) == [
        Mount("bind", "/r/snapshots/1/fs", ("ro", "rbind"))]


def test_a_view_of_one_layer_is_a_read_only_bind_of_it() -> None:
    assert mounts_for(Snapshot("2", Kind.VIEW, ("1",)), R, index_off=True) == [
        Mount("bind", "/r/snapshots/1/fs", ("ro", "rbind"))]


def test_overlays_list_lower_dirs_nearest_first() -> None:
    assert mounts_for(Snapshot("9", Kind.ACTIVE, ("5", "3")), R, index_off=True) == [
        Mount("overlay", "overlay", (
            "index=off", "workdir=/r/snapshots/9/work", "upperdir=/r/snapshots/9/fs",
            "lowerdir=/r/snapshots/5/fs:/r/snapshots/3/fs"))]
    assert mounts_for(Snapshot("9", Kind.ACTIVE, ("5",)), R) == [
        Mount("overlay", "overlay", (
            "workdir=/r/snapshots/9/work", "upperdir=/r/snapshots/9/fs",
            "lowerdir=/r/snapshots/5/fs"))]
    assert mounts_for(Snapshot("9", Kind.VIEW, ("5", "3", "1")), R) == [
        Mount("overlay", "overlay",
              ("lowerdir=/r/snapshots/5/fs:/r/snapshots/3/fs:/r/snapshots/1/fs",))]


def test_lowers_name_other_directories_for_some_parents() -> None:
    other = {"3": "/r/fuse/k3"}
    assert mounts_for(Snapshot("9", Kind.ACTIVE, ("5", "3")), R, lowers=other) == [
        Mount("overlay", "overlay", (
            "workdir=/r/snapshots/9/work", "upperdir=/r/snapshots/9/fs",
            "lowerdir=/r/snapshots/5/fs:/r/fuse/k3"))]
    assert mounts_for(Snapshot("2", Kind.VIEW, ("3",)), R, lowers=other) == [
        Mount("bind", "/r/fuse/k3", ("ro", "rbind"))]
