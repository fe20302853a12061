"""The built-in bench images: what each holds, how it starts, when it is ready.

* ``tiny`` (seconds): busybox plus the demo's application layer (a 48 MB library, weights, 2000
  small modules); ``/app/start.sh`` reads a tenth of the modules and exits.
* ``torch`` (1.1 GB): a Debian 12 rootfs (``debootstrap --variant=minbase``) with python3, torch
  2.13.0 (CPU) and its dependencies installed by the host's pip, a small app layer; the
  command imports torch and exits (:mod:`coldstart.benchmark.imagesteps` makes the first two).
* ``server``: torch's OS and torch layers plus a model-server layer, ``/model/model.safetensors``
  (2.7 GB of bf16 weights) and ``/app/server.py`` (:mod:`coldstart.benchmark.server_app`), which
  reports its phases by sd_notify and on stdout, serves ``GET /infer`` and says ``READY=1``.
* ``cuda-like`` (15.7 GB): shaped like a CUDA PyTorch serving image: torch's layers, a layer of
  multi-GB shared libraries, one of ~49 000 small Python modules, one of 4.6 GB of sharded
  safetensors weights and the server, which imports a tenth of the modules, touches a few per
  cent of the libraries' pages, loads the weights and says ``READY=1``.
* ``compile`` (issue 51: warm-up caches): torch's OS and torch layers, a C++ toolchain layer
  (g++, Python 3.11's headers and openssl: what Inductor's C++ backend compiles with;
  :func:`coldstart.benchmark.imagesteps.toolchain_tree`) and an app layer: ``/app/compile_app.py``
  (:mod:`coldstart.benchmark.compile_app`), which compiles a small transformer at start
  (``COMPILE_MODE``: ``jit``, ``aoti``), says ``READY=1`` after the first compiled call and
  keeps Inductor's caches in ``$TORCHINDUCTOR_CACHE_DIR`` (``/var/cache/warmup/inductor``);
  with coldstart and what ``python3 -m coldstart.commands.warmup`` needs (httpx and its
  dependencies). Inductor's precompiled headers are off
  (``TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS=0``, as ``coldstart warmup run`` sets it):
  they live in ``/tmp/torchinductor_root``, outside the cache directory, so a fresh container
  rebuilds them (149 MB, 8.7 s here) even when every kernel comes from the cache.

Each is a :class:`Recipe` in :data:`RECIPES`: a version (bump it when the image's content or
metadata changes: cached builds of an older one are rebuilt) and a function that writes the
layers (:mod:`coldstart.benchmark.imagelayers`) from generated content
(:mod:`coldstart.benchmark.imagecontent`). :mod:`coldstart.benchmark.images` builds and caches
them.
"""

from __future__ import annotations

import json
import random
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from coldstart.benchmark.imagecontent import (
    bf16_pool,
    lib_chunks,
    lib_pools,
    llama_tensors,
    module_source,
    safetensors_chunks,
    safetensors_size,
    text_pool,
)
from coldstart.benchmark.imagelayers import (
    Built,
    Context,
    Tar,
    add_tree,
    reuse_layers,
    write_layer,
)
from coldstart.benchmark.imagesteps import (
    PY_SITE,
    TOOLCHAIN_PACKAGES,
    compile_tree,
    debian_rootfs,
    toolchain_tree,
    torch_site,
)

__all__ = ["RECIPES", "Recipe"]

MiB = 1 << 20
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TORCH_COMMAND = ["python3", "-c", "import torch; print(torch.ones(2).sum())"]
_SERVER_APP = Path(__file__).resolve().with_name("server_app.py")
_COMPILE_APP = _SERVER_APP.with_name("compile_app.py")
_PACKAGE = _SERVER_APP.parents[1]      # the coldstart package


@dataclass(frozen=True)
class Recipe:
    """A built-in image: ``build`` writes its layers into the context's layout."""

    version: int            # bump when the image's content or metadata changes: rebuilds it
    description: str
    build: Callable[[Context], Built]
    # what else the image's content follows (files of this checkout it copies in): a build
    # whose fingerprint differs is rebuilt too
    fingerprint: Callable[[], str] | None = None


# -- tiny --------------------------------------------------------------------------------------

