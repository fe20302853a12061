"""No silent fallback (issue 13): a layer offered for lazy pulling but pulled normally says why
in the snapshotter's log, its metrics, ``coldstart snapshotter status`` and the snapshot's labels
(``ctr snapshots info``), also after containerd committed the snapshot it unpacked into.

Two layers, through the real containerd, our daemon and its FUSE server: a plain gzip layer (no
TOC at all) and a zstd:chunked layer whose TOC checksum annotation lies.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldstart._proto.containerd.services.snapshots.v1 import snapshots_pb2 as pb
from coldstart.format.writer import LayerResult
from coldstart.lazyfs.client import FuseServerClient
from coldstart.lazyfs.spec import REMOTE_ANNOTATIONS
from coldstart.snapshotter.service_metrics import LAZY_FALLBACKS
from coldstart.snapshotter.snapshotter import LAYER_LABEL, LAZY_LABEL, REASON_LABEL
from coldstart.stack.registry import push_layer
from tests.fixtures.containerd import Containerd, SnapshotterDaemon
from tests.fixtures.registry import Registry
from tests.integration.snapshotter.remote_layers import (
    chain_id,
    make_tar,
    push_files,
    remote_labels,
    sample_files,
)
from tests.integration.snapshotter.snapclient import SnapClient, mounted

pytestmark = pytest.mark.integration

GZIP_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


@pytest.fixture
def ns_snap(containerd: Containerd, fuse_server_up: FuseServerClient
            ) -> Iterator[tuple[str, SnapClient]]:
    ns = f"t-{uuid.uuid4().hex[:10]}"
    containerd.ctr("leases", "create", "--id", ns, namespace=ns)
    client = SnapClient(containerd.address, "coldstart", ns, lease=ns)
    try:
        yield ns, client
    finally:
        client.close()


def fallbacks(daemon: SnapshotterDaemon) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{daemon.metrics_address}/metrics",
                                  timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(LAZY_FALLBACKS + "{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.split()[-1])
    return out


def plain_gzip_labels(registry: Registry, files: dict[str, bytes]) -> tuple[str, dict[str, str]]:
    """A plain (not seekable) gzip layer pushed with an image; the lazy-pull labels of it."""
    tar = make_tar(files)
    blob = gzip.compress(tar, mtime=0)
    result = LayerResult(digest="sha256:" + hashlib.sha256(blob).hexdigest(), size=len(blob),
                         diff_id="sha256:" + hashlib.sha256(tar).hexdigest(), toc_digest="",
                         media_type=GZIP_LAYER, annotations={})
    spec = push_layer(registry.host, f"plain-{uuid.uuid4().hex[:8]}", blob, result)
    chain = chain_id("", result.diff_id)
    return chain, remote_labels(spec, chain)


def lying_toc_labels(registry: Registry) -> tuple[str, dict[str, str]]:
    """A zstd:chunked layer whose TOC checksum annotation names another TOC."""
    layer = push_files(registry.host, f"liar-{uuid.uuid4().hex[:8]}", sample_files(7))
    chain = chain_id("", layer.diff_id)
    labels = remote_labels(layer.spec, chain)
    annotations = json.loads(labels[REMOTE_ANNOTATIONS])
    bogus = {k: ("sha256:" + "0" * 64 if "checksum" in k else v) for k, v in annotations.items()}
    assert bogus != annotations
    labels[REMOTE_ANNOTATIONS] = json.dumps(bogus)
    return chain, labels


def test_each_fallback_says_why_everywhere(
        ns_snap: tuple[str, SnapClient], registry: Registry, containerd: Containerd,
        coldstart_snapshotter: SnapshotterDaemon, tmp_path: Path) -> None:
    ns, snap = ns_snap
    before = fallbacks(coldstart_snapshotter)
    cases = {
        # no TOC digest annotation (allow_unverified is off): containerd pulls it
        "no-index": plain_gzip_labels(registry, sample_files(8, n=2)),
        "integrity": lying_toc_labels(registry),
    }
    log_start = coldstart_snapshotter.log.stat().st_size
    for i, (reason, (chain, labels)) in enumerate(cases.items()):
        key = f"extract-{i} {chain}"
        mounts = snap.prepare(key, "", labels)          # no ALREADY_EXISTS: a plain ACTIVE
        info = snap.stat(key)
        assert info.kind == pb.ACTIVE
        assert (info.labels[LAZY_LABEL], info.labels[REASON_LABEL]) == ("false", reason)
        with mounted(mounts, tmp_path / f"m{i}") as root:    # containerd unpacks into it
            (root / "unpacked").write_text("by containerd")
        snap.commit(chain, key)                          # with containerd's own labels

    # the labels survive containerd's Commit: `ctr snapshots info` shows them
    for reason, (chain, labels) in cases.items():
        out = containerd.ctr("snapshots", "--snapshotter", "coldstart", "info", chain,
                             namespace=ns).stdout
        shown = json.loads(out)["Labels"]
        assert shown[LAZY_LABEL] == "false" and shown[REASON_LABEL] == reason, out
        digest = labels["containerd.io/snapshot/remote/coldstart.digest"]
        assert shown[LAYER_LABEL] == digest

    # one WARNING line per layer, with the layer, the image and the reason
    log = coldstart_snapshotter.log.read_bytes()[log_start:].decode(errors="replace")
    for reason, (_, labels) in cases.items():
        digest = labels["containerd.io/snapshot/remote/coldstart.digest"]
        image = labels["containerd.io/snapshot/remote/coldstart.reference"]
        lines = [x for x in log.splitlines() if "WARNING" in x and digest in x]
        assert len(lines) == 1, log
        assert image in lines[0] and f"reason {reason}" in lines[0], lines[0]

    # the counter by reason
    after = fallbacks(coldstart_snapshotter)
    for reason in cases:
        assert after[reason] - before.get(reason, 0) == 1, after

    # `coldstart snapshotter status`: rows in state not-lazy, with the reason and snapshot
    r = subprocess.run([sys.executable, "-m", "coldstart.cli", "snapshotter", "status",
                        "--config", str(coldstart_snapshotter.config), "-o", "json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert isinstance(rows, list)
    for reason, (chain, labels) in cases.items():
        digest = labels["containerd.io/snapshot/remote/coldstart.digest"]
        mine = [x for x in rows if x.get("digest") == digest]
        assert len(mine) == 1, rows
        assert mine[0]["state"] == "not-lazy" and mine[0]["reason"] == reason
        assert mine[0]["snapshot"].endswith(chain) and mine[0]["kind"] == "committed"
    table = subprocess.run([sys.executable, "-m", "coldstart.cli", "snapshotter", "status",
                            "--config", str(coldstart_snapshotter.config)],
                           capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    assert "not mounted lazily" in table.stdout
    for reason, (_, labels) in cases.items():
        digest = labels["containerd.io/snapshot/remote/coldstart.digest"]
        (line,) = [x for x in table.stdout.splitlines() if x.startswith(digest[:19])]
        assert reason in line, table.stdout
