"""A container's root file system changes: taken from its overlay's upper directory, put back
into a new container's root before CRIU restores into it, and taken back out if it does not.

CRIU saves no file contents: it reopens each open or mapped file by path and checks its size,
so the files a process wrote (``/tmp``, caches, a pid file) must be where they were. The
changes travel as a tar with OCI whiteouts (``.wh.<name>`` for a deleted path, ``.wh..wh..opq``
for a directory whose lower contents are hidden), as ``ctr containers checkpoint --rw`` and
CRI-O's rootfs-diff carry them.

:func:`apply` writes into the new container's mounted root through directory descriptors
opened without following symlinks, so no entry lands outside it, and keeps a journal: what it
created is removed, what it replaced or deleted is moved aside and moved back by
:meth:`Applied.undo`. A failed restore thus leaves the root as containerd prepared it, and
the normal start that follows sees the image, not the snapshot.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import secrets
import shutil
import stat
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from coldstart.errors import FormatError, InvalidArgument

__all__ = ["Applied", "apply", "capture", "open_parent", "upper_dir"]

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
MAX_BYTES = 4 << 30
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def upper_dir(mounts: list[tuple[str, list[str]]]) -> Path | None:
    """The upper directory of a container's rootfs mounts (``(type, options)`` pairs, as
    containerd's snapshotters give them); None for a mount without one (a bind mount)."""
    for kind, options in mounts:
        if kind != "overlay":
            continue
        for opt in options:
            if opt.startswith("upperdir="):
                return Path(opt.partition("=")[2])
    return None


def _opaque(path: str) -> bool:
    for name in ("trusted.overlay.opaque", "user.overlay.opaque"):
        try:
            if os.getxattr(path, name, follow_symlinks=False) == b"y":
                return True
        except OSError:
            continue
    return False


def capture(upper: Path, dst: io.BufferedIOBase | io.RawIOBase, *,
            max_bytes: int = MAX_BYTES) -> int:
    """Write the changes in overlay upper directory ``upper`` as a tar with OCI whiteouts to
    ``dst``; the number of entries (0: no change)."""
    count = total = 0
    with tarfile.open(fileobj=dst, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(upper):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, upper)
            for name in sorted(dirnames) + sorted(filenames):
                path = os.path.join(dirpath, name)
                rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                st = os.lstat(path)
                if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                    head, _, base = rel.rpartition("/")
                    info = tarfile.TarInfo(f"{head}/{WHITEOUT}{base}" if head else
                                           f"{WHITEOUT}{base}")
                    tar.addfile(info)
                elif stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode) or \
                        stat.S_ISLNK(st.st_mode):
                    total += st.st_size if stat.S_ISREG(st.st_mode) else 0
                    if total > max_bytes:
                        raise InvalidArgument(f"the container's root file system changes hold "
                                              f"more than {max_bytes} bytes")
                    tar.add(path, arcname=rel, recursive=False)
                    if stat.S_ISDIR(st.st_mode) and _opaque(path):
                        tar.addfile(tarfile.TarInfo(f"{rel}/{OPAQUE}"))
                else:
                    continue        # sockets, FIFOs, devices: recreated by the process
                count += 1
    return count


