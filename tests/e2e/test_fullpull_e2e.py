"""Issue 14 end to end: a layer coldstart does not mount lazily is pulled in full by it, in
parallel (``pull.mode = "auto"``, the default), and the node sees what containerd's own pull
gives.

An unconverted image (busybox, a tree with modes, owners, links, xattrs, whiteouts and an opaque
dir, and a layer with every tar entry kind: devices, a FIFO, a char-device whiteout, long and
non-ASCII names) with no gzip index: ``coldstart pull`` reports every layer pulled in full by the
snapshotter and why it is not lazy; the registry served each blob once, in range requests; the
image runs; its root file system equals containerd's own unpack file by file. A layer whose
gzip stream ends early fails the pull with a clear error and leaves no snapshot of it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from coldstart.containerd import Containerd
from coldstart.containerd.pull import chain_ids
from coldstart.oci.registry import RegistryClient
from tests.fixtures.registry import Registry
from tests.integration.pull.pull_env import (
    WORKLOAD,
    AccessLog,
    Entry,
    LazyStack,
    PushedImage,
    assert_same_tree,
    coldstart_cli,
    containerd_tree,
    every_kind_layers,
    lazy_stack,
    push_image,
    rich_layers,
    snapshot_tree,
    workload_expected,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _layers(tag: str) -> list[list[Entry] | bytes]:
    return every_kind_layers(f"full-{tag}")


@pytest.fixture(scope="module")
def stack(registry: Registry) -> Iterator[LazyStack]:
    with lazy_stack(pull_mode="auto") as st:
        yield st


@pytest.fixture(scope="module")
def image(registry: Registry) -> PushedImage:
    with RegistryClient() as reg:
        return push_image(reg, f"{registry.host}/e2e-full/app:gzip", _layers("app"))


def test_every_layer_is_pulled_in_full_in_parallel(stack: LazyStack, registry: Registry,
                                                  image: PushedImage) -> None:
    log = AccessLog(registry.access_log)
    proc = coldstart_cli("pull", "--address", stack.ctd.address, "--namespace", "full",
                         image.ref)
    assert proc.returncode == 0, proc.stderr
    assert "4 layers: 0 lazy, 0 downloaded" in proc.stderr, proc.stderr
    assert "4 pulled in full by the snapshotter" in proc.stderr
    assert proc.stderr.count("not lazy: no-index") == 4, proc.stderr
    for digest, size in zip(image.layer_digests, image.layer_sizes, strict=True):
        served = log.blob_requests(digest)
        assert sum(r.bytes for r in served) == size, (digest, served)
        assert all(r.method == "GET" for r in served)
    run = stack.ctd.ctr("run", "--rm", "--snapshotter", "coldstart", image.ref, "run-full",
                        "/bin/sh", "-c", WORKLOAD, namespace="full")
    assert run.stdout == workload_expected(rich_layers())


def test_the_rootfs_is_what_containerd_unpacks(stack: LazyStack, image: PushedImage) -> None:
    reference = containerd_tree(stack, image)
    assert {"dev/null", "dev/sda", "run/fifo", "var/cache", "data/link-to-b"} <= set(reference)
    proc = coldstart_cli("pull", "--address", stack.ctd.address, "--namespace", "tree",
                         image.ref)
    assert proc.returncode == 0 and "4 pulled in full" in proc.stderr, proc.stderr
    assert_same_tree(snapshot_tree(stack, "tree", "coldstart", image.diff_ids), reference)


def test_a_gzip_stream_that_ends_early_leaves_no_snapshot(stack: LazyStack,
                                                          registry: Registry) -> None:
    layers = _layers("short")[:2]
    with RegistryClient() as reg:
        image = push_image(reg, f"{registry.host}/e2e-full/short:gzip", layers)
        # the second layer's blob replaced by its first half (its config still names the
        # whole tar's diffID): a stream that ends early
        from coldstart.oci.reference import Reference
        ref = Reference.parse(image.ref)
        body, media, _ = reg.get_manifest(ref)
        import json
        manifest = json.loads(body)
        blob = reg.get_blob(ref, manifest["layers"][1]["digest"], max_size=64 << 20)
        short = blob[: len(blob) // 2]
        manifest["layers"][1].update(digest=reg.push_blob(ref, short), size=len(short))
        reg.push_manifest(ref, json.dumps(manifest).encode(), media)
    proc = coldstart_cli("pull", "--address", stack.ctd.address, "--namespace", "short",
                         image.ref)
    assert proc.returncode != 0
    log = stack.snapshotter.log.read_text()
    assert "the full pull failed" in log and ("truncated" in log or "diffID" in log), log[-3000:]
    chain = chain_ids(image.diff_ids)[1]
    with Containerd(stack.ctd.address, "short") as client:
        assert not client.has_snapshot("coldstart", chain)
    downloads = stack.snapshotter.root / "downloads"
    assert not list(downloads.glob("*.part")) if downloads.exists() else True

