"""The warm-up cache's content: which directories, packed into a seekable layer and unpacked.

The compilers' caches live where their environment variables say (:data:`ROLES`); a bundle is
a tar of ``<role>/<path inside that directory>``, converted to zstd:chunked (a digest per
chunk, so a node's chunk cache verifies and deduplicates it like an image layer). Unpacking
reads every file through the verified layer reader (the TOC against its manifest checksum,
each chunk against its digest, each whole file against its digest): nothing unverified is
written. Files land under a staging directory first and are renamed into place one by one, so
an interrupted restore leaves whole files or none; files already there are kept (a local
entry is as good as a shipped one).

Measured with torch 2.13 (CPU, Inductor's C++ backend): a cache copied to another directory,
with new mtimes, is hit; a cache used with ``CXX`` pointing at a wrapper of g++ (or a wrapper
named ``g++`` first on ``PATH``) is missed, entry by entry, because the compiler's command is
part of Inductor's key. So the proof of a hit (:func:`evidence`) reads what compile work left
in the caches, new compiler outputs and new graph entries, and never wraps the compiler.
"""

from __future__ import annotations

import getpass
import os
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from coldstart.errors import FormatError, InvalidArgument
from coldstart.format.layer import SeekableLayer
from coldstart.format.writer import LayerResult, convert_layer

__all__ = ["OFF_IN_CONTAINERS", "ROLES", "WATCHED", "Evidence", "Unpacked", "cache_dirs",
           "evidence", "pack", "snapshot", "unpack", "watched_dirs"]

#: role → (environment variable, default directory; ``{user}``/``~`` expanded)
ROLES: dict[str, tuple[str, str]] = {
    "inductor": ("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_{user}"),
    "triton": ("TRITON_CACHE_DIR", "~/.triton/cache"),
    "vllm": ("VLLM_CACHE_ROOT", "~/.cache/vllm"),
    "cuda": ("CUDA_CACHE_PATH", "~/.nv/ComputeCache"),
}
#: directories watched for compile work but not shipped: Inductor's precompiled headers live
#: under its *default* cache directory whatever TORCHINDUCTOR_CACHE_DIR says (149 MB for a
#: six-block transformer); ``coldstart warmup run`` turns them off (:data:`OFF_IN_CONTAINERS`)
WATCHED: dict[str, str] = {"headers": "/tmp/torchinductor_{user}/precompiled_headers"}
#: settings ``coldstart warmup run`` gives the app unless its environment has them: what a
#: container would rebuild on every start outside the shipped directories
OFF_IN_CONTAINERS: dict[str, str] = {"TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0"}
# what a cache directory holds that is not cache: locks, half-written temporaries
_SKIP_SUFFIXES = (".lock", ".tmp")
_SKIP_PREFIXES = ("tmp", ".tmp")
MAX_FILES = 200_000

#: a bundle file's bytes, verified: ``read(layer, name)``
ReadFile = Callable[[SeekableLayer, str], bytes]


def _user(env: Mapping[str, str]) -> str:
    """The user name as getpass finds it (the environment first), for the defaults' ``{user}``."""
    user = env.get("LOGNAME") or env.get("USER") or env.get("LNAME") or env.get("USERNAME")
    if user:
        return user
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def cache_dirs(env: Mapping[str, str] | None = None) -> dict[str, Path]:
    """Each role's directory as a process with ``env`` (default: ours) would use it: the
    variable, else the default under ``$HOME`` or for ``$USER``."""
    env = os.environ if env is None else env
    user = _user(env)
    home = env.get("HOME") or os.path.expanduser("~")
    out: dict[str, Path] = {}
    for role, (var, default) in ROLES.items():
        value = env.get(var) or default.format(user=user)
        if value.startswith("~/"):
            value = home.rstrip("/") + value[1:]
        out[role] = Path(value)
    return out


def watched_dirs(env: Mapping[str, str] | None = None) -> dict[str, Path]:
    """:func:`cache_dirs` plus the directories only watched for compile work (:data:`WATCHED`)."""
    env = os.environ if env is None else env
    user = _user(env)
    return {**cache_dirs(env), **{role: Path(p.format(user=user)) for role, p in WATCHED.items()}}


def _skipped(name: str) -> bool:
    return name.endswith(_SKIP_SUFFIXES) or name.startswith(_SKIP_PREFIXES)


