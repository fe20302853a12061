"""The images ``coldstart bench`` runs: reproducible, built on this machine, cached on disk.

Four built-in images, each an OCI image-layout directory (gzip layers, tag ``latest``) with the
start-up command, ready condition and sizes recorded beside it in ``recipe.json``:

* ``tiny`` (seconds): busybox plus the demo's application layer (a 48 MB library, weights, 2000
  small modules); ``/app/start.sh`` reads a tenth of the modules and exits.
* ``torch`` (1.1 GB): a Debian 12 rootfs (``debootstrap --variant=minbase``) with python3, torch
  2.13.0 (CPU) and its dependencies installed by the host's pip, a small app layer; the
  command imports torch and exits.
* ``server``: torch's OS and torch layers plus a model-server layer, ``/model/model.safetensors``
  (2.7 GB of bf16 weights) and ``/app/server.py`` (:mod:`coldstart.benchmark.server_app`), which
  reports its phases by sd_notify and on stdout, serves ``GET /infer`` and says ``READY=1``.
* ``cuda-like`` (15.7 GB): shaped like a CUDA PyTorch serving image: torch's layers, a layer of
  multi-GB shared libraries, one of ~49 000 small Python modules, one of 4.6 GB of sharded
  safetensors weights and the server, which imports a tenth of the modules, touches a few per
  cent of the libraries' pages, loads the weights and says ``READY=1``.

>>> image = build_image("tiny")                                       # doctest: +SKIP
>>> image.layout, image.command, image.ready                           # doctest: +SKIP
(PosixPath('.../bench/images/tiny'), ['/app/start.sh'], 'exit')

Content is deterministic: fixed seeds, mtimes, owners and entry order; Python bytecode compiled
hash-based (``unchecked-hash``) so it does not depend on mtimes. Layers are written streaming
(never a whole layer in memory): a tar stream hashed for its diff_id on the fly and
gzip-compressed in parallel blocks, as pigz does (each block a raw deflate stream primed with the
previous 32 KiB and ended with a sync flush), so the output does not depend on the number of
threads. A build goes to a temporary directory beside the cache entry and is renamed into place
once complete; ``recipe.json`` is written last, so a directory without it is incomplete and is
rebuilt. What the torch image downloads (the Debian packages, the rootfs debootstrap made, the
wheels and the installed site-packages tree) is kept under ``<cache>/_build`` and reused by later
builds, ``force=True`` included; delete that directory to download again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import random
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from coldstart.errors import ColdstartError, FailedPrecondition, InvalidArgument, Unavailable
from coldstart.oci.layout import OciLayout
from coldstart.oci.manifest import (
    OCI_CONFIG,
    OCI_LAYER_GZIP,
    OCI_MANIFEST,
    Descriptor,
    build_manifest,
    canonical_json,
    host_platform,
    parse_manifest,
)
from coldstart.stack.mounts import unmount_under

__all__ = ["BUILTIN", "BenchImage", "build_image", "default_cache_dir", "load_image"]

Progress = Callable[[str], None]

MiB = 1 << 20
MTIME = 1_700_000_000              # every member's mtime (2023-11-14)
CREATED = "2023-11-14T22:13:20Z"   # the same instant, in the image config
RECIPE_FILE = "recipe.json"
BUILD_DIR = "_build"               # downloads and intermediate trees shared by builds
PY_SITE = "usr/local/lib/python3.11/dist-packages"
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEBIAN_SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# torch and what it needs, pinned (the host venv's versions), so the torch layer is reproducible
TORCH_PINS = ("torch==2.13.0", "safetensors==0.8.0", "numpy==2.4.6", "filelock==4.3.1",
              "fsspec==2026.9.0", "jinja2==3.1.6", "markupsafe==3.0.4", "mpmath==1.3.0",
              "networkx==3.6.1", "setuptools==84.2.1", "sympy==1.14.0",
              "typing-extensions==4.16.0")
TORCH_COMMAND = ["python3", "-c", "import torch; print(torch.ones(2).sum())"]
_SERVER_APP = Path(__file__).with_name("server_app.py")


# -- the public API ----------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchImage:
    """A built benchmark image: where it is, how it starts, how big it is."""

    name: str               # "tiny", "torch", "server", "cuda-like"
    layout: Path            # an OCI layout directory holding the gzip image, tag "latest"
    command: list[str]      # the start-up argv run in the container
    ready: str              # "exit" (the command exits 0) or "notify" (READY=1 on $NOTIFY_SOCKET)
    env: list[str]          # the config's Env, e.g. ["PATH=/usr/local/bin:/usr/bin:/bin"]
    uncompressed_bytes: int  # the layers' tar streams, summed
    compressed_bytes: int   # the layers' gzip blobs, summed
    description: str

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON types (``layout`` as a string)."""
        return {"name": self.name, "layout": str(self.layout), "command": list(self.command),
                "ready": self.ready, "env": list(self.env),
                "uncompressed_bytes": self.uncompressed_bytes,
                "compressed_bytes": self.compressed_bytes, "description": self.description}


