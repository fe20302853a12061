"""Which directory stands for a lazily mounted parent: the one a start reads, or the one that
answers extended attributes as a local disk does.

A layer that shows no extended attribute is served on the FUSE connection that answers no
getxattr (``fuse.split_xattrs``) and its snapshot's ``fs`` is bound from there: overlayfs then
stops asking each lower file and directory for ``trusted.overlay.*``, a third of a start-up's
requests. The price: the kernel answers every getxattr of those files ``EOPNOTSUPP`` itself,
through overlayfs too, where a local disk answers ``ENODATA`` for an absent attribute; and
containerd's diff (continuity's ``compareCapabilities``, behind ``ctr snapshots diff``,
``checkpoint --rw``, commit tools, CRI checkpoint) accepts only ``ENODATA``. One mount cannot
have both: FUSE keeps no negative answer for getxattr, and overlayfs asks on every lookup of a
connection that answers. So the snapshotter hands out both, by what the mounts are for:

- an ACTIVE snapshot with nothing in it yet and no rootfs mounted from it (the mount about to
  happen is a container's start: ``ctr``, CRI and nerdctl mount it briefly before, to read
  ``/etc/passwd``, which changes nothing) gets its parents' ``fs``, as containerd's overlayfs
  snapshotter would;
- a VIEW, or an ACTIVE snapshot that holds changes or whose rootfs is mounted now (a running
  container, or one that exited after writing: what a diff, a commit or a checkpoint reads)
  gets, for each parent bound from the plain connection, the same layer's directory on the
  connection that answers (``<root>/fuse/<key>``): the same files, and ``ENODATA`` for an
  absent attribute.

A running container's own rootfs (mounted at its start) keeps the plain connection: a
``getxattr`` inside it still fails ``EOPNOTSUPP`` on those layers' files (listing answers an
empty list, so ``cp -a``, ``tar --xattrs`` and copy-up are unaffected); and the diff of a
container that exited without changing a file is still refused, as before.
"""

from __future__ import annotations

import os

from coldstart.lazyfs.mountsys import MountEntry, mount_table
from coldstart.lazyfs.spec import FUSE_DIR, PLAIN_FUSE_DIR
from coldstart.snapshotter.mounts import upper_path
from coldstart.snapshotter.store import Kind, Snapshot

__all__ = ["attribute_lowers"]


def attribute_lowers(root: str, snap: Snapshot) -> dict[str, str]:
    """Parent id -> its layer's directory on the connection that answers getxattr, for each
    parent of ``snap`` bound from the plain connection, when ``snap`` is assembled to be read
    (see the module's notes); {} when it is a start's or nothing is plain."""
    if not snap.parent_ids or snap.kind not in (Kind.ACTIVE, Kind.VIEW):
        return {}
    table = mount_table()
    if snap.kind == Kind.ACTIVE and _about_to_start(upper_path(root, snap.id), table):
        return {}
    seen = {m.point: m for m in table}  # the last of a stack is the one seen
    plain = seen.get(os.path.join(root, PLAIN_FUSE_DIR))
    full = seen.get(os.path.join(root, FUSE_DIR))
    if plain is None or full is None:
        return {}
    out: dict[str, str] = {}
    for pid in snap.parent_ids:
        bound = seen.get(upper_path(root, pid))
        if bound is not None and bound.dev == plain.dev:
            out[pid] = os.path.normpath(full.point + "/" + bound.root)
    return out


def _about_to_start(upper: str, table: list[MountEntry]) -> bool:
    """Whether an ACTIVE snapshot's upper directory is empty and no overlay uses it."""
    try:
        with os.scandir(upper) as it:
            if any(True for _ in it):
                return False
    except FileNotFoundError:
        return True
    used = f"upperdir={upper}"
    return not any(m.fstype == "overlay" and used in m.options for m in table)
