"""The warm-up cache's content: which directories, packed into a seekable layer and unpacked.

The compilers' caches live where their environment variables say (:data:`ROLES`); a bundle is
a tar of ``<role>/<path inside that directory>``, converted to zstd:chunked (a digest per
chunk, so a node's chunk cache verifies and deduplicates it like an image layer). Unpacking
reads every file through the verified layer reader (the TOC against its manifest checksum,
each chunk against its digest, each whole file against its digest): nothing unverified is
written. Each file is written whole (a temporary file beside it, renamed), through
directories opened without following symlinks, so an interrupted restore leaves whole files or
none and nothing lands outside the directories; files already there are kept (a local entry
is as good as a shipped one).

Measured with torch 2.13 (CPU, Inductor's C++ backend): a cache copied to another directory,
with new mtimes, is hit; with ``CXX`` pointing at a wrapper of g++ the FX graph misses (the
compiler's name is in Inductor's config), and with a wrapper named ``g++`` first on ``PATH``
the graph hits but every C++ kernel is rebuilt (their keys hold the compiler's resolved path).
So the proof of a hit (:func:`evidence`) reads what compile work left in the caches, new
compiler outputs and new graph entries, and never wraps the compiler.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import re
import secrets
import stat
import tarfile
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, BinaryIO

from coldstart.errors import FormatError, InvalidArgument
from coldstart.format.layer import SeekableLayer

if TYPE_CHECKING:       # the writer only packs: a restore does not import it
    from coldstart.format.writer import LayerResult

__all__ = ["HEADERS", "OFF_IN_CONTAINERS", "ROLES", "Evidence", "Unpacked", "cache_dirs",
           "evidence", "inductor_default", "pack", "snapshot", "unpack", "watched_dirs"]

#: role → the environment variable that names its directory (the defaults: :func:`cache_dirs`)
ROLES: dict[str, str] = {
    "inductor": "TORCHINDUCTOR_CACHE_DIR",
    "triton": "TRITON_CACHE_DIR",
    "vllm": "VLLM_CACHE_ROOT",
    "cuda": "CUDA_CACHE_PATH",
}
#: settings ``coldstart warmup run`` gives the app unless its environment has them: Inductor's
#: precompiled headers live under its *default* directory whatever TORCHINDUCTOR_CACHE_DIR
#: says (149 MB for a six-block transformer), so a fresh container rebuilds them on every start
OFF_IN_CONTAINERS: dict[str, str] = {"TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0"}
#: never shipped, only watched for compile work (they are rebuilt where they are needed)
HEADERS = "precompiled_headers"
# what a cache directory holds that is not cache: locks, half-written temporaries
_SKIP_SUFFIXES = (".lock", ".tmp")
_SKIP_PREFIXES = ("tmp", ".tmp")
MAX_FILES = 200_000

#: a bundle file's bytes, verified: ``read(layer, name)``
ReadFile = Callable[[SeekableLayer, str], bytes]


def _user(env: Mapping[str, str]) -> str:
    """The user name as torch's ``default_cache_dir`` finds it (getpass: the environment
    first, then the password database; ``uid_<n>`` without one), sanitised as torch does."""
    user = env.get("LOGNAME") or env.get("USER") or env.get("LNAME") or env.get("USERNAME")
    if not user:
        try:
            user = pwd.getpwuid(os.getuid()).pw_name
        except KeyError:
            user = f"uid_{os.getuid()}"
    return re.sub(r'[\\/:*?"<>|]', "_", user)


def _tmp(env: Mapping[str, str]) -> str:
    """``tempfile.gettempdir()`` as a process with ``env`` would find it (the first of
    ``$TMPDIR``, ``$TEMP``, ``$TMP`` that is a directory, else ``/tmp``)."""
    for var in ("TMPDIR", "TEMP", "TMP"):
        if env.get(var) and os.path.isdir(env[var]):
            return env[var]
    return "/tmp"


def inductor_default(env: Mapping[str, str] | None = None) -> Path:
    """Inductor's default cache directory (``<tmp>/torchinductor_<user>``): its precompiled
    headers live here even when TORCHINDUCTOR_CACHE_DIR names another."""
    env = os.environ if env is None else env
    return Path(_tmp(env), f"torchinductor_{_user(env)}")


def cache_dirs(env: Mapping[str, str] | None = None) -> dict[str, Path]:
    """Each role's directory as a process with ``env`` (default: ours) would use it, by the
    compilers' own rules: the variable, else Inductor's ``<tmp>/torchinductor_<user>``,
    Triton's ``$TRITON_HOME/.triton/cache``, vLLM's ``$XDG_CACHE_HOME/vllm`` and the CUDA
    driver's ``~/.nv/ComputeCache``; relative paths against the working directory."""
    env = os.environ if env is None else env
    home = env.get("HOME") or os.path.expanduser("~")
    defaults = {
        "inductor": str(inductor_default(env)),
        "triton": os.path.join(env.get("TRITON_HOME") or home, ".triton", "cache"),
        "vllm": os.path.join(env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"), "vllm"),
        "cuda": os.path.join(home, ".nv", "ComputeCache"),
    }
    out: dict[str, Path] = {}
    for role, var in ROLES.items():
        value = env.get(var)
        if value is None:           # torch tests for None: an empty value is the cwd
            value = defaults[role]
        if role == "vllm" and value.startswith("~"):      # vLLM expands it, the others not
            value = home.rstrip("/") + value[1:]
        out[role] = Path(os.path.abspath(value))
    return out


def watched_dirs(env: Mapping[str, str] | None = None) -> dict[str, Path]:
    """:func:`cache_dirs` plus the precompiled headers' directory (watched, not shipped)."""
    return {**cache_dirs(env), "headers": inductor_default(env) / HEADERS}


def _skipped(name: str) -> bool:
    return name.endswith(_SKIP_SUFFIXES) or name.startswith(_SKIP_PREFIXES)


def _walk(root: Path) -> Iterator[tuple[str, Path]]:
    """``(relative posix path, path)`` of the regular files under ``root``, sorted."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not _skipped(d) and
                             not (d == HEADERS and dirpath == str(root)))
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
    """Write the files of ``dirs`` (role → directory) as one zstd:chunked layer to ``dst``.

    A role whose directory lies inside another's is left to that one (Inductor puts Triton's
    cache under its own); the precompiled headers are never shipped; a file that disappears
    while it is packed (a compiler replacing it) is skipped."""
    roles: dict[str, int] = {}
    total = files = 0
    for role in dirs:
        if role not in ROLES:
            raise InvalidArgument(f"unknown warm-up cache role {role!r}")
    roots = {r: Path(os.path.realpath(p)) for r, p in dirs.items()}
    # a role inside another's directory (or in the same one, after the first by name) is
    # packed by that one
    nested = {r for r, p in roots.items()
              if any(o != r and p.is_relative_to(q) and (p != q or o < r)
                     for o, q in roots.items())}
    with tempfile.TemporaryFile() as spool:
        with tarfile.open(fileobj=spool, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for role in sorted(set(roots) - nested):
                root = roots[role]
                if not root.is_dir():
                    continue
                for rel, path in _walk(root):
                    try:    # not through a symlink, nor blocking on a FIFO swapped in
                        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK |
                                     os.O_CLOEXEC)
                    except (FileNotFoundError, OSError) as exc:
                        if isinstance(exc, FileNotFoundError) or exc.errno == errno.ELOOP:
                            continue
                        raise
                    with os.fdopen(fd, "rb") as f:
                        st = os.fstat(f.fileno())   # the size of what is open, not of a path
                        if not stat.S_ISREG(st.st_mode):
                            continue
                        files += 1
                        if files > MAX_FILES:
                            raise InvalidArgument(f"{root}: more than {MAX_FILES} files; not "
                                                  "a compile cache?")
                        total += st.st_size
                        if total > max_bytes:
                            raise InvalidArgument(f"the caches hold more than {max_bytes} "
                                                  "bytes (raise --max-bytes)")
                        info = tarfile.TarInfo(f"{role}/{rel}")
                        info.size, info.mode, info.mtime = st.st_size, st.st_mode & 0o755, 0
                        tar.addfile(info, f)
                    roles[role] = roles.get(role, 0) + 1
        spool.seek(0)
        from coldstart.format.writer import convert_layer

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


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_parent(root: Path, rel: PurePosixPath) -> int:
    """A descriptor of ``rel``'s parent under ``root``, each directory below the root created
    if missing and opened without following a symlink (FormatError if one is a symlink or not
    a directory): nothing is written outside the root, whatever was planted in it."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)   # the root: as named
    try:
        for part in rel.parts[:-1]:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o755, dir_fd=fd)
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise FormatError(f"{root}/{rel}: {part!r} is a symlink or not a directory: "
                                      "refusing to write through it") from None
                raise
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kept(dirfd: int, name: str, size: int) -> bool | None:
    """Whether ``name`` in ``dirfd`` is kept as it is: True for a regular file of ``size``
    bytes (a local entry is as good as a shipped one), False for nothing there, None for
    something else (a file of another size: one a crash cut short, replaced; a symlink or a
    directory: left alone, and the entry is not restored)."""
    try:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if stat.S_ISREG(st.st_mode):
        return True if st.st_size == size else None
    return True


