"""Our daemon on its own socket: what containerd's metadata layer hides, and the process life.

(``labels.<key>`` field masks, our filter parser's errors, Cleanup, List batching, SIGTERM, one
daemon per root, restart after ``kill -9`` with the same store.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from coldstart._proto.containerd.services.snapshots.v1 import snapshots_pb2 as pb
from tests.fixtures.containerd import SnapshotterDaemon, start_snapshotter
from tests.integration.snapshotter.snapclient import SnapClient, code_of

pytestmark = pytest.mark.integration


@pytest.fixture
def ours(coldstart_snapshotter: SnapshotterDaemon) -> Iterator[SnapClient]:
    client = SnapClient(coldstart_snapshotter.socket, "", None)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def p() -> str:
    """A key prefix of this test (the session daemon is shared)."""
    return f"d-{uuid.uuid4().hex[:8]}/"


def test_field_masks_reach_us_directly(ours: SnapClient, p: str) -> None:
    ours.prepare(p + "a", labels={"x": "1", "y": "2"})
    assert dict(ours.update(p + "a", {"x": "9", "z": "3"}, ["labels.x", "labels.z"]).labels) \
        == {"x": "9", "y": "2", "z": "3"}
    assert dict(ours.update(p + "a", {}, ["labels.y"]).labels) == {"x": "9", "z": "3"}
    assert code_of(lambda: ours.update(p + "a", {}, ["parent"])) \
        == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(ours.stat(p + "a").labels) == {"x": "9", "z": "3"}


def test_our_errors_carry_containerds_codes(ours: SnapClient, p: str) -> None:
    assert code_of(lambda: ours.list("kind==")) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: ours.prepare(p + "x", p + "missing")) == grpc.StatusCode.NOT_FOUND
    ours.prepare(p + "a")
    assert code_of(lambda: ours.prepare(p + "b", p + "a")) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: ours.mounts("")) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: ours.prepare("")) == grpc.StatusCode.INVALID_ARGUMENT
    # containerd >= 2.2 sends Commit.parent: accepted
    ours._call("Commit", pb.CommitSnapshotRequest(name=p + "a-c", key=p + "a", parent=""))
    assert ours.stat(p + "a-c").kind == pb.COMMITTED


def test_list_streams_in_batches(ours: SnapClient, p: str) -> None:
    for i in range(130):
        ours.view(f"{p}v{i:03d}")
    batches = list(ours.stub.List(pb.ListSnapshotsRequest(filters=[f"name~=^{p}"]),
                                  timeout=30))
    assert [len(b.info) for b in batches] == [100, 30]
    assert sorted(i.name for b in batches for i in b.info) == [f"{p}v{i:03d}"
                                                               for i in range(130)]


def test_cleanup_removes_orphan_directories_only(ours: SnapClient, p: str,
                                                 coldstart_snapshotter: SnapshotterDaemon
                                                 ) -> None:
    src = Path(ours.prepare(p + "a")[0].source)
    orphan = coldstart_snapshotter.root / "snapshots" / "9999999"
    (orphan / "fs").mkdir(parents=True)
    ours.cleanup()
    assert not orphan.exists()
    assert src.is_dir()


def test_sigterm_stops_gracefully_and_the_store_persists(tmp_path: Path) -> None:
    with start_snapshotter(tmp_path / "d", spawn=False, metrics=False) as d:
        c = SnapClient(d.socket, "", None)
        c.prepare("a", labels={"k": "v"})
        c.commit("a-c", "a")
        c.close()
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(30) == 0
        assert "stopped" in d.log.read_text()
        d.start()
        c = SnapClient(d.socket, "", None)
        assert [(i.name, i.kind) for i in c.list()] == [("a-c", pb.COMMITTED)]
        c.close()


def test_one_daemon_per_root_and_restart_after_kill_9(tmp_path: Path) -> None:
    with start_snapshotter(tmp_path / "d", spawn=False, metrics=False) as d:
        c = SnapClient(d.socket, "", None)
        c.prepare("a")
        second = subprocess.run(
            [sys.executable, "-m", "coldstart.cli", "snapshotter", "--config", str(d.config),
             "--socket", str(tmp_path / "other.sock")], capture_output=True, text=True,
            timeout=60)
        assert second.returncode == 5
        assert "another coldstart snapshotter uses root" in second.stderr
        d.kill(signal.SIGKILL)
        assert os.path.exists(d.socket)  # left behind by the killed process
        d.start()
        assert c.stat("a").kind == pb.ACTIVE  # the client's channel reconnects by itself
        c.close()


def test_concurrent_clients_get_distinct_snapshots(ours: SnapClient, p: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def chain(i: int) -> str:
        src = ours.prepare(f"{p}k{i}")[0].source
        ours.commit(f"{p}c{i}", f"{p}k{i}")
        ours.prepare(f"{p}top{i}", f"{p}c{i}")
        return src

    with ThreadPoolExecutor(16) as pool:
        sources = list(pool.map(chain, range(32)))
    assert len(set(sources)) == 32
    assert len(ours.list(f"name~=^{p}c,kind==committed")) == 32
    assert len(ours.list(f'name~=^{p}top,parent~="^{p}c"')) == 32
