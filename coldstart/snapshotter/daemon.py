"""The ``coldstart snapshotter`` process: wiring, the FUSE server beside it, signals.

Two processes (DESIGN "FUSE survives us"): this gRPC process owns the metadata and answers
containerd; the FUSE server (``coldstart fuse-server``) serves the lazily mounted layers. This
process connects to the FUSE server's control socket (``config.fuse.socket``) and, when nothing
answers, starts one detached (its own session, log ``<root>/fuse-server.log``, pid in
``<root>/fuse-server.pid``, effective config in ``<root>/fuse-server.toml``), so that killing or
restarting this process never touches mounts. On restart it reopens the same SQLite store;
containerd's proxy client reconnects by itself. SIGTERM/SIGINT stop serving gracefully (in-flight
RPCs get ``shutdown_grace`` seconds; every write is a committed transaction or none).

:func:`make_mounter` is the one place that picks the :class:`LayerMounter` implementation; it
wraps the FUSE server's client so that a FUSE server found dead by a later call is started again
(it restores its mounts) and the call retried once.

Example::

    run(config.load("/etc/coldstart/config.toml"))   # blocks until SIGTERM
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, Protocol

from coldstart.config import Config, dump
from coldstart.errors import ColdstartError, FailedPrecondition, InvalidArgument
from coldstart.files import private_dir
from coldstart.lazyfs.client import FuseServerClient, FuseServerUnreachable
from coldstart.lazyfs.spec import LayerSpec
from coldstart.snapshotter.mounter import LayerMounter
from coldstart.snapshotter.server import socket_answers, start_server
from coldstart.snapshotter.service import SnapshotService
from coldstart.snapshotter.service_metrics import ServiceMetrics, serve_metrics
from coldstart.snapshotter.snapshotter import Snapshotter
from coldstart.snapshotter.store import Store
from coldstart.unixsock import sd_notify

__all__ = [
    "FuseServerFailed",
    "RespawningMounter",
    "ensure_fuse_server",
    "make_mounter",
    "root_lock",
    "run",
    "spawn_fuse_server",
]

log = logging.getLogger("coldstart.snapshotter.daemon")

METADATA_DB = "metadata.db"
LOCK_FILE = "snapshotter.lock"
FUSE_LOG = "fuse-server.log"
FUSE_PID = "fuse-server.pid"
FUSE_CONFIG = "fuse-server.toml"


class FuseClient(LayerMounter, Protocol):
    def ping(self) -> object: ...

    def unpack(self, directory: str, spec: LayerSpec, *, lowers: list[str], parent_chain: str,
               chain: str, timeout: float) -> dict[str, Any]: ...


@contextlib.contextmanager
def root_lock(root: str) -> Iterator[IO[str]]:
    """Exclusive for one snapshotter process per root; the kernel drops it if we are killed."""
    f = open(os.path.join(root, LOCK_FILE), "a+")  # noqa: SIM115 - held for the process
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FailedPrecondition(f"another coldstart snapshotter uses root {root}") from None
        yield f
    finally:
        f.close()


def _absolute_paths(cfg: Config) -> Config:
    """``cfg`` with its paths made absolute from our working directory: the FUSE server runs
    in ``/`` (it must not pin ours), where a relative ``root`` would name another place."""
    def a(path: str) -> str:
        return os.path.abspath(path) if path else path

    return dataclasses.replace(
        cfg, root=a(cfg.root),
        fuse=dataclasses.replace(cfg.fuse, socket=a(cfg.fuse.socket)),
        cache=dataclasses.replace(cfg.cache, dir=a(cfg.cache.dir)),
        registry=dataclasses.replace(cfg.registry, hosts_dir=a(cfg.registry.hosts_dir),
                                     docker_config=a(cfg.registry.docker_config)))


def _last_error(path: Path) -> str:
    """The last non-empty line of the FUSE server's log (its one-line error, when it failed)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            lines = [x.strip() for x in f.read().decode(errors="replace").splitlines()]
    except OSError as exc:
        return f"(cannot read it: {exc})"
    return next((x for x in reversed(lines) if x), "(nothing logged)")


class FuseServerFailed(FuseServerUnreachable):
    """The FUSE server we started exited at start with an error: no lazy pulls until fixed."""


def spawn_fuse_server(cfg: Config) -> subprocess.Popen[bytes]:
    """Start ``coldstart fuse-server`` detached from us (its own session)."""
    root = Path(cfg.root)
    conf = root / FUSE_CONFIG
    tmp = conf.with_suffix(".tmp")
    tmp.write_text(dump(_absolute_paths(cfg)))
    os.replace(tmp, conf)
    with open(root / FUSE_LOG, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "coldstart.cli", "fuse-server", "--config", str(conf)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True, cwd="/")
    (root / FUSE_PID).write_text(f"{proc.pid}\n")
    log.info("started fuse-server (pid %d, log %s)", proc.pid, root / FUSE_LOG)
    return proc