def _write_at(dirfd: int, name: str, data: bytes) -> None:
    """Write ``name`` in ``dirfd`` whole: a temporary file (a random name, never followed)
    renamed over it. No fsync: a file a crash cut short has the wrong size and is written
    again by the next restore (:func:`_kept`)."""
    tmp = f".tmp-coldstart-{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644, dir_fd=dirfd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, name, src_dir_fd=dirfd, dst_dir_fd=dirfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dirfd)
        raise


def unpack(layer: SeekableLayer, dirs: Mapping[str, Path], *,
           read: ReadFile | None = None, into: Unpacked | None = None) -> Unpacked:
    """Write the bundle's files under ``dirs`` (role → directory), each verified first.

    The whole TOC is checked before anything is written (names that escape, unknown roles,
    entries other than files and directories refuse the bundle). Each file is written whole
    (temporary file, rename), through directories opened without following symlinks; files
    already there are kept. Roles not in ``dirs`` are skipped. ``read(layer, name)``: a
    file's bytes, verified (default :meth:`SeekableLayer.read_file`;
    :func:`coldstart.warmup.artifacts.cached_reader` goes through a chunk cache)."""
    reader: ReadFile = read or (lambda lay, name: lay.read_file(name))
    out = into if into is not None else Unpacked()     # counted as it goes (a failure midway)
    plan: list[tuple[str, str, PurePosixPath]] = []
    for name, entry in layer.toc.entries.items():
        if entry.type == "dir":
            if name.strip("/") not in ("", "."):    # the TOC's root
                _target(name.rstrip("/"), dirs)
            continue
        if entry.type != "reg":
            raise FormatError(f"warm-up bundle entry {name!r} is a {entry.type}; only files "
                              "and directories are restored")
        role, rel = _target(name, dirs)
        if role in dirs and rel.parts and rel.parts[0] != HEADERS:
            plan.append((name, role, rel))
    for name, role, rel in plan:
        dirfd = _open_parent(Path(dirs[role]), rel)
        try:
            if _kept(dirfd, rel.name, layer.resolve(name).size):
                out.kept += 1
                continue
            data = reader(layer, name)
            _write_at(dirfd, rel.name, data)
            out.files += 1
            out.bytes += len(data)
        finally:
            os.close(dirfd)
    return out