def _walk(root: Path) -> Iterator[tuple[str, Path]]:
    """``(relative posix path, path)`` of the regular files under ``root``, sorted."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not _skipped(d))
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if _skipped(name) or path.is_symlink() or not path.is_file():
                continue
            yield path.relative_to(root).as_posix(), path


@dataclass(frozen=True)
class Packed:
    layer: LayerResult
    files: int
    bytes: int           # uncompressed
    roles: dict[str, int]   # files per role


def pack(dirs: Mapping[str, Path], dst: BinaryIO, *, max_bytes: int = 4 << 30) -> Packed:
    """Write the files of ``dirs`` (role → directory) as one zstd:chunked layer to ``dst``."""
    roles: dict[str, int] = {}
    total = files = 0
    with tempfile.TemporaryFile() as spool:
        with tarfile.open(fileobj=spool, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for role in sorted(dirs):
                if role not in ROLES:
                    raise InvalidArgument(f"unknown warm-up cache role {role!r}")
                root = dirs[role]
                if not root.is_dir():
                    continue
                for rel, path in _walk(root):
                    files += 1
                    if files > MAX_FILES:
                        raise InvalidArgument(f"{root}: more than {MAX_FILES} files; not a "
                                              "compile cache?")
                    st = path.stat()
                    total += st.st_size
                    if total > max_bytes:
                        raise InvalidArgument(f"the caches hold more than {max_bytes} bytes "
                                              f"(raise --max-bytes)")
                    info = tarfile.TarInfo(f"{role}/{rel}")
                    info.size, info.mode, info.mtime = st.st_size, st.st_mode & 0o755, 0
                    with open(path, "rb") as f:
                        tar.addfile(info, f)
                    roles[role] = roles.get(role, 0) + 1
        spool.seek(0)
        layer = convert_layer(spool, dst, format="zstd:chunked")
    return Packed(layer, files, total, roles)


def _target(name: str, dirs: Mapping[str, Path]) -> tuple[str, PurePosixPath]:
    """``(role, path inside its directory)`` of entry ``name``; FormatError if it escapes."""
    p = PurePosixPath(name.removeprefix("./"))
    if p.is_absolute() or not p.parts or any(part in ("..", "") for part in p.parts):
        raise FormatError(f"warm-up bundle entry {name!r} escapes its directory")
    role, rest = p.parts[0], PurePosixPath(*p.parts[1:]) if len(p.parts) > 1 else None
    if role not in ROLES:
        raise FormatError(f"warm-up bundle entry {name!r}: unknown role {role!r}")
    return role, rest if rest is not None else PurePosixPath(".")


@dataclass
class Unpacked:
    files: int = 0         # written
    kept: int = 0          # already there
    bytes: int = 0         # uncompressed, written


def unpack(layer: SeekableLayer, dirs: Mapping[str, Path], *,
           read: ReadFile | None = None) -> Unpacked:
    """Write the bundle's files under ``dirs`` (role → directory), each verified first.

    ``read(layer, name)``: a file's bytes, verified (default :meth:`SeekableLayer.read_file`;
    :func:`coldstart.warmup.artifacts.cached_reader` goes through a chunk cache)."""
    reader: ReadFile = read or (lambda lay, name: lay.read_file(name))
    out = Unpacked()
    plan: list[tuple[str, Path]] = []
    for name, entry in layer.toc.entries.items():
        if entry.type == "dir":
            if name.strip("/") not in ("", "."):    # the TOC's root
                _target(name.rstrip("/"), dirs)
            continue
        if entry.type != "reg":
            raise FormatError(f"warm-up bundle entry {name!r} is a {entry.type}; only files "
                              "and directories are restored")
        role, rel = _target(name, dirs)
        if role not in dirs:
            continue
        plan.append((name, dirs[role] / rel))
    stages: dict[Path, Path] = {}
    try:
        for name, dst in plan:
            if dst.exists():
                out.kept += 1
                continue
            data = reader(layer, name)
            root = next(d for d in dirs.values() if dst.is_relative_to(d))
            stage = stages.get(root)
            if stage is None:
                root.mkdir(parents=True, exist_ok=True)
                stage = stages[root] = Path(tempfile.mkdtemp(prefix=".tmp-coldstart-",
                                                             dir=root))
            tmp = stage / f"{out.files}"
            tmp.write_bytes(data)
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, dst)
            out.files += 1
            out.bytes += len(data)
    finally:
        for stage in stages.values():
            shutil.rmtree(stage, ignore_errors=True)
    return out


# -- evidence of compile work ---------------------------------------------------------------

#: what a compiler's output looks like in each role's directory: a new one is a compile
_COMPILED = {
    "inductor": (".so", ".o"),
    "triton": (".cubin", ".hsaco", ".so"),
    "vllm": (".so",),
    "cuda": ("",),     # the driver's JIT cache: any new file is a PTX compile
    "headers": (".gch",),
}


def snapshot(dirs: Mapping[str, Path]) -> dict[str, set[str]]:
    """The files under each role's directory now (to compare with :func:`evidence` later)."""
    return {role: {rel for rel, _ in _walk(root)} if root.is_dir() else set()
            for role, root in dirs.items()}


@dataclass
class Evidence:
    compiled: int = 0                  # new compiler outputs (C++ .so, cubins, driver JIT)
    graphs: int = 0                    # new Inductor FX graph / AOTAutograd entries (misses)
    new_files: int = 0
    examples: list[str] | None = None  # a few of the new outputs

    def to_json(self) -> dict[str, object]:
        return {"compiled": self.compiled, "graphs": self.graphs, "new_files": self.new_files,
                "examples": self.examples or []}


def evidence(before: Mapping[str, set[str]], dirs: Mapping[str, Path]) -> Evidence:
    """What compile work left in the caches since ``before``: each new compiler output is one
    compile, each new FX graph or AOTAutograd entry one graph that was not in the cache."""
    now = snapshot(dirs)
    ev = Evidence(examples=[])
    for role, files in now.items():
        new = sorted(files - before.get(role, set()))
        ev.new_files += len(new)
        for rel in new:
            head = rel.split("/", 1)[0]
            if role == "inductor" and head in ("fxgraph", "aotautograd"):
                ev.graphs += 1
            elif any(rel.endswith(s) for s in _COMPILED.get(role, ())) and \
                    head != "precompiled_headers" and "/locks/" not in f"/{rel}":
                ev.compiled += 1
                if len(ev.examples or []) < 3:
                    assert ev.examples is not None
                    ev.examples.append(f"{role}/{rel}")
    return ev
