"""Writing a bench image's layers: the build context, streaming gzip layers, reused ones.

A layer is written streaming (never a whole layer in memory): a PAX tar stream (:class:`Tar`,
members in the order given, parents first, fixed mtimes and owners) hashed for its diff_id on
the fly and gzip-compressed in parallel blocks, as pigz does (each block a raw deflate stream
primed with the previous 32 KiB and ended with a sync flush), so the output does not depend on
the number of threads; the blob is named by the hash of the bytes written. A recipe
(:mod:`coldstart.benchmark.imagerecipes`) fills each layer through :func:`write_layer`, adds
trees from disk with :func:`add_tree`, and takes another built image's layers with
:func:`reuse_layers` (hard-linked). Files beside the layers (``recipe.json``, a build step's
stamp) are written with :func:`atomic_write`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import struct
import tarfile
import tempfile
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from coldstart.errors import InvalidArgument, Unavailable
from coldstart.oci.layout import OciLayout
from coldstart.oci.manifest import OCI_LAYER_GZIP, Descriptor

__all__ = ["MTIME", "RECIPE_FILE", "Built", "Context", "Layer", "Progress", "Tar", "add_tree",
           "atomic_write", "human_size", "reuse_layers", "write_layer"]

Progress = Callable[[str], None]

MiB = 1 << 20
MTIME = 1_700_000_000              # every member's mtime (2023-11-14)
RECIPE_FILE = "recipe.json"        # beside a built image's layout: what it is, its layers


@dataclass
class Context:
    """What a recipe builds with: the image's name, the cache it goes to, the layout being
    written, where its steps are reported, how many threads compress, and ``other(name)``: the
    layout of another built-in image, built into the same cache first if need be."""

    name: str
    cache_dir: Path
    layout: OciLayout
    progress: Progress
    workers: int
    other: Callable[[str], Path]


@dataclass(frozen=True)
class Layer:
    """A layer written into the layout: its descriptor, diff_id, tar size, what it holds."""

    desc: Descriptor
    diff_id: str
    uncompressed: int
    what: str

    def to_json(self) -> dict[str, Any]:
        return {"digest": self.desc.digest, "size": self.desc.size, "diff_id": self.diff_id,
                "uncompressed": self.uncompressed, "what": self.what}


@dataclass(frozen=True)
class Built:
    """What a recipe made: the layers in order, and the config's command, ready, env."""

    layers: list[Layer]
    command: list[str]
    ready: str
    env: list[str]


