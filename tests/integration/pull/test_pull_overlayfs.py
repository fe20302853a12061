"""``coldstart pull`` against containerd's built-in overlayfs snapshotter: the fallback path
(download + containerd's diff service) end to end, GC wiring, and clear errors."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from coldstart.containerd import Containerd
from coldstart.containerd.pull import chain_ids, pull_image
from coldstart.errors import InvalidArgument, NotFound, Unavailable
from coldstart.oci.registry import RegistryClient
from tests.fixtures.containerd import Containerd as ContainerdProc
from tests.fixtures.registry import Registry
from tests.integration.pull.pull_env import (
    AccessLog,
    Entry,
    PushedImage,
    busybox_entries,
    coldstart_cli,
    containerd,
    mounted_view,
    push_image,
    push_index,
    rich_layers,
    walk_tree,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def ctd() -> Iterator[ContainerdProc]:
    with containerd() as proc:
        yield proc


@pytest.fixture(scope="module")
def image(registry: Registry) -> PushedImage:
    with RegistryClient() as client:
        return push_image(client, f"{registry.host}/pull-ovl/app:v1", [
            busybox_entries(),
            [Entry("etc/hello.txt", data=b"hello from layer 2\n"),
             Entry("etc/gone.txt", data=b"to be deleted\n")],
            [Entry("etc/gone.txt", "whiteout")],
        ])


def test_pull_then_run_with_overlayfs(ctd: ContainerdProc, registry: Registry,
                                      image: PushedImage) -> None:
    log = AccessLog(registry.access_log)
    proc = coldstart_cli("pull", "--address", ctd.address, "--snapshotter", "overlayfs",
                         image.ref)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [image.ref, image.manifest_digest]
    # progress per layer and a summary on stderr
    assert proc.stderr.count("downloaded") >= 3
    assert "3 layers: 0 lazy, 3 downloaded" in proc.stderr
    # every layer blob was fetched exactly once, whole
    for digest, size in zip(image.layer_digests, image.layer_sizes, strict=True):
        assert log.blob_bytes(digest) == size
        assert len(log.blob_requests(digest)) == 1

    run = ctd.ctr("run", "--rm", "--snapshotter", "overlayfs", image.ref, "ovl-run-1",
                  "/bin/sh", "-c", "cat /etc/hello.txt; ls /etc")
    assert run.stdout.splitlines() == ["hello from layer 2", "hello.txt"]

    top = chain_ids(image.diff_ids)[-1]
    with Containerd(ctd.address) as client:
        record = client.get_image(image.ref)
        assert record.target.digest == image.manifest_digest
        manifest_info = client.content_info(image.manifest_digest)
        for i, digest in enumerate(image.layer_digests):
            assert manifest_info.labels[f"containerd.io/gc.ref.content.l.{i}"] == digest
        config_digest = manifest_info.labels["containerd.io/gc.ref.content.config"]
        config_info = client.content_info(config_digest)
        assert config_info.labels["containerd.io/gc.ref.snapshot.overlayfs"] == top
        assert client.stat_snapshot("overlayfs", top).kind == "COMMITTED"
        # the pull's lease is gone
        assert not [lease for lease in client.list_leases() if lease.startswith("coldstart-")]


def test_labels_keep_everything_through_gc_and_image_removal_frees_it(
        ctd: ContainerdProc, registry: Registry, image: PushedImage) -> None:
    ns = "gc-test"
    with Containerd(ctd.address, ns) as client, RegistryClient() as reg:
        result = pull_image(client, reg, image.ref, snapshotter="overlayfs")
    assert 0 < result.cpu_s < result.seconds * 2      # its threads' CPU, both counted
    top = result.chain_id
    # a synchronous GC: the image record is the only root now
    ctd.ctr("leases", "create", "--id", "gc-trigger", namespace=ns)
    ctd.ctr("leases", "delete", "--sync", "gc-trigger", namespace=ns)
    snaps = ctd.ctr("snapshots", "--snapshotter", "overlayfs", "ls", namespace=ns).stdout
    assert top in snaps
    content = ctd.ctr("content", "ls", "-q", namespace=ns).stdout.split()
    assert set(image.layer_digests) <= set(content)
    assert result.config_digest in content
    # removing the image lets GC collect everything the pull made
    ctd.ctr("images", "rm", "--sync", image.ref, namespace=ns)
    snaps = ctd.ctr("snapshots", "--snapshotter", "overlayfs", "ls", namespace=ns).stdout
    assert top not in snaps and chain_ids(image.diff_ids)[0] not in snaps
    assert ctd.ctr("content", "ls", "-q", namespace=ns).stdout.split() == []


def test_second_pull_downloads_no_layer(ctd: ContainerdProc, registry: Registry,
                                        image: PushedImage) -> None:
    ns = "twice"
    with Containerd(ctd.address, ns) as client, RegistryClient() as reg:
        first = pull_image(client, reg, image.ref, snapshotter="overlayfs")
        log = AccessLog(registry.access_log)
        second = pull_image(client, reg, image.ref, snapshotter="overlayfs")
    assert [la.how for la in first.layers] == ["downloaded"] * 3
    assert [la.how for la in second.layers] == ["present"] * 3
    assert second.chain_id == first.chain_id
    assert all(log.blob_requests(d) == [] for d in image.layer_digests)


def test_pull_through_an_index_picks_the_host_platform(
        ctd: ContainerdProc, registry: Registry, image: PushedImage) -> None:
    ref = f"{registry.host}/pull-ovl/app:multi"
    with RegistryClient() as reg:
        index_digest = push_index(reg, ref, image)
    ns = "index"
    proc = coldstart_cli("pull", "-q", "--address", ctd.address, "--namespace", ns,
                         "--snapshotter", "overlayfs", ref)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    with Containerd(ctd.address, ns) as client:
        record = client.get_image(ref)
        assert record.target.digest == index_digest
        assert record.target.media_type == "application/vnd.oci.image.index.v1+json"
        index_info = client.content_info(index_digest)
        assert image.manifest_digest in index_info.labels.values()
    run = ctd.ctr("run", "--rm", "--snapshotter", "overlayfs", ref, "idx-run-1",
                  "/bin/cat", "/etc/hello.txt", namespace=ns)
    assert run.stdout == "hello from layer 2\n"


def test_the_config_must_match_the_layers(ctd: ContainerdProc, registry: Registry,
                                          image: PushedImage) -> None:
    # a manifest whose config lists a wrong diff ID: containerd's diff service unpacks the
    # layer, the digest of what it unpacked disagrees, the pull fails and leaves no snapshot
    from coldstart.oci.reference import Reference

    ref = f"{registry.host}/pull-ovl/app:bad-config"
    with RegistryClient() as reg:
        body, _, _ = reg.get_manifest(Reference.parse(image.ref))
        manifest = json.loads(body)
        bad_config = json.dumps({"architecture": "amd64", "os": "linux",
                                 "rootfs": {"type": "layers",
                                            "diff_ids": ["sha256:" + "1" * 64,
                                                         *image.diff_ids[1:]]}}).encode()
        digest = reg.push_blob(Reference.parse(ref), bad_config)
        manifest["config"] = {"mediaType": "application/vnd.oci.image.config.v1+json",
                              "digest": digest, "size": len(bad_config)}
        reg.push_manifest(Reference.parse(ref), json.dumps(manifest).encode(),
                          "application/vnd.oci.image.manifest.v1+json")
    proc = coldstart_cli("pull", "--address", ctd.address, "--namespace", "bad",
                         "--snapshotter", "overlayfs", ref)
    assert proc.returncode == 8, proc.stderr          # IntegrityError
    assert "config says sha256:1111" in proc.stderr
    assert "Traceback" not in proc.stderr
    snaps = ctd.ctr("snapshots", "--snapshotter", "overlayfs", "ls", namespace="bad").stdout
    assert "extract-" not in snaps
    with Containerd(ctd.address, "bad") as client:     # the failed pull's lease is gone
        assert not [lease for lease in client.list_leases() if lease.startswith("coldstart-")]


def test_clear_errors(ctd: ContainerdProc, registry: Registry, tmp_path_factory:
                      pytest.TempPathFactory) -> None:
    missing_sock = tmp_path_factory.mktemp("nosock") / "containerd.sock"
    proc = coldstart_cli("pull", "--address", str(missing_sock), f"{registry.host}/x/y:z")
    assert proc.returncode == Unavailable.exit_code
    assert proc.stderr.strip() == (f"coldstart: error: containerd socket {missing_sock} does "
                                   "not exist (is containerd running? see --address)")

    proc = coldstart_cli("pull", "--address", ctd.address, "Not A Ref")
    assert proc.returncode == InvalidArgument.exit_code
    assert proc.stderr.startswith("coldstart: error: invalid image reference")

    proc = coldstart_cli("pull", "--address", ctd.address, "--namespace", "none",
                         f"{registry.host}/pull-ovl/none:v9")
    assert proc.returncode == NotFound.exit_code, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    # the lease, made while the registry was asked, is released all the same
    with Containerd(ctd.address, "none") as client:
        assert not [lease for lease in client.list_leases() if lease.startswith("coldstart-")]

    proc = coldstart_cli("pull", "--address", ctd.address, "--platform", "linux//v7",
                         f"{registry.host}/pull-ovl/app:v1")
    assert proc.returncode == InvalidArgument.exit_code
    assert "invalid platform" in proc.stderr

    # a snapshotter containerd does not have
    proc = coldstart_cli("pull", "--address", ctd.address, "--snapshotter", "nope",
                         f"{registry.host}/pull-ovl/app:v1")
    assert proc.returncode != 0
    assert "nope" in proc.stderr and "Traceback" not in proc.stderr


def test_same_tree_as_containerds_own_pull(ctd: ContainerdProc, registry: Registry) -> None:
    # coldstart pull's fallback (download + containerd's diff service) against `ctr image pull`:
    # the two unpacked root file systems are identical, file by file
    layers = rich_layers()
    with RegistryClient() as reg:
        image = push_image(reg, f"{registry.host}/pull-ovl/rich:v1", layers)
    ctd.ctr("images", "pull", "--plain-http", image.ref, namespace="ctr-own", timeout=180)
    with Containerd(ctd.address, "ours") as client, RegistryClient() as reg:
        ours = pull_image(client, reg, image.ref, snapshotter="overlayfs")
    top = chain_ids(image.diff_ids)[-1]
    assert ours.chain_id == top
    with Containerd(ctd.address, "ctr-own") as theirs_client, \
            mounted_view(theirs_client, "overlayfs", top) as theirs_root:
        theirs = walk_tree(theirs_root)
    with Containerd(ctd.address, "ours") as client, \
            mounted_view(client, "overlayfs", top) as our_root:
        mine = walk_tree(our_root)
    assert mine == theirs
    # the walk saw what the layers hold (guards against comparing two empty trees)
    assert theirs["data/link-to-b"].links == ("data/b.txt",)
    assert theirs["data/link-to-a"].links == ()      # layer 3 replaced data/a.txt
    assert "etc/gone.txt" not in theirs and "rmdir" not in theirs
    assert sorted(p for p in theirs if p.startswith("opq/")) == ["opq/z"]
    assert dict(theirs["data/a.txt"].xattrs) == {"user.new": b"1"}
    assert theirs["data/setuid"].mode == "-rwsr-xr-x"
    assert (theirs["etc/secret"].uid, theirs["etc/secret"].gid) == (1000, 1000)
