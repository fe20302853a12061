"""Apply a layer's tar stream to an empty directory as containerd's overlayfs applier does.

containerd (``archive.Apply`` with ``OverlayConvertWhiteout``, 1.6) is the reference: a node
whose layers coldstart unpacks must look to a container exactly as one whose layers containerd
unpacked. What it does, and so what this does:

- names are cleaned; the root entry is ignored; a name may not leave the layer;
- a missing parent directory is made, with the owner, mode, xattrs and times of the same
  directory in the nearest lower layer that has it (``lowers``), else 0755 root;
- whiteouts become what overlayfs reads: ``.wh.NAME`` → a character device 0/0 ``NAME`` owned
  as the whiteout entry; ``.wh..wh..opq`` → ``trusted.overlay.opaque=y`` on its directory;
- an entry replaces what the layer wrote at its path before, unless both are directories;
- regular files, directories, symlinks, hard links (to an earlier entry of the layer),
  character and block devices and FIFOs are made with the entry's owner (``lchown``), its
  ``SCHILY.xattr.*`` records (``trusted.*`` refused and skipped, with a warning), its
  permission bits (``chmod`` after ``chown``, so set-id bits stay; not for symlinks) and
  times (atime = the later of atime and mtime; symlinks not followed); directories get their
  times once every entry is written.

Unlike containerd, a path through a symlink the layer made is refused (FormatError), not
resolved inside the root: tar writers do not produce such layers, and refusing cannot write
outside the directory. The stream's SHA-256 (the layer's diffID) is computed as it is read.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import shutil
import stat
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from coldstart.errors import FormatError
from coldstart.format.toc import normalize_name
from coldstart.format.writer import _HeaderLog, _members, _mtime_ns

__all__ = ["Applied", "apply_tar"]

log = logging.getLogger(__name__)

_WH = ".wh."
_OPAQUE = ".wh..wh..opq"
_XATTR = "SCHILY.xattr."
_COPY = 1 << 20


@dataclass(frozen=True)
class Applied:
    """What one layer's tar stream held: its diffID, entries, bytes of regular files."""

    diff_id: str
    entries: int
    file_bytes: int
    tar_bytes: int


class _Hashed(io.RawIOBase):
    """The stream, hashed and counted as it is read."""

    def __init__(self, inner: IO[bytes]) -> None:
        self.inner = inner
        self.sha = hashlib.sha256()
        self.n = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        try:
            data = self.inner.read(len(b))
        except Exception as exc:
            # rapidgzip, zstandard and zlib each have their own error types for corrupt data
            raise FormatError(f"the layer does not decompress: {type(exc).__name__}: "
                              f"{exc}") from None
        n = len(data)
        b[:n] = data
        self.sha.update(data)
        self.n += n
        return n

    def drain(self) -> None:
        buf = bytearray(_COPY)
        while n := self.readinto(buf):
            del n


def _times(info: tarfile.TarInfo) -> tuple[int, int]:
    mtime = max(0, _mtime_ns(info))
    atime = info.pax_headers.get("atime")
    a = mtime
    if atime is not None:
        try:
            a = max(mtime, int(float(atime) * 1e9))
        except ValueError:
            pass
    return a, mtime


class _Tree:
    """The directory being written, and what this layer put at each path (authoritative: the
    directory starts empty and nothing else writes to it)."""

    def __init__(self, root: Path, lowers: Sequence[Path]) -> None:
        self.root = root
        self.rootfd = str(root)
        self.lowers = list(lowers)
        self.kinds: dict[str, str] = {"": "dir"}
        self.dirs: list[tuple[str, tarfile.TarInfo]] = []

    def path(self, name: str) -> str:
        return os.path.join(self.rootfd, name)

    def parent(self, name: str, what: str) -> None:
        """Make ``name``'s parents (FormatError if one is not a directory)."""
        parent = name.rpartition("/")[0]
        if not parent or self.kinds.get(parent) == "dir":
            return
        kind = self.kinds.get(parent)
        if kind is not None:
            raise FormatError(f"{what}: its parent {parent!r} is a {kind}, not a directory")
        self.parent(parent, what)
        self._copy_up(parent)
        self.kinds[parent] = "dir"

    def _copy_up(self, name: str) -> None:
        path = self.path(name)
        for lower in self.lowers:
            src = os.path.join(lower, name)
            try:
                st = os.lstat(src)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                break
            os.mkdir(path, 0o700)
            os.lchown(path, st.st_uid, st.st_gid)
            os.chmod(path, stat.S_IMODE(st.st_mode))
            for key in os.listxattr(src, follow_symlinks=False):
                if not key.startswith("trusted."):
                    os.setxattr(path, key, os.getxattr(src, key, follow_symlinks=False),
                                follow_symlinks=False)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
            return
        os.mkdir(path, 0o755)
        os.chmod(path, 0o755)

    def clear(self, name: str, new_kind: str) -> None:
        """Remove what the layer wrote at ``name`` unless both it and the new entry are dirs."""
        old = self.kinds.get(name)
        if old is None or (old == "dir" and new_kind == "dir"):
            return
        path = self.path(name)
        if old == "dir":
            shutil.rmtree(path)
            prefix = name + "/"
            for k in [k for k in self.kinds if k.startswith(prefix)]:
                del self.kinds[k]
        else:
            os.unlink(path)
        del self.kinds[name]


