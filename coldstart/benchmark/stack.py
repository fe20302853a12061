"""A private containerd + coldstart snapshotter on this machine, for the demo and benchmarks.

Everything lives under one directory: containerd's root, state and socket (its CRI plugin and
unused snapshotters disabled, a ``proxy_plugins.coldstart`` section pointing at our snapshotter),
the snapshotter's root, chunk cache and FUSE server socket. Both daemons run in their own
process groups and are stopped by PID at the end; leftover mounts under the directory are undone.
Needs root (mounts) and Debian's ``containerd`` and ``runc``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from coldstart.errors import FailedPrecondition, Unavailable

_DISABLED = ("io.containerd.grpc.v1.cri", "io.containerd.snapshotter.v1.aufs",
             "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper",
             "io.containerd.snapshotter.v1.zfs", "io.containerd.tracing.processor.v1.otlp",
             "io.containerd.internal.v1.tracing")


@dataclass(frozen=True)
class Stack:
    base: Path
    containerd: str            # containerd's socket
    snapshotter_root: Path
    fuse_socket: str

    def ctr(self, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
        """``ctr --address … --namespace default ARGS…``, output captured."""
        return subprocess.run(["ctr", "--address", self.containerd, "--namespace", "default",
                               *args], capture_output=True, text=True, timeout=timeout,
                              check=False)


def missing_tools() -> list[str]:
    """What this machine lacks to run the stack (empty when it can)."""
    out = [t for t in ("containerd", "ctr", "runc") if shutil.which(t) is None]
    if os.geteuid() != 0:
        out.append("root")
    if not Path("/dev/fuse").exists():
        out.append("/dev/fuse")
    return out


def _wait_socket(path: Path, proc: subprocess.Popen[bytes], what: str, log: Path,
                 timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise Unavailable(f"{what} exited with {proc.returncode}; see {log}")
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(str(path))
                return
            except OSError:
                pass
        time.sleep(0.05)
    raise Unavailable(f"{what} did not start within {timeout:.0f} s; see {log}")


def stop_process(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL it if it does not exit within ``grace``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def _stop_pid(pidfile: Path, grace: float = 10.0) -> None:
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _unmount_under(base: Path) -> None:
    prefix = str(base.resolve()) + "/"
    points: list[str] = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4]
            if mp.startswith(prefix):
                points.append(mp)
    for mp in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", mp], capture_output=True, check=False, timeout=30)


@contextlib.contextmanager
def local_stack(base: Path, *, background_rate: int = 0) -> Iterator[Stack]:
    """Run containerd and ``coldstart snapshotter`` under ``base`` until the block ends."""
    missing = missing_tools()
    if missing:
        raise FailedPrecondition(f"cannot run containerd here: missing {', '.join(missing)}")
    base.mkdir(parents=True, exist_ok=True)
    sn = base / "sn"
    sn.mkdir(exist_ok=True)
    sn_config = sn / "config.toml"
    sn_config.write_text(
        f'root = "{sn / "root"}"\nsocket = "{sn / "s.sock"}"\nlog_level = "info"\n'
        f'[cache]\ndir = "{sn / "cache"}"\n[fuse]\nsocket = "{sn / "f.sock"}"\n'
        f"[fetch]\nbackground_rate = {background_rate}\n")
    ctd = base / "ctrd"
    ctd.mkdir(exist_ok=True)
    disabled = ", ".join(f'"{p}"' for p in _DISABLED)
    (ctd / "config.toml").write_text(
        f'version = 2\nroot = "{ctd / "root"}"\nstate = "{ctd / "state"}"\n'
        f"disabled_plugins = [{disabled}]\n"
        f'[grpc]\n  address = "{ctd / "c.sock"}"\n[ttrpc]\n  address = "{ctd / "c.sock.ttrpc"}"\n'
        '[debug]\n  address = ""\n[metrics]\n  address = ""\n'
        '[proxy_plugins]\n  [proxy_plugins.coldstart]\n    type = "snapshot"\n'
        f'    address = "{sn / "s.sock"}"\n')
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with open(sn / "snapshotter.log", "ab") as log:
            p = subprocess.Popen([sys.executable, "-m", "coldstart.cli", "snapshotter",
                                  "--config", str(sn_config)], stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        _wait_socket(sn / "s.sock", p, "coldstart snapshotter", sn / "snapshotter.log")
        with open(ctd / "containerd.log", "ab") as log:
            p = subprocess.Popen(["containerd", "--config", str(ctd / "config.toml")],
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        _wait_socket(ctd / "c.sock", p, "containerd", ctd / "containerd.log")
        yield Stack(base=base, containerd=str(ctd / "c.sock"), snapshotter_root=sn / "root",
                    fuse_socket=str(sn / "f.sock"))
    finally:
        for p in reversed(procs):
            stop_process(p)
        _stop_pid(sn / "root" / "fuse-server.pid")
        _unmount_under(base)
