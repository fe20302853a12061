"""A benchmark node: the daemons one mode needs, fresh for every run, and one cold start on it.

Every run gets a new :class:`Node` under its own directory: a containerd with empty content store
and snapshots, and for the lazy modes a fresh snapshotter with an empty chunk cache (ours, or
stargz-snapshotter's). Starting them is not timed; stopping them removes every process and mount
they made. :func:`cold_start` then times one start of an image on it, phase by phase:

    resolve  the registry client resolves the reference to a manifest
    pull     ctr image pull (fetch + unpack) | coldstart's pull | ctr-remote image rpull
    create   ctr container create (the rootfs snapshot is prepared)
    start    ctr task start (the process runs)
    …        the app's phases (``STATUS=``/``X_PHASE=`` notices, ``coldstart-phase`` lines)
    READY    the ready condition holds

CPU seconds are read from ``/proc`` for each daemon (and the pulling client) at READY.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import resource
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coldstart.benchmark.ready import ReadyCondition, ReadyWatch
from coldstart.benchmark.results import Phase, Run
from coldstart.errors import DeadlineExceeded, FailedPrecondition
from coldstart.lazyfs.filewire import DEFAULT_SOCKET, SOCKET_ENV
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from coldstart.stack.containerd import CTR_BIN, Containerd, start_containerd
from coldstart.stack.mounts import unmount_under
from coldstart.stack.procs import cpu_seconds, peak_rss_bytes

__all__ = ["MODES", "ModeSpec", "Node", "Workload", "cold_start", "drop_caches", "existing_node",
           "heat_memory", "hot_memory_bytes", "require_root", "start_node"]

IO_MOUNT = "/run/coldstart-bench"        # where the container sees the notify socket
#: where `coldstart warmup run --report` writes in the io directory (warm-cache modes)
WARMUP_REPORT = "warmup.json"


@dataclass(frozen=True)
class ModeSpec:
    name: str
    snapshotter: str     # containerd's name for it
    image_format: str    # which copy of the image it pulls: gzip | zstd:chunked | estargz…
    description: str
    # coldstart's fetch.background_rate (the hybrid fill): 0 = off, None = its default
    background_rate: int | None = 0
    # coldstart's fuse.page_cache (prefetched chunks handed to the kernel's page cache)
    page_cache: bool = True
    # coldstart's fuse.split_xattrs (layers with no attribute on the connection that answers
    # no getxattr)
    split_xattrs: bool = True
    # our own A/B variant of another mode (what one feature is worth): accepted by --mode, not
    # listed in `coldstart bench --help` (bench/ scripts and docs/bench.md name them)
    ablation: bool = False
    # the app loads its weights with coldstart.weights through the node's files socket
    # (mounted into the container at filewire.DEFAULT_SOCKET's directory; SERVER_LOADER=
    # coldstart for the built-in server images)
    files_socket: bool = False
    # the app runs under `coldstart warmup run`, which restores the image's warm-up cache
    # artifact (made once before the runs, as the profile is) before the app compiles
    warm_cache: bool = False
    # the node's runc is coldstart-runc and the container asks for a restore: it starts from
    # the image's snapshot (made once before the runs, from a ready container)
    snapshot: bool = False
    # coldstart-runc's snapshot.pages: eager (fetched, then restored) or lazy (CRIU's lazy
    # pages, served through the FUSE server)
    snapshot_pages: str = "eager"


MODES: dict[str, ModeSpec] = {m.name: m for m in (
    ModeSpec("overlayfs", "overlayfs", "gzip",
             "containerd's full pull (download + unpack) into overlayfs: the baseline"),
    ModeSpec("coldstart", "coldstart", "zstd:chunked",
             "coldstart's snapshotter, zstd:chunked, chunks fetched on demand"),
    ModeSpec("stargz", "stargz", "estargz",
             "stargz-snapshotter 0.12 (the peer), eStargz from ctr-remote image convert"),
    ModeSpec("stargz-optimized", "stargz", "estargz-optimized",
             "stargz-snapshotter 0.12, the image from ctr-remote image optimize"),
    ModeSpec("coldstart+ctr-profile", "coldstart", "estargz-optimized",
             "coldstart's snapshotter on the image from ctr-remote image optimize"),
    ModeSpec("coldstart+weights", "coldstart", "zstd:chunked",
             "coldstart with the app loading its weights through coldstart.weights and the "
             "node's files socket (the weights fast path; the built-in server image carries "
             "it, SERVER_LOADER=coldstart)", files_socket=True),
    ModeSpec("coldstart+profile", "coldstart", "zstd:chunked-profile",
             "coldstart's snapshotter on the image from coldstart optimize (its start-up "
             "set prefetched in bulk at mount)"),
    ModeSpec("coldstart+fill", "coldstart", "zstd:chunked-profile",
             "coldstart+profile with the hybrid fill on (the rest of every layer at the "
             "link's rate, in the background)", background_rate=None),
    ModeSpec("coldstart+warmcache", "coldstart", "zstd:chunked",
             "coldstart with the app's compile caches restored from their warm-up artifact "
             "(coldstart warmup run) before it compiles", warm_cache=True),
    ModeSpec("coldstart+profile+warmcache", "coldstart", "zstd:chunked-profile-warmcache",
             "coldstart+profile with the warm-up artifact restored before the app compiles "
             "(its profile recorded under coldstart warmup run, the wrapper's own start-up "
             "included, from a start whose caches were warm: the restore itself not "
             "recorded)",
             warm_cache=True),
    ModeSpec("coldstart+fill+warmcache", "coldstart", "zstd:chunked-profile-warmcache",
             "coldstart+profile+warmcache with the hybrid fill on (the product's default)",
             background_rate=None, warm_cache=True),
    ModeSpec("coldstart+snapshot", "coldstart", "zstd:chunked",
             "coldstart, the container restored from the image's snapshot (coldstart-runc: "
             "CRIU restore of a ready container, its pages fetched and verified from the "
             "registry; made once before the runs, from a ready container of this mode)",
             snapshot=True),
    ModeSpec("coldstart+snapshot+fill", "coldstart", "zstd:chunked",
             "coldstart+snapshot with the hybrid fill on (the product's default)",
             background_rate=None, snapshot=True),
    ModeSpec("coldstart+profile+snapshot", "coldstart", "zstd:chunked-profile",
             "coldstart+profile, the container restored from the image's snapshot (both made "
             "once before the runs): the start-up set the profile names comes in bulk from "
             "the mount on while coldstart-runc fetches the pages and restores",
             snapshot=True),
    ModeSpec("coldstart+snapshot-lazy", "coldstart", "zstd:chunked",
             "coldstart+snapshot with lazy pages: CRIU restores before the memory is here, "
             "userfaultfd faults each page in from the bundle, mounted through the FUSE server "
             "(snapshot.pages = lazy)", snapshot=True, snapshot_pages="lazy"),
    ModeSpec("coldstart+profile-nowarm", "coldstart", "zstd:chunked-profile",
             "coldstart+profile without handing the prefetched chunks to the kernel's page "
             "cache (fuse.page_cache = false; an ablation)", page_cache=False, ablation=True),
    ModeSpec("coldstart+profile-grid", "coldstart", "zstd:chunked-profile-grid",
             "coldstart+profile on the same profile's image written with fixed-size chunks "
             "only (no chunk cut at the edges of what the start-up read; an ablation)",
             ablation=True),
    ModeSpec("coldstart+profile-xattrs", "coldstart", "zstd:chunked-profile",
             "coldstart+profile with every layer on the FUSE connection that answers getxattr "
             "(fuse.split_xattrs = false; an ablation)", split_xattrs=False,
             ablation=True),
)}


def drop_caches(settle: float, heat: int = 0) -> None:
    """Write back and drop the page cache, then wait ``settle`` seconds (on a VM with free page
    reporting the freed pages go back to the host meanwhile: every run starts the same way);
    then, with ``heat`` bytes, :func:`heat_memory` (hot free memory)."""
    subprocess.run(["sync"], check=True, timeout=300)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
    time.sleep(settle)
    if heat:
        heat_memory(heat)


def hot_memory_bytes(most: int, meminfo: str = "/proc/meminfo",
                     cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup") -> int:
    """What ``--memory hot`` writes and frees: ``most`` bytes, at most half of the memory the
    kernel says is available (``MemAvailable``) and half of what this process's memory cgroup
    has left under its limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``): a container's
    limit, not the host's free memory, is what the OOM killer goes by."""
    room = [most]
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    room.append(int(line.split()[1]) * 1024 // 2)
    except (OSError, ValueError, IndexError):
        pass
    left = _cgroup_memory_left(cgroup, cgroup_root)
    if left is not None:
        room.append(left // 2)
    return max(0, min(room))


def _cgroup_memory_left(cgroup: str, root: str) -> int | None:
    """Bytes this process's memory cgroup may still use (limit less usage), or None if it has
    no limit or the files do not say."""
    try:
        with open(cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            limit_file, usage_file = "memory.max", "memory.current"
            base = os.path.join(root, path.lstrip("/"))
        elif "memory" in controllers.split(","):
            limit_file, usage_file = "memory.limit_in_bytes", "memory.usage_in_bytes"
            base = os.path.join(root, "memory", path.lstrip("/"))
        else:
            continue
        try:
            with open(os.path.join(base, limit_file)) as f:
                limit = f.read().strip()
            with open(os.path.join(base, usage_file)) as f:
                usage = int(f.read().strip())
            if limit != "max" and int(limit) < 1 << 60:     # v1 says "no limit" as ~2**63
                return max(0, int(limit) - usage)
        except (OSError, ValueError):
            continue
    return None


def heat_memory(nbytes: int) -> None:
    """Write ``nbytes`` of anonymous memory and free it: the next allocations (the page
    cache's among them) reuse pages the host still backs, where a VM with free page reporting
    would otherwise back each new page again on its first touch (a benchmark's "hot" free
    memory, against the "settled" state :func:`drop_caches` leaves)."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(23)  # MADV_POPULATE_WRITE (Linux 5.14)
    except OSError:
        for off in range(0, nbytes, mmap.PAGESIZE):
            m[off] = 1
    m.close()


class ExitEvents:
    """``ctr events`` in the background: the exit code of each task as containerd reports it."""

    _LINE = re.compile(r"/tasks/exit\s+(\{.*\})\s*$")

    def __init__(self, ctd: Containerd, log: Path) -> None:
        self._codes: dict[str, int] = {}
        self._lock = threading.Lock()
        with open(log, "ab") as err:
            self._proc = subprocess.Popen(
                [CTR_BIN, "--address", ctd.address, "--namespace", ctd.namespace, "events"],
                stdout=subprocess.PIPE, stderr=err, text=True)
        self._thread = threading.Thread(target=self._read, name="ctr-events", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            m = self._LINE.search(line)
            if not m:
                continue
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                ev = json.loads(m.group(1))
                with self._lock:
                    self._codes[ev.get("container_id", "")] = int(ev.get("exit_status", 0))

    def code(self, container: str) -> int | None:
        with self._lock:
            return self._codes.get(container)

    def close(self) -> None:
        self._proc.kill()
        self._proc.wait(10)
        self._thread.join(5)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


@dataclass
class Node:
    mode: ModeSpec
    base: Path
    ctd: Containerd
    daemons: dict[str, Callable[[], int | None]] = field(default_factory=dict)
    insecure: tuple[str, ...] = ()
    # coldstart's pull runs in this process: its containerd connection and registry client
    # are made when the node starts, as a node's long-running puller has them (not timed)
    puller: Any = None
    # coldstart's FUSE server's control socket (the lazy modes of coldstart only)
    fuse_socket: str = ""
    # the directory of coldstart's files socket (mounted into containers of a files_socket
    # mode); "" where there is none
    files_dir: str = ""
    # coldstart-runc's state directory (events.jsonl) on a snapshot mode's node
    snapshot_state: Path | None = None

    def ctr(self, *args: str, timeout: float = 900.0) -> subprocess.CompletedProcess[str]:
        return self.ctd.ctr(*args, timeout=timeout)

    def cpu(self) -> dict[str, float]:
        return {name: cpu_seconds(pid()) for name, pid in self.daemons.items()}

    def peak_memory(self) -> dict[str, float]:
        """Each daemon's peak resident memory in MB (since it started: this node's)."""
        return {name: peak_rss_bytes(pid()) / 1e6 for name, pid in self.daemons.items()}

    def plain_http(self, ref: str) -> bool:
        host = Reference.parse(ref).registry
        return host.startswith(("127.", "localhost", "[::1]")) or host in self.insecure

    def pull(self, ref: str, timeout: float) -> float:
        """Pull ``ref`` the way this mode does; returns the client's CPU seconds."""
        plain = ["--plain-http"] if self.plain_http(ref) else []
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        if self.mode.snapshotter == "overlayfs":
            self.ctr("image", "pull", "--snapshotter", "overlayfs", *plain, ref, timeout=timeout)
        elif self.mode.snapshotter == "stargz":
            from coldstart.stack.stargz import rpull

            rpull(self.ctd.address, ref, plain_http=bool(plain), namespace=self.ctd.namespace,
                  timeout=timeout)
        else:
            from coldstart.containerd.pull import pull_image

            client, registry = self.puller
            # the pull's threads' CPU only: the bench's other threads (progress, the --link
            # proxy, the ctr events reader) are not the pull's
            return pull_image(client, registry, ref, snapshotter=self.mode.snapshotter,
                              timeout=timeout).cpu_s
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


BENCH_NAMESPACE = "coldstart-bench"


@contextlib.contextmanager
def existing_node(mode: ModeSpec, base: Path, address: str, ref: str, *,
                  insecure: tuple[str, ...] = ()) -> Iterator[Node]:
    """A node on a containerd that is already running (``--address``), in the namespace
    ``coldstart-bench``: the image is removed before and after the run (``images rm --sync``
    garbage-collects its content and snapshots). The snapshotters' own chunk caches stay: the
    runner says so."""
    base.mkdir(parents=True, exist_ok=True)
    ctd = Containerd(address=address, root=base, state=base, config=base, log=base,
                     namespace=BENCH_NAMESPACE)
    missing = ctd.ctr("snapshot", "--snapshotter", mode.snapshotter, "ls", check=False,
                      timeout=30)
    if missing.returncode != 0:
        raise FailedPrecondition(f"containerd at {address} has no snapshotter "
                                 f"{mode.snapshotter!r}: {missing.stderr.strip()}")

    def clear() -> None:
        ctd.ctr("image", "rm", "--sync", ref, check=False, timeout=300)

    clear()
    try:
        with contextlib.ExitStack() as stack:
            node = Node(mode=mode, base=base, ctd=ctd, insecure=insecure)
            if os.path.exists(DEFAULT_SOCKET):      # the node's own (its default config)
                node.files_dir = os.path.dirname(DEFAULT_SOCKET)
            if mode.snapshotter == "coldstart":
                import coldstart.containerd.pull  # noqa: F401  (imported before the clock runs)
                from coldstart.containerd.client import Containerd as Client

                node.puller = (stack.enter_context(Client(address, BENCH_NAMESPACE)),
                               stack.enter_context(RegistryClient(insecure_hosts=insecure)))
            yield node
    finally:
        clear()
        shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def start_node(mode: ModeSpec, base: Path, *, insecure: tuple[str, ...] = (),
               stargz_binary: Path | None = None, record: bool = False) -> Iterator[Node]:
    """The daemons ``mode`` needs under ``base`` (fresh: empty stores and caches); stopped by
    PID and every mount below ``base`` undone at the end. ``record``: coldstart's FUSE server
    records every layer's file accesses (``coldstart optimize``)."""
    base.mkdir(parents=True, exist_ok=True)
    try:
        with contextlib.ExitStack() as stack:
            proxies: dict[str, str] = {}
            daemons: dict[str, Callable[[], int | None]] = {}
            if mode.snapshotter == "coldstart":
                from coldstart.stack.snapshotter import start_snapshotter

                sn = stack.enter_context(start_snapshotter(
                    base / "sn", metrics=False, log_level="info",
                    background_rate=mode.background_rate, record=record,
                    page_cache=mode.page_cache, split_xattrs=mode.split_xattrs))
                proxies["coldstart"] = sn.socket
                daemons["snapshotter"] = lambda: sn.proc.pid if sn.proc else None
                daemons["fuse-server"] = lambda: sn.fuse_pid
            elif mode.snapshotter == "stargz":
                from coldstart.stack.stargz import start_stargz

                sg = stack.enter_context(start_stargz(base / "sg", binary=stargz_binary))
                proxies["stargz"] = sg.socket
                daemons["stargz"] = lambda: sg.proc.pid if sg.proc else None
            env = (_snapshot_env(base, insecure, mode.snapshot_pages,
                                 sn.fuse_socket if mode.snapshotter == "coldstart" else "")
                   if mode.snapshot else None)
            ctd = stack.enter_context(start_containerd(base / "ctrd", proxies=proxies,
                                                       env=env))
            ctd.namespace = "default"
            daemons = {"containerd": lambda: ctd.proc.pid if ctd.proc else None, **daemons}
            node = Node(mode=mode, base=base, ctd=ctd, daemons=daemons, insecure=insecure,
                        snapshot_state=base / "snap" / "state" if mode.snapshot else None)
            if mode.snapshotter == "coldstart":
                node.fuse_socket = sn.fuse_socket
                # fuse.files_socket "auto": files/files.sock beside the control socket
                node.files_dir = str(Path(sn.fuse_socket).parent / "files")
                import coldstart.containerd.pull  # noqa: F401  (imported before the clock runs)
                from coldstart.containerd.client import Containerd as Client

                node.puller = (stack.enter_context(Client(ctd.address, ctd.namespace)),
                               stack.enter_context(RegistryClient(insecure_hosts=insecure)))
            yield node
    finally:
        unmount_under(base, abort_fuse=True)
        shutil.rmtree(base, ignore_errors=True)


def _snapshot_env(base: Path, insecure: tuple[str, ...], pages: str,
                  fuse_socket: str) -> dict[str, str]:
    """containerd's environment on a snapshot mode's node: ``runc`` on its PATH is
    coldstart-runc (every container of the node goes through it, as the runc shim's
    ``BinaryName`` makes it on a real node), whose config keeps its state, its chunk cache and
    its registry settings under ``base``."""
    import sys

    from coldstart.snapshot.invocation import CONFIG_ENV, real_runc

    snap = base / "snap"
    bindir = snap / "bin"
    bindir.mkdir(parents=True, exist_ok=True)
    wrapper = Path(sys.executable).absolute().parent / "coldstart-runc"
    if not wrapper.exists():
        raise FailedPrecondition(f"{wrapper} is missing (pip install -e . installs it)")
    (bindir / "runc").symlink_to(wrapper)
    config = snap / "config.toml"
    config.write_text(
        "[registry]\n"
        f"insecure_hosts = {json.dumps(list(insecure))}\n"
        "[snapshot]\n"
        f"state_dir = {json.dumps(str(snap / 'state'))}\n"
        f"chunk_dir = {json.dumps(str(snap / 'chunks'))}\n"
        f"work_dir = {json.dumps(str(snap / 'work'))}\n"
        f"runc = {json.dumps(real_runc(''))}\n"
        f"pages = {json.dumps(pages)}\n"
        + (f"[fuse]\nsocket = {json.dumps(fuse_socket)}\n" if fuse_socket else ""))
    return {"PATH": f"{bindir}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}",
            CONFIG_ENV: str(config)}


def snapshot_event(node: Node, cid: str) -> dict[str, Any] | None:
    """coldstart-runc's record of the last restore attempt of ``cid`` on ``node``."""
    if node.snapshot_state is None:
        return None
    try:
        lines = (node.snapshot_state / "events.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        # the attempt's own line (a lazy restore's pager adds its end later: pages-in)
        if isinstance(ev, dict) and ev.get("container") == cid and \
                ev.get("outcome") in ("restored", "fallback"):
            return ev
    return None


@dataclass(frozen=True)
class Workload:
    command: list[str]
    env: list[str]
    ready: ReadyCondition
    timeout: float = 600.0
    # more bind mounts into the container: (host path, container path)
    mounts: tuple[tuple[str, str], ...] = ()
    # the container shares the host's network (it reaches the bench's loopback registry)
    host_network: bool = False


Traffic = Callable[[], tuple[int, int]]   # (bytes served, requests) so far


def cold_start(node: Node, ref: str, work: Workload, index: int, *, traffic: Traffic | None,
               settle: float = 0.0, heat: int = 0,
               on_phase: Callable[[str], None] = lambda _p: None,
               prepared: bool = False,
               after_ready: Callable[[Node, str], None] | None = None) -> Run:
    """One cold start of ``ref`` on ``node``; a failure is recorded in the run, not raised.

    ``heat``: bytes of memory written and freed after the page cache is dropped and the
    ``settle`` rest (:func:`heat_memory`), not timed. ``prepared``: the image is already
    pulled (the warm start of the floor): only create, start and the app's phases are
    timed. ``after_ready(node, container)``: called once the container is ready, before it
    is removed (the snapshot of a ready container); its failure fails the run."""
    run = Run(node.mode.name, index)
    cid = f"bench-{os.getpid()}-{index}"     # unique: runc's state is per host, not per root
    io_dir = node.base / "io"
    io_dir.mkdir(exist_ok=True)
    log = io_dir / "out.log"
    log.unlink(missing_ok=True)
    (io_dir / WARMUP_REPORT).unlink(missing_ok=True)
    cpu_client = 0.0
    served0: tuple[int, int] | None = None
    events: ExitEvents | None = None
    cpu0: dict[str, float] = {}
    last = t0 = time.monotonic()

    def phase(name: str) -> None:
        nonlocal last
        now = time.monotonic()
        run.phases.append(Phase(name, last - t0, now - t0))
        last = now

    def cpu() -> dict[str, float]:
        # since t0: each node's daemons are new, their own start-up is not the cold start's
        now = node.cpu()
        return {**{k: max(0.0, v - cpu0.get(k, 0.0)) for k, v in now.items()},
                "client": cpu_client}

    try:
        events = ExitEvents(node.ctd, node.base / "events.log")
        drop_caches(settle, heat)
        served0 = traffic() if traffic else None
        cpu0 = node.cpu()
        last = t0 = time.monotonic()
        with ReadyWatch(work.ready, notify_path=io_dir / "n.sock", log_path=log,
                        exited=lambda: events.code(cid) if events else None, t0=t0) as watch:
            if not prepared:
                on_phase("resolve")
                insecure = [Reference.parse(ref).registry] if node.plain_http(ref) else []
                with RegistryClient(insecure_hosts=insecure, timeout=60) as client:
                    client.resolve(Reference.parse(ref))
                phase("resolve")
                on_phase("pull")
                cpu_client = node.pull(ref, timeout=_left(work, t0))
                phase("pull")
            on_phase("create")
            argv = ["container", "create", "--snapshotter", node.mode.snapshotter,
                    "--mount", f"type=bind,src={io_dir},dst={IO_MOUNT},options=rbind:rw",
                    "--env", f"NOTIFY_SOCKET={IO_MOUNT}/n.sock"]
            mounts, env = list(work.mounts), list(work.env)
            if node.mode.files_socket:
                if not node.files_dir:
                    raise FailedPrecondition(f"mode {node.mode.name} needs coldstart's files "
                                             f"socket; this node has none")
                inside = os.path.dirname(DEFAULT_SOCKET)
                mounts.append((node.files_dir, inside))
                env += ["SERVER_LOADER=coldstart", f"{SOCKET_ENV}={DEFAULT_SOCKET}"]
            for host, inside in mounts:
                argv += ["--mount", f"type=bind,src={host},dst={inside},options=rbind:rw"]
            for e in env:
                argv += ["--env", e]
            if node.mode.snapshot:
                from coldstart.snapshot.invocation import ANNOTATION

                argv += ["--annotation", f"{ANNOTATION}={ref}"]
            if work.ready.needs_host_network or work.host_network:
                # "=true": ctr (urfave/cli) reorders its flags and takes the word after a
                # bare flag for its value, so the image ref after "--net-host" would vanish
                argv.append("--net-host=true")
            # "--": ctr would read the command's own flags (sh -c) as its flags
            node.ctr(*argv, ref, cid, "--", *work.command, timeout=_left(work, t0))
            phase("create")
            on_phase("start")
            node.ctr("task", "start", "-d", "--log-uri", f"file://{log}", cid,
                     timeout=_left(work, t0))
            phase("start")
            started = last - t0
            on_phase("app")
            outcome = watch.wait(_left(work, t0))
            run.cpu_s = cpu()
            run.peak_rss_mb = node.peak_memory()
            run.ready_s = outcome.ready_at
            if outcome.ready_at < started:
                # READY=1 came before `ctr task start` returned (a restore: the process runs
                # once the runtime's create returns; what the runtime does after is not the
                # app's wait): the start phase ends there
                last_phase = run.phases[-1]
                run.phases[-1] = Phase(last_phase.name, min(last_phase.start_s,
                                                             outcome.ready_at),
                                       outcome.ready_at)
                started = outcome.ready_at
            run.exit_code = outcome.exit_code
            run.warmup = _warmup_report(io_dir / WARMUP_REPORT)
            for name, a, b in watch.marks.phases(started, outcome.ready_at):
                run.phases.append(Phase(name, a, b))
            run.snapshot = snapshot_event(node, cid)
            if after_ready is not None:
                after_ready(node, cid)
    except Exception as exc:   # any failure is this run's, recorded; Ctrl-C is not caught
        run.ok = False
        run.error_kind = type(exc).__name__
        run.error = _condense(str(exc)) or repr(exc)
        run.cpu_s = run.cpu_s or cpu()
    finally:
        try:
            if served0 is not None and traffic is not None:
                b, n = traffic()
                run.registry_bytes, run.registry_requests = b - served0[0], n - served0[1]
        finally:
            _remove_task(node, cid)
            if events is not None:
                events.close()
    return run


def _warmup_report(path: Path) -> dict[str, Any] | None:
    """What `coldstart warmup run` reported at READY (None: it did not run or wrote nothing)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _left(work: Workload, t0: float) -> float:
    """Seconds left of the run's ``timeout`` (one deadline for all its steps)."""
    left = work.timeout - (time.monotonic() - t0)
    if left <= 0:
        raise DeadlineExceeded(f"the cold start took longer than --timeout {work.timeout:.0f} s")
    return left


def _condense(text: str, limit: int = 1500) -> str:
    """An error for a run record: its non-empty lines joined, at most ``limit`` characters."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    joined = " | ".join(lines)
    return joined if len(joined) <= limit else joined[:limit] + "…"


def _remove_task(node: Node, cid: str) -> None:
    """Kill and delete the task and container (the node goes away next anyway)."""
    node.ctd.ctr("task", "kill", "-s", "SIGKILL", cid, check=False, timeout=30)
    for _ in range(50):
        done = node.ctd.ctr("task", "delete", cid, check=False, timeout=30)
        if done.returncode == 0 or "not found" in done.stderr:
            break
        time.sleep(0.1)
    node.ctd.ctr("container", "delete", cid, check=False, timeout=30)


def require_root() -> None:
    if os.geteuid() != 0:
        raise FailedPrecondition("coldstart bench needs root (containerd, mounts, drop_caches)")