@dataclass(frozen=True)
class _Recipe:
    version: int            # bump when the image's content or metadata changes: rebuilds it
    description: str
    build: Callable[[_Context], _Built]


@dataclass
class _Context:
    name: str
    cache_dir: Path
    layout: OciLayout
    progress: Progress
    workers: int


@dataclass(frozen=True)
class _Layer:
    desc: Descriptor
    diff_id: str
    uncompressed: int
    what: str

    def to_json(self) -> dict[str, Any]:
        return {"digest": self.desc.digest, "size": self.desc.size, "diff_id": self.diff_id,
                "uncompressed": self.uncompressed, "what": self.what}


@dataclass(frozen=True)
class _Built:
    layers: list[_Layer]
    command: list[str]
    ready: str
    env: list[str]


def default_cache_dir() -> Path:
    """Where built images are kept: ``$COLDSTART_BENCH_IMAGES``; else ``bench/images`` of the
    checkout coldstart runs from; else ``~/.cache/coldstart/bench-images``."""
    env = os.environ.get("COLDSTART_BENCH_IMAGES")
    if env:
        return Path(env).expanduser()
    checkout = Path(__file__).resolve().parents[2]     # coldstart/benchmark/images.py
    if (checkout / "bench").is_dir():
        return checkout / "bench" / "images"
    return Path.home() / ".cache" / "coldstart" / "bench-images"


