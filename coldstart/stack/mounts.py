"""Undo what a stack left mounted below its directory, so a temp dir can always be removed."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from coldstart.errors import ColdstartError
from coldstart.lazyfs.mountsys import lazy_unmount, mount_table


def unmount_under(base: Path, *, abort_fuse: bool = False) -> None:
    """Lazily unmount every mount at or below ``base``, deepest first.

    With ``abort_fuse`` the FUSE connections among them are aborted first, so that a hung FUSE
    server cannot keep a process (or this unmount) in uninterruptible sleep.
    """
    prefix = os.path.realpath(base)
    mine = [m for m in mount_table() if m.point == prefix or m.point.startswith(prefix + "/")]
    if abort_fuse:
        for m in mine:
            if m.fstype.startswith("fuse"):
                with contextlib.suppress(OSError):
                    Path(f"/sys/fs/fuse/connections/{m.dev.split(':')[1]}/abort").write_text("1")
    for m in sorted(mine, key=lambda m: len(m.point), reverse=True):
        with contextlib.suppress(ColdstartError, OSError):  # already gone: nothing to undo
            lazy_unmount(m.point)