# -- evidence of compile work ---------------------------------------------------------------

#: what a compiler leaves in a cache, wherever it lies: a new one is one compile (a C++ or
#: Triton kernel, an AOTInductor library, a precompiled header); in the CUDA driver's cache any
#: new file is one PTX compile
_COMPILED_SUFFIXES = (".so", ".o", ".cubin", ".hsaco", ".gch", ".pt2")
#: directories whose new entries are graphs the cache did not hold (Inductor's FX graph and
#: AOTAutograd caches, whoever's directory they are in: vLLM keeps its own)
_GRAPH_DIRS = ("fxgraph", "aotautograd")


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
    compile, each new FX graph or AOTAutograd entry one graph that was not in the cache.
    Files are classified by what they are, not by whose directory holds them."""
    now = snapshot(dirs)
    ev = Evidence(examples=[])
    seen: set[Path] = set()     # a directory watched under two roles counts once: under the
    # deepest (CUDA_CACHE_PATH inside TORCHINDUCTOR_CACHE_DIR is the driver's)
    for role, files in sorted(now.items(), key=lambda kv: -len(Path(
            os.path.abspath(dirs[kv[0]])).parts)):
        root = Path(os.path.abspath(dirs[role]))
        for rel in sorted(files - before.get(role, set())):
            path = root / rel
            if path in seen:
                continue
            seen.add(path)
            ev.new_files += 1
            parts = rel.split("/")
            if any(p in _GRAPH_DIRS for p in parts[:-1]):
                ev.graphs += 1
            elif rel.endswith(_COMPILED_SUFFIXES) or role == "cuda":
                ev.compiled += 1
                if len(ev.examples or []) < 3:
                    assert ev.examples is not None
                    ev.examples.append(f"{role}/{rel}")
    return ev
