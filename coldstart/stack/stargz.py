"""stargz-snapshotter 0.12, the peer ``coldstart bench`` measures beside coldstart: built here,
run here, and its ``ctr-remote`` tool.

Debian ships stargz's Go library and ``ctr-remote`` but not its daemon, so
:func:`build_stargz_daemon` builds ``bench/peers/stargz/main.go`` offline from Debian's Go
sources (``/usr/share/gocode``, GOPATH mode) once and caches the binary (keyed by main.go and
the Go toolchain). :func:`start_stargz` runs it as a proxy snapshotter on a unix socket (give
containerd ``proxies={"stargz": d.socket}``), stopped by PID, its mounts undone afterwards.
:func:`rpull` lazily pulls an eStargz image through it; :func:`make_estargz_images` converts a
gzip image in a loopback registry to eStargz (and, given a workload, an optimized eStargz) with
``ctr-remote`` in a private containerd. :func:`stargz_missing` says why any of it cannot run here.

Example::

    with start_stargz(tmp / "sgz") as sgz, temp_containerd(proxies={"stargz": sgz.socket}) as c:
        rpull(c.address, ref)
        c.ctr("run", "--rm", "--snapshotter", "stargz", ref, "job", "cat", "/etc/hostname")
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from coldstart.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from coldstart.stack.containerd import temp_containerd
from coldstart.stack.mounts import unmount_under
from coldstart.stack.procs import cpu_seconds, daemon, unix_open

__all__ = [
    "GO_SOURCES",
    "MAIN_GO",
    "StargzDaemon",
    "build_stargz_daemon",
    "ctr_remote",
    "make_estargz_images",
    "rpull",
    "stargz_missing",
    "start_stargz",
]

MAIN_GO = Path(__file__).resolve().parents[2] / "bench" / "peers" / "stargz" / "main.go"
GO_SOURCES = Path("/usr/share/gocode")
# the Debian -dev packages main.go compiles from (GOPATH mode, no module download)
_GO_PACKAGES = {
    "github.com/containerd/stargz-snapshotter": "golang-github-containerd-stargz-snapshotter-dev",
    "github.com/containerd/containerd": "golang-github-containerd-containerd-dev",
}
DEFAULT_CACHE = Path.home() / ".cache" / "coldstart" / "stargz-peer"
SNAPSHOTTER = "stargz"     # the name rpull and ``ctr run --snapshotter`` use


def _which(name: str) -> str | None:
    """``name`` on PATH; for ``go``, ``$COLDSTART_GO`` when set (the toolchain to build with)."""
    if name == "go" and os.environ.get("COLDSTART_GO"):
        go = os.environ["COLDSTART_GO"]
        return go if os.access(go, os.X_OK) else None
    return shutil.which(name)


def _build_missing() -> str | None:
    """Why main.go cannot be built here, or None."""
    if _which("go") is None:
        if os.environ.get("COLDSTART_GO"):
            return f"no Go toolchain at $COLDSTART_GO ({os.environ['COLDSTART_GO']})"
        return "no `go` on PATH (apt-get install golang-go)"
    for pkg, deb in _GO_PACKAGES.items():
        if not (GO_SOURCES / "src" / pkg).is_dir():
            return f"no Go sources in {GO_SOURCES / 'src' / pkg} (apt-get install {deb})"
    return None


def stargz_missing() -> str | None:
    """Why the stargz peer cannot be built and run here (one line), or None when it can.

    Example::

        if (why := stargz_missing()) is not None:
            pytest.skip(why)
    """
    return _build_missing() or _tools_missing() or _run_missing()


def _tools_missing() -> str | None:
    """Why ctr-remote cannot pull/convert/run images here, or None."""
    for tool, deb in (("ctr-remote", "stargz-snapshotter"), ("containerd", "containerd"),
                      ("runc", "runc")):
        if _which(tool) is None:
            return f"no `{tool}` on PATH (apt-get install {deb})"
    if os.geteuid() != 0:
        return "not root (containerd, overlayfs and FUSE mounts need it)"
    return None


def _run_missing() -> str | None:
    """Why a built daemon cannot run here, or None."""
    if os.geteuid() != 0:
        return "not root (stargz mounts FUSE and overlayfs)"
    if not Path("/dev/fuse").exists():
        return "no /dev/fuse (FUSE is not available)"
    return None


# -- build -------------------------------------------------------------------------------------

def _go_version(go: str) -> str:
    try:
        out = subprocess.run([go, "version"], capture_output=True, text=True, timeout=30,
                             check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise FailedPrecondition(f"`{go} version` failed: {exc}") from exc
    return out.stdout.strip()


def _build_key(go: str) -> str:
    """main.go, the toolchain, and (cheaply) which Debian source trees it compiles against."""
    h = hashlib.sha256(MAIN_GO.read_bytes())
    h.update(_go_version(go).encode())
    for pkg in _GO_PACKAGES:
        with contextlib.suppress(OSError):
            st = (GO_SOURCES / "src" / pkg).stat()
            h.update(f"{pkg}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def build_stargz_daemon(cache_dir: Path | None = None, timeout: float = 900) -> Path:
    """Build ``bench/peers/stargz/main.go`` offline (GOPATH mode on /usr/share/gocode) unless a
    binary for this main.go and Go toolchain is cached; return the binary's path.

    Concurrent callers build once (a lock file). A failed build raises
    :class:`~coldstart.errors.FailedPrecondition` with the tail of go's output.

    Example::

        binary = build_stargz_daemon()      # ~/.cache/coldstart/stargz-peer/stargz-peer-<key>
    """
    if (why := _build_missing()) is not None:
        raise FailedPrecondition(f"cannot build the stargz peer: {why}")
    go = _which("go") or "go"
    cache = (cache_dir or DEFAULT_CACHE).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    binary = cache / f"stargz-peer-{_build_key(go)}"
    if binary.exists():
        return binary
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)     # another builder may finish while we wait
        if binary.exists():
            return binary
        env = {**os.environ, "GO111MODULE": "off", "GOFLAGS": "", "GOPROXY": "off",
               "GOPATH": f"{cache / 'gopath'}:{GO_SOURCES}", "GOCACHE": str(cache / "gocache"),
               "GOTOOLCHAIN": "local"}
        tmp = binary.with_name(binary.name + f".tmp{os.getpid()}")
        argv = [go, "build", "-trimpath", "-o", str(tmp), str(MAIN_GO)]
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                 env=env, cwd=MAIN_GO.parent, check=False)
        except subprocess.TimeoutExpired as exc:
            tmp.unlink(missing_ok=True)
            raise DeadlineExceeded(f"go build of the stargz peer took over {timeout} s") from exc
        except BaseException:      # Ctrl-C: no half-written binary left in the cache
            tmp.unlink(missing_ok=True)
            raise
        if out.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise FailedPrecondition(
                f"go build of {MAIN_GO} exited {out.returncode}:\n"
                f"{(out.stdout + out.stderr)[-4000:]}")
        tmp.rename(binary)
    return binary


# -- run ---------------------------------------------------------------------------------------

@dataclass
class StargzDaemon:
    socket: str        # unix socket of its snapshots gRPC API (containerd proxy plugin address)
    root: Path         # its state: root/snapshotter (overlay + metadata), root/stargz (cache)
    log: Path
    proc: subprocess.Popen[bytes] = field(repr=False)
    _last_cpu: float = field(default=0.0, init=False, repr=False)

    def cpu_seconds(self) -> float:
        """User + system CPU time the daemon (and children it waited for) used so far; its
        last value once it has exited (0.0 if it was never read)."""
        now = cpu_seconds(self.proc.pid) if self.proc.poll() is None else 0.0
        self._last_cpu = max(self._last_cpu, now)
        return self._last_cpu


@contextlib.contextmanager
def start_stargz(base: Path, *, binary: Path | None = None,
                 log_level: str = "info") -> Iterator[StargzDaemon]:
    """Run the stargz peer with its root in ``base`` until the block ends; stop it by PID
    (SIGTERM: it unmounts its layers) and undo every mount left under ``base``.

    ``binary``: a prebuilt daemon, else :func:`build_stargz_daemon` (cached).
    """
    if (why := _run_missing() if binary else stargz_missing()) is not None:
        raise FailedPrecondition(f"the stargz peer cannot run here: {why}")
    if log_level not in ("trace", "debug", "info", "warn", "warning", "error"):
        raise InvalidArgument(f"stargz log level {log_level!r}")
    exe = binary or build_stargz_daemon()
    base = base.resolve()
    base.mkdir(parents=True, exist_ok=True)
    root, log = base / "root", base / "stargz.log"
    sock_dir: Path | None = None
    sock = base / "sgz.sock"
    if len(str(sock)) > 100:          # sun_path is 108 bytes
        sock_dir = Path(tempfile.mkdtemp(prefix="cs-sgz-", dir="/tmp"))
        sock = sock_dir / "sgz.sock"
    argv = [str(exe), "-root", str(root), "-address", str(sock), "-log-level", log_level]
    try:
        with daemon(argv, log=log, ready=unix_open(sock), what="stargz peer",
                    timeout=60) as proc:
            yield StargzDaemon(socket=str(sock), root=root, log=log, proc=proc)
    finally:
        unmount_under(base, abort_fuse=True)
        if sock_dir is not None:
            shutil.rmtree(sock_dir, ignore_errors=True)


# -- ctr-remote --------------------------------------------------------------------------------

def ctr_remote(address: str, *args: str, namespace: str = "default",
               timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
    """``ctr-remote --address ADDRESS --namespace NS ARGS…`` with its output captured; a
    non-zero exit raises :class:`~coldstart.errors.Unavailable` with that output.

    Example::

        ctr_remote(ctd.address, "image", "ls", "-q")
    """
    exe = _which("ctr-remote")
    if exe is None:
        raise FailedPrecondition("no `ctr-remote` on PATH (apt-get install stargz-snapshotter)")
    argv = [exe, "--address", address, "--namespace", namespace, *args]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                check=False)
    except subprocess.TimeoutExpired as exc:
        raise DeadlineExceeded(f"{' '.join(argv)} took over {timeout} s") from exc
    if result.returncode != 0:
        raise Unavailable(f"{' '.join(argv)} exited {result.returncode}:\n"
                          f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


def rpull(address: str, ref: str, *, plain_http: bool = True, namespace: str = "default",
          timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
    """Lazily pull ``ref`` (eStargz) into the containerd at ``address`` through the proxy
    snapshotter named ``stargz``: ``ctr-remote image rpull --snapshotter stargz``."""
    flags = ["--plain-http"] if plain_http else []
    return ctr_remote(address, "image", "rpull", *flags, "--snapshotter", SNAPSHOTTER, ref,
                      namespace=namespace, timeout=timeout)


def make_estargz_images(src_ref: str, estargz_ref: str | None, optimized_ref: str | None,
                        workload: Sequence[str], work: Path, env: Sequence[str] = (), *,
                        period: int = 10, timeout: float = 1800.0,
                        compression_level: int | None = None) -> None:
    """Convert the gzip image ``src_ref`` (in a plain-HTTP loopback registry) to eStargz and
    push it as ``estargz_ref`` (when given); with ``optimized_ref`` also push an optimized
    eStargz (files ``workload`` reads first are prefetched), made by ``ctr-remote image
    optimize`` running ``workload`` (argv; ``env`` ``K=V`` entries added) in a container for
    at most ``period`` seconds. All in a private containerd under /tmp; ``work`` holds scratch
    files (the optimizer's access record). ``timeout``: per ctr-remote command;
    ``compression_level``: gzip's (ctr-remote's default, 9, when None).

    Example::

        make_estargz_images(f"{reg.host}/app:gzip", f"{reg.host}/app:esgz",
                            f"{reg.host}/app:esgz-opt", ["/bin/sh", "/run.sh"], tmp)
    """
    if optimized_ref is not None and not workload:
        raise InvalidArgument("an optimized eStargz image needs a workload (argv)")
    if (why := _tools_missing()) is not None:
        raise FailedPrecondition(f"cannot convert to eStargz here: {why}")
    work.mkdir(parents=True, exist_ok=True)
    with temp_containerd() as ctd:
        def run(*args: str) -> None:
            ctr_remote(ctd.address, *args, namespace=ctd.namespace, timeout=timeout)

        run("image", "pull", "--plain-http", src_ref)
        level = ([] if compression_level is None
                 else ["--estargz-compression-level", str(compression_level)])
        if estargz_ref is not None:
            run("image", "convert", "--estargz", *level, "--oci", src_ref, estargz_ref)
            run("image", "push", "--plain-http", estargz_ref)
        if optimized_ref is not None:
            record = work / f"optimize-record-{time.monotonic_ns()}.json"
            flags = ["--oci", "--period", str(period), "--record-out", str(record),
                     "--entrypoint", json.dumps(list(workload[:1])),
                     "--args", json.dumps(list(workload[1:]))]
            for e in env:
                flags += ["--env", e]
            run("image", "optimize", *flags, *level, src_ref, optimized_ref)
            run("image", "push", "--plain-http", optimized_ref)
