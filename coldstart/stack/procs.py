"""Start a daemon, wait until it answers, stop it by PID (its whole process group).

A daemon runs in its own session (``start_new_session``), so stopping it also stops what it
started, and a test runner's Ctrl-C does not reach it before our ``finally`` does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from coldstart.errors import DeadlineExceeded, Unavailable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(check: Callable[[], bool], *, timeout: float, what: str,
             proc: subprocess.Popen[bytes] | None = None, log: Path | None = None) -> None:
    """Poll ``check`` until it is true; fail with the daemon's log if it dies or time runs out.

    ``check`` may raise ``OSError`` (a socket not yet listening): that counts as not yet.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise Unavailable(f"{what} exited with {proc.returncode} (log: {log}):\n"
                              f"{tail(log)}")
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.02)
    raise DeadlineExceeded(f"{what} not ready after {timeout} s (log: {log}):\n{tail(log)}")


def tcp_open(port: int, host: str = "127.0.0.1") -> Callable[[], bool]:
    """A readiness check: something accepts TCP connections on ``host:port``."""
    def check() -> bool:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    return check


def unix_open(path: str | os.PathLike[str]) -> Callable[[], bool]:
    """A readiness check: something accepts connections on the unix socket ``path``."""
    def check() -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            s.connect(os.fspath(path))
            return True
    return check


def tail(log: Path | None, n: int = 4000) -> str:
    """The last ``n`` characters of a daemon's log (for error messages)."""
    if log is None or not log.exists():
        return "(no log)"
    return log.read_text(errors="replace")[-n:]


@contextlib.contextmanager
def daemon(argv: Sequence[str], *, log: Path, ready: Callable[[], bool], what: str,
           timeout: float = 30.0, env: dict[str, str] | None = None,
           cwd: str | os.PathLike[str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``argv`` in its own process group, yield once ``ready()`` holds, stop it afterwards.

    Example::

        with daemon(["redis-server", "--port", str(port)], log=tmp / "redis.log",
                    ready=tcp_open(port), what="redis-server"):
            ...
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=cwd, start_new_session=True)
    try:
        wait_for(ready, timeout=timeout, what=what, proc=proc, log=log)
        yield proc
    finally:
        stop_process(proc)


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


def wait_gone(pid: int, sig: int, grace: float) -> bool:
    """Send ``sig`` to ``pid`` (not our child: e.g. a detached FUSE server) and wait until it
    has exited (or is a zombie); False if it is still there after ``grace`` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of ``pid`` and the children it reaped; 0 when it is gone."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # fields[0] is field 3 (state): utime, stime, cutime, cstime are fields 14-17
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def peak_rss_bytes(pid: int | None) -> int:
    """The peak resident memory of ``pid`` (``VmHWM``) in bytes; 0 when it is gone."""
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def read_pid(pidfile: Path) -> int | None:
    """The pid written in ``pidfile``, or None when there is none (yet)."""
    try:
        return int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None


def coldstart_cli(*args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    """Run the ``coldstart`` CLI in a subprocess, as a user would (this interpreter, this
    checkout on its path), output captured as text."""
    src = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-c", "from coldstart.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)
