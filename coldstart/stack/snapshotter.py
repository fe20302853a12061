"""Our daemons: ``coldstart snapshotter`` (which spawns ``coldstart fuse-server``), the private
containerd + snapshotter stack of the demo and benchmarks, and a stand-alone FUSE server.

- :func:`start_snapshotter` -> :class:`SnapshotterDaemon`: the gRPC daemon on a temp root
  (socket ``s.sock``, FUSE socket ``f.sock``, cache ``cache/``; with ``spawn`` it starts the
  FUSE server detached, pid in ``root/fuse-server.pid``, log ``root/fuse-server.log``).
  ``.kill()`` / ``.start()`` restart the gRPC process only; at the end it is stopped by PID,
  then the FUSE server it spawned, then every mount left under the directory is undone (FUSE
  connections aborted first, so nothing hangs).
- :func:`local_stack` -> :class:`LocalStack`: that snapshotter and a containerd that knows it
  as ``coldstart``, under one directory (``sn/``, ``ctrd/``); needs root, ``containerd``,
  ``ctr``, ``runc`` and ``/dev/fuse`` (:func:`missing_tools` says what is missing);
  :func:`temp_local_stack` makes (and removes) the directory itself.
- :func:`fuse_server` runs ``coldstart fuse-server`` alone (no gRPC side) and yields a control
  client for it, for FUSE data-path tests and ``bench/bench_fuse.py``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from coldstart.errors import FailedPrecondition
from coldstart.lazyfs.client import FuseServerClient
from coldstart.stack.containerd import Containerd, start_containerd
from coldstart.stack.mounts import unmount_under
from coldstart.stack.procs import (
    daemon,
    free_port,
    read_pid,
    stop_process,
    unix_open,
    wait_for,
    wait_gone,
)

# the directory holding the ``coldstart`` package: a daemon started with it on PYTHONPATH
# runs this checkout's code, installed or not
_SRC_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class SnapshotterDaemon:
    """``coldstart snapshotter`` run as a separate process on a temp root."""

    base: Path
    root: Path
    socket: str
    config: Path
    log: Path
    metrics_address: str = ""   # host:port of its Prometheus endpoint ("" when off)
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        argv = [sys.executable, "-m", "coldstart.cli", "snapshotter", "--config",
                str(self.config)]
        # this checkout's code, as for fuse_server(): a benchmark run from an older tree
        # (its bench script on PYTHONPATH) measures that tree's daemons, not the installed ones
        env = dict(os.environ, PYTHONPATH=str(_SRC_ROOT))
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=env)
        wait_for(unix_open(self.socket), timeout=timeout, what="coldstart snapshotter",
                 proc=self.proc, log=self.log)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the gRPC process only (never to the FUSE server) and reap it."""
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)
        self.proc.wait(30)

    @property
    def fuse_pid(self) -> int | None:
        return read_pid(self.root / "fuse-server.pid")

    @property
    def fuse_socket(self) -> str:
        """The control socket of the FUSE server it spawns (see :func:`snapshotter_config`)."""
        return str(self.base / "f.sock")

    def stop(self) -> None:
        """Stop the gRPC process, then the FUSE server it spawned, then unmount leftovers."""
        if self.proc is not None:
            stop_process(self.proc)
        pid = self.fuse_pid
        if pid is not None and not wait_gone(pid, signal.SIGTERM, 10.0):
            unmount_under(self.base, abort_fuse=True)  # aborts its FUSE connection if it hangs
            wait_gone(pid, signal.SIGKILL, 5.0)
        unmount_under(self.base, abort_fuse=True)


def snapshotter_config(base: Path, *, spawn: bool = True, extra: str = "",
                       log_level: str = "debug", background_rate: int | None = 0,
                       record: bool = False, page_cache: bool = True,
                       pull_mode: str | None = "lazy", split_xattrs: bool = True) -> str:
    """The snapshotter's TOML config, everything under ``base``; ``extra``: more top-level
    keys. ``background_rate``: ``fetch.background_rate`` (0, the default here: no fill, so
    what a test reads is all that is fetched; None: the config's default, the link's rate);
    ``record``: ``fuse.record`` (every layer records its file accesses); ``page_cache``:
    ``fuse.page_cache`` (prefetched chunks handed to the kernel's page cache); ``split_xattrs``:
    ``fuse.split_xattrs`` (written only when off); ``pull_mode``:
    ``pull.mode`` ("lazy", the default here: a layer not mounted lazily is pulled by containerd,
    which the tests of lazy pulling count on; None: the config's default, "auto")."""
    text = (
        f'root = "{base / "root"}"\n'
        f'socket = "{base / "s.sock"}"\n'
        f'log_level = "{log_level}"\n'
        "shutdown_grace = 2.0\n"
        f"{extra}"
        "[cache]\n"
        f'dir = "{base / "cache"}"\n'
        "[fuse]\n"
        f'socket = "{base / "f.sock"}"\n'
        f"spawn = {'true' if spawn else 'false'}\n"
        "start_timeout = 20.0\n"
        "request_timeout = 20.0\n"
        f"{'record = true' if record else ''}\n"
        f"{'' if page_cache else 'page_cache = false'}\n"
        f"{'' if split_xattrs else 'split_xattrs = false'}\n"
    )
    if background_rate is not None:
        text += f"[fetch]\nbackground_rate = {background_rate}\n"
    if pull_mode is not None:
        text += f'[pull]\nmode = "{pull_mode}"\n'
    return text


