"""mount(2)/umount2(2) for the FUSE server: bind a layer directory onto a mountpoint.

Called from worker threads only: binding ``<root>/fuse/<key>`` makes the kernel look the path up
in our own FUSE file system, which the server's trio loop must be free to answer. Also the one
reader of the mount table (:func:`mount_table`), and the FUSE mount's read-ahead
(:func:`set_read_ahead`), set through it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import re
from typing import NamedTuple

from coldstart.errors import ColdstartError, FailedPrecondition, InvalidArgument, NotFound

__all__ = ["MountEntry", "bind_mount", "is_mountpoint", "lazy_unmount", "mount", "mount_table",
           "mounted_paths", "set_read_ahead"]

log = logging.getLogger(__name__)

MS_RDONLY = 1
MS_NOATIME = 1024
MS_REMOUNT = 32
MS_BIND = 4096
MNT_DETACH = 2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _error(what: str, err: int) -> ColdstartError:
    msg = f"{what}: {os.strerror(err)}"
    if err == errno.ENOENT:
        return NotFound(msg)
    if err in (errno.EINVAL, errno.ENOTDIR):
        return InvalidArgument(msg)
    return FailedPrecondition(msg)


def mount(source: str, target: str, fstype: str, flags: int, data: str) -> None:
    """mount(2); a ColdstartError naming the file system type, the target and the cause."""
    if _libc.mount(source.encode(), os.fsencode(target), fstype.encode(), flags,
                   data.encode()) != 0:
        raise _error(f"mount of {fstype} at {target}", ctypes.get_errno())


def bind_mount(source: str, target: str) -> None:
    """``mount --bind source target`` (the FUSE mount is read-only, so is the bind)."""
    if _libc.mount(os.fsencode(source), os.fsencode(target), None, MS_BIND, None) != 0:
        raise _error(f"bind mount {source} on {target}", ctypes.get_errno())


def lazy_unmount(target: str) -> bool:
    """``umount -l target``; False if nothing was mounted there."""
    if _libc.umount2(os.fsencode(target), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOENT):
            return False
        raise _error(f"unmount {target}", err)
    return True


class MountEntry(NamedTuple):
    """One line of ``/proc/self/mountinfo``."""

    point: str      # where it is mounted
    dev: str        # the file system's ``major:minor``
    root: str       # the directory of that file system shown there (``/`` but for binds)
    fstype: str
    options: tuple[str, ...]    # the file system's own (overlayfs: ``upperdir=…``), each whole


def mount_table() -> list[MountEntry]:
    """Every mount this process sees, in mount order (of mounts stacked on one point, the
    last is the one seen)."""
    out: list[MountEntry] = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            parts = left.split(" ")
            if len(parts) > 4:
                fstype, _source, options = ([*right.split(" ", 2), "", ""])[:3]
                # split before unescaping: a "," inside a path is escaped (\054)
                out.append(MountEntry(_unescape(parts[4]), parts[2], _unescape(parts[3]),
                                      fstype, tuple(_unescape(o) for o in
                                                    options.rstrip("\n").split(",") if o)))
    return out


def mounted_paths() -> list[tuple[str, str]]:
    """``(mount point, fs type)`` of every mount this process sees."""
    return [(m.point, m.fstype) for m in mount_table()]


def is_mountpoint(path: str) -> bool:
    """Whether ``path`` is a mount point (read from mountinfo; ``path`` itself is not
    touched, only its parent is resolved)."""
    parent, name = os.path.split(os.path.abspath(path))
    target = os.path.join(os.path.realpath(parent), name)
    return any(p == target for p, _ in mounted_paths())


def set_read_ahead(mountpoint: str, read_ahead_kb: int) -> bool:
    """Set the FUSE mount's bdi ``read_ahead_kb`` (found via /proc/self/mountinfo, no stat:
    a stat of our own mount from the serving thread would deadlock)."""
    target = os.path.abspath(mountpoint)
    try:
        devs = [m.dev for m in mount_table() if m.point == target]
    except OSError:
        return False
    if not devs:
        return False
    try:
        with open(f"/sys/class/bdi/{devs[-1]}/read_ahead_kb", "w") as f:
            f.write(str(read_ahead_kb))
    except OSError as exc:
        log.warning("could not set read_ahead_kb on %s: %s", mountpoint, exc)
        return False
    return True


def _unescape(path: str) -> str:
    # the kernel escapes space, tab, newline and backslash in paths, and more (",", "=") in
    # overlayfs's options: every \ooo
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), path)


_OCTAL = re.compile(r"\\([0-7]{3})")
