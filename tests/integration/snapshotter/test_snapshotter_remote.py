"""The remote-snapshot handshake through the real containerd, with the real FUSE server.

Layers are converted to zstd:chunked, pushed to the test registry, and prepared through
containerd's snapshots service with the labels a lazy pull passes. A servable layer is committed
by us under its chain id (containerd adopts it: ALREADY_EXISTS, then List by the ref label); a
layer whose TOC digest is wrong falls back to a plain ACTIVE snapshot that containerd would unpack
into.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from coldstart._proto.containerd.services.snapshots.v1 import snapshots_pb2 as pb
from coldstart.lazyfs.client import FuseServerClient
from coldstart.lazyfs.mountsys import is_mountpoint
from coldstart.lazyfs.spec import REMOTE_ANNOTATIONS, REMOTE_SNAPSHOT
from tests.fixtures.containerd import Containerd, SnapshotterDaemon
from tests.fixtures.registry import Registry
from tests.integration.snapshotter.remote_layers import (
    PushedLayer,
    chain_id,
    push_files,
    remote_labels,
    sample_files,
)
from tests.integration.snapshotter.snapclient import SnapClient, code_of, mounted

pytestmark = pytest.mark.integration


@pytest.fixture
def snap(containerd: Containerd, fuse_server_up: FuseServerClient) -> Iterator[SnapClient]:
    ns = f"t-{uuid.uuid4().hex[:10]}"
    containerd.ctr("leases", "create", "--id", ns, namespace=ns)
    client = SnapClient(containerd.address, "coldstart", ns, lease=ns)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def ours(coldstart_snapshotter: SnapshotterDaemon) -> Iterator[SnapClient]:
    """Our daemon's socket, directly (backend names, no namespace)."""
    client = SnapClient(coldstart_snapshotter.socket, "", None)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="module")
def two_layers(registry: Registry) -> tuple[PushedLayer, PushedLayer]:
    repo = f"remote-{uuid.uuid4().hex[:8]}"
    return (push_files(registry.host, repo + "-a", sample_files(1)),
            push_files(registry.host, repo + "-b", sample_files(2)))