@contextlib.contextmanager
def start_snapshotter(base: Path, *, spawn: bool = True, metrics: bool = True,
                      extra: str = "", log_level: str = "debug",
                      background_rate: int | None = 0,
                      record: bool = False, page_cache: bool = True,
                      pull_mode: str | None = "lazy",
                      split_xattrs: bool = True) -> Iterator[SnapshotterDaemon]:
    """Our daemon on a temp root (config written to ``base/config.toml``); stopped by PID."""
    base.mkdir(parents=True, exist_ok=True)
    config = base / "config.toml"
    metrics_address = f"127.0.0.1:{free_port()}" if metrics else ""
    if metrics_address:
        extra = f'metrics_address = "{metrics_address}"\n' + extra
    config.write_text(snapshotter_config(base, spawn=spawn, extra=extra, log_level=log_level,
                                         background_rate=background_rate, record=record,
                                         page_cache=page_cache, pull_mode=pull_mode,
                                         split_xattrs=split_xattrs))
    d = SnapshotterDaemon(base=base, root=base / "root", socket=str(base / "s.sock"),
                          config=config, log=base / "snapshotter.log",
                          metrics_address=metrics_address)
    try:
        d.start()
        yield d
    finally:
        d.stop()


# -- containerd + snapshotter ------------------------------------------------------------------

def missing_tools() -> list[str]:
    """What this machine lacks to run :func:`local_stack` (empty when it can)."""
    out = [t for t in ("containerd", "ctr", "runc") if shutil.which(t) is None]
    if os.geteuid() != 0:
        out.append("root")
    if not Path("/dev/fuse").exists():
        out.append("/dev/fuse")
    return out


