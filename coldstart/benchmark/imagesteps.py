"""The torch image's build steps: a Debian rootfs by debootstrap, torch by the host's pip; and
the compile image's: a C++ toolchain over that rootfs (:func:`toolchain_tree`).

Each step runs once per cache (:func:`_cached_step`): into a temporary directory under
``<cache>/_build``, renamed into place when done, its stamp (what it was made from) written
last; an interrupted step is cleaned up (mounts included) and made again. What the steps
download (the Debian packages, the wheels) and make (the rootfs, the installed site-packages
tree) is kept there and reused by later builds, ``force=True`` included; delete that directory
to download again. Python bytecode is compiled hash-based (``unchecked-hash``) with a fixed
``PYTHONHASHSEED``, so it depends neither on mtimes nor on the run. A step's command runs in
its own session with a timeout; on failure its last 40 lines of output are in the error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coldstart.benchmark.imagelayers import Context, Progress, atomic_write
from coldstart.errors import FailedPrecondition, Unavailable
from coldstart.stack.mounts import unmount_under

__all__ = ["DEBIAN_SUITE", "PY_SITE", "TOOLCHAIN_PACKAGES", "TORCH_PINS", "compile_tree",
           "debian_rootfs", "toolchain_tree", "torch_site"]

BUILD_DIR = "_build"               # downloads and intermediate trees shared by builds
PY_SITE = "usr/local/lib/python3.11/dist-packages"
DEBIAN_SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# torch and what it needs, pinned (the host venv's versions), so the torch layer is reproducible
TORCH_PINS = ("torch==2.13.0", "safetensors==0.8.0", "numpy==2.4.6", "filelock==4.3.1",
              "fsspec==2026.9.0", "jinja2==3.1.6", "markupsafe==3.0.4", "mpmath==1.3.0",
              "networkx==3.6.1", "setuptools==84.2.1", "sympy==1.14.0",
              "typing-extensions==4.16.0")


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
    atomic_write(stamp, json.dumps(info, indent=2).encode() + b"\n")
    return final


def compile_tree(tree: Path, strip: str, prepend: str, timeout: float) -> None:
    """Byte-compile every module under ``tree`` hash-based and unchecked (valid whatever the
    files' mtimes), as the image's Python 3.11 would import it; PYTHONHASHSEED fixed so the
    bytecode is reproducible. Files that do not compile are skipped (nor can they be imported)."""
    script = ("import compileall, py_compile, sys\n"
              "compileall.compile_dir(sys.argv[1], quiet=2, force=True, workers=0,\n"
              "    stripdir=sys.argv[2], prependdir=sys.argv[3],\n"
              "    invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)\n")
    # (no cache prefix, no -O: the .pyc files go beside the sources, as the image imports them)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPYCACHEPREFIX", "PYTHONOPTIMIZE", "PYTHONDONTWRITEBYTECODE")}
    env["PYTHONHASHSEED"] = "0"
    _run([sys.executable, "-c", script, str(tree), strip, prepend], f"compiling {tree}",
         timeout=timeout, env=env)


def debian_rootfs(ctx: Context) -> Path:
    """Debian 12 minbase with python3, stripped of docs, caches and logs; cached."""
    build = ctx.cache_dir / BUILD_DIR

    def make(tmp: Path) -> dict[str, Any]:
        _check_debootstrap("the torch image's OS layer")
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
                compile_tree(root / sub, str(root), "/", timeout=1800)
        return {"suite": DEBIAN_SUITE, "mirror": mirror, "variant": "minbase",
                "include": ["python3"]}

    return _cached_step(build, f"debian-{DEBIAN_SUITE}", make) / "rootfs"


def _check_debootstrap(what: str) -> None:
    if shutil.which("debootstrap") is None:
        raise FailedPrecondition(f"{what} is made by debootstrap, which is not installed "
                                 "(apt-get install debootstrap)")
    if os.geteuid() != 0:
        raise FailedPrecondition(f"debootstrap ({what}) needs root")


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


# what Inductor's C++ backend compiles with: g++ (binutils, libstdc++'s and libc's headers come
# with it), Python.h (python3-dev: libpython3.11-dev's /usr/include/python3.11) and openssl: the
# precompiled headers (on by default, jit and AOTInductor) are keyed by `openssl sha512` of the
# preprocessed header, which fails with "No such file or directory: 'openssl'" without it
TOOLCHAIN_PACKAGES = ("g++", "python3-dev", "openssl")
_NOT_IN_LAYERS = ("dev", "proc", "sys", "run", "tmp")     # the os layer keeps these empty
_CHECK_CPP = b"""#include <Python.h>
#include <vector>
#include <cstdio>
int main() {
    std::vector<double> v{1.0, 2.0};
    std::printf("ok %d.%d %g\\n", PY_MAJOR_VERSION, PY_MINOR_VERSION, v[0] + v[1]);
    return 0;
}
"""


def toolchain_tree(ctx: Context) -> Path:
    """The files a Debian 12 rootfs with :data:`TOOLCHAIN_PACKAGES` installed has beyond
    :func:`debian_rootfs` (new, or of other content, mode or owner; dpkg's database included),
    with their parent directories: a layer over the OS layer. Made by a second debootstrap
    (sharing the downloaded packages), stripped and byte-compiled the same way, compared file by
    file, then checked: ``g++ --version`` and a C++ program including ``<Python.h>`` compile and
    run in a chroot of the base rootfs with the tree copied over it. Cached."""
    build = ctx.cache_dir / BUILD_DIR
    base = debian_rootfs(ctx)
    include = ",".join(("python3", *TOOLCHAIN_PACKAGES))

    def make(tmp: Path) -> dict[str, Any]:
        _check_debootstrap("the compile image's toolchain layer")
        mirror = _debian_mirror()
        full = tmp / "full"
        ctx.progress(f"debootstrap {DEBIAN_SUITE} (minbase + {include}) from {mirror}")
        _run(["debootstrap", "--variant=minbase", f"--include={include}",
              f"--cache-dir={(build / 'debs').resolve()}", DEBIAN_SUITE, str(full), mirror],
             "debootstrap (toolchain)", timeout=1800)
        _strip_rootfs(full)
        for sub in ("usr/lib/python3.11", "usr/lib/python3/dist-packages"):
            if (full / sub).is_dir():
                compile_tree(full / sub, str(full), "/", timeout=1800)
        tree = tmp / "tree"
        files, size = _tree_delta(base, full, tree)
        shutil.rmtree(full)
        ctx.progress(f"toolchain: {files} files ({size / 1e6:.0f} MB) beyond the base rootfs")
        version = _check_toolchain(base, tree, tmp / "check")
        ctx.progress(f"toolchain checked in a chroot: {version}")
        return {"suite": DEBIAN_SUITE, "mirror": mirror, "variant": "minbase",
                "include": include.split(","), "files": files, "bytes": size, "g++": version}

    key = hashlib.sha256(include.encode()).hexdigest()[:8]     # another package list: made anew
    return _cached_step(build, f"toolchain-{DEBIAN_SUITE}-{key}", make) / "tree"


def _tree_delta(base: Path, full: Path, out: Path) -> tuple[int, int]:
    """Copy into ``out`` what of ``full`` is not in ``base`` as it is there (files and
    symlinks new or changed, directories new or of other mode or owner) and the parent
    directories of all that (their metadata from ``full``); hard links kept. Returns the
    number of files and symlinks copied and the files' bytes."""
    import filecmp
    import stat

    links: dict[tuple[int, int], Path] = {}
    count = size = 0

    def meta(st: os.stat_result) -> tuple[int, int, int, int]:
        return stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid

    def same(src: Path, st: os.stat_result, old: Path) -> bool:
        try:
            ost = old.lstat()
        except FileNotFoundError:
            return False
        if meta(st) != meta(ost):
            return False
        if stat.S_ISLNK(st.st_mode):
            return os.readlink(src) == os.readlink(old)
        if stat.S_ISREG(st.st_mode):
            return st.st_size == ost.st_size and filecmp.cmp(src, old, shallow=False)
        return True

    def ensure_dir(rel: Path) -> None:
        """``out/rel`` and its parents, with ``full``'s modes and owners."""
        if (out / rel).is_dir():
            return
        if rel != Path("."):
            ensure_dir(rel.parent)
        st = (full / rel).lstat()
        (out / rel).mkdir()
        os.chown(out / rel, st.st_uid, st.st_gid)
        os.chmod(out / rel, stat.S_IMODE(st.st_mode))

    def walk(rel: Path) -> None:
        nonlocal count, size
        with os.scandir(full / rel) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            r = rel / e.name
            if rel == Path(".") and e.name in _NOT_IN_LAYERS:
                continue
            src, st = Path(e.path), e.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                if not same(src, st, base / r):
                    ensure_dir(r)
                walk(r)
                continue
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)) \
                    or same(src, st, base / r):
                continue
            ensure_dir(rel)
            dst = out / r
            key = (st.st_dev, st.st_ino)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(src), dst)
            elif st.st_nlink > 1 and key in links:
                os.link(links[key], dst)
            else:
                shutil.copyfile(src, dst)
                os.chmod(dst, stat.S_IMODE(st.st_mode))
                links[key] = dst
                size += st.st_size
            os.lchown(dst, st.st_uid, st.st_gid)
            count += 1

    out.mkdir()
    walk(Path("."))
    return count, size


