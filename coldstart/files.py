"""Writing files safely: atomically, with the mode and owner of the file replaced.

A crash or a full disk leaves the old file or the new one, never half of one: the bytes go to a
temporary file beside the target, are synced, get the target's mode and owner, and are renamed
over it (then the directory is synced, so the rename survives a power cut). Used where a file
must never be seen half-written: containerd's config (``coldstart node``), the CRI keychain.

Example::

    atomic_write(Path("/etc/containerd/config.toml"), new_bytes)
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from coldstart.errors import FailedPrecondition

__all__ = ["atomic_write", "read_optional", "remove"]


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
