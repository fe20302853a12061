"""The ``compile`` image's app (compile_app.py) on this host's Python and torch, eager mode: its
phases and READY=1 arrive on a real notify socket in order, its result line, SIGTERM ends it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

APP = Path(__file__).resolve().parents[3] / "coldstart" / "benchmark" / "compile_app.py"


def _start(tmp_path: Path, **env: str) -> tuple[subprocess.Popen[str], socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.settimeout(60)
    proc = subprocess.Popen(
        [sys.executable, str(APP)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify.sock"),
             "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), **env})
    return proc, sock


def _notices_until_ready(sock: socket.socket) -> list[dict[str, str]]:
    notices: list[dict[str, str]] = []
    while not notices or notices[-1].get("READY") != "1":
        data = sock.recv(4096).decode()
        notices.append(dict(line.split("=", 1) for line in data.splitlines() if "=" in line))
    return notices


@pytest.mark.timeout(60)
def test_eager_run_reports_phases_then_ready_and_stops_on_sigterm(tmp_path: Path) -> None:
    proc, sock = _start(tmp_path, COMPILE_MODE="eager")
    try:
        notices = _notices_until_ready(sock)
        assert [n.get("STATUS") for n in notices] == ["importing", "building", "warm-up", "ready"]
        assert [n.get("X_PHASE") for n in notices][:3] == ["importing", "building", "warm-up"]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(results) == 1
    assert results[0]["mode"] == "eager"
    assert isinstance(results[0]["result"], float) and results[0]["compile_s"] >= 0
    phases = [line.split()[1] for line in out.splitlines() if line.startswith("coldstart-phase")]
    assert phases == ["importing", "building", "warm-up", "ready"]
    assert not (tmp_path / "inductor").exists()     # eager compiles nothing


@pytest.mark.timeout(30)
def test_unknown_mode_fails_before_importing_torch(tmp_path: Path) -> None:
    proc, sock = _start(tmp_path, COMPILE_MODE="nope")
    try:
        out, err = proc.communicate(timeout=20)
    finally:
        sock.close()
    assert proc.returncode == 2
    assert "COMPILE_MODE='nope'" in err and "jit, aoti, eager" in err
    assert out == ""
