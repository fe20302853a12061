"""``coldstart node install`` against the real thing: containerd 1.6 started with the installed
config lists the ``coldstart`` snapshotter (``ctr plugins ls``) and its CRI plugin loads with
it; uninstall gives the file back byte for byte. And the snapshotter daemon tells systemd
``READY=1`` (``Type=notify``) once it serves."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldstart.stack.mounts import unmount_under
from coldstart.stack.procs import stop_process, unix_open, wait_for
from tests.fixtures.containerd import CONTAINERD_BIN, CTR_BIN, start_snapshotter

pytestmark = pytest.mark.integration


@pytest.fixture
def base() -> Iterator[Path]:
    """A short directory (unix socket paths stay under 108 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="cs-node-", dir="/tmp"))
    try:
        yield d
    finally:
        unmount_under(d, abort_fuse=True)
        shutil.rmtree(d, ignore_errors=True)


def sample_config(base: Path) -> str:
    """A containerd 1.6 config as an operator keeps one: comments, CRI section, other plugins."""
    return f"""\
# containerd 1.6 for the node test (kept by hand)
version = 2
root = "{base / 'ctrd' / 'root'}"
state = "{base / 'ctrd' / 'state'}"
# nothing a snapshot listing needs
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{base / 'c.sock'}"  # ctr dials this

[ttrpc]
  address = "{base / 'c.sock.ttrpc'}"

[debug]
  level = "info"

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "registry.k8s.io/pause:3.9"
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "overlayfs"   # until coldstart
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "{base / 'cni-bin'}"
      conf_dir = "{base / 'cni-conf'}"
"""


def coldstart(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coldstart.cli", *args], capture_output=True,
                          text=True, timeout=120)


def plugins(address: Path) -> dict[tuple[str, str], str]:
    r = subprocess.run([CTR_BIN, "--address", str(address), "plugins", "ls"],
                       capture_output=True, text=True, timeout=60, check=True)
    rows = [line.split() for line in r.stdout.splitlines()[1:]]
    return {(cols[0], cols[1]): cols[-1] for cols in rows if len(cols) >= 3}


def test_containerd_started_with_the_installed_config_lists_coldstart(base: Path) -> None:
    if not Path(CONTAINERD_BIN).exists():
        pytest.fail("containerd is not installed (apt-get install containerd runc)")
    ctd_config = base / "containerd.toml"
    original = sample_config(base).encode()
    ctd_config.write_bytes(original)
    with start_snapshotter(base / "sn", spawn=False, metrics=False) as sn:
        paths = ["--containerd-config", str(ctd_config), "--config", str(sn.config),
                 "--state-dir", str(base / "state"), "--systemd-dir", str(base / "units")]
        r = coldstart("node", "install", *paths)
        assert r.returncode == 0, r.stderr
        log = base / "containerd.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen([CONTAINERD_BIN, "--config", str(ctd_config)], stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(unix_open(base / "c.sock"), timeout=60, what="containerd", proc=proc,
                     log=log)
            listed = plugins(base / "c.sock")
            assert listed.get(("io.containerd.snapshotter.v1", "coldstart")) == "ok", listed
            # the CRI plugin loaded with coldstart as its snapshotter
            assert listed.get(("io.containerd.grpc.v1", "cri")) == "ok", log.read_text()[-3000:]
            r = coldstart("node", "status", *paths, "--address", str(base / "c.sock"),
                          "-o", "json")
            doc = json.loads(r.stdout)
            assert doc["containerd"] == {"address": str(base / "c.sock"), "listed": True,
                                         "status": "ok", "error": None}
            assert doc["containerd_config"]["installed"] is True
            assert doc["snapshotter"] == {"socket": sn.socket, "answers": True, "error": None}
        finally:
            stop_process(proc)
        r = coldstart("node", "uninstall", *paths)
        assert r.returncode == 0, r.stderr
    assert ctd_config.read_bytes() == original
    assert sn.config.exists()   # it was there before install: not ours to remove


def test_the_daemon_tells_systemd_it_is_ready(base: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    notify = base / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(notify))
        s.settimeout(60)
        monkeypatch.setenv("NOTIFY_SOCKET", str(notify))
        with start_snapshotter(base / "sn", spawn=False, metrics=False) as sn:
            message = s.recv(4096).decode()
            assert message.startswith("READY=1\n") and sn.socket in message
            assert unix_open(sn.socket)()   # it serves by then
            sn.kill(15)
            assert s.recv(4096) == b"STOPPING=1"