#: one start at a time: the watchdog and a Prepare that found the server gone must not both
#: spawn one (the loser's pid could end up in the pidfile, and the winner outlive a stop)
_ENSURE_LOCK = threading.Lock()


def ensure_fuse_server(cfg: Config, answers: Callable[[], bool] | None = None) -> bool:
    """:func:`_ensure_fuse_server`, one caller at a time."""
    with _ENSURE_LOCK:
        return _ensure_fuse_server(cfg, answers)


def _ensure_fuse_server(cfg: Config, answers: Callable[[], bool] | None = None) -> bool:
    """True when a FUSE server answers on ``cfg.fuse.socket`` (spawning one if allowed).

    ``answers`` asks the server (default: something accepts connections on the socket). A
    spawned server that finds another one holding the root (``<root>/fuse-server.lock``: it is
    still starting, or was started by someone else) refuses to start; we then wait for that one
    to answer, within the same ``fuse.start_timeout``. A spawned server that exits with another
    error raises :class:`FuseServerFailed` (its log's last line): at start-up the daemon then
    fails instead of serving with no lazy pulls."""
    answers = answers or (lambda: socket_answers(cfg.fuse.socket))
    if answers():
        log.info("fuse-server answers on %s", cfg.fuse.socket)
        return True
    if not cfg.fuse.spawn:
        log.warning("no fuse-server on %s and fuse.spawn is off: layers are pulled normally "
                    "until one starts", cfg.fuse.socket)
        return False
    if socket_answers(cfg.fuse.socket):
        log.warning("a fuse-server listens on %s but does not answer; not starting another "
                    "(layers are pulled normally until it does)", cfg.fuse.socket)
        return False
    pidfile = Path(cfg.root) / FUSE_PID
    try:
        previous: str | None = pidfile.read_text()
    except OSError:
        previous = None
    proc: subprocess.Popen[bytes] | None = spawn_fuse_server(cfg)
    deadline = time.monotonic() + cfg.fuse.start_timeout
    while time.monotonic() < deadline:
        if socket_answers(cfg.fuse.socket) and answers():
            return True
        if proc is not None and proc.poll() is not None:
            _restore_pidfile(pidfile, proc.pid, previous)
            flog = Path(os.path.abspath(cfg.root)) / FUSE_LOG
            if not _another_serves(proc.returncode, cfg.root, flog):
                # an error, not a warning: serving with no lazy pulls hides it (issue 13)
                raise FuseServerFailed(
                    f"the FUSE server exited with status {proc.returncode} at start (log "
                    f"{flog}): {_last_error(flog)}")
            log.info("another fuse-server holds %s (see %s): waiting for it to answer",
                     cfg.root, Path(cfg.root) / FUSE_LOG)
            proc = None
        time.sleep(0.05)
    log.warning("fuse-server did not answer on %s within %.0f s (see %s): layers are pulled "
                "normally until it does", cfg.fuse.socket, cfg.fuse.start_timeout,
                Path(cfg.root) / FUSE_LOG)
    return False


def _another_serves(returncode: int | None, root: str, flog: Path) -> bool:
    """Whether the spawned server's exit means another FUSE server has this root: exit 5 is
    also a busy metrics port or a lock file it cannot open, so the lock must be held now or
    the server must have said so (the other one may have let go of it since)."""
    if returncode != FailedPrecondition.exit_code:
        return False
    said = _last_error(flog)
    return _root_locked(root) or "fuse-server serves root" in said or \
        "already answers on" in said