def _build_tiny(ctx: Context) -> Built:
    from coldstart.benchmark.demo import demo_files
    from coldstart.stack.images import APPLETS, busybox_entries

    def busybox(tar: Tar) -> None:
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

    def app(tar: Tar) -> None:
        for f in app_files:
            tar.file(f.name, f.data, mode=f.mode)

    layers = [write_layer(ctx, "busybox", busybox), write_layer(ctx, "app", app)]
    return Built(layers, ["/app/start.sh"], "exit", ["PATH=/bin"])


# -- torch -------------------------------------------------------------------------------------

def _build_torch(ctx: Context) -> Built:
    rootfs = debian_rootfs(ctx)
    site = torch_site(ctx)

    def os_layer(tar: Tar) -> None:
        add_tree(tar, rootfs, skip_contents=frozenset({"dev", "proc", "sys", "run", "tmp"}))

    def torch_layer(tar: Tar) -> None:
        add_tree(tar, site, PY_SITE + "/", keep_owner=False, skip=lambda rel: rel == "bin")
        bindir = site / "bin"
        if bindir.is_dir():     # console scripts: point their shebang at the image's python
            for script in sorted(bindir.iterdir()):
                data = script.read_bytes()
                if data.startswith(b"#!") and b"python" in data.split(b"\n", 1)[0]:
                    data = b"#!/usr/bin/python3" + data[data.index(b"\n"):]
                tar.file(f"usr/local/bin/{script.name}", data, mode=0o755)

    def app_layer(tar: Tar) -> None:
        tar.file("app/main.py", b"import torch\n\nprint(torch.ones(2).sum())\n")

    layers = [write_layer(ctx, "debian-12-python3", os_layer),
              write_layer(ctx, "torch-2.13.0-cpu", torch_layer),
              write_layer(ctx, "app", app_layer)]
    return Built(layers, list(TORCH_COMMAND), "exit",
                 [PATH_ENV, "LANG=C.UTF-8", "PYTHONUNBUFFERED=1"])


# -- server ------------------------------------------------------------------------------------

SERVER_TENSORS = llama_tensors(2048, 5632, range(24), 32000, embed=True, head=True)


def _server_env() -> list[str]:
    # safetensors' own loader unless a mode asks for coldstart's (coldstart+weights)
    return [PATH_ENV, "LANG=C.UTF-8", "PYTHONUNBUFFERED=1", "MODEL_PATH=/model",
            "SERVER_LOADER=safetensors"]


#: what ``import coldstart.weights`` needs besides the standard library and torch
WEIGHTS_CLIENT_DISTS = ("msgspec", "PyYAML", "zstandard", "typing_extensions")


#: what ``python3 -m coldstart.commands.warmup`` needs besides those: click, httpx and what it
#: imports (``importlib.metadata.requires("httpx")``, less the extras; sniffio: httpcore's and
#: httpx's optional import)
WARMUP_CLIENT_DISTS = (*WEIGHTS_CLIENT_DISTS, "httpx", "httpcore", "h11", "anyio", "idna",
                       "certifi", "sniffio", "click")


def _package_files() -> list[Path]:
    """Every source file of the coldstart package (what :func:`weights_client_layer` copies)."""
    return sorted(_PACKAGE.rglob("*.py"))


def _weights_client_files() -> list[Path]:
    """The files of this checkout the server images copy in: the model server and every
    source file of the coldstart package."""
    return [_SERVER_APP, *_package_files()]


def _fingerprint(files: list[Path], dists: tuple[str, ...], *extra: str) -> str:
    """What an image copies from this checkout and this interpreter, hashed: the files' names
    and bytes, the distributions' versions, ``extra``."""
    import hashlib
    import importlib.metadata

    h = hashlib.sha256()
    h.update(sys.implementation.cache_tag.encode())     # the bytecode it writes is for this
    for path in files:
        h.update(str(path.relative_to(_PACKAGE.parent)).encode() + b"\0" + path.read_bytes())
    for dist in dists:
        h.update(f"{dist}={importlib.metadata.version(dist)}".encode())
    for item in extra:
        h.update(item.encode())
    return h.hexdigest()[:16]


def _server_fingerprint() -> str:
    return _fingerprint(_weights_client_files(), WEIGHTS_CLIENT_DISTS)


