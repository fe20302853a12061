"""``coldstart bench`` end to end on a small image: real containerd, snapshotter, registry.

What is asserted is behaviour, never timing: every mode's phases come in order and end at READY,
the registry bytes are counted, the JSON matches its schema, a peer that cannot run is skipped
with its reason, and after a failed run, and after SIGINT in the middle of a run, nothing is left
behind: no process, no mount, no containerd state.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest

from coldstart.benchmark.demo import build_image, demo_files
from coldstart.benchmark.results import SCHEMA_PATH
from coldstart.stack.snapshotter import missing_tools
from tests.fixtures.procs import mounts_under, processes_naming

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(bool(missing_tools()), reason="needs root, containerd, runc")]

SRC = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base, app = demo_files(0.05)
    path = tmp_path_factory.mktemp("layout") / "small"
    build_image(path, [base, app])
    return path


def _bench(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", "from coldstart.cli import main; main()", "bench", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=SRC,
        env={**os.environ, "PYTHONPATH": str(SRC), **(env or {})})


def _leftovers(*paths: Path) -> list[str]:
    """Processes whose command line names one of ``paths``, and mounts below them."""
    needles = [str(p) for p in paths]
    return processes_naming(*needles) + mounts_under(*needles)


def test_bench_two_modes_json_and_a_skipped_peer(layout: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    work = tmp_path / "work"
    # no Go toolchain: the stargz peer cannot be built, so its mode is skipped with the reason
    proc = _bench(f"oci:{layout}", "--embedded", "--mode", "overlayfs,coldstart,stargz",
                  "--runs", "2", "--command", "/app/start.sh", "--cache-dir", str(tmp_path / "c"),
                  "--workdir", str(work), "--json", str(out), "--settle", "0",
                  env={"COLDSTART_GO": "/nonexistent/go"})
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, json.loads(SCHEMA_PATH.read_text()))
    assert doc["modes"]["stargz"]["status"] == "skipped"
    assert "go" in doc["modes"]["stargz"]["reason"]
    assert "skipping stargz: " in stderr
    assert "| stargz | skipped: " in stdout
    for mode in ("overlayfs", "coldstart"):
        m = doc["modes"][mode]
        assert m["status"] == "ok" and m["summary"]["ok_runs"] == 2
        for run in m["runs"]:
            names = [p["name"] for p in run["phases"]]
            assert names[:4] == ["resolve", "pull", "create", "start"]
            assert run["exit_code"] == 0
            ends = [p["end_s"] for p in run["phases"]]
            assert ends == sorted(ends) and ends[-1] == pytest.approx(run["ready_s"])
            assert run["registry_bytes"] > 0 and run["registry_requests"] > 0
            assert run["cpu_s"]["containerd"] > 0
        assert f"| {mode} | **" in stdout
    # the lazy mode fetched less than the full pull did (the start-up reads a tenth)
    lazy = doc["modes"]["coldstart"]["summary"]["registry_bytes"]["median"]
    full = doc["modes"]["overlayfs"]["summary"]["registry_bytes"]["median"]
    assert lazy < full
    # the floor's warm starts take their turn in each round, like the modes
    floor = doc["floor"]
    assert len(floor["warm_runs_s"]) == 2 and all(s > 0 for s in floor["warm_runs_s"])
    assert floor["warm_start_s"] == pytest.approx(sum(floor["warm_runs_s"]) / 2)
    assert "[3/6] floor run 1: READY" in stderr and "floor run 2: READY" in stderr
    assert _leftovers(work) == []
    assert list(work.iterdir()) == []


def test_a_failing_start_up_is_reported_and_cleaned_up(layout: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    out = tmp_path / "r.json"
    proc = _bench(f"oci:{layout}", "--embedded", "--mode", "coldstart", "--runs", "1",
                  "--command", "/app/start.sh", "--ready", "log:never printed", "--timeout", "8",
                  "--cache-dir", str(tmp_path / "c"), "--workdir", str(work), "--json", str(out),
                  "--settle", "0", "--no-floor")
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1
    assert "nothing was measured: every mode was skipped or failed" in stderr
    doc = json.loads(out.read_text())
    run = doc["modes"]["coldstart"]["runs"][0]
    assert not run["ok"]
    assert "exited with code 0 before it was ready" in run["error"]
    assert doc["modes"]["coldstart"]["status"] == "failed"
    assert _leftovers(work) == []
    assert list(work.iterdir()) == []


def test_sigint_in_the_middle_of_a_run_leaves_nothing(layout: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    cache = tmp_path / "c"
    proc = _bench(f"oci:{layout}", "--embedded", "--mode", "coldstart", "--runs", "1",
                  "--command", "sh -c 'sleep 600'", "--cache-dir", str(cache),
                  "--workdir", str(work), "--settle", "0")
    deadline = time.monotonic() + 240
    try:
        while not _container_sleeping():     # the container is running: mounts, shim, all
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the container never started"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "coldstart: aborted" in stderr or "interrupted" in stderr
    assert not _container_sleeping()
    assert _leftovers(work, cache) == []
    assert list(work.iterdir()) == []


def _container_sleeping() -> bool:
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes() == b"sleep\x00600\x00":
                    return True
            except OSError:
                pass
    return False


def test_bench_against_a_running_containerd(layout: Path, tmp_path: Path) -> None:
    """--address: the node's own containerd and snapshotter; the image is gone afterwards
    (with hot free memory before each run: written and freed, not timed)."""
    from coldstart.stack.snapshotter import temp_local_stack

    out = tmp_path / "r.json"
    with temp_local_stack() as st:
        proc = _bench(f"oci:{layout}", "--address", st.address, "--mode", "overlayfs,coldstart",
                      "--runs", "1", "--command", "/app/start.sh", "--cache-dir",
                      str(tmp_path / "c"), "--json", str(out), "--settle", "0", "--no-floor",
                      "--memory", "hot")
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        assert "chunk caches are not cleared" in stderr
        doc = json.loads(out.read_text())
        assert doc["node"] == f"address:{st.address}"
        assert all(m["summary"]["ok_runs"] == 1 for m in doc["modes"].values())
        images = st.ctd.ctr("image", "ls", "-q", namespace="coldstart-bench")
        assert images.stdout.strip() == ""
        snapshots = st.ctd.ctr("snapshot", "--snapshotter", "coldstart", "ls",
                               namespace="coldstart-bench")
        assert len(snapshots.stdout.strip().splitlines()) <= 1   # the header only
