"""Issue 14 end to end: images nobody converted, lazily pulled through a gzip index.

An image of plain gzip layers (busybox, a tree with modes, owners, links, xattrs, whiteouts
and an opaque dir, and a layer with every tar entry kind: devices, a FIFO, a char-device
whiteout, long and non-ASCII names) is indexed by ``coldstart index --push`` (an OCI
artifact found through the fallback tag: Debian's registry has no referrers API). A node that
does not trust the index pulls it in full and says why; one that pins the artifact's digest
mounts every layer lazily, runs the image without downloading its blobs, and its root file
system equals containerd's own unpack file by file. An index that lies about one file makes
that file's read fail (EIO), caches nothing, and the layer is pulled in full from then on.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldstart.lazyfs.client import FuseServerClient
from coldstart.oci.gzindex import LayerIndex, index_image, push_image_index
from coldstart.oci.reference import Reference
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
from tests.unit.format.layers import rewrite_index

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _layers(tag: str) -> list[list[Entry] | bytes]:
    return every_kind_layers(f"index-{tag}")


@pytest.fixture(scope="module")
def stack(registry: Registry) -> Iterator[LazyStack]:
    with lazy_stack() as st:
        yield st


@pytest.fixture(scope="module")
def indexed(registry: Registry) -> tuple[PushedImage, str]:
    with RegistryClient() as reg:
        image = push_image(reg, f"{registry.host}/e2e-index/app:gzip", _layers("app"))
    proc = coldstart_cli("index", image.ref, "--push", "--span", "256KiB", "-o", "json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["pushed"] and all(la["indexed"] for la in doc["layers"]), doc
    assert doc["manifest"] == image.manifest_digest
    return image, doc["artifact"]


def _trust(stack: LazyStack, digest: str) -> None:
    with open(stack.snapshotter.root / "trusted-indexes", "a") as f:
        f.write(f"{digest}  # test\n")


def _pull(stack: LazyStack, ref: str, namespace: str) -> str:
    proc = coldstart_cli("pull", "--address", stack.ctd.address, "--namespace", namespace, ref)
    assert proc.returncode == 0, f"{proc.stderr}\n--- FUSE server log:\n" \
        f"{stack.fuse_log.read_text()[-3000:]}"
    return proc.stderr


def test_an_untrusted_index_is_not_used(stack: LazyStack,
                                        indexed: tuple[PushedImage, str]) -> None:
    image, _ = indexed
    out = _pull(stack, image.ref, "untrusted")
    assert "4 layers: 0 lazy, 4 downloaded" in out, out
    log = stack.snapshotter.log.read_text()
    assert "reason index-untrusted" in log and "index.trust is pinned" in log


def test_a_pinned_index_mounts_every_layer_lazily(stack: LazyStack, registry: Registry,
                                                  indexed: tuple[PushedImage, str]) -> None:
    image, artifact = indexed
    _trust(stack, artifact)
    log = AccessLog(registry.access_log)
    out = _pull(stack, image.ref, "indexed")
    assert "4 layers: 4 lazy, 0 downloaded" in out, out
    run = stack.ctd.ctr("run", "--rm", "--snapshotter", "coldstart", image.ref, "run-indexed",
                        "/bin/sh", "-c", WORKLOAD, namespace="indexed")
    assert run.stdout == workload_expected(rich_layers())
    # the third layer's 3 MiB file nobody reads stayed in the registry
    top, size = image.layer_digests[2], image.layer_sizes[2]
    assert log.blob_bytes(top) < size - (2 << 20), (log.blob_bytes(top), size)


def test_the_indexed_rootfs_is_what_containerd_unpacks(
        stack: LazyStack, indexed: tuple[PushedImage, str]) -> None:
    image, artifact = indexed
    _trust(stack, artifact)
    reference = containerd_tree(stack, image)
    assert {"dev/null", "dev/sda", "run/fifo", "var/cache", "data/link-to-b"} <= set(reference)
    assert "etc/gone.txt" not in reference
    out = _pull(stack, image.ref, "tree")
    assert "4 lazy" in out
    assert_same_tree(snapshot_tree(stack, "tree", "coldstart", image.diff_ids), reference)


def test_a_lying_index_fails_the_read_then_the_layer_is_pulled_in_full(
        stack: LazyStack, registry: Registry) -> None:
    with RegistryClient() as reg:
        image = push_image(reg, f"{registry.host}/e2e-index/lying:gzip", _layers("lying"))
        with tempfile.TemporaryDirectory() as tmp:
            ix = index_image(reg, Reference.parse(image.ref), span=256 << 10, workdir=Path(tmp))

        def lie(t: dict) -> None:      # the top layer's small.txt: a digest of other bytes
            e = next(e for e in t["entries"] if e["name"] == "data/small.txt")
            e["chunkDigest"] = "sha256:" + "1" * 64

        top = ix.layers[2]
        lying = dataclasses.replace(ix, layers=(*ix.layers[:2], LayerIndex(
            top.digest, top.size, blob=rewrite_index(top.blob, toc=lie)), *ix.layers[3:]))
        artifact = push_image_index(reg, lying)
    _trust(stack, artifact)
    assert "4 layers: 4 lazy" in _pull(stack, image.ref, "lying")
    run = stack.ctd.ctr("run", "--rm", "--snapshotter", "coldstart", image.ref, "run-lying",
                        "/bin/sh", "-c", "cat /etc/hello.txt; cat /data/small.txt",
                        namespace="lying", check=False)
    assert run.returncode != 0 and "Input/output error" in run.stdout + run.stderr, run
    # nothing was cached: a second read fails the same way
    again = stack.ctd.ctr("run", "--rm", "--snapshotter", "coldstart", image.ref, "run-lying2",
                          "/bin/sh", "-c", "cat /data/small.txt", namespace="lying", check=False)
    assert again.returncode != 0 and "Input/output error" in again.stdout + again.stderr
    fuse_log = stack.fuse_log.read_text()
    assert f"layer {top.digest}" in fuse_log and "gzip index proved wrong" in fuse_log
    bad = json.loads((stack.snapshotter.root / "bad-indexes.json").read_text())
    assert top.digest in bad and bad[top.digest]["index"] == artifact
    # removed (so that no snapshot of it is adopted), then pulled again: from now on that
    # layer is pulled in full (the others stay lazy), and the file reads
    stack.ctd.ctr("images", "rm", "--sync", image.ref, namespace="lying")
    out = _pull(stack, image.ref, "lying-again")
    assert "4 layers: 3 lazy, 1 downloaded" in out, out
    assert "reason index-failed" in stack.snapshotter.log.read_text()
    run = stack.ctd.ctr("run", "--rm", "--snapshotter", "coldstart", image.ref, "run-again",
                        "/bin/sh", "-c", "cat /data/small.txt", namespace="lying-again",
                        check=False)
    small = next(e for e in rich_layers()[2] if e.path == "data/small.txt").data
    assert run.returncode == 0 and run.stdout == small.decode(), run


def test_an_index_with_a_profile_prefetches_the_start_up_set_at_mount(
        registry: Registry, tmp_path: Path) -> None:
    """``coldstart index --profile``: the image stays unconverted; its second layer's index
    names the recorded files' spans, which the node fetches as soon as it mounts the layer
    (before anything reads them), and the start-up's reads then need no request. A node of
    its own: the module's node may hold these files' pieces already (the cache is keyed by
    content, and the other tests' images share them)."""
    with lazy_stack() as stack:
        _profiled(stack, registry, tmp_path)


def _profiled(stack: LazyStack, registry: Registry, tmp_path: Path) -> None:
    with RegistryClient() as reg:
        image = push_image(reg, f"{registry.host}/e2e-index/profiled:gzip", _layers("prof"))
    profile = {"schema": "coldstart.dev/profile/v1", "image": image.ref, "layers": [
        {"index": 1, "diff_id": image.diff_ids[1], "files": [
            {"path": "data/b.txt", "t": 0.1, "ranges": [[0, 6000]]},
            {"path": "data/cold.bin", "t": 0.2, "ranges": [[0, 4096]]},
            {"path": "data/not-in-this-layer", "t": 0.3}]}]}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    proc = coldstart_cli("index", image.ref, "--push", "--span", "256KiB", "--profile",
                         str(path), "-o", "json")
    assert proc.returncode == 0, proc.stderr
    assert "1 files of the profile are not regular files of this layer" in proc.stderr
    doc = json.loads(proc.stdout)
    named = doc["layers"][1]
    assert named["prefetch_files"] == 2 and 0 < named["prefetch_bytes"] < (1 << 20), named
    assert all(la["prefetch_files"] == 0 for i, la in enumerate(doc["layers"]) if i != 1)
    _trust(stack, doc["artifact"])
    layer = image.layer_digests[1]
    log = AccessLog(registry.access_log)
    assert "4 layers: 4 lazy" in _pull(stack, image.ref, "profiled")
    client = FuseServerClient(stack.fuse_socket, timeout=10)

    def prefetched() -> dict | None:
        rows = [r for r in client.status() if r["digest"] == layer and r["prefetch_done"]]
        return rows[0] if rows else None

    deadline = time.monotonic() + 30
    while (row := prefetched()) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert row is not None and row["prefetched_bytes"] > 0, client.status()
    assert row["requests_by_kind"].get("demand", 0) == 0
    # only the named spans came: most of the 2 MiB cold.bin stayed in the registry (the
    # registry logs a request once it is answered: wait for the lines)
    deadline = time.monotonic() + 10
    while log.blob_bytes(layer) < row["prefetched_bytes"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert 0 < log.blob_bytes(layer) <= named["prefetch_bytes"] < image.layer_sizes[1] - (1 << 20)
    run = stack.ctd.ctr("run", "--rm", "--snapshotter", "coldstart", image.ref, "run-profiled",
                        "/bin/sh", "-c", "cat /data/b.txt | wc -c", namespace="profiled")
    assert run.stdout.strip() == "6000"
    row = next(r for r in client.status() if r["digest"] == layer)
    assert row["requests_by_kind"].get("demand", 0) == 0, row    # read from the prefetch


@pytest.mark.parametrize("text, says", [("", "the profile is empty"), ("{nope", "not JSON"),
                                         ('{"schema": "other"}', "schema")])
def test_a_bad_profile_is_one_line_and_nothing_is_read(tmp_path: Path, text: str,
                                                       says: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(text)
    # refused before the registry is asked (nothing listens on port 9)
    proc = coldstart_cli("index", "127.0.0.1:9/none/app:gzip", "--profile", str(path))
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and str(path) in lines[0], proc.stderr