def apply_tar(stream: IO[bytes], root: Path, *, lowers: Sequence[Path] = (),
              what: str = "layer") -> Applied:
    """Apply the tar ``stream`` to the empty directory ``root`` (see the module's doc);
    ``lowers``: the layers below, nearest first. FormatError for a stream that is not a
    complete tar, or an entry that cannot be applied as containerd would; OSError (a full
    disk...) as raised. Either way ``root`` holds a partial tree: the caller removes it."""
    hashed = _Hashed(stream)
    headers = _HeaderLog()
    tree = _Tree(root, lowers)
    entries = 0
    file_bytes = 0
    try:
        tf = tarfile.open(None, "r|", fileobj=io.BufferedReader(hashed, _COPY),  # noqa: SIM115
                          encoding="utf-8", errors="surrogateescape", tarinfo=headers.tarinfo)
    except (tarfile.TarError, EOFError) as exc:
        if hashed.n == 0:
            raise FormatError(f"{what}: the layer decompresses to nothing (truncated or "
                              "corrupt)") from None
        raise FormatError(f"{what}: not a tar stream: {exc}") from None
    with tf:
        for info in _members(tf, headers):
            if info.type == tarfile.XGLTYPE:
                continue
            name = normalize_name(info.name, what="tar entry")
            if not name:
                continue                     # containerd: "resolved to root", ignored
            entries += 1
            here = f"{what}: entry {name!r}"
            tree.parent(name, here)
            base = name.rpartition("/")[2]
            if base.startswith(_WH):
                _whiteout(tree, name, base, info, here)
                continue
            file_bytes += _entry(tree, tf, name, info, here)
        end = tf.offset
    hashed.drain()
    if hashed.n < end + 512:
        raise FormatError(f"{what}: the tar stream ends without its end-of-archive marker "
                          f"(after {hashed.n} bytes): truncated")
    for name, info in reversed(tree.dirs):
        os.utime(tree.path(name), ns=_times(info), follow_symlinks=False)
    return Applied("sha256:" + hashed.sha.hexdigest(), entries, file_bytes, hashed.n)


def _whiteout(tree: _Tree, name: str, base: str, info: tarfile.TarInfo, here: str) -> None:
    parent = name.rpartition("/")[0]
    if base == _OPAQUE:
        os.setxattr(tree.path(parent), "trusted.overlay.opaque", b"y", follow_symlinks=False)
        return
    gone = f"{parent}/{base[len(_WH):]}" if parent else base[len(_WH):]
    if not base[len(_WH):] or base[len(_WH):] in (".", ".."):
        raise FormatError(f"{here}: a whiteout of nothing")
    if gone in tree.kinds:
        raise FormatError(f"{here}: whites out {gone!r}, which this layer wrote")
    path = tree.path(gone)
    os.mknod(path, stat.S_IFCHR, 0)
    os.chown(path, info.uid, info.gid)
    tree.kinds[gone] = "whiteout"


def _entry(tree: _Tree, tf: tarfile.TarFile, name: str, info: tarfile.TarInfo,
           here: str) -> int:
    path = tree.path(name)
    mode = info.mode & 0o7777
    kind = ("dir" if info.isdir() else "reg" if info.isreg() else "symlink" if info.issym()
            else "hardlink" if info.islnk() else "dev")
    if info.ischr() or info.isblk() or info.isfifo():
        kind = "dev"
    elif kind == "dev":
        raise FormatError(f"{here}: unsupported tar entry type {info.type!r}")
    tree.clear(name, kind)
    written = 0
    if kind == "dir":
        if tree.kinds.get(name) != "dir":
            os.mkdir(path, mode)
        tree.dirs.append((name, info))
    elif kind == "reg":
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
        try:
            src = tf.extractfile(info)
            if src is not None:
                while chunk := src.read(_COPY):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view):]
                    written += len(chunk)
            if written != info.size:
                raise FormatError(f"{here}: the stream ends inside its data (truncated)")
        except (tarfile.TarError, EOFError) as exc:
            raise FormatError(f"{here}: the stream ends inside its data (truncated): "
                              f"{exc}") from None
        finally:
            os.close(fd)
    elif kind == "symlink":
        os.symlink(info.linkname, path)
    elif kind == "hardlink":
        target = normalize_name(info.linkname, what=f"{here}: hardlink target")
        if tree.kinds.get(target) not in ("reg", "hardlink", "dev", "symlink"):
            raise FormatError(f"{here}: hardlink to {target!r}, which this layer did not "
                              "write (or wrote as a directory)")
        os.link(tree.path(target), path, follow_symlinks=False)
    else:
        fmt = stat.S_IFCHR if info.ischr() else stat.S_IFBLK if info.isblk() else stat.S_IFIFO
        dev = os.makedev(info.devmajor, info.devminor) if fmt != stat.S_IFIFO else 0
        os.mknod(path, mode | fmt, dev)
    tree.kinds[name] = kind
    os.lchown(path, info.uid, info.gid)
    for key, value in info.pax_headers.items():
        if not key.startswith(_XATTR):
            continue
        attr = key[len(_XATTR):]
        if attr.startswith("trusted."):
            log.warning("%s: xattr %s ignored (admin attributes from an archive are not "
                        "applied, as containerd does not)", here, attr)
            continue
        os.setxattr(path, attr, value.encode("utf-8", "surrogateescape"),
                    follow_symlinks=False)
    if kind != "symlink" and not (kind == "hardlink" and os.path.islink(path)):
        os.chmod(path, mode)
    if kind != "dir":
        os.utime(path, ns=_times(info), follow_symlinks=False)
    return written
