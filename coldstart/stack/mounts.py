"""Undo what a stack left mounted below its directory, so a temp dir can always be removed."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from coldstart.errors import ColdstartError
from coldstart.lazyfs.mountsys import lazy_unmount


def _mounts() -> list[tuple[str, str, str]]:
    """``(mount point, major:minor, fs type)`` of every mount this process sees."""
    out: list[tuple[str, str, str]] = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if len(fields) > 4:
                point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
                out.append((point, fields[2], right.split()[0] if right else ""))
    return out


def unmount_under(base: Path, *, abort_fuse: bool = False) -> None:
    """Lazily unmount every mount at or below ``base``, deepest first.

    With ``abort_fuse`` the FUSE connections among them are aborted first, so that a hung FUSE
    server cannot keep a process (or this unmount) in uninterruptible sleep.
    """
    prefix = os.path.realpath(base)
    mine = [m for m in _mounts() if m[0] == prefix or m[0].startswith(prefix + "/")]
    if abort_fuse:
        for _, dev, fstype in mine:
            if fstype.startswith("fuse"):
                with contextlib.suppress(OSError):
                    Path(f"/sys/fs/fuse/connections/{dev.split(':')[1]}/abort").write_text("1")
    for point, _, _ in sorted(mine, key=lambda m: len(m[0]), reverse=True):
        with contextlib.suppress(ColdstartError, OSError):  # already gone: nothing to undo
            lazy_unmount(point)
