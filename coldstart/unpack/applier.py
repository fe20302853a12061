"""Apply a layer's tar stream to an empty directory as containerd's overlayfs applier does.

containerd (``archive.Apply`` with ``OverlayConvertWhiteout``, 1.6) is the reference: a node
whose layers coldstart unpacks must look to a container exactly as one whose layers containerd
unpacked. What it does, and so what this does:

- names are cleaned; the root entry is ignored; a name may not leave the layer;
- a missing parent directory is made, with the owner, mode, xattrs and times of the same
  directory in the nearest lower layer that has it (``lowers``; a lower where a component of
  the path is not a real directory ends the search), else 0755 root;
- over lower layers, whiteouts become what overlayfs reads: ``.wh.NAME`` → a character device
  0/0 ``NAME`` owned as the whiteout entry; ``.wh..wh..opq`` → ``trusted.overlay.opaque=y`` on
  its directory. A base layer (no lowers: containerd applies it on a bind mount) takes them
  naively: ``.wh.NAME`` removes what the layer wrote at NAME, an opaque marker does nothing;
- an entry replaces what the layer wrote at its path before, unless both are directories;
- regular files, directories, symlinks, hard links (to an earlier entry of the layer),
  character and block devices and FIFOs are made with the entry's owner (``lchown``), its
  ``SCHILY.xattr.*`` records (``trusted.*``, and what the file system does not support, or
  a ``user.*`` one it refuses on a special file, skipped with a warning), its permission bits
  (``chmod`` after ``chown``, so set-id bits stay; not for symlinks) and times (atime = the
  later of atime and mtime, both outside 1970..2262 taken as the epoch; symlinks not
  followed); directories get their times once every entry is written, in entry order.

Unlike containerd, a path through a symlink the layer made, an absolute name or one with
``..`` is refused (FormatError), not resolved inside the root: tar writers do not produce such
layers, refusing cannot write outside the directory, and the caller then lets containerd pull
the layer. The stream's SHA-256 (the layer's diffID) is computed as it is read.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import logging
import os
import queue
import shutil
import stat
import tarfile
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from coldstart.errors import FormatError
from coldstart.format.tarread import HeaderLog, checked_members, mtime_ns
from coldstart.format.toc import OPAQUE_WHITEOUT, WHITEOUT_PREFIX, normalize_name

__all__ = ["Applied", "apply_tar"]

log = logging.getLogger(__name__)

_WH = WHITEOUT_PREFIX
_OPAQUE = OPAQUE_WHITEOUT
_XATTR = "SCHILY.xattr."
_COPY = 1 << 20


@dataclass(frozen=True)
class Applied:
    """What one layer's tar stream held: its diffID, entries, bytes of regular files."""

    diff_id: str
    entries: int
    file_bytes: int
    tar_bytes: int


class _Forward:
    """The decompressed stream read forward only, for tarfile's random-access mode (``seek``
    only ahead: skipped bytes are read), hashed in a thread of its own (the applier's thread
    waits on the file system most of the time, and the digest of a GB is seconds of CPU) and
    counted as it is read. File data is handed out as views of the decompressor's own chunks
    (:meth:`views`): no copy between the inflate and ``write``. :meth:`digest` waits for the
    hash of everything read."""

    def __init__(self, inner: IO[bytes]) -> None:
        self.inner = inner
        self._buf = b""
        self._pos = 0          # in _buf
        self._base = 0         # the stream offset of _buf[0]
        self._sha = hashlib.sha256()
        self._q: queue.Queue[bytes | None] = queue.Queue(maxsize=64)   # ≤ 64 chunks ahead
        self._t = threading.Thread(target=self._hash, name="applier-hash", daemon=True)
        self._t.start()

    @property
    def n(self) -> int:
        """Bytes read from the decompressor so far."""
        return self._base + len(self._buf)

    def _hash(self) -> None:
        while (data := self._q.get()) is not None:
            self._sha.update(data)

    def _fill(self) -> bool:
        """The next chunk (False at the end of the stream)."""
        try:
            data = self.inner.read(_COPY)
        except EOFError as exc:
            raise FormatError(f"the layer's compressed stream ends early (truncated): "
                              f"{exc}") from None
        except Exception as exc:
            # rapidgzip, zstandard and zlib each have their own error types for corrupt data
            raise FormatError(f"the layer does not decompress: {type(exc).__name__}: "
                              f"{exc}") from None
        if not data:
            return False
        self._base += len(self._buf)
        self._buf, self._pos = bytes(data), 0
        self._q.put(self._buf)
        return True

    def tell(self) -> int:
        return self._base + self._pos

    def read(self, size: int = -1) -> bytes:
        if size < -1:
            raise ValueError(f"a read of {size} bytes")
        if 0 <= size <= len(self._buf) - self._pos:          # the common case: a header
            out = self._buf[self._pos:self._pos + size]
            self._pos += size
            return out
        parts = [bytes(v) for v in self.views(size if size >= 0 else 1 << 62)]
        return b"".join(parts)

    def views(self, size: int) -> Iterator[memoryview]:
        """Up to ``size`` bytes from here, as views of the stream's chunks (fewer at its end)."""
        while size > 0:
            if self._pos == len(self._buf) and not self._fill():
                return
            n = min(size, len(self._buf) - self._pos)
            view = memoryview(self._buf)[self._pos:self._pos + n]
            self._pos += n
            size -= n
            yield view

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence != os.SEEK_SET or offset < self.tell():
            raise io.UnsupportedOperation("the layer stream is read forward only")
        for _ in self.views(offset - self.tell()):
            pass
        return self.tell()

    def drain(self) -> None:
        self.seek(1 << 62)

    def close(self) -> None:
        if self._t.is_alive():
            self._q.put(None)
            self._t.join()

    def digest(self) -> str:
        self.close()
        return "sha256:" + self._sha.hexdigest()


