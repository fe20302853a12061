"""Mount lists for a snapshot: a pure function, containerd's overlayfs snapshotter's rules.

- no parent: a ``bind`` of the snapshot's own ``fs`` (``rw`` for ACTIVE, ``ro`` for VIEW);
- a VIEW with one parent: a read-only ``bind`` of the parent's ``fs``;
- otherwise ``overlay`` with ``lowerdir=`` the parents' ``fs`` dirs, nearest first, plus
  ``workdir=``/``upperdir=`` for ACTIVE.

``lowers`` names another directory for some parents (a lazily mounted layer's directory on the
FUSE connection that answers getxattr, see :mod:`coldstart.snapshotter.xattrpaths`); every
other parent is its ``fs``.

Example::

    mounts_for(Snapshot("7", Kind.ACTIVE, ("5", "3")), "/var/lib/coldstart")
    # [Mount("overlay", "overlay", ("index=off", "workdir=…/7/work", "upperdir=…/7/fs",
    #                              "lowerdir=…/5/fs:…/3/fs"))]
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from coldstart.snapshotter.store import Kind, Snapshot

__all__ = ["Mount", "index_supported", "mounts_for", "upper_path", "work_path"]


@dataclass(frozen=True)
class Mount:
    type: str
    source: str
    options: tuple[str, ...] = ()
    target: str = ""


def upper_path(root: str, snapshot_id: str) -> str:
    return os.path.join(root, "snapshots", snapshot_id, "fs")


def work_path(root: str, snapshot_id: str) -> str:
    return os.path.join(root, "snapshots", snapshot_id, "work")


def index_supported() -> bool:
    """containerd adds ``index=off`` when the kernel's overlay has an ``index`` feature."""
    return os.path.exists("/sys/module/overlay/parameters/index")


def mounts_for(snap: Snapshot, root: str, *, index_off: bool = False,
               lowers: Mapping[str, str] | None = None) -> list[Mount]:
    """The mounts that assemble ``snap``'s filesystem under ``root``; ``lowers``: parent id ->
    the directory that stands for that parent's ``fs``."""
    def lower_of(pid: str) -> str:
        return (lowers or {}).get(pid) or upper_path(root, pid)

    if not snap.parent_ids:
        flag = "ro" if snap.kind == Kind.VIEW else "rw"
        return [Mount("bind", upper_path(root, snap.id), (flag, "rbind"))]
    options: list[str] = ["index=off"] if index_off else []
    if snap.kind == Kind.ACTIVE:
        options += [f"workdir={work_path(root, snap.id)}",
                    f"upperdir={upper_path(root, snap.id)}"]
    elif len(snap.parent_ids) == 1:
        return [Mount("bind", lower_of(snap.parent_ids[0]), ("ro", "rbind"))]
    lower = ":".join(lower_of(p) for p in snap.parent_ids)
    options.append(f"lowerdir={lower}")
    return [Mount("overlay", "overlay", tuple(options))]