def weights_client_layer(tar: Tar, dists: tuple[str, ...] = WEIGHTS_CLIENT_DISTS) -> None:
    """coldstart itself (its Python sources) and the distributions ``coldstart.weights``
    imports (or ``dists``), from this interpreter's installation, into the image's
    site-packages, byte-compiled as the torch layer is: what a user who adopts the fast path
    does with ``pip install coldstart`` in the image (without the bytecode, every start would
    compile each module it imports)."""
    import importlib.metadata
    import tempfile

    with tempfile.TemporaryDirectory(prefix="coldstart-client-layer-") as tmp:
        site = Path(tmp)

        def put(name: str, data: bytes) -> None:
            dst = site / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data)

        for path in _package_files():
            put(f"coldstart/{path.relative_to(_PACKAGE)}", path.read_bytes())
        for dist in dists:
            found = importlib.metadata.distribution(dist)
            for rel in sorted(found.files or [], key=str):
                name = str(rel)
                if name.startswith("..") or "__pycache__" in name or name.endswith(".pyc"):
                    continue
                put(name, Path(str(found.locate_file(rel))).read_bytes())
        if sys.version_info[:2] == (3, 11):     # else its bytecode is not the image's 3.11's
            compile_tree(site, str(site), "/" + PY_SITE, timeout=600)
        add_tree(tar, site, PY_SITE + "/", keep_owner=False)


def _build_server(ctx: Context) -> Built:
    layers = reuse_layers(ctx, "torch", 2)
    ctx.progress("generating bf16 weights (normal(0, 0.02))")
    pool = bf16_pool(20261201, 32 * MiB)

    def model_layer(tar: Tar) -> None:
        tar.file("app/server.py", _SERVER_APP.read_bytes(), mode=0o755)
        tar.file("model/model.safetensors", safetensors_chunks(SERVER_TENSORS, pool, 1),
                 safetensors_size(SERVER_TENSORS))

    # weights gain little from matching: Huffman-only coding is 3x faster at the same ratio
    layers.append(write_layer(ctx, "model-server", model_layer, strategy=zlib.Z_HUFFMAN_ONLY))
    layers.append(write_layer(ctx, "coldstart-weights", weights_client_layer))
    return Built(layers, ["python3", "/app/server.py"], "notify", _server_env())


# -- cuda-like ---------------------------------------------------------------------------------

CUDA_LIBS = (("libcublasLt.so.12", 2_600_000_000), ("libcudnn_engines_precompiled.so.9",
             2_000_000_000), ("libcufft.so.11", 1_200_000_000), ("libcusparse.so.12",
             1_100_000_000), ("libnccl.so.2", 1_000_000_000), ("libcublas.so.12", 800_000_000),
             ("libcurand.so.10", 300_000_000), ("libcudart.so.12", 700_000))
CUDA_LIB_DIR = "usr/local/cuda/lib64"
PY_PACKAGES = ("servekit", "modelhub", "tokenkit", "kernelzoo", "evalkit", "datakit")
PY_TREE_BYTES = 1_000_000_000
CUDA_LAYERS = 10
CUDA_SHARDS = (llama_tensors(4096, 11008, range(5), 32000, embed=True, head=False),
               llama_tensors(4096, 11008, range(5, CUDA_LAYERS), 32000, embed=False, head=True))


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