#: containerd's boundTime: a time outside [epoch, 2262] is the epoch
_MAX_NS = (1 << 63) - 1


def _bound(ns: int) -> int:
    return ns if 0 <= ns <= _MAX_NS else 0


def _times(info: tarfile.TarInfo) -> tuple[int, int]:
    mtime = mtime_ns(info)
    atime = mtime
    if "atime" in info.pax_headers:
        probe = tarfile.TarInfo(info.name)
        probe.pax_headers = {"mtime": info.pax_headers["atime"]}
        try:
            atime = max(mtime, mtime_ns(probe))
        except FormatError:
            atime = mtime
    return _bound(atime), _bound(mtime)


class _Tree:
    """The directory being written, and what this layer put at each path (authoritative: the
    directory starts empty and nothing else writes to it)."""

    def __init__(self, root: Path, lowers: Sequence[Path]) -> None:
        self.root = root
        self.rootfd = str(root)
        self.lowers = list(lowers)
        self.kinds: dict[str, str] = {"": "dir"}
        #: what entries of the layer wrote (not parents made for them, not whiteouts)
        self.unpacked: set[str] = set()
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

    def _lower_dir(self, lower: Path, name: str) -> tuple[str, os.stat_result] | bool | None:
        """``name`` in ``lower`` as a real directory (no component a symlink): its path and
        stat; None when the lower lacks it; False when a component is not a directory."""
        path = str(lower)
        st: os.stat_result | None = None
        for part in name.split("/"):
            path = os.path.join(path, part)
            try:
                st = os.lstat(path)
            except OSError:
                return None
            if not stat.S_ISDIR(st.st_mode):
                return False
        return (path, st) if st is not None else None

    def _copy_up(self, name: str) -> None:
        path = self.path(name)
        for lower in self.lowers:
            found = self._lower_dir(lower, name)
            if found is None:
                continue
            if found is False:
                break
            assert not isinstance(found, bool)
            src, st = found
            os.mkdir(path, 0o700)
            os.lchown(path, st.st_uid, st.st_gid)
            os.chmod(path, stat.S_IMODE(st.st_mode))
            with contextlib.suppress(OSError):      # a lower without xattr support
                for key in os.listxattr(src, follow_symlinks=False):
                    if not key.startswith("trusted."):
                        _setxattr(path, key, os.getxattr(src, key, follow_symlinks=False),
                                  f"{name} (copied up)", True)
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
    hashed = _Forward(stream)
    try:
        headers = HeaderLog()
        tree = _Tree(root, lowers)
        entries = 0
        file_bytes = 0
        try:
            # random-access mode over a forward-only stream: tarfile's stream mode copies
            # every byte through 10 KiB Python-level reads
            tf = tarfile.open(  # noqa: SIM115 (closed by the with below)
                None, "r:", fileobj=hashed, encoding="utf-8",  # type: ignore[call-overload]
                errors="surrogateescape", tarinfo=headers.tarinfo)
        except (tarfile.TarError, EOFError) as exc:
            if hashed.n == 0:
                raise FormatError(f"{what}: the layer decompresses to nothing (truncated or "
                                  "corrupt)") from None
            raise FormatError(f"{what}: not a tar stream: {exc}") from None
        with tf:
            for info in checked_members(tf, headers):
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
                file_bytes += _entry(tree, tf, hashed, name, info, here)
            end = tf.offset
        hashed.drain()
        diff_id = hashed.digest()
        if hashed.n < end + 512:
            raise FormatError(f"{what}: the tar stream ends without its end-of-archive marker "
                              f"(after {hashed.n} bytes): truncated")
        for name, info in tree.dirs:
            os.utime(tree.path(name), ns=_times(info), follow_symlinks=False)
    finally:
        hashed.close()
    return Applied(diff_id, entries, file_bytes, hashed.n)


def _setxattr(where: str | int, attr: str, value: bytes, here: str, plain: bool) -> None:
    """Set an xattr as containerd does: what the file system does not support, and a
    ``user.*`` one refused on a special file, are skipped with a warning."""
    try:
        os.setxattr(where, attr, value, follow_symlinks=isinstance(where, int))
    except OSError as exc:
        if exc.errno == errno.ENOTSUP or (exc.errno == errno.EPERM and not plain
                                          and attr.startswith("user.")):
            log.warning("%s: xattr %s ignored: %s", here, attr, exc)
            return
        raise