@dataclass
class Applied:
    """What :func:`apply` did, to take it back."""

    root: Path
    aside: Path | None = None                       # where replaced entries were moved
    created: list[str] = field(default_factory=list)         # paths, in creation order
    moved: list[tuple[str, str]] = field(default_factory=list)  # (path, name in aside)
    entries: int = 0

    def undo(self) -> list[str]:
        """Remove what was created and move back what was moved aside; the paths that could
        not be put back (empty when the root is as it was)."""
        failed: list[str] = []

        def remove(parent: int, name: str, _: str) -> None:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                os.rmdir(name, dir_fd=parent)
            else:
                os.unlink(name, dir_fd=parent)

        def put_back(parent: int, name: str, saved: str) -> None:
            if self.aside is None:
                raise OSError(errno.ENOENT, f"nothing was moved aside ({saved})")
            os.rename(self.aside / saved, name, dst_dir_fd=parent)

        steps: list[tuple[str, str, Callable[[int, str, str], None]]] = [
            (rel, "", remove) for rel in reversed(self.created)]
        steps += [(rel, saved, put_back) for rel, saved in reversed(self.moved)]
        for rel, saved, step in steps:
            try:
                parent, name = open_parent(self.root, rel, create=False)
            except (OSError, FormatError):
                failed.append(rel)
                continue
            try:
                step(parent, name, saved)
            except FileNotFoundError:
                if step is put_back:
                    failed.append(rel)
            except OSError:
                failed.append(rel)
            finally:
                os.close(parent)
        self.drop()
        return failed

    def drop(self) -> None:
        """Forget the journal; what was moved aside is deleted (after a restore that took)."""
        if self.aside is not None:
            shutil.rmtree(self.aside, ignore_errors=True)
            self.aside = None
        self.created.clear()
        self.moved.clear()


def _clean(name: str) -> PurePosixPath:
    p = PurePosixPath(name.removeprefix("./"))
    if p.is_absolute() or not p.parts or any(part in ("..", "", ".") for part in p.parts):
        raise FormatError(f"rootfs change {name!r} escapes the root")
    return p


