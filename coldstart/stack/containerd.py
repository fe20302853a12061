"""A real containerd 1.6 with its own root, state and socket, started and stopped by PID.

Its CRI plugin and the snapshotters we never use are disabled (fast, quiet start-up); with
``proxy_socket`` a ``[proxy_plugins.coldstart]`` (type snapshot) points at a snapshotter there,
and ``proxies`` (snapshotter name -> socket, e.g. ``{"stargz": sock}``) adds more of them.
Unix socket paths must stay under 108 bytes, hence the short directory names (``c.sock``).
``ctr run`` needs ``runc`` on PATH.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from coldstart.errors import FailedPrecondition, InvalidArgument, Unavailable
from coldstart.stack.mounts import unmount_under
from coldstart.stack.procs import stop_process, unix_open, wait_for

CONTAINERD_BIN = shutil.which("containerd") or "/usr/bin/containerd"
CTR_BIN = shutil.which("ctr") or "/usr/bin/ctr"

# plugins a snapshot/pull/run never needs; disabling them makes start-up fast and quiet
DISABLED_PLUGINS = (
    "io.containerd.grpc.v1.cri",
    "io.containerd.snapshotter.v1.aufs",
    "io.containerd.snapshotter.v1.btrfs",
    "io.containerd.snapshotter.v1.devmapper",
    "io.containerd.snapshotter.v1.zfs",
    "io.containerd.tracing.processor.v1.otlp",
    "io.containerd.internal.v1.tracing",
)


@dataclass
class Containerd:
    address: str          # unix socket path of containerd's gRPC API
    root: Path
    state: Path
    config: Path
    log: Path
    namespace: str = "coldstart-test"
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def ctr(self, *args: str, check: bool = True, namespace: str | None = None,
            timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run ``ctr --address ADDRESS --namespace NS ARGS…`` and capture its output; with
        ``check`` a non-zero exit raises :class:`~coldstart.errors.Unavailable` (its output in
        the message), without it the failed CompletedProcess is returned."""
        argv = [CTR_BIN, "--address", self.address, "--namespace",
                namespace or self.namespace, *args]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                check=False)
        if check and result.returncode != 0:
            raise Unavailable(f"{' '.join(argv)} exited {result.returncode}:\n"
                              f"{result.stdout}\n{result.stderr}")
        return result


def _proxy_table(proxy_socket: str | None,
                 proxies: Mapping[str, str] | None) -> dict[str, str]:
    """Snapshotter name -> socket: ``proxy_socket`` is ``coldstart``'s, ``proxies`` the rest."""
    table = {"coldstart": proxy_socket} if proxy_socket else {}
    for name, sock in (proxies or {}).items():
        if not name.replace("-", "").replace("_", "").isalnum():
            raise InvalidArgument(f"proxy snapshotter name {name!r}: letters, digits, - and _")
        if name in table and table[name] != sock:
            raise InvalidArgument(f"proxy snapshotter {name!r} given twice ({table[name]}, {sock})")
        table[name] = sock
    return table


def containerd_config(base: Path, proxy_socket: str | None,
                      proxies: Mapping[str, str] | None = None) -> str:
    """containerd's TOML config: everything under ``base``, our proxy snapshotter if given
    (``proxy_socket``) and the proxy snapshotters in ``proxies`` (name -> socket)."""
    disabled = ", ".join(f'"{p}"' for p in DISABLED_PLUGINS)
    text = (
        "version = 2\n"
        f'root = "{base / "root"}"\n'
        f'state = "{base / "state"}"\n'
        f"disabled_plugins = [{disabled}]\n"
        "[grpc]\n"
        f'  address = "{base / "c.sock"}"\n'
        "[ttrpc]\n"
        f'  address = "{base / "c.sock.ttrpc"}"\n'
        "[debug]\n"
        '  address = ""\n'
        '  level = "info"\n'
        "[metrics]\n"
        '  address = ""\n'
    )
    table = _proxy_table(proxy_socket, proxies)
    if table:
        text += "[proxy_plugins]\n"
        for name, sock in table.items():
            text += (f"  [proxy_plugins.{name}]\n"
                     '    type = "snapshot"\n'
                     f'    address = "{sock}"\n')
    return text


@contextlib.contextmanager
def start_containerd(base: Path, proxy_socket: str | None = None, *,
                     proxies: Mapping[str, str] | None = None,
                     env: Mapping[str, str] | None = None) -> Iterator[Containerd]:
    """containerd in ``base`` (root, state, socket, log), stopped by PID afterwards and the
    mounts it left below ``base`` undone; ``proxies``: more proxy snapshotters (name -> socket)
    beside ``proxy_socket`` (``coldstart``); ``env``: set in its environment, which its shims
    and the runc they run inherit (``PATH``, ``COLDSTART_CONFIG``)."""
    if not Path(CONTAINERD_BIN).exists():
        raise FailedPrecondition("containerd is not installed (apt-get install containerd runc)")
    base.mkdir(parents=True, exist_ok=True)
    config = base / "config.toml"
    config.write_text(containerd_config(base, proxy_socket, proxies))
    log = base / "containerd.log"
    sock = base / "c.sock"
    if len(str(sock)) > 100:
        raise InvalidArgument(f"containerd socket path too long: {sock}")
    with open(log, "ab") as out:
        proc = subprocess.Popen([CONTAINERD_BIN, "--config", str(config)], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **env} if env else None)
    try:
        wait_for(unix_open(sock), timeout=30, what="containerd", proc=proc, log=log)
        yield Containerd(address=str(sock), root=base / "root", state=base / "state",
                         config=config, log=log, proc=proc)
    finally:
        if proc.poll() is None:
            kill_tasks(str(sock))
        stop_process(proc)
        unmount_under(base, abort_fuse=True)


def kill_tasks(address: str) -> None:
    """SIGKILL and delete every task of the containerd at ``address``, in every namespace:
    a task's shim runs in its own process group and would outlive containerd (and a Ctrl-C
    can land between a task's start and its deletion)."""
    def ctr(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([CTR_BIN, "--address", address, *args], capture_output=True,
                              text=True, timeout=30, check=False)

    try:
        for ns in ctr("namespaces", "ls", "-q").stdout.split():
            for task in ctr("--namespace", ns, "task", "ls", "-q").stdout.split():
                ctr("--namespace", ns, "task", "kill", "-s", "SIGKILL", task)
                ctr("--namespace", ns, "task", "delete", "--force", task)
    except (OSError, subprocess.TimeoutExpired):   # containerd is stopped next anyway
        return


@contextlib.contextmanager
def temp_containerd(proxy_socket: str | None = None, *,
                    proxies: Mapping[str, str] | None = None) -> Iterator[Containerd]:
    """:func:`start_containerd` in a fresh short directory under /tmp, removed afterwards;
    ``ctr`` runs in namespace ``default`` unless told otherwise, like ``coldstart pull``.

    Example::

        with start_stargz(tmp) as sgz, temp_containerd(proxies={"stargz": sgz.socket}) as ctd:
            ctd.ctr("run", "--rm", "--snapshotter", "stargz", ref, "id", "true")
    """
    base = Path(tempfile.mkdtemp(prefix="cs-ctd-", dir="/tmp"))
    try:
        with start_containerd(base, proxy_socket, proxies=proxies) as proc:
            proc.namespace = "default"
            yield proc
    finally:
        unmount_under(base, abort_fuse=True)
        shutil.rmtree(base, ignore_errors=True)
