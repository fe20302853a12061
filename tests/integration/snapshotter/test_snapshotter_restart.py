"""``kill -9`` of the gRPC process never touches a lazily mounted layer; containerd reconnects.

A thread reads every file of a lazily mounted layer in a loop (dropping each file's page cache
first, so the reads reach the FUSE server) while the snapshotter's gRPC process is killed with
SIGKILL and started again on the same root.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import grpc
import pytest

from coldstart._proto.containerd.services.snapshots.v1 import snapshots_pb2 as pb
from coldstart.lazyfs.client import FuseServerClient
from tests.fixtures.containerd import Containerd, SnapshotterDaemon, wait_gone
from tests.fixtures.registry import Registry
from tests.integration.lazy.lazy_helpers import ReadLoop, needs_resend
from tests.integration.snapshotter.remote_layers import (
    chain_id,
    push_files,
    remote_labels,
    sample_files,
)
from tests.integration.snapshotter.snapclient import SnapClient, code_of, mounted

pytestmark = pytest.mark.integration


def list_when_reconnected(snap: SnapClient, flt: str, timeout: float = 60.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return [i.name for i in snap.list(flt)]
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN) \
                    or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_kill_9_of_the_grpc_process_fails_no_read(
        containerd: Containerd, coldstart_snapshotter: SnapshotterDaemon, registry: Registry,
        fuse_server_up: FuseServerClient, tmp_path: Path) -> None:
    layer = push_files(registry.host, f"restart-{uuid.uuid4().hex[:8]}", sample_files(7, n=8))
    chain = chain_id("", layer.diff_id)
    ns = f"t-{uuid.uuid4().hex[:10]}"
    containerd.ctr("leases", "create", "--id", ns, namespace=ns)
    snap = SnapClient(containerd.address, "coldstart", ns, lease=ns)
    assert code_of(lambda: snap.prepare(f"extract-1 {chain}", "", remote_labels(layer.spec,
                                                                                chain))) \
        == grpc.StatusCode.ALREADY_EXISTS
    fuse_pid = coldstart_snapshotter.fuse_pid
    assert fuse_pid is not None

    with mounted(snap.view("v", chain), tmp_path / "v") as root:
        reader = ReadLoop(root, layer.files)
        try:
            reader.wait_reads(len(layer.files))
            coldstart_snapshotter.kill(signal.SIGKILL)
            before = reader.reads
            reader.wait_reads(3 * len(layer.files))  # served while no gRPC process exists
            during_outage = reader.reads - before
            coldstart_snapshotter.start()
            reader.wait_reads(len(layer.files))
        finally:
            failures = reader.stop()[1]
    assert failures == []
    assert during_outage >= 3 * len(layer.files)
    assert coldstart_snapshotter.fuse_pid == fuse_pid  # the same FUSE server, never restarted
    os.kill(fuse_pid, 0)

    # containerd reaches the new process on its own (its gRPC client redials with backoff, so
    # calls in the first second or so may still be refused): list, stat, a new container rootfs
    t0 = time.monotonic()
    assert list_when_reconnected(snap, f'labels."containerd.io/snapshot.ref"=={chain}') \
        == [chain]
    print(f"reads: {reader.reads} total, {during_outage} while the gRPC process was dead; "
          f"containerd answered again {time.monotonic() - t0:.2f} s after the restart")
    assert snap.stat(chain).kind == pb.COMMITTED
    with mounted(snap.prepare("rootfs", chain), tmp_path / "rw") as root:
        name, data = next(iter(layer.files.items()))
        assert (root / name).read_bytes() == data
    snap.close()


@needs_resend
def test_a_killed_fuse_server_is_started_again_and_restores_its_mounts(
        containerd: Containerd, coldstart_snapshotter: SnapshotterDaemon, registry: Registry,
        fuse_server_up: FuseServerClient, tmp_path: Path) -> None:
    repo = f"respawn-{uuid.uuid4().hex[:8]}"
    first = push_files(registry.host, repo + "-a", sample_files(8, n=3))
    second = push_files(registry.host, repo + "-b", sample_files(9, n=3))
    ca, cb = chain_id("", first.diff_id), chain_id("", second.diff_id)
    ns = f"t-{uuid.uuid4().hex[:10]}"
    containerd.ctr("leases", "create", "--id", ns, namespace=ns)
    snap = SnapClient(containerd.address, "coldstart", ns, lease=ns)
    assert code_of(lambda: snap.prepare(f"extract-1 {ca}", "", remote_labels(first.spec, ca))) \
        == grpc.StatusCode.ALREADY_EXISTS
    (view,) = snap.view("va", ca)
    name, data = next(iter(first.files.items()))
    assert (Path(view.source) / name).read_bytes() == data

    old = coldstart_snapshotter.fuse_pid
    loop = ReadLoop(Path(view.source), first.files)   # a container reading on
    assert old is not None and wait_gone(old, signal.SIGKILL, 10.0)

    # the next lazy Prepare finds it unreachable and starts it again; the new server takes
    # over the dead one's connection (kept by the holder): the reads wait, none fails
    assert code_of(lambda: snap.prepare(f"extract-2 {cb}", "", remote_labels(second.spec, cb))) \
        == grpc.StatusCode.ALREADY_EXISTS
    new = coldstart_snapshotter.fuse_pid
    assert new is not None and new != old
    os.kill(new, 0)
    # the watchdog and this Prepare both found it gone: one server was started, and the
    # pidfile names it (the fixture stops it by that pid)
    assert _fuse_servers(coldstart_snapshotter.root) == [new]
    with mounted(snap.view("vb", cb), tmp_path / "vb") as root:
        for n, d in second.files.items():
            assert (root / n).read_bytes() == d
    loop.wait_reads(10, timeout=30)                   # after the takeover
    assert loop.stop()[1] == []
    assert (Path(view.source) / name).read_bytes() == data
    snap.close()


def _fuse_servers(root: Path) -> list[int]:
    """The pids of the FUSE servers running on ``root``'s config."""
    config = str(root / "fuse-server.toml").encode()
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"fuse-server" in argv and config in argv:
                out.append(int(entry.name))
    return out