def read_tree(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        assert (root / name).read_bytes() == data, name


def metric(daemon: SnapshotterDaemon, name: str, labels: str) -> float:
    text = urllib.request.urlopen(f"http://{daemon.metrics_address}/metrics",
                                  timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(f"{name}{{{labels}}} "):
            return float(line.split()[-1])
    return 0.0


def test_lazy_layers_are_committed_under_their_chain_id(
        snap: SnapClient, ours: SnapClient, two_layers: tuple[PushedLayer, PushedLayer],
        coldstart_snapshotter: SnapshotterDaemon, containerd: Containerd,
        tmp_path: Path) -> None:
    l1, l2 = two_layers
    c1 = chain_id("", l1.diff_id)
    c2 = chain_id(c1, l2.diff_id)
    mounted_before = metric(coldstart_snapshotter, "coldstart_snapshotter_remote_layers_total",
                            'result="mounted"')

    # containerd's unpacker: Prepare("extract-… <chainID>") -> ALREADY_EXISTS means "skip"
    assert code_of(lambda: snap.prepare(f"extract-1 {c1}", "", remote_labels(l1.spec, c1))) \
        == grpc.StatusCode.ALREADY_EXISTS
    assert code_of(lambda: snap.prepare(f"extract-2 {c2}", c1, remote_labels(l2.spec, c2))) \
        == grpc.StatusCode.ALREADY_EXISTS

    info = snap.stat(c2)
    assert (info.kind, info.parent) == (pb.COMMITTED, c1)
    assert info.labels[REMOTE_SNAPSHOT] == "remote snapshot"
    assert [i.name for i in snap.list(f'labels."containerd.io/snapshot.ref"=={c1}')] == [c1]
    assert code_of(lambda: snap.stat(f"extract-1 {c1}")) == grpc.StatusCode.NOT_FOUND

    # in our backend: committed under the ref's value, found by the filter containerd uses
    found = ours.list(f'labels."containerd.io/snapshot.ref"=={c2},parent=="{c1}"')
    assert [(i.name, i.kind) for i in found] == [(c2, pb.COMMITTED)]
    assert not [i for i in ours.list() if i.name.endswith(f"extract-1 {c1}")]

    # the data is there, served by the FUSE server: a view and a container-like rootfs
    with mounted(snap.view("v1", c1), tmp_path / "v1") as root:
        read_tree(root, l1.files)
    with mounted(snap.prepare("rootfs", c2), tmp_path / "rw") as root:
        read_tree(root, l1.files)
        read_tree(root, l2.files)
        (root / "written").write_text("upper")
        assert (root / "written").read_text() == "upper"

    # another namespace pulling the same layers adopts our snapshots without a new mount
    ns2 = f"t-{uuid.uuid4().hex[:10]}"
    containerd.ctr("leases", "create", "--id", ns2, namespace=ns2)
    other = SnapClient(containerd.address, "coldstart", ns2, lease=ns2)
    assert code_of(lambda: other.prepare(f"extract-5 {c1}", "", remote_labels(l1.spec, c1))) \
        == grpc.StatusCode.ALREADY_EXISTS
    assert other.stat(c1).kind == pb.COMMITTED
    other.close()
    after = metric(coldstart_snapshotter, "coldstart_snapshotter_remote_layers_total",
                   'result="mounted"')
    assert after - mounted_before == 2
    assert metric(coldstart_snapshotter, "coldstart_snapshotter_snapshots",
                  'kind="committed"') >= 2
    assert metric(coldstart_snapshotter, "coldstart_snapshotter_rpc_duration_seconds_count",
                  'method="Prepare"') >= 2
    assert metric(coldstart_snapshotter, "coldstart_snapshotter_rpc_errors_total",
                  'code="ALREADY_EXISTS",method="Prepare"') >= 2


def test_wrong_toc_digest_falls_back_to_a_normal_snapshot(
        snap: SnapClient, registry: Registry, tmp_path: Path) -> None:
    layer = push_files(registry.host, f"bad-{uuid.uuid4().hex[:8]}", sample_files(3))
    chain = chain_id("", layer.diff_id)
    labels = remote_labels(layer.spec, chain)
    bogus = {k: ("sha256:" + "0" * 64 if "checksum" in k else v)
             for k, v in json.loads(labels[REMOTE_ANNOTATIONS]).items()}
    assert bogus != json.loads(labels[REMOTE_ANNOTATIONS])
    labels[REMOTE_ANNOTATIONS] = json.dumps(bogus)
    key = f"extract-9 {chain}"

    mounts = snap.prepare(key, "", labels)  # no ALREADY_EXISTS: containerd will download
    assert [m.type for m in mounts] == ["bind"]
    assert list(mounts[0].options) == ["rw", "rbind"]
    assert snap.stat(key).kind == pb.ACTIVE
    assert os.listdir(mounts[0].source) == []
    with mounted(mounts, tmp_path / "m") as root:  # what the unpacker then writes into
        (root / "unpacked").write_text("by containerd")
    snap.commit(chain, key)
    with mounted(snap.view("v", chain), tmp_path / "v") as root:
        assert (root / "unpacked").read_text() == "by containerd"


def test_removing_a_lazy_layer_unmounts_it_first(
        snap: SnapClient, registry: Registry, coldstart_snapshotter: SnapshotterDaemon) -> None:
    layer = push_files(registry.host, f"rm-{uuid.uuid4().hex[:8]}", sample_files(4, n=2))
    chain = chain_id("", layer.diff_id)
    assert code_of(lambda: snap.prepare(f"extract-3 {chain}", "", remote_labels(layer.spec,
                                                                                chain))) \
        == grpc.StatusCode.ALREADY_EXISTS
    (view,) = snap.view("v", chain)
    # a view reads a plain layer through the connection that answers getxattr
    # (<root>/fuse/<key>): the layer's own mountpoint is its snapshot's fs, bound by key
    fuse = FuseServerClient(str(coldstart_snapshotter.base / "f.sock"), 10.0)
    key = os.path.basename(view.source)
    (fs,) = [m["mountpoint"] for m in fuse.status() if m["key"] == key]
    assert is_mountpoint(fs) and os.path.basename(fs) == "fs"
    snap.remove("v")
    snap.remove(chain)  # containerd forgets it now and removes it from us in its GC
    # the snapshot's directory goes last (rmtree removes ``fs`` before it): wait for it, not
    # for ``fs`` (a CI run once caught the directory between the two)
    deadline = time.monotonic() + 30
    while os.path.exists(os.path.dirname(fs)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(os.path.dirname(fs))
    assert not is_mountpoint(fs)
    assert fs not in [m["mountpoint"] for m in fuse.status()]