def open_parent(root: Path, rel: str, *, create: bool,
            made: list[str] | None = None) -> tuple[int, str]:
    """A descriptor of ``rel``'s parent under ``root`` (directories opened without following
    symlinks; missing ones created when ``create``, and noted in ``made``) and its last name."""
    p = _clean(rel)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        walked: list[str] = []
        for part in p.parts[:-1]:
            walked.append(part)
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    if made is not None:
                        made.append("/".join(walked))
                except FileExistsError:
                    pass
            try:
                nfd = os.open(part, _DIR, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise FormatError(f"rootfs change {rel!r}: {part!r} is a symlink or not "
                                      "a directory") from None
                raise
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd, p.parts[-1]


def _exists(dirfd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def apply(data: bytes, root: Path) -> Applied:
    """Put the changes of tar ``data`` (:func:`capture`'s) into the mounted root ``root``;
    on an error what was done is undone before it is raised."""
    done = Applied(root)
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:")  # noqa: SIM115 (closed below)
        members = tar.getmembers()
    except tarfile.TarError as exc:
        raise FormatError(f"rootfs changes: not a tar: {exc}") from None
    with tar:
        # every name is checked before anything is written; the journal undoes creations
        # and moves separately, so no entry may come twice, and a whiteout or an opaque
        # marker may hide only what the image had (capture writes them before what they hide)
        seen: set[str] = set()
        for m in members:
            p = _clean(m.name)
            if not (m.isfile() or m.isdir() or m.issym() or m.islnk()):
                raise FormatError(f"rootfs change {m.name!r}: unsupported entry type")
            if str(p) in seen:
                raise FormatError(f"rootfs change {m.name!r} comes twice")
            if p.name == OPAQUE:
                inside = [n for n in seen if n.startswith(f"{p.parent}/") and
                          n != str(p.parent)] if str(p.parent) != "." else list(seen)
                if inside:
                    raise FormatError(f"rootfs change {m.name!r} would hide {inside[0]!r}, "
                                      "written before it")
            elif p.name.startswith(WHITEOUT):
                target = str(p.parent / p.name[len(WHITEOUT):])
                if target in seen or any(n.startswith(target + "/") for n in seen):
                    raise FormatError(f"rootfs change {m.name!r} deletes {target!r}, "
                                      "written before it")
            seen.add(str(p))
        try:
            for m in members:
                _apply_one(m, tar, done)
                done.entries += 1
        except BaseException:
            done.undo()
            raise
    return done


def _aside(done: Applied, parent: int, name: str, rel: str) -> None:
    if done.aside is None:
        done.aside = done.root / f".coldstart-restore-{secrets.token_hex(6)}"
        os.mkdir(done.aside, 0o700)
    saved = str(len(done.moved))
    os.rename(name, done.aside / saved, src_dir_fd=parent)
    done.moved.append((rel, saved))


def _apply_one(m: tarfile.TarInfo, tar: tarfile.TarFile, done: Applied) -> None:
    p = _clean(m.name)
    base = p.name
    if base == OPAQUE:
        # the directory's lower contents are hidden: move them aside
        parent, name = open_parent(done.root, str(p.parent / "x"), create=True, made=done.created)
        try:
            for child in sorted(os.listdir(parent)):
                _aside(done, parent, child, str(p.parent / child))
        finally:
            os.close(parent)
        return
    if base.startswith(WHITEOUT):
        if base == WHITEOUT:
            raise FormatError(f"rootfs change {m.name!r}: a whiteout of nothing")
        target = str(p.parent / base[len(WHITEOUT):]) if str(p.parent) != "." else \
            base[len(WHITEOUT):]
        parent, name = open_parent(done.root, target, create=False)
        try:
            if _exists(parent, name) is not None:
                _aside(done, parent, name, target)
        except OSError as exc:
            # a lower directory cannot be moved without overlayfs' redirect_dir (EXDEV): it
            # stays, which a restored process that deleted it does not look at again
            if exc.errno not in (errno.ENOENT, errno.EXDEV):
                raise
        finally:
            os.close(parent)
        return
    rel = str(p)
    parent, name = open_parent(done.root, rel, create=True, made=done.created)
    try:
        st = _exists(parent, name)
        if m.isdir():
            if st is not None and stat.S_ISDIR(st.st_mode):
                return          # the image's directory: kept as it is
            if st is not None:
                _aside(done, parent, name, rel)
            os.mkdir(name, 0o700, dir_fd=parent)
            done.created.append(rel)
            fd = os.open(name, _DIR, dir_fd=parent)     # the one just made, not a path
            try:
                with contextlib.suppress(OSError):
                    os.fchown(fd, m.uid, m.gid)
                os.fchmod(fd, m.mode & 0o7777)
            finally:
                os.close(fd)
            return
        if st is not None:
            if stat.S_ISDIR(st.st_mode):
                raise FormatError(f"rootfs change {rel!r}: a directory is in the way")
            _aside(done, parent, name, rel)
        if m.issym():
            os.symlink(m.linkname, name, dir_fd=parent)
            done.created.append(rel)
            with contextlib.suppress(OSError):
                os.chown(name, m.uid, m.gid, dir_fd=parent, follow_symlinks=False)
        elif m.islnk():
            # a link to a regular file only (never to a symlink: a later chmod would follow
            # it out of the root); it shares that file's owner and mode as they are
            src_parent, src_name = open_parent(done.root, m.linkname, create=False)
            try:
                src = _exists(src_parent, src_name)
                if src is None or not stat.S_ISREG(src.st_mode):
                    raise FormatError(f"rootfs change {rel!r}: a hard link to "
                                      f"{m.linkname!r}, which is not a regular file")
                os.link(src_name, name, src_dir_fd=src_parent, dst_dir_fd=parent,
                        follow_symlinks=False)
            finally:
                os.close(src_parent)
            done.created.append(rel)
        else:
            data = tar.extractfile(m)
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                         os.O_CLOEXEC, 0o600, dir_fd=parent)
            done.created.append(rel)
            with os.fdopen(fd, "wb") as f:
                if data is not None:
                    shutil.copyfileobj(data, f, 1 << 20)
                # owner, then mode, on the file this call created (never a path)
                with contextlib.suppress(OSError):
                    os.fchown(f.fileno(), m.uid, m.gid)
                os.fchmod(f.fileno(), m.mode & 0o7777)
    finally:
        os.close(parent)