def atomic_write(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` (mode 0644) or what it held before, never part of it."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(name, 0o644)
        os.replace(name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
        raise


def human_size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


# -- streaming layer writer --------------------------------------------------------------------

_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"   # deflate, no name, mtime 0
_WINDOW = 32 * 1024


def _deflate(block: bytes, zdict: bytes, level: int, strategy: int, final: bool) -> bytes:
    if zdict:
        c = zlib.compressobj(level, zlib.DEFLATED, -15, 8, strategy, zdict)
    else:
        c = zlib.compressobj(level, zlib.DEFLATED, -15, 8, strategy)
    return c.compress(block) + c.flush(zlib.Z_FINISH if final else zlib.Z_SYNC_FLUSH)


class _GzipBlob:
    """A gzip file written streaming, compressed in parallel blocks (pigz's scheme); also the
    SHA-256 of what goes in (the diff_id) and of what comes out (the blob digest)."""

    def __init__(self, path: Path, *, level: int, strategy: int, workers: int,
                 block: int = MiB) -> None:
        self.path = path
        self._file: IO[bytes] = open(path, "wb")  # noqa: SIM115 (closed by finish/close)
        self._level, self._strategy, self._block = level, strategy, block
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="gzip")
        self._pending: deque[Future[bytes]] = deque()
        self._max_pending = 2 * workers + 1
        self._buf = bytearray()
        self._zdict = b""
        self._raw_hash, self._out_hash = hashlib.sha256(), hashlib.sha256()
        self._crc = 0
        self.raw_size = 0
        self.size = 0
        self._emit(_GZIP_HEADER)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._buf += data
        while len(self._buf) >= self._block:
            with memoryview(self._buf) as view:
                block = bytes(view[:self._block])
            del self._buf[:self._block]
            self._submit(block, final=False)

    def _submit(self, block: bytes, final: bool) -> None:
        self._raw_hash.update(block)
        self._crc = zlib.crc32(block, self._crc)
        self.raw_size += len(block)
        zdict = self._zdict
        self._zdict = block[-_WINDOW:] if len(block) >= _WINDOW else (zdict + block)[-_WINDOW:]
        self._pending.append(self._pool.submit(_deflate, block, zdict, self._level,
                                               self._strategy, final))
        while len(self._pending) > (0 if final else self._max_pending):
            self._emit(self._pending.popleft().result())

    def _emit(self, data: bytes) -> None:
        self._file.write(data)
        self._out_hash.update(data)
        self.size += len(data)

    def finish(self) -> tuple[str, str]:
        """Flush, write the trailer, fsync; return (blob digest, diff_id)."""
        self._submit(bytes(self._buf), final=True)
        self._buf = bytearray()
        self._emit(struct.pack("<II", self._crc & 0xFFFFFFFF, self.raw_size & 0xFFFFFFFF))
        self._file.flush()
        os.fsync(self._file.fileno())
        self.close()
        return f"sha256:{self._out_hash.hexdigest()}", f"sha256:{self._raw_hash.hexdigest()}"

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._file.close()


class Tar:
    """A PAX tar stream of members in the order given (parents first), fixed mtimes."""

    def __init__(self, out: _GzipBlob) -> None:
        self._out = out
        self._pos = 0
        self._dirs: set[str] = set()

    def _write(self, data: bytes | bytearray | memoryview) -> None:
        self._out.write(data)
        self._pos += len(data)

    def _header(self, name: str, kind: bytes, *, size: int = 0, mode: int, uid: int = 0,
                gid: int = 0, link: str = "") -> None:
        ti = tarfile.TarInfo(name)
        ti.type, ti.size, ti.mode, ti.uid, ti.gid, ti.mtime = kind, size, mode, uid, gid, MTIME
        ti.linkname = link
        ti.uname = ti.gname = ""
        self._write(ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))

    def parents(self, name: str) -> None:
        parts = name.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            if d not in self._dirs:
                self.dir(d)

    def dir(self, name: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> None:
        self.parents(name)
        self._dirs.add(name)
        self._header(name, tarfile.DIRTYPE, mode=mode, uid=uid, gid=gid)

    def symlink(self, name: str, target: str, uid: int = 0, gid: int = 0) -> None:
        self.parents(name)
        self._header(name, tarfile.SYMTYPE, mode=0o777, uid=uid, gid=gid, link=target)

    def hardlink(self, name: str, target: str, mode: int, uid: int = 0, gid: int = 0) -> None:
        self.parents(name)
        self._header(name, tarfile.LNKTYPE, mode=mode, uid=uid, gid=gid, link=target)

    def file(self, name: str, data: bytes | Iterable[bytes], size: int | None = None, *,
             mode: int = 0o644, uid: int = 0, gid: int = 0) -> None:
        """A regular file; ``data`` is its bytes, or chunks of them adding up to ``size``."""
        if isinstance(data, bytes | bytearray):
            size, chunks = len(data), [bytes(data)]
        elif size is None:
            raise InvalidArgument(f"{name}: chunked data needs its size")
        else:
            chunks = data       # type: ignore[assignment]
        self.parents(name)
        self._header(name, tarfile.REGTYPE, size=size, mode=mode, uid=uid, gid=gid)
        written = 0
        for chunk in chunks:
            written += len(chunk)
            if written > size:
                break
            self._write(chunk)
        if written != size:
            raise Unavailable(f"{name}: got {written} bytes of content, expected {size} "
                              "(did the file change while it was being read?)")
        if size % 512:
            self._write(bytes(512 - size % 512))

    def close(self) -> None:
        self._write(bytes(1024))
        if self._pos % tarfile.RECORDSIZE:
            self._write(bytes(tarfile.RECORDSIZE - self._pos % tarfile.RECORDSIZE))


def write_layer(ctx: Context, what: str, fill: Callable[[Tar], None], *,
                level: int = 6, strategy: int = zlib.Z_DEFAULT_STRATEGY) -> Layer:
    """Write one gzip layer into the layout from the members ``fill`` adds."""
    t0 = time.monotonic()
    fd, tmp = tempfile.mkstemp(dir=ctx.layout.root / "blobs", prefix=".layer-")
    os.close(fd)
    blob = _GzipBlob(Path(tmp), level=level, strategy=strategy, workers=ctx.workers)
    try:
        tar = Tar(blob)
        fill(tar)
        tar.close()
        digest, diff_id = blob.finish()
        dst = ctx.layout.blob_path(digest)      # named by the hash of the bytes just written
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dst)
    except BaseException:
        blob.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    secs = time.monotonic() - t0
    ctx.progress(f"layer {what}: {human_size(blob.raw_size)} -> {human_size(blob.size)} gzip "
                 f"in {secs:.1f} s ({blob.raw_size / 1e6 / max(secs, 1e-9):.0f} MB/s)")
    return Layer(Descriptor(OCI_LAYER_GZIP, digest, blob.size), diff_id, blob.raw_size, what)


def reuse_layers(ctx: Context, name: str, count: int) -> list[Layer]:
    """The first ``count`` layers of the built-in image ``name`` (built first if need be),
    hard-linked (or copied) into this layout."""
    base = ctx.other(name)
    recipe = json.loads((base / RECIPE_FILE).read_text())
    src = OciLayout(base)
    out = []
    for la in recipe["layers"][:count]:
        digest = str(la["digest"])
        dst = ctx.layout.blob_path(digest)
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src.blob_path(digest), dst)
            except OSError:
                shutil.copyfile(src.blob_path(digest), dst)
        out.append(Layer(Descriptor(OCI_LAYER_GZIP, digest, int(la["size"])),
                         str(la["diff_id"]), int(la["uncompressed"]), str(la["what"])))
    ctx.progress(f"reused {count} layers of {name} "
                 f"({human_size(sum(la.uncompressed for la in out))})")
    return out


def add_tree(tar: Tar, root: Path, prefix: str = "", *, keep_owner: bool = True,
             skip_contents: frozenset[str] = frozenset(),
             skip: Callable[[str], bool] = lambda rel: False) -> int:
    """Add the tree under ``root`` (sorted; hard links kept, devices and sockets left out) with
    names ``prefix + relative path``. ``keep_owner=False``: owned by root, modes 0755/0644."""
    seen: dict[tuple[int, int], str] = {}
    count = 0

    def mode_of(st: os.stat_result) -> int:
        if keep_owner:
            return stat.S_IMODE(st.st_mode)
        if stat.S_ISDIR(st.st_mode) or st.st_mode & 0o111:
            return 0o755
        return 0o644

    def walk(directory: Path, rel: str) -> None:
        nonlocal count
        with os.scandir(directory) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            r = f"{rel}{e.name}"
            if skip(r):
                continue
            name = prefix + r
            st = e.stat(follow_symlinks=False)
            uid, gid = (st.st_uid, st.st_gid) if keep_owner else (0, 0)
            if stat.S_ISDIR(st.st_mode):
                tar.dir(name, mode_of(st), uid, gid)
                if r not in skip_contents:
                    walk(Path(e.path), r + "/")
            elif stat.S_ISLNK(st.st_mode):
                tar.symlink(name, os.readlink(e.path), uid, gid)
            elif stat.S_ISREG(st.st_mode):
                key = (st.st_dev, st.st_ino)
                if st.st_nlink > 1 and key in seen:
                    tar.hardlink(name, seen[key], mode_of(st), uid, gid)
                    continue
                seen[key] = name
                tar.file(name, _read_chunks(Path(e.path)), st.st_size, mode=mode_of(st),
                         uid=uid, gid=gid)
            else:
                continue        # devices, fifos, sockets: the runtime provides /dev
            count += 1

    walk(root, "")
    return count


def _read_chunks(path: Path, size: int = 4 * MiB) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(size):
            yield chunk
