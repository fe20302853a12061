"""The systemd unit (checked by ``systemd-analyze verify`` where it exists), systemctl calls
(with a fake runner: no systemd here), ``sd_notify``, and ``ctr plugins ls`` parsing."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from coldstart.errors import Unavailable
from coldstart.node.status import containerd_plugin
from coldstart.node.systemd import UNIT_NAME, activate, default_exec, systemctl, unit_text
from coldstart.unixsock import sd_notify


def test_the_unit_has_what_the_daemon_needs(tmp_path: Path) -> None:
    text = unit_text(["/opt/cold start/coldstart"], Path("/etc/coldstart/config.toml"))
    lines = text.splitlines()
    for want in ("Type=notify", "KillMode=process", "Restart=always",
                 "Before=containerd.service", "WantedBy=multi-user.target"):
        assert want in lines
    assert "ExecStart='/opt/cold start/coldstart' snapshotter --config " \
           "/etc/coldstart/config.toml" in lines
    assert default_exec()[0].startswith("/")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze (Debian's systemd package) is not installed: the "
                           "unit is checked by the text tests only")
def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    unit = tmp_path / UNIT_NAME
    unit.write_text(unit_text([sys.executable, "-m", "coldstart.cli"], tmp_path / "c.toml"))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                       text=True, timeout=60)
    # a bad line is only a warning naming the file (exit status 0): any line naming it fails
    complaints = [line for line in (r.stdout + r.stderr).splitlines() if UNIT_NAME in line]
    assert (r.returncode, complaints) == (0, []), r.stdout + r.stderr


class FakeRunner:
    def __init__(self, fail_on: str = "", stdout: str = "") -> None:
        self.calls: list[list[str]] = []
        self.fail_on, self.stdout = fail_on, stdout

    def __call__(self, argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        failed = bool(self.fail_on) and self.fail_on in argv
        return subprocess.CompletedProcess(argv, 1 if failed else 0, self.stdout,
                                           "Unit containerd.service not found.\n" if failed
                                           else "")


def test_activate_runs_systemctl_in_order_and_a_failure_is_one_line() -> None:
    run = FakeRunner()
    assert activate(run=run) == ["systemctl daemon-reload",
                                 f"systemctl enable {UNIT_NAME}",
                                 f"systemctl restart {UNIT_NAME}",
                                 "systemctl restart containerd"]
    # the unit is restarted (an upgrade's new files run; its FUSE server keeps serving)
    assert [c[1:] for c in run.calls] == [["daemon-reload"], ["enable", UNIT_NAME],
                                          ["restart", UNIT_NAME], ["restart", "containerd"]]
    # containerd is restarted only when its config changed
    run = FakeRunner()
    assert activate(run=run, restart_containerd=False)[-1] == f"systemctl restart {UNIT_NAME}"
    assert ["restart", "containerd"] not in [c[1:] for c in run.calls]
    with pytest.raises(Unavailable, match=r"restart containerd failed: Unit containerd\.service "
                                          r"not found"):
        systemctl("restart", "containerd", run=FakeRunner(fail_on="restart"))


def test_ctr_plugins_ls_is_read(tmp_path: Path) -> None:
    sock = tmp_path / "c.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock))
        listing = ("TYPE                            ID          PLATFORMS      STATUS\n"
                   "io.containerd.snapshotter.v1    overlayfs   linux/amd64    ok\n"
                   "io.containerd.snapshotter.v1    coldstart   -              ok\n")
        got = containerd_plugin(str(sock), run=FakeRunner(stdout=listing))
        assert (got["listed"], got["status"], got["error"]) == (True, "ok", None)
        got = containerd_plugin(str(sock), run=FakeRunner(stdout=listing.replace("coldstart",
                                                                                 "stargz")))
        assert (got["listed"], got["error"]) == (False, None)
        got = containerd_plugin(str(sock), run=FakeRunner(fail_on="plugins"))
        assert got["error"].startswith("ctr plugins ls: Unit")
    sock.unlink()
    assert "no socket at" in containerd_plugin(str(sock))["error"]


@pytest.mark.parametrize("abstract", [False, True])
def test_sd_notify_sends_a_datagram(tmp_path: Path, abstract: bool,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"@coldstart-test-{os.getpid()}" if abstract else str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name[1:] if abstract else name)
        s.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", name)
        assert sd_notify("READY=1")
        assert s.recv(4096) == b"READY=1"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert not sd_notify("READY=1")                         # not under systemd
    assert not sd_notify("READY=1", str(tmp_path / "gone"))  # nobody listens