def _build_cuda_like(ctx: Context) -> Built:
    layers = reuse_layers(ctx, "torch", 2)

    def libs_layer(tar: Tar) -> None:
        pools = lib_pools(7)
        for k, (name, size) in enumerate(CUDA_LIBS):
            path = f"{CUDA_LIB_DIR}/{name}"
            tar.file(path, lib_chunks(size, pools, 100 + k), size, mode=0o755)
            base = name.split(".so")[0] + ".so"
            tar.symlink(f"{CUDA_LIB_DIR}/{base}", name)
        tar.symlink("usr/local/cuda-12", "cuda")

    mods, imports = _py_tree(11)

    def py_layer(tar: Tar) -> None:
        pool = text_pool(12, 8 * MiB)
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
            tar.file(path, module_source(i, size, pool, rng))

    def weights_layer(tar: Tar) -> None:
        pool = bf16_pool(20261202, 32 * MiB)
        names = [f"model-{k + 1:05d}-of-{len(CUDA_SHARDS):05d}.safetensors"
                 for k in range(len(CUDA_SHARDS))]
        index = {"metadata": {"total_size": sum(t.nbytes for s in CUDA_SHARDS for t in s)},
                 "weight_map": {t.name: names[k] for k, s in enumerate(CUDA_SHARDS) for t in s}}
        tar.file("model/model.safetensors.index.json",
                 json.dumps(index, indent=2, sort_keys=True).encode() + b"\n")
        for k, shard in enumerate(CUDA_SHARDS):
            tar.file(f"model/{names[k]}", safetensors_chunks(shard, pool, 50 + k),
                     safetensors_size(shard))

    def app_layer(tar: Tar) -> None:
        tar.file("app/server.py", _SERVER_APP.read_bytes(), mode=0o755)
        tar.file("app/imports.txt", ("\n".join(imports) + "\n").encode())

    layers.append(write_layer(ctx, "cuda-libraries", libs_layer, level=1,
                              strategy=zlib.Z_RLE))
    layers.append(write_layer(ctx, "site-packages", py_layer))
    layers.append(write_layer(ctx, "weights", weights_layer, strategy=zlib.Z_HUFFMAN_ONLY))
    layers.append(write_layer(ctx, "app", app_layer))
    command = ["python3", "/app/server.py", "--imports", "/app/imports.txt",
               "--touch-libs", "/" + CUDA_LIB_DIR, "--model", "/model"]
    env = [*_server_env(), "CUDA_HOME=/usr/local/cuda", "LD_LIBRARY_PATH=/" + CUDA_LIB_DIR]
    return Built(layers, command, "notify", env)


# -- compile -----------------------------------------------------------------------------------

COMPILE_CACHE_DIR = "/var/cache/warmup/inductor"     # the app's $TORCHINDUCTOR_CACHE_DIR


def _compile_fingerprint() -> str:
    return _fingerprint([_COMPILE_APP, *_package_files()], WARMUP_CLIENT_DISTS,
                        *TOOLCHAIN_PACKAGES)


def _build_compile(ctx: Context) -> Built:
    layers = reuse_layers(ctx, "torch", 2)
    tree = toolchain_tree(ctx)

    def toolchain_layer(tar: Tar) -> None:
        add_tree(tar, tree)

    def app_layer(tar: Tar) -> None:
        tar.file("app/compile_app.py", _COMPILE_APP.read_bytes(), mode=0o755)
        weights_client_layer(tar, WARMUP_CLIENT_DISTS)

    layers.append(write_layer(ctx, "toolchain-g++-python3-dev-openssl", toolchain_layer))
    layers.append(write_layer(ctx, "compile-app-coldstart-warmup", app_layer))
    env = [PATH_ENV, "LANG=C.UTF-8", "PYTHONUNBUFFERED=1",
           f"TORCHINDUCTOR_CACHE_DIR={COMPILE_CACHE_DIR}",
           "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS=0"]
    return Built(layers, ["python3", "/app/compile_app.py"], "notify", env)


RECIPES: dict[str, Recipe] = {
    "tiny": Recipe(1, "busybox + an 80 MB demo app; /app/start.sh reads a tenth of its 2000 "
                      "modules, exits (builds in seconds)", _build_tiny),
    "torch": Recipe(1, "Debian 12 + python3 + torch 2.13.0 CPU, 1.1 GB; imports torch, exits",
                    _build_torch),
    "server": Recipe(2, "torch + 2.7 GB of bf16 weights + a model server (sd_notify phases, "
                        "GET /infer, READY=1) + coldstart.weights", _build_server,
                     _server_fingerprint),
    "cuda-like": Recipe(1, "15.7 GB like a CUDA PyTorch server: 9 GB of libraries, 49k modules, "
                           "4.6 GB of weights; READY=1", _build_cuda_like),
    "compile": Recipe(2, "torch + g++, Python.h, openssl + an app compiling a 6-block transformer "
                         "at start (Inductor; COMPILE_MODE jit or aoti; READY=1 after the "
                         "first compiled call) + coldstart.warmup", _build_compile,
                      _compile_fingerprint),
}