def build_image(name: str, cache_dir: Path | None = None, *,
                progress: Progress = lambda s: None, force: bool = False) -> BenchImage:
    """The image ``name``, built into ``cache_dir`` unless a complete build is there already
    (``force``: build it again). ``progress`` receives one line per step.

    >>> build_image("tiny", Path("/tmp/imgs")).command               # doctest: +SKIP
    ['/app/start.sh']
    """
    recipe = _recipe(name)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FailedPrecondition(f"cannot create the image cache {cache}: {exc}") from exc
    with _lock(cache / f".{name}.lock"):
        if not force:
            cached = load_image(name, cache)
            if cached is not None:
                return cached
        for stale in cache.glob(f".tmp-{name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=cache))
        t0 = time.monotonic()
        try:
            os.chmod(tmp, 0o755)
            ctx = _Context(name, cache, OciLayout.create(tmp), progress,
                           max(1, os.cpu_count() or 1))
            built = recipe.build(ctx)
            manifest = _write_manifest(ctx.layout, built)
            image = BenchImage(
                name=name, layout=cache / name, command=built.command, ready=built.ready,
                env=built.env, uncompressed_bytes=sum(la.uncompressed for la in built.layers),
                compressed_bytes=sum(la.desc.size for la in built.layers),
                description=recipe.description)
            fields = image.to_json()
            del fields["layout"]            # the directory may move; the layout is where it is
            body = {"recipe_version": recipe.version, "image": fields,
                    "manifest": manifest.digest,
                    "layers": [la.to_json() for la in built.layers],
                    "build_seconds": round(time.monotonic() - t0, 1)}
            _atomic_write(tmp / RECIPE_FILE, json.dumps(body, indent=2).encode() + b"\n")
            _swap_into_place(tmp, cache / name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        progress(f"built in {time.monotonic() - t0:.1f} s: {image.layout} "
                 f"({_size(image.uncompressed_bytes)} uncompressed, "
                 f"{_size(image.compressed_bytes)} gzip)")
        return image


def load_image(name: str, cache_dir: Path | None = None) -> BenchImage | None:
    """The complete cached build of ``name``, or ``None`` (not built, unfinished, missing blobs,
    or built by an older recipe)."""
    recipe = _recipe(name)
    root = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / name
    try:
        body = json.loads((root / RECIPE_FILE).read_text())
        if body.get("recipe_version") != recipe.version:
            return None
        img = body["image"]
        layout = OciLayout(root)
        mdesc = layout.resolve("latest")
        manifest = parse_manifest(layout.read_blob(mdesc.digest), mdesc.media_type)
        for d in (manifest.config, *manifest.layers):
            if layout.blob_size(d.digest) != d.size:
                return None
        return BenchImage(name=name, layout=root, command=[str(a) for a in img["command"]],
                          ready=str(img["ready"]), env=[str(e) for e in img["env"]],
                          uncompressed_bytes=int(img["uncompressed_bytes"]),
                          compressed_bytes=int(img["compressed_bytes"]),
                          description=recipe.description)
    except (OSError, ValueError, KeyError, TypeError, ColdstartError):
        return None


def _recipe(name: str) -> _Recipe:
    recipe = _RECIPES.get(name)
    if recipe is None:
        raise InvalidArgument(f"unknown bench image {name!r} (built-in: {', '.join(_RECIPES)})")
    return recipe


# -- cache plumbing ----------------------------------------------------------------------------

@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """One builder per image and cache directory at a time (others wait, then reuse)."""
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _atomic_write(path: Path, data: bytes) -> None:
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


def _swap_into_place(tmp: Path, final: Path) -> None:
    """Rename the finished build over ``final`` (an old or incomplete one is removed after)."""
    old: Path | None = None
    if final.exists() or final.is_symlink():
        old = final.with_name(f".tmp-{final.name}-old-{os.getpid()}")
        os.rename(final, old)
    os.rename(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_manifest(layout: OciLayout, built: _Built) -> Descriptor:
    plat = host_platform()
    config = {"architecture": plat.architecture, "os": plat.os, "created": CREATED,
              "config": {"Env": built.env, "Cmd": built.command, "WorkingDir": "/"},
              "rootfs": {"type": "layers", "diff_ids": [la.diff_id for la in built.layers]},
              "history": [{"created": CREATED, "created_by": f"coldstart bench-image: {la.what}"}
                          for la in built.layers]}
    cdesc = layout.put_blob(canonical_json(config), OCI_CONFIG)
    manifest = build_manifest(cdesc, [la.desc for la in built.layers], media_type=OCI_MANIFEST)
    mdesc = layout.put_blob(manifest.to_bytes(), OCI_MANIFEST)
    layout.add_manifest(mdesc, "latest")
    for path in (layout.blob_path(cdesc.digest), layout.blob_path(mdesc.digest),
                 layout.root / "index.json"):
        os.chmod(path, 0o644)           # readable by a registry or containerd not run as root
    return mdesc


def _size(n: int) -> str:
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


class _Tar:
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


def _write_layer(ctx: _Context, what: str, fill: Callable[[_Tar], None], *,
                 level: int = 6, strategy: int = zlib.Z_DEFAULT_STRATEGY) -> _Layer:
    """Write one gzip layer into the layout from the members ``fill`` adds."""
    t0 = time.monotonic()
    fd, tmp = tempfile.mkstemp(dir=ctx.layout.root / "blobs", prefix=".layer-")
    os.close(fd)
    blob = _GzipBlob(Path(tmp), level=level, strategy=strategy, workers=ctx.workers)
    try:
        tar = _Tar(blob)
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
    ctx.progress(f"layer {what}: {_size(blob.raw_size)} -> {_size(blob.size)} gzip "
                 f"in {secs:.1f} s ({blob.raw_size / 1e6 / max(secs, 1e-9):.0f} MB/s)")
    return _Layer(Descriptor(OCI_LAYER_GZIP, digest, blob.size), diff_id, blob.raw_size, what)


def _reuse_layers(ctx: _Context, base: BenchImage, count: int) -> list[_Layer]:
    """The first ``count`` layers of a built image, hard-linked (or copied) into this layout."""
    recipe = json.loads((base.layout / RECIPE_FILE).read_text())
    src = OciLayout(base.layout)
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
        out.append(_Layer(Descriptor(OCI_LAYER_GZIP, digest, int(la["size"])),
                          str(la["diff_id"]), int(la["uncompressed"]), str(la["what"])))
    ctx.progress(f"reused {count} layers of {base.name} "
                 f"({_size(sum(la.uncompressed for la in out))})")
    return out


def _add_tree(tar: _Tar, root: Path, prefix: str = "", *, keep_owner: bool = True,
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


# -- content generators ------------------------------------------------------------------------

def _text_pool(seed: int, size: int) -> bytes:
    """Word soup: letters, spaces and newlines (no quotes or backslashes: safe in a docstring)."""
    rng = random.Random(seed)
    words = [bytes(rng.choice(b"abcdefghijklmnopqrstuvwxyz_") for _ in range(rng.randint(2, 10)))
             for _ in range(4000)]
    out = bytearray()
    while len(out) < size:
        out += b" ".join(rng.choices(words, k=10)) + b"\n"
    return bytes(out[:size])


def _bf16_pool(seed: int, elements: int) -> Any:
    """``elements`` bf16 bit patterns of normal(0, 0.02) values (a numpy uint16 array)."""
    try:
        import numpy as np
    except ImportError as exc:
        raise FailedPrecondition("generating weights needs numpy (pip install numpy)") from exc
    values = np.random.default_rng(seed).standard_normal(elements, dtype=np.float32)
    values *= np.float32(0.02)
    return (values.view(np.uint32) >> 16).astype(np.uint16)     # bf16: float32's top half


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 2
        for d in self.shape:
            n *= d
        return n


def _llama_tensors(hidden: int, intermediate: int, layers: range, vocab: int, *,
                   embed: bool, head: bool) -> list[_Tensor]:
    """Tensor names and shapes of a Llama-style decoder (or a shard of one)."""
    out = [_Tensor("model.embed_tokens.weight", (vocab, hidden))] if embed else []
    for i in layers:
        p = f"model.layers.{i}."
        out += [_Tensor(p + "input_layernorm.weight", (hidden,))]
        out += [_Tensor(p + f"self_attn.{k}_proj.weight", (hidden, hidden)) for k in "qkvo"]
        out += [_Tensor(p + "post_attention_layernorm.weight", (hidden,)),
                _Tensor(p + "mlp.gate_proj.weight", (intermediate, hidden)),
                _Tensor(p + "mlp.up_proj.weight", (intermediate, hidden)),
                _Tensor(p + "mlp.down_proj.weight", (hidden, intermediate))]
    if head:
        out += [_Tensor("model.norm.weight", (hidden,)), _Tensor("lm_head.weight", (vocab, hidden))]
    return out


def _safetensors_header(tensors: list[_Tensor]) -> bytes:
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        meta[t.name] = {"dtype": "BF16", "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    body = json.dumps(meta, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def _safetensors_size(tensors: list[_Tensor]) -> int:
    return len(_safetensors_header(tensors)) + sum(t.nbytes for t in tensors)


def _safetensors_chunks(tensors: list[_Tensor], pool: Any, seed: int) -> Iterator[bytes]:
    """A safetensors file, streamed: weights are 1 MiB runs of ``pool`` at random offsets, each
    XORed with a random 7-bit mantissa mask (no two runs alike, the value distribution kept);
    norms are ones."""
    import numpy as np

    rng = random.Random(seed)
    yield _safetensors_header(tensors)
    run = MiB // 2                      # elements
    for t in tensors:
        n = t.nbytes // 2
        if "norm" in t.name:
            yield np.full(n, 0x3F80, dtype=np.uint16).tobytes()     # bf16 1.0
            continue
        for pos in range(0, n, run):
            k = min(run, n - pos)
            start = rng.randrange(0, len(pool) - k)
            yield (pool[start:start + k] ^ np.uint16(rng.randrange(128))).tobytes()


def _lib_pools(seed: int) -> tuple[bytes, bytes]:
    """(uniformly random bytes, skewed bytes like machine code: 3.2 bits of entropy a byte)."""
    rng = random.Random(seed)
    rand = rng.randbytes(64 * MiB)
    weights = {0x00: 100, 0xFF: 20, 0x48: 20, 0x89: 16, 0x8B: 16, 0xE8: 12, 0x0F: 12,
               0x24: 12, 0x44: 10, 0x85: 8, 0xC0: 8, 0x83: 8, 0x01: 6, 0x08: 4, 0x10: 4}
    table = b"".join(bytes([v]) * n for v, n in weights.items())
    skewed = rng.randbytes(64 * MiB).translate(table)
    return rand, skewed


def _lib_chunks(size: int, pools: tuple[bytes, bytes], seed: int) -> Iterator[bytes]:
    """A shared library's worth of bytes, ~2.8x compressible: an ELF-like header, then runs of
    random bytes (15%), skewed "code" bytes (47%) and zeros (38%)."""
    rand, skewed = pools
    rng = random.Random(seed)
    zeros = bytes(32 * 1024)
    head = b"\x7fELF\x02\x01\x01" + bytes(57)
    out = bytearray(head)
    left = size
    while left > 0:
        while len(out) < 4 * MiB:
            x = rng.random()
            n = rng.randint(1024, 32 * 1024)
            if x < 0.15:
                o = rng.randrange(len(rand) - n)
                out += rand[o:o + n]
            elif x < 0.62:
                o = rng.randrange(len(skewed) - n)
                out += skewed[o:o + n]
            else:
                out += zeros[:n]
        take = min(left, len(out))
        yield bytes(out[:take])
        left -= take
        del out[:take]


def _module_source(i: int, size: int, pool: bytes, rng: random.Random) -> bytes:
    """A valid Python module of about ``size`` bytes, mostly docstrings (they compile fast, as
    the bytecode a real site-packages tree ships would load fast)."""
    funcs = "".join(f"def f{k}(x, y={k}):\n    \"\"\"Step {k}.\"\"\"\n    return x * {k} + y - {i}"
                    f"\n\n\n" for k in range(min(40, size // 1500 + 1)))
    code = (f'\n"""\n\nfrom __future__ import annotations\n\nVERSION = {i}\n\n\n{funcs}'
            f"class C{i}:\n    def __call__(self, x):\n        return f0(x)\n").encode()
    head = f'"""Module {i}.\n\n'.encode()
    n = max(0, size - len(head) - len(code))
    o = rng.randrange(0, len(pool) - n)
    return head + pool[o:o + n] + code


# -- tiny --------------------------------------------------------------------------------------

def _build_tiny(ctx: _Context) -> _Built:
    from coldstart.benchmark.demo import demo_files
    from coldstart.stack.images import APPLETS, busybox_entries

    def busybox(tar: _Tar) -> None:
        for e in busybox_entries((*APPLETS, "dd")):
            if e.kind == "dir":
                tar.dir(e.path, e.mode)
            elif e.kind == "symlink":
                tar.symlink(e.path, e.target)
            else:
                tar.file(e.path, e.data, mode=e.mode)
        tar.file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
        tar.file("etc/group", b"root:x:0:\n")

    _, app_files = demo_files()

    def app(tar: _Tar) -> None:
        for f in app_files:
            tar.file(f.name, f.data, mode=f.mode)

    layers = [_write_layer(ctx, "busybox", busybox), _write_layer(ctx, "app", app)]
    return _Built(layers, ["/app/start.sh"], "exit", ["PATH=/bin"])


# -- torch -------------------------------------------------------------------------------------

def _debian_mirror() -> str:
    """The Debian mirror this machine's apt uses (``$COLDSTART_DEBIAN_MIRROR`` overrides)."""
    env = os.environ.get("COLDSTART_DEBIAN_MIRROR")
    if env:
        return env
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            words = line.split("#", 1)[0].split()
            uris = words[1:] if words[:1] == ["URIs:"] else \
                [w for w in words[1:] if "://" in w] if words[:1] == ["deb"] else []
            for uri in uris:
                if uri.startswith(("http://", "https://")) and uri.rstrip("/").endswith("/debian"):
                    return uri.rstrip("/")
    return DEFAULT_MIRROR


def _run(argv: list[str], what: str, *, timeout: float, env: dict[str, str] | None = None,
         progress: Progress | None = None,
         show: Callable[[str], bool] = lambda line: False) -> str:
    """Run a build step; lines ``show`` accepts go to ``progress``; fail with its output."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        _kill_group(proc)

    timer = threading.Timer(timeout, kill)
    timer.start()
    lines: deque[str] = deque(maxlen=40)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())
            if progress is not None and show(line):
                progress(line.rstrip())
        rc = proc.wait()
    finally:
        timer.cancel()
        # the whole group: debootstrap's and pip's children hold the pipe and the rootfs
        _kill_group(proc)
        proc.wait()
    out = "\n".join(lines)
    if timed_out.is_set():
        raise Unavailable(f"{what} did not finish within {timeout:.0f} s:\n{out}")
    if rc != 0:
        raise Unavailable(f"{what} failed (exit {rc}):\n{out}")
    return out


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the step's process group (it runs in its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _cached_step(build: Path, key: str, make: Callable[[Path], dict[str, Any]]) -> Path:
    """``build/key``, made once by ``make(tmp)`` into a temp dir then renamed; its stamp
    ``build/key.json`` (what ``make`` returned) is written last."""
    final, stamp = build / key, build / f"{key}.json"
    if stamp.is_file() and final.is_dir():
        return final
    build.mkdir(parents=True, exist_ok=True)
    for stale in build.glob(f".tmp-{key}-*"):
        unmount_under(stale)        # an interrupted debootstrap leaves proc/sys mounted
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=build))
    try:
        info = make(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        unmount_under(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _atomic_write(stamp, json.dumps(info, indent=2).encode() + b"\n")
    return final


def _compile_tree(tree: Path, strip: str, prepend: str, timeout: float) -> None:
    """Byte-compile every module under ``tree`` hash-based and unchecked (valid whatever the
    files' mtimes), as the image's Python 3.11 would import it; PYTHONHASHSEED fixed so the
    bytecode is reproducible. Files that do not compile are skipped (nor can they be imported)."""
    script = ("import compileall, py_compile, sys\n"
              "compileall.compile_dir(sys.argv[1], quiet=2, force=True, workers=0,\n"
              "    stripdir=sys.argv[2], prependdir=sys.argv[3],\n"
              "    invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)\n")
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    _run([sys.executable, "-c", script, str(tree), strip, prepend], f"compiling {tree}",
         timeout=timeout, env=env)


def _debian_rootfs(ctx: _Context) -> Path:
    """Debian 12 minbase with python3, stripped of docs, caches and logs; cached."""
    build = ctx.cache_dir / BUILD_DIR

    def make(tmp: Path) -> dict[str, Any]:
        if shutil.which("debootstrap") is None:
            raise FailedPrecondition("the torch image's OS layer is made by debootstrap, which "
                                     "is not installed (apt-get install debootstrap)")
        if os.geteuid() != 0:
            raise FailedPrecondition("debootstrap (the torch image's OS layer) needs root")
        mirror = _debian_mirror()
        debs = build / "debs"
        debs.mkdir(parents=True, exist_ok=True)
        ctx.progress(f"debootstrap {DEBIAN_SUITE} (minbase + python3) from {mirror}")
        root = tmp / "rootfs"
        keep = ("Retrieving Release", "Resolving", "Checking", "Found", "Installing core",
                "Unpacking required", "Configuring required", "Unpacking the base",
                "Configuring the base", "Base system")
        _run(["debootstrap", "--variant=minbase", "--include=python3",
              f"--cache-dir={debs.resolve()}", DEBIAN_SUITE, str(root), mirror],
             "debootstrap", timeout=1800, progress=ctx.progress,
             show=lambda line: line.startswith("I: ") and line[3:].startswith(keep))
        _strip_rootfs(root)
        ctx.progress("byte-compiling the rootfs' Python modules (hash-based)")
        for sub in ("usr/lib/python3.11", "usr/lib/python3/dist-packages"):
            if (root / sub).is_dir():
                _compile_tree(root / sub, str(root), "/", timeout=1800)
        return {"suite": DEBIAN_SUITE, "mirror": mirror, "variant": "minbase",
                "include": ["python3"]}

    return _cached_step(build, f"debian-{DEBIAN_SUITE}", make) / "rootfs"


def _strip_rootfs(root: Path) -> None:
    """What a slim image leaves out: docs, man pages, locales, apt lists and caches, logs; and
    what would differ from one debootstrap to the next (host resolv.conf, hostname, dates)."""
    for rel in ("usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale",
                "usr/share/lintian", "usr/share/linda", "var/cache/apt", "var/lib/apt/lists",
                "var/cache/debconf", "var/cache/ldconfig", "var/log", "var/cache/man"):
        d = root / rel
        if d.is_dir() and not d.is_symlink():
            for child in d.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
    for rel in ("var/lib/dpkg/status-old", "var/lib/dpkg/diversions-old",
                "var/lib/dpkg/available-old", "etc/hostname", "etc/machine-id",
                "var/lib/dbus/machine-id"):
        with contextlib.suppress(FileNotFoundError):
            (root / rel).unlink()
    (root / "etc/resolv.conf").write_text("")
    shadow = root / "etc/shadow"
    if shadow.is_file():     # field 3, the day of the last password change, is today's date
        lines = []
        for line in shadow.read_text().splitlines():
            f = line.split(":")
            if len(f) > 2 and f[2]:
                f[2] = "19675"
            lines.append(":".join(f))
        shadow.write_text("\n".join(lines) + "\n")


def _check_host_python() -> None:
    """The wheels pip picks are for the interpreter running it: it must match the image's."""
    if sys.version_info[:2] != (3, 11):
        raise FailedPrecondition(
            f"the torch image's wheels are installed with this Python's pip, which is "
            f"{platform.python_version()}; the image's Debian 12 python3 is 3.11 (run coldstart "
            "from a Python 3.11 virtualenv)")


def _torch_site(ctx: _Context) -> Path:
    """torch (CPU) and its dependencies installed with the host's pip into a site-packages tree
    for the image's /usr/local/lib/python3.11/dist-packages; the wheels and the tree cached."""
    build = ctx.cache_dir / BUILD_DIR
    _check_host_python()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]

    def download(tmp: Path) -> dict[str, Any]:
        ctx.progress(f"pip download {' '.join(TORCH_PINS)}")
        _run([*pip, "download", "--dest", str(tmp), *TORCH_PINS],
             "pip download (torch)", timeout=1800)
        wheels = sorted(p.name for p in tmp.iterdir())
        torch = [w for w in wheels if w.startswith("torch-")]
        cuda = [w for w in wheels if w.startswith(("nvidia_", "triton-"))]
        if not torch:
            raise Unavailable(f"pip download left no torch wheel in {tmp}: {wheels}")
        if "+cpu" not in torch[0] and cuda:
            raise FailedPrecondition(
                f"pip resolved torch==2.13.0 to a CUDA build ({', '.join(torch + cuda[:3])}); "
                "the bench images need the CPU one: add https://download.pytorch.org/whl/cpu "
                "to pip's index URLs (pip config set global.extra-index-url ...)")
        return {"pins": list(TORCH_PINS), "wheels": wheels}

    wheels = _cached_step(build, "wheels-torch-2.13.0", download)

    def install(tmp: Path) -> dict[str, Any]:
        site = tmp / "site"
        ctx.progress("pip install --target (torch and its dependencies)")
        _run([*pip, "install", "--no-index", "--find-links", str(wheels), "--target", str(site),
              "--no-compile", "--no-warn-script-location", *TORCH_PINS],
             "pip install (torch)", timeout=1800)
        ctx.progress("byte-compiling site-packages (hash-based)")
        _compile_tree(site, str(site), "/" + PY_SITE, timeout=1800)
        return {"pins": list(TORCH_PINS)}

    return _cached_step(build, "site-torch-2.13.0", install) / "site"


def _build_torch(ctx: _Context) -> _Built:
    rootfs = _debian_rootfs(ctx)
    site = _torch_site(ctx)

    def os_layer(tar: _Tar) -> None:
        _add_tree(tar, rootfs, skip_contents=frozenset({"dev", "proc", "sys", "run", "tmp"}))

    def torch_layer(tar: _Tar) -> None:
        _add_tree(tar, site, PY_SITE + "/", keep_owner=False, skip=lambda rel: rel == "bin")
        bindir = site / "bin"
        if bindir.is_dir():     # console scripts: point their shebang at the image's python
            for script in sorted(bindir.iterdir()):
                data = script.read_bytes()
                if data.startswith(b"#!") and b"python" in data.split(b"\n", 1)[0]:
                    data = b"#!/usr/bin/python3" + data[data.index(b"\n"):]
                tar.file(f"usr/local/bin/{script.name}", data, mode=0o755)

    def app_layer(tar: _Tar) -> None:
        tar.file("app/main.py", b"import torch\n\nprint(torch.ones(2).sum())\n")

    layers = [_write_layer(ctx, "debian-12-python3", os_layer),
              _write_layer(ctx, "torch-2.13.0-cpu", torch_layer),
              _write_layer(ctx, "app", app_layer)]
    return _Built(layers, list(TORCH_COMMAND), "exit",
                  [PATH_ENV, "LANG=C.UTF-8", "PYTHONUNBUFFERED=1"])


# -- server ------------------------------------------------------------------------------------

SERVER_TENSORS = _llama_tensors(2048, 5632, range(24), 32000, embed=True, head=True)


def _server_env() -> list[str]:
    return [PATH_ENV, "LANG=C.UTF-8", "PYTHONUNBUFFERED=1", "MODEL_PATH=/model"]


def _build_server(ctx: _Context) -> _Built:
    torch_image = build_image("torch", ctx.cache_dir, progress=ctx.progress)
    layers = _reuse_layers(ctx, torch_image, 2)
    ctx.progress("generating bf16 weights (normal(0, 0.02))")
    pool = _bf16_pool(20261201, 32 * MiB)

    def model_layer(tar: _Tar) -> None:
        tar.file("app/server.py", _SERVER_APP.read_bytes(), mode=0o755)
        tar.file("model/model.safetensors", _safetensors_chunks(SERVER_TENSORS, pool, 1),
                 _safetensors_size(SERVER_TENSORS))

    # weights gain little from matching: Huffman-only coding is 3x faster at the same ratio
    layers.append(_write_layer(ctx, "model-server", model_layer, strategy=zlib.Z_HUFFMAN_ONLY))
    return _Built(layers, ["python3", "/app/server.py"], "notify", _server_env())


# -- cuda-like ---------------------------------------------------------------------------------

CUDA_LIBS = (("libcublasLt.so.12", 2_600_000_000), ("libcudnn_engines_precompiled.so.9",
             2_000_000_000), ("libcufft.so.11", 1_200_000_000), ("libcusparse.so.12",
             1_100_000_000), ("libnccl.so.2", 1_000_000_000), ("libcublas.so.12", 800_000_000),
             ("libcurand.so.10", 300_000_000), ("libcudart.so.12", 700_000))
CUDA_LIB_DIR = "usr/local/cuda/lib64"
PY_PACKAGES = ("servekit", "modelhub", "tokenkit", "kernelzoo", "evalkit", "datakit")
PY_TREE_BYTES = 1_000_000_000
CUDA_LAYERS = 10
CUDA_SHARDS = (_llama_tensors(4096, 11008, range(5), 32000, embed=True, head=False),
               _llama_tensors(4096, 11008, range(5, CUDA_LAYERS), 32000, embed=False, head=True))


def _py_tree(seed: int) -> tuple[list[tuple[str, int]], list[str]]:
    """(module path, size) of the site-packages tree, and the modules the start-up imports."""
    rng = random.Random(seed)
    mods: list[tuple[str, int]] = []
    total, i = 0, 0
    per_dir, dirs_per_pkg = 200, 42
    while total < PY_TREE_BYTES:
        d = i // per_dir
        pkg = PY_PACKAGES[min(d // dirs_per_pkg, len(PY_PACKAGES) - 1)]
        n = min(int(rng.lognormvariate(9.4, 1.0)) + 300, MiB)     # median ~12 kB, mean ~20 kB
        mods.append((f"{PY_SITE}/{pkg}/sub{d:03d}/mod{i:05d}.py", n))
        total += n
        i += 1
    imports = [m[len(PY_SITE) + 1:-3].replace("/", ".") for m, _ in mods[::10]]
    return mods, imports


def _build_cuda_like(ctx: _Context) -> _Built:
    torch_image = build_image("torch", ctx.cache_dir, progress=ctx.progress)
    layers = _reuse_layers(ctx, torch_image, 2)

    def libs_layer(tar: _Tar) -> None:
        pools = _lib_pools(7)
        for k, (name, size) in enumerate(CUDA_LIBS):
            path = f"{CUDA_LIB_DIR}/{name}"
            tar.file(path, _lib_chunks(size, pools, 100 + k), size, mode=0o755)
            base = name.split(".so")[0] + ".so"
            tar.symlink(f"{CUDA_LIB_DIR}/{base}", name)
        tar.symlink("usr/local/cuda-12", "cuda")

    mods, imports = _py_tree(11)

    def py_layer(tar: _Tar) -> None:
        pool = _text_pool(12, 8 * MiB)
        rng = random.Random(13)
        packages: set[str] = set()
        for i, (path, size) in enumerate(mods):
            parent = path.rsplit("/", 1)[0]
            pkgdir = parent.rsplit("/", 1)[0]
            for d in (pkgdir, parent):
                if d not in packages:
                    packages.add(d)
                    tar.file(f"{d}/__init__.py", f'"""Package {d.rsplit("/", 1)[1]}."""\n'
                             .encode())
            tar.file(path, _module_source(i, size, pool, rng))

    def weights_layer(tar: _Tar) -> None:
        pool = _bf16_pool(20261202, 32 * MiB)
        names = [f"model-{k + 1:05d}-of-{len(CUDA_SHARDS):05d}.safetensors"
                 for k in range(len(CUDA_SHARDS))]
        index = {"metadata": {"total_size": sum(t.nbytes for s in CUDA_SHARDS for t in s)},
                 "weight_map": {t.name: names[k] for k, s in enumerate(CUDA_SHARDS) for t in s}}
        tar.file("model/model.safetensors.index.json",
                 json.dumps(index, indent=2, sort_keys=True).encode() + b"\n")
        for k, shard in enumerate(CUDA_SHARDS):
            tar.file(f"model/{names[k]}", _safetensors_chunks(shard, pool, 50 + k),
                     _safetensors_size(shard))

    def app_layer(tar: _Tar) -> None:
        tar.file("app/server.py", _SERVER_APP.read_bytes(), mode=0o755)
        tar.file("app/imports.txt", ("\n".join(imports) + "\n").encode())

    layers.append(_write_layer(ctx, "cuda-libraries", libs_layer, level=1,
                               strategy=zlib.Z_RLE))
    layers.append(_write_layer(ctx, "site-packages", py_layer))
    layers.append(_write_layer(ctx, "weights", weights_layer, strategy=zlib.Z_HUFFMAN_ONLY))
    layers.append(_write_layer(ctx, "app", app_layer))
    command = ["python3", "/app/server.py", "--imports", "/app/imports.txt",
               "--touch-libs", "/" + CUDA_LIB_DIR, "--model", "/model"]
    env = [*_server_env(), "CUDA_HOME=/usr/local/cuda", "LD_LIBRARY_PATH=/" + CUDA_LIB_DIR]
    return _Built(layers, command, "notify", env)


_RECIPES: dict[str, _Recipe] = {
    "tiny": _Recipe(1, "busybox + an 80 MB demo app; /app/start.sh reads a tenth of its 2000 "
                       "modules, exits (builds in seconds)", _build_tiny),
    "torch": _Recipe(1, "Debian 12 + python3 + torch 2.13.0 CPU, 1.1 GB; imports torch, exits",
                     _build_torch),
    "server": _Recipe(1, "torch + 2.7 GB of bf16 weights + a model server (sd_notify phases, "
                         "GET /infer, READY=1)", _build_server),
    "cuda-like": _Recipe(1, "15.7 GB like a CUDA PyTorch server: 9 GB of libraries, 49k modules, "
                            "4.6 GB of weights; READY=1", _build_cuda_like),
}

BUILTIN: dict[str, str] = {name: r.description for name, r in _RECIPES.items()}