def _check_toolchain(base: Path, tree: Path, root: Path) -> str:
    """Compile and run a C++ program including <Python.h> with g++ in a chroot of ``base``
    with ``tree`` copied over it (then removed), hash it with ``openssl sha512``; returns
    ``g++ --version``'s first line."""
    try:
        _run(["cp", "-a", f"{base}/.", f"{root}/"], "copying the base rootfs", timeout=600)
        _run(["cp", "-a", f"{tree}/.", f"{root}/"], "copying the toolchain", timeout=600)
        (root / "tmp").mkdir(exist_ok=True)
        (root / "tmp/check.cpp").write_bytes(_CHECK_CPP)
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "LANG": "C.UTF-8"}
        version = _run(["chroot", str(root), "g++", "--version"], "g++ --version (chroot)",
                       timeout=60, env=env).splitlines()[0]
        flags = _run(["chroot", str(root), "python3-config", "--includes"],
                     "python3-config --includes (chroot)", timeout=60, env=env).split()
        _run(["chroot", str(root), "g++", "-O1", *flags, "/tmp/check.cpp", "-o", "/tmp/check"],
             "compiling a C++ program including <Python.h> (chroot)", timeout=300, env=env)
        out = _run(["chroot", str(root), "/tmp/check"], "running it (chroot)", timeout=60,
                   env=env).strip()
        if out != "ok 3.11 3":
            raise Unavailable(f"the toolchain check printed {out!r}, not 'ok 3.11 3'")
        _run(["chroot", str(root), "openssl", "sha512", "/tmp/check.cpp"],
             "openssl sha512 (chroot)", timeout=60, env=env)
        return version
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _check_host_python() -> None:
    """The wheels pip picks are for the interpreter running it: it must match the image's."""
    if sys.version_info[:2] != (3, 11):
        raise FailedPrecondition(
            f"the torch image's wheels are installed with this Python's pip, which is "
            f"{platform.python_version()}; the image's Debian 12 python3 is 3.11 (run coldstart "
            "from a Python 3.11 virtualenv)")


def torch_site(ctx: Context) -> Path:
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
        compile_tree(site, str(site), "/" + PY_SITE, timeout=1800)
        return {"pins": list(TORCH_PINS)}

    return _cached_step(build, "site-torch-2.13.0", install) / "site"