@dataclass(frozen=True)
class LocalStack:
    ctd: Containerd
    snapshotter: SnapshotterDaemon

    @property
    def address(self) -> str:
        """containerd's socket."""
        return self.ctd.address

    @property
    def fuse_socket(self) -> str:
        return self.snapshotter.fuse_socket

    @property
    def fuse_log(self) -> Path:
        return self.snapshotter.root / "fuse-server.log"

    def ctr(self, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
        """``ctr --address … --namespace default ARGS…``, output captured, never raises on a
        non-zero exit (the caller reads ``returncode``)."""
        return self.ctd.ctr(*args, check=False, timeout=timeout)


@contextlib.contextmanager
def local_stack(base: Path, *, log_level: str = "info",
                background_rate: int | None = 0,
                pull_mode: str | None = "lazy") -> Iterator[LocalStack]:
    """``coldstart snapshotter`` (which spawns its FUSE server) and a containerd that knows it
    as ``coldstart``, under ``base`` until the block ends; ``ctr`` in namespace ``default``.

    ``log_level`` is the snapshotter's (debug costs CPU on every FUSE request, which a
    benchmark must not pay)."""
    missing = missing_tools()
    if missing:
        raise FailedPrecondition(f"cannot run containerd here: missing {', '.join(missing)}")
    with start_snapshotter(base / "sn", metrics=False, log_level=log_level,
                           background_rate=background_rate, pull_mode=pull_mode) as sn, \
            start_containerd(base / "ctrd", proxy_socket=sn.socket) as ctd:
        ctd.namespace = "default"
        yield LocalStack(ctd=ctd, snapshotter=sn)


@contextlib.contextmanager
def temp_local_stack(*, log_level: str = "info", background_rate: int | None = 0,
                     pull_mode: str | None = "lazy") -> Iterator[LocalStack]:
    """:func:`local_stack` in a fresh short directory under /tmp (unix socket paths are
    limited to 108 bytes; /tmp must not be overlayfs for overlay mounts), removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="cs-lz-", dir="/tmp"))
    try:
        with local_stack(base, log_level=log_level, background_rate=background_rate,
                         pull_mode=pull_mode) as st:
            yield st
    finally:
        unmount_under(base, abort_fuse=True)
        shutil.rmtree(base, ignore_errors=True)


# -- a stand-alone FUSE server -----------------------------------------------------------------

def fuse_server_config(path: Path, root: Path, *, registry_host: str,
                       read_deadline: float = 10.0, request_timeout: float = 5.0,
                       cache_max: int = 1 << 30, max_coalesce: int = 16 << 20,
                       background_rate: int = 0, cache_dir: Path | None = None,
                       registry_timeout: float = 5.0, page_cache: bool = True,
                       retries: int = 0, concurrency: int = 4,
                       neighbor_bytes: int | None = None, log_level: str | None = None,
                       split_xattrs: bool = True) -> Path:
    """Write a FUSE server config at ``path`` (root, cache and socket under ``root``; plain
    HTTP to ``registry_host``; by default no retries) and return ``path``.

    ``background_rate``: ``fetch.background_rate`` (bytes/s of the background fetch of whole
    layers; 0: off); ``cache_dir``: the chunk cache somewhere else than ``root/cache``;
    ``registry_timeout``: ``registry.timeout`` (also how long a response may stall);
    ``retries``: ``registry.retries``; ``concurrency``: ``fetch.concurrency``;
    ``neighbor_bytes``: ``fetch.neighbor_bytes`` (None: the default); ``log_level`` (None:
    the default); ``page_cache``, ``split_xattrs``: ``fuse.page_cache``, ``fuse.split_xattrs``
    (written only when off)."""
    # written only when set: an older checkout's server (``source_root``) may not know it
    cache = f'dir = "{cache_dir}"\n' if cache_dir is not None else ""
    background = f"background_rate = {background_rate}\n"
    neighbors = f"neighbor_bytes = {neighbor_bytes}\n" if neighbor_bytes is not None else ""
    level = f'log_level = "{log_level}"\n' if log_level is not None else ""
    path.write_text(
        f'root = "{root}"\n'
        f"{level}"
        "[registry]\n"
        f'insecure_hosts = ["{registry_host}"]\n'
        f'hosts_dir = "{root}/certs.d"\n'
        f'docker_config = "{root}/docker-config.json"\n'
        f"timeout = {registry_timeout}\nretries = {retries}\n"
        "[fetch]\n"
        f"read_deadline = {read_deadline}\nrequest_timeout = {request_timeout}\n"
        f"max_coalesce_bytes = {max_coalesce}\nconcurrency = {concurrency}\n"
        f"{background}{neighbors}"
        "[cache]\n"
        f"{cache}max_bytes = {cache_max}\n"
        "[fuse]\n"
        f'socket = "{root}/fuse.sock"\n'
        f"{'' if page_cache else 'page_cache = false'}\n"
        f"{'' if split_xattrs else 'split_xattrs = false'}\n"
    )
    return path


@contextlib.contextmanager
def fuse_server(tmp: Path, *, registry_host: str, log_name: str = "fuse-server.log",
                extra_args: tuple[str, ...] = (), read_deadline: float = 10.0,
                request_timeout: float = 5.0, cache_max: int = 1 << 30,
                max_coalesce: int = 16 << 20, source_root: Path | None = None,
                background_rate: int = 0, cache_dir: Path | None = None,
                registry_timeout: float = 5.0, page_cache: bool = True,
                retries: int = 0, concurrency: int = 4, neighbor_bytes: int | None = None,
                log_level: str | None = None, split_xattrs: bool = True
                ) -> Iterator[tuple[subprocess.Popen[bytes], FuseServerClient, Path]]:
    """Run ``coldstart fuse-server`` on ``tmp/root`` (config :func:`fuse_server_config`);
    yield ``(process, control client, root)``; stop it and unmount everything after (below
    ``tmp``: a ``cache_dir`` on a file system of its own belongs outside it).

    ``source_root``: the coldstart checkout the server runs from (default: this one; a
    benchmark may point it at an older commit's tree)."""
    src = source_root or _SRC_ROOT
    root = tmp / "root"
    root.mkdir(exist_ok=True)
    cfg = fuse_server_config(tmp / "config.toml", root, registry_host=registry_host,
                             read_deadline=read_deadline, request_timeout=request_timeout,
                             cache_max=cache_max, max_coalesce=max_coalesce,
                             background_rate=background_rate, cache_dir=cache_dir,
                             registry_timeout=registry_timeout, page_cache=page_cache,
                             retries=retries, concurrency=concurrency,
                             neighbor_bytes=neighbor_bytes, log_level=log_level,
                             split_xattrs=split_xattrs)
    sock = root / "fuse.sock"
    with contextlib.suppress(FileNotFoundError):
        sock.unlink()
    env = dict(os.environ, PYTHONPATH=str(src))
    try:
        with daemon([sys.executable, "-m", "coldstart.cli", "fuse-server", "--config", str(cfg),
                     *extra_args],
                    log=tmp / log_name, ready=unix_open(sock), what="fuse-server",
                    env=env, cwd=src) as proc:
            yield proc, FuseServerClient(str(sock), timeout=30.0), root
    finally:
        unmount_under(tmp)
