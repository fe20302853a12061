"""The images ``coldstart bench`` runs: reproducible, built on this machine, cached on disk.

Five built-in images (:mod:`coldstart.benchmark.imagerecipes` says what each holds: ``tiny``,
``torch``, ``server``, ``cuda-like``, ``compile``), each an OCI image-layout directory (gzip
layers, tag ``latest``) with the start-up command, ready condition and sizes recorded beside it
in ``recipe.json``.

>>> image = build_image("tiny")                                       # doctest: +SKIP
>>> image.layout, image.command, image.ready                           # doctest: +SKIP
(PosixPath('.../bench/images/tiny'), ['/app/start.sh'], 'exit')

Content is deterministic: fixed seeds, mtimes, owners and entry order
(:mod:`coldstart.benchmark.imagecontent`, :mod:`coldstart.benchmark.imagelayers`), so the output
does not depend on the number of threads. A build goes to a temporary directory beside the cache
entry and is renamed into place once complete; ``recipe.json`` is written last, so a directory
without it is incomplete and is rebuilt; so is one built by an older version of its recipe. One
builder per image and cache directory at a time (others wait, then reuse its build). What the
torch and compile images download is kept under ``<cache>/_build``
(:mod:`coldstart.benchmark.imagesteps`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coldstart.benchmark.imagelayers import (
    RECIPE_FILE,
    Built,
    Context,
    Progress,
    atomic_write,
    human_size,
)
from coldstart.benchmark.imagerecipes import RECIPES, Recipe
from coldstart.errors import ColdstartError, FailedPrecondition, InvalidArgument
from coldstart.oci.layout import OciLayout
from coldstart.oci.manifest import (
    OCI_CONFIG,
    OCI_MANIFEST,
    Descriptor,
    build_manifest,
    canonical_json,
    host_platform,
    parse_manifest,
)

__all__ = ["BUILTIN", "BenchImage", "build_image", "default_cache_dir", "load_image"]

CREATED = "2023-11-14T22:13:20Z"   # the layers' mtime (imagelayers.MTIME), in the image config


# -- the public API ----------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchImage:
    """A built benchmark image: where it is, how it starts, how big it is."""

    name: str               # "tiny", "torch", "server", "cuda-like", "compile"
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
            ctx = Context(name, cache, OciLayout.create(tmp), progress,
                          max(1, os.cpu_count() or 1),
                          lambda other: build_image(other, cache, progress=progress).layout)
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
                    "fingerprint": recipe.fingerprint() if recipe.fingerprint else None,
                    "manifest": manifest.digest,
                    "layers": [la.to_json() for la in built.layers],
                    "build_seconds": round(time.monotonic() - t0, 1)}
            atomic_write(tmp / RECIPE_FILE, json.dumps(body, indent=2).encode() + b"\n")
            _swap_into_place(tmp, cache / name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        progress(f"built in {time.monotonic() - t0:.1f} s: {image.layout} "
                 f"({human_size(image.uncompressed_bytes)} uncompressed, "
                 f"{human_size(image.compressed_bytes)} gzip)")
        return image


def load_image(name: str, cache_dir: Path | None = None) -> BenchImage | None:
    """The complete cached build of ``name``, or ``None`` (not built, unfinished, missing blobs,
    or built by an older recipe)."""
    recipe = _recipe(name)
    root = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / name
    try:
        body = json.loads((root / RECIPE_FILE).read_text())
        if body.get("recipe_version") != recipe.version or body.get("fingerprint") != (
                recipe.fingerprint() if recipe.fingerprint else None):
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


def _recipe(name: str) -> Recipe:
    recipe = RECIPES.get(name)
    if recipe is None:
        raise InvalidArgument(f"unknown bench image {name!r} (built-in: {', '.join(RECIPES)})")
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


def _swap_into_place(tmp: Path, final: Path) -> None:
    """Rename the finished build over ``final`` (an old or incomplete one is removed after)."""
    old: Path | None = None
    if final.exists() or final.is_symlink():
        old = final.with_name(f".tmp-{final.name}-old-{os.getpid()}")
        os.rename(final, old)
    os.rename(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_manifest(layout: OciLayout, built: Built) -> Descriptor:
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


BUILTIN: dict[str, str] = {name: r.description for name, r in RECIPES.items()}