def _whiteout(tree: _Tree, name: str, base: str, info: tarfile.TarInfo, here: str) -> None:
    parent = name.rpartition("/")[0]
    naive = not tree.lowers            # a base layer: containerd applies it on a bind mount
    if base == _OPAQUE:
        if not naive:
            os.setxattr(tree.path(parent), "trusted.overlay.opaque", b"y",
                        follow_symlinks=False)
            return
        # containerd's naive opaque: what this layer holds below it but did not write
        # itself (parents it had to make) goes
        prefix = f"{parent}/" if parent else ""
        for k in sorted(k for k in tree.kinds if k.startswith(prefix) and k != parent):
            if k in tree.kinds and k not in tree.unpacked:
                tree.clear(k, "whiteout")
        return
    gone = f"{parent}/{base[len(_WH):]}" if parent else base[len(_WH):]
    if not base[len(_WH):] or base[len(_WH):] in (".", ".."):
        raise FormatError(f"{here}: a whiteout of nothing")
    if naive:
        tree.clear(gone, "whiteout")
        return
    if gone in tree.kinds:
        raise FormatError(f"{here}: whites out {gone!r}, which this layer wrote")
    path = tree.path(gone)
    os.mknod(path, stat.S_IFCHR, 0)
    os.chown(path, info.uid, info.gid)
    tree.kinds[gone] = "whiteout"


def _entry(tree: _Tree, tf: tarfile.TarFile, stream: _Forward, name: str,
           info: tarfile.TarInfo, here: str) -> int:
    path = tree.path(name)
    mode = info.mode & 0o7777
    kind = ("dir" if info.isdir() else "reg" if info.isreg() else "symlink" if info.issym()
            else "hardlink" if info.islnk() else "dev")
    if info.ischr() or info.isblk() or info.isfifo():
        kind = "dev"
    elif kind == "dev":
        raise FormatError(f"{here}: unsupported tar entry type {info.type!r}")
    tree.clear(name, kind)
    if kind == "reg":
        _write_file(path, _data(tf, stream, info, here), info, here)
        tree.kinds[name] = kind
        tree.unpacked.add(name)
        return info.size
    if kind == "dir":
        if tree.kinds.get(name) != "dir":
            os.mkdir(path, mode)
        tree.dirs.append((name, info))
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
    tree.unpacked.add(name)
    os.lchown(path, info.uid, info.gid)
    _xattrs(path, info, here, kind in ("dir", "hardlink"))
    if kind != "symlink" and not (kind == "hardlink" and os.path.islink(path)):
        os.chmod(path, mode)
    if kind != "dir":
        os.utime(path, ns=_times(info), follow_symlinks=False)
    return 0


def _data(tf: tarfile.TarFile, stream: _Forward, info: tarfile.TarInfo,
               here: str) -> Iterator[memoryview]:
    """A regular file's data as it is read: straight from the stream's chunks (a sparse file
    through tarfile, which fills its holes). FormatError if the stream ends inside it."""
    if info.sparse is None:
        stream.seek(info.offset_data)
        yield from stream.views(info.size)
        if stream.tell() - info.offset_data != info.size:
            raise FormatError(f"{here}: the stream ends inside its data (truncated)")
        return
    written = 0
    try:
        src = tf.extractfile(info)
        if src is not None:
            while chunk := src.read(_COPY):
                written += len(chunk)
                yield memoryview(chunk)
    except (tarfile.TarError, EOFError) as exc:
        raise FormatError(f"{here}: the stream ends inside its data (truncated): "
                          f"{exc}") from None
    if written != info.size:
        raise FormatError(f"{here}: the stream ends inside its data (truncated)")


def _write_file(path: str, data: Iterable[memoryview], info: tarfile.TarInfo,
                here: str) -> None:
    """Create the regular file ``path`` with ``data``, then its owner, xattrs, mode and
    times, each by descriptor (no path walk for each)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                 info.mode & 0o7777)
    try:
        for view in data:
            while view:
                view = view[os.write(fd, view):]
        os.fchown(fd, info.uid, info.gid)
        _xattrs(fd, info, here, True)
        os.fchmod(fd, info.mode & 0o7777)
        os.utime(fd, ns=_times(info))
    finally:
        os.close(fd)


def _xattrs(where: str | int, info: tarfile.TarInfo, here: str, plain: bool) -> None:
    """The entry's ``SCHILY.xattr.*`` records set on ``where`` (a path, not followed, or a
    descriptor); ``plain``: a regular file or directory (see :func:`_setxattr`)."""
    for key, value in info.pax_headers.items():
        if not key.startswith(_XATTR):
            continue
        attr = key[len(_XATTR):]
        if attr.startswith("trusted."):
            log.warning("%s: xattr %s ignored (admin attributes from an archive are not "
                        "applied, as containerd does not)", here, attr)
            continue
        _setxattr(where, attr, value.encode("utf-8", "surrogateescape"), here, plain)
