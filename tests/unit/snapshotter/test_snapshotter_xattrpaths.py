"""Which directory stands for a lazily mounted parent (coldstart.snapshotter.xattrpaths): the
plain connection's bind for a container's start, the connection that answers getxattr for a
view or a container running or changed (what containerd's diff reads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coldstart.lazyfs.mountsys import MountEntry
from coldstart.snapshotter import xattrpaths
from coldstart.snapshotter.mounts import upper_path, work_path
from coldstart.snapshotter.store import Kind, Snapshot


def _root(tmp_path: Path) -> str:
    root = str(tmp_path / "with space,and=comma")
    for sid in ("1", "2", "3", "9"):
        os.makedirs(upper_path(root, sid))
        os.makedirs(work_path(root, sid))
    return root


def _table(root: str, *, overlay_upper: str | None = None,
           plain: bool = True) -> list[MountEntry]:
    out = [MountEntry("/", "8:1", "/", "ext4", ("rw",)),
           MountEntry(f"{root}/fuse", "0:50", "/", "fuse.coldstart", ("rw",))]
    if plain:
        out.append(MountEntry(f"{root}/fuse-plain", "0:51", "/", "fuse.coldstart", ("rw",)))
    out += [MountEntry(upper_path(root, "1"), "0:51", "/k1", "fuse.coldstart", ("rw",)),
            MountEntry(upper_path(root, "2"), "0:50", "/k2", "fuse.coldstart", ("rw",))]
    # "3" is an ordinary (unpacked) layer: no mount of its own
    if overlay_upper is not None:
        out.append(MountEntry("/run/c/rootfs", "0:60", "/", "overlay",
                              ("rw", f"upperdir={overlay_upper}", "workdir=/x")))
    return out


def test_a_start_reads_through_the_plain_binds(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    root = _root(tmp_path)
    monkeypatch.setattr(xattrpaths, "mount_table", lambda: _table(root))
    assert xattrpaths.attribute_lowers(root, Snapshot("9", Kind.ACTIVE, ("1", "2", "3"))) == {}


@pytest.mark.parametrize("case", ["view", "changed", "running"])
def test_a_view_or_a_container_running_or_changed_reads_what_answers_getxattr(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    root = _root(tmp_path)
    upper = upper_path(root, "9")
    if case == "changed":
        Path(upper, "new.txt").write_text("x")
    monkeypatch.setattr(xattrpaths, "mount_table",
                        lambda: _table(root, overlay_upper=upper if case == "running" else None))
    kind = Kind.VIEW if case == "view" else Kind.ACTIVE
    got = xattrpaths.attribute_lowers(root, Snapshot("9", kind, ("1", "2", "3")))
    # only the parent bound from the plain connection moves; the others stay their fs
    assert got == {"1": f"{root}/fuse/k1"}


def test_nothing_moves_without_a_plain_connection(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    root = _root(tmp_path)
    monkeypatch.setattr(xattrpaths, "mount_table", lambda: _table(root, plain=False))
    assert xattrpaths.attribute_lowers(root, Snapshot("9", Kind.VIEW, ("1", "2"))) == {}
    assert xattrpaths.attribute_lowers(root, Snapshot("9", Kind.VIEW, ())) == {}
