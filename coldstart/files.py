"""Writing files safely: atomically, with the mode and owner of the file replaced; and
directories only their owner can enter.

A crash or a full disk leaves the old file or the new one, never half of one: the bytes go to a
temporary file beside the target, are synced, get the target's mode and owner, and are renamed
over it (then the directory is synced, so the rename survives a power cut). Used where a file
must never be seen half-written: containerd's config (``coldstart node``), the CRI keychain.

:func:`private_dir` makes the directories that hold node state (the snapshotter's and the FUSE
server's roots, the chunk cache: bytes of private images) ``0700``, as containerd keeps its
content store, and narrows one found wider.

Example::

    atomic_write(Path("/etc/containerd/config.toml"), new_bytes)
    private_dir(Path("/var/lib/coldstart"), "snapshotter root")
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
from pathlib import Path

from coldstart.errors import FailedPrecondition

__all__ = ["PRIVATE_DIR_MODE", "atomic_write", "private_dir", "read_optional", "remove"]

log = logging.getLogger("coldstart.files")

#: node state directories: only their owner (root) may list, enter or read them
PRIVATE_DIR_MODE = 0o700


def read_optional(path: Path) -> bytes | None:
    """The bytes of ``path``, or ``None`` when it does not exist."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise FailedPrecondition(f"cannot read {path}: {exc.strerror} (run as root?)") from None


def atomic_write(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` (temp file + rename in the same directory). An existing
    file's mode and owner are kept; a new file gets ``mode``; missing directories are made. A
    symlink stays a symlink: its target is replaced (config management, NixOS)."""
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            st: os.stat_result | None = path.stat()
        except FileNotFoundError:
            st = None
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, (st.st_mode & 0o7777) if st is not None else mode)
            if st is not None and (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
                os.chown(tmp, st.st_uid, st.st_gid)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _sync_dir(path.parent)
    except OSError as exc:
        raise FailedPrecondition(f"cannot write {path}: {exc.strerror} (run as root? is the "
                                 "disk full?)") from None


def private_dir(path: Path, what: str) -> Path:
    """Make ``path`` a directory only its owner can enter and return it: created ``0700``
    (and so are the missing directories above it: ours too); an existing one that group or
    others may read or enter is narrowed to ``0700`` with a warning. Refused: a symlink (one
    planted where we keep state would make us narrow and fill its target), something else
    than a directory, and a directory owned by another user (its owner could read, or swap,
    what we keep there). The checks and the chmod act on one open descriptor, not on the
    path twice. ``what`` names it in messages."""
    try:
        for d in [*reversed(path.parents), path]:
            if not os.path.lexists(d):
                d.mkdir(mode=PRIVATE_DIR_MODE, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if os.path.islink(path):
            raise FailedPrecondition(f"the {what} {path} is a symlink (to "
                                     f"{os.readlink(path)}): name the directory itself") from None
        if os.path.lexists(path) and not os.path.isdir(path):
            raise FailedPrecondition(f"the {what} {path} is not a directory") from None
        raise FailedPrecondition(f"cannot create the {what} {path}: {exc.strerror} (run as "
                                 "root?)") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise FailedPrecondition(
                f"the {what} {path} belongs to uid {st.st_uid}, not to this process (uid "
                f"{os.geteuid()}): its owner could read or replace what coldstart keeps there; "
                f"chown it to uid {os.geteuid()} or choose another directory")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            try:
                os.fchmod(fd, mode & ~0o077)
            except OSError as exc:
                raise FailedPrecondition(f"cannot make the {what} {path} private (mode "
                                         f"{mode:04o}): {exc.strerror}") from None
            log.warning("the %s %s was mode %04o: other users could read the node's state "
                        "(cached bytes of private images among it); narrowed to %04o", what,
                        path, mode, mode & ~0o077)
    finally:
        os.close(fd)
    return path


def remove(path: Path) -> bool:
    """Remove ``path``; False when it was not there."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise FailedPrecondition(f"cannot remove {path}: {exc.strerror} (run as root?)") from None
    _sync_dir(path.parent)
    return True


def _sync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