def _root_locked(root: str) -> bool:
    """Whether a FUSE server holds ``<root>/fuse-server.lock`` (lazyfs.server's LOCK_FILE)."""
    try:
        with open(Path(root) / "fuse-server.lock", "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False
    except OSError:
        return False


def _restore_pidfile(pidfile: Path, pid: int, previous: str | None) -> None:
    """The spawned server exited: the pid file names the previous server again."""
    try:
        if pidfile.read_text().strip() != str(pid):
            return
        if previous is None:
            pidfile.unlink()
        else:
            pidfile.write_text(previous)
    except OSError as exc:
        log.debug("pid file %s: %s", pidfile, exc)


class RespawningMounter:
    """The FUSE server's client; when the server is unreachable it is started again (it then
    restores its persisted mounts) and the call is retried once.

    Only :class:`FuseServerUnreachable` (the transport failed) means that; an ``Unavailable``
    the server answered with (a registry 503 while it opened a TOC) is the call's result."""

    def __init__(self, cfg: Config, client: FuseClient) -> None:
        self.cfg = cfg
        self.client = client

    def answers(self) -> bool:
        try:
            self.client.ping()
        except ColdstartError:
            return False
        return True

    def _retry(self, call: Callable[[], None]) -> None:
        try:
            call()
        except FuseServerUnreachable as exc:
            if not self.cfg.fuse.spawn:
                raise
            log.warning("fuse-server unreachable (%s): starting it again", exc)
            if not ensure_fuse_server(self.cfg, self.answers):
                raise
            call()

    def mount(self, mountpoint: str, spec: LayerSpec) -> None:
        self._retry(lambda: self.client.mount(mountpoint, spec))

    def check(self, mountpoint: str) -> None:
        self._retry(lambda: self.client.check(mountpoint))

    def unmount(self, mountpoint: str) -> None:
        self._retry(lambda: self.client.unmount(mountpoint))

    def unpack(self, directory: str, spec: LayerSpec, *, lowers: list[str], parent_chain: str,
               chain: str, timeout: float) -> dict[str, Any]:
        """Have the FUSE server pull ``spec``'s layer in full into ``directory``. Not retried
        on a server that went away (it may have written part of the directory): the caller
        lets containerd pull the layer."""
        return self.client.unpack(directory, spec, lowers=lowers, parent_chain=parent_chain,
                                  chain=chain, timeout=timeout)


#: how often the daemon checks that its FUSE server answers (seconds)
FUSE_WATCH_INTERVAL = 1.0


def watch_fuse_server(cfg: Config, mounter: RespawningMounter) -> bool:
    """Start the FUSE server again if it died: the new one takes over its connection, and
    the reads of running containers, which wait meanwhile, go on (coldstart.lazyfs.handover).
    Without this, a server that died would be started only by the next lazy pull."""
    if not cfg.fuse.spawn or mounter.answers():
        return True
    log.warning("fuse-server does not answer on %s: starting it again", cfg.fuse.socket)
    try:
        return ensure_fuse_server(cfg, mounter.answers)
    except Exception as exc:      # a full disk, no more processes: tried again later
        log.error("fuse-server could not be started again: %s: %s", type(exc).__name__, exc)
        return False


def make_mounter(cfg: Config) -> RespawningMounter:
    """The one wiring place of the LayerMounter: the FUSE server's client."""
    mounter = RespawningMounter(cfg, FuseServerClient(cfg.fuse.socket, cfg.fuse.request_timeout))
    ensure_fuse_server(cfg, mounter.answers)
    return mounter


def run(cfg: Config, *, ready: threading.Event | None = None,
        stop: threading.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or ``stop`` is set when given)."""
    level = logging.getLevelName(cfg.log_level.upper())
    if not isinstance(level, int):
        raise InvalidArgument(f"config: log_level {cfg.log_level!r} is not a logging level")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = str(Path(cfg.root).resolve())
    private_dir(Path(root), "snapshotter root")
    stop = stop or threading.Event()
    with root_lock(root):
        store = Store(os.path.join(root, METADATA_DB))
        try:
            _serve(cfg, root, store, ready, stop)
        finally:
            store.close()
    log.info("stopped")


def _serve(cfg: Config, root: str, store: Store, ready: threading.Event | None,
           stop: threading.Event) -> None:
    def counts() -> dict[str, int]:
        with store.transaction() as tx:
            return {k.word: n for k, n in tx.counts().items()}

    def restores() -> dict[str, Any]:
        from coldstart.snapshot.state import NodeState

        return NodeState(Path(cfg.snapshot.state_dir)).counters()

    metrics = ServiceMetrics(counts, restores)
    mounter = make_mounter(cfg)
    snapshotter = Snapshotter(root, store, mounter, on_remote=metrics.remote_layer,
                              pull_mode=cfg.pull.mode,
                              full_pull_timeout=cfg.pull.timeout)
    if cfg.metrics_address:
        serve_metrics(cfg.metrics_address, metrics)
        log.info("metrics on http://%s/metrics", cfg.metrics_address)
    server = start_server(SnapshotService(snapshotter, metrics), cfg.socket,
                          workers=cfg.grpc_workers)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    log.info("serving containerd snapshots on unix:%s (root %s)", cfg.socket, root)
    if sd_notify(f"READY=1\nSTATUS=serving on {cfg.socket}"):  # systemd's Type=notify unit
        log.info("told systemd we are ready")
    if ready is not None:
        ready.set()
    last_check, interval = time.monotonic(), FUSE_WATCH_INTERVAL
    while not stop.wait(0.5):  # a timed wait lets the signal handler run promptly
        if time.monotonic() - last_check >= interval:
            ok = watch_fuse_server(cfg, mounter)
            # a server that fails to start is tried again less and less often (up to 1 min)
            interval = FUSE_WATCH_INTERVAL if ok else min(60.0, interval * 2)
            last_check = time.monotonic()
    log.info("stopping: in-flight requests get %.0f s", cfg.shutdown_grace)
    sd_notify("STOPPING=1")
    server.stop(cfg.shutdown_grace).wait()
