"""containerd's own diff of a container whose lower layers coldstart serves lazily.

``ctr snapshots diff`` runs the path that ``ctr containers checkpoint --rw``, commit tools and
CRI checkpoint take: containerd views the parent, mounts the container's snapshot and walks both
(continuity's ``doubleWalkDiff``), asking each file in both trees for
``security.capability``, where it accepts only ``ENODATA``. The image's layers show no
extended attribute, so coldstart serves them on the FUSE connection that answers no getxattr
(``fuse.split_xattrs``, the default), whose files the kernel answers ``EOPNOTSUPP``. The diff
must succeed and hold what the same diff holds on containerd's overlayfs snapshotter, for a
running container and for one that has exited; the container's own start keeps the plain
connection (its rootfs overlay's lower directories are the snapshots' ``fs``).
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldstart.containerd import Containerd
from coldstart.lazyfs.mountsys import mount_table
from coldstart.oci.registry import RegistryClient
from coldstart.stack.containerd import CTR_BIN
from coldstart.stack.images import Entry, busybox_entries
from tests.fixtures.registry import Registry
from tests.integration.pull.pull_env import (
    LazyStack,
    PushedImage,
    coldstart_cli,
    lazy_stack,
    mounted_view,
    push_image,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

#: changes of every kind a diff carries: a new file and directory, a changed file, a changed
#: mode, a deleted file (a whiteout) and a replaced directory's content
WORKLOAD = (
    "echo new > /new.txt && /bin/busybox mkdir -p /newdir/sub && echo x > /newdir/sub/f && "
    "echo changed >> /etc/hello.txt && /bin/busybox chmod 600 /etc/mode.txt && "
    "/bin/busybox rm /etc/gone.txt && /bin/busybox rm -r /data/old && "
    "echo fresh > /data/fresh.txt"
)


def _layers() -> list[list[Entry]]:
    base = [*busybox_entries(), Entry("etc/hello.txt", data=b"hello\n"),
            Entry("etc/mode.txt", data=b"m\n"),
            Entry("etc/gone.txt", data=b"deleted by the container\n")]
    second = [Entry("data", "dir", mode=0o755), Entry("data/old", "dir", mode=0o755),
              Entry("data/old/a", data=b"a\n" * 100), Entry("data/keep", data=b"k\n" * 5000)]
    return [base, second]


@pytest.fixture(scope="module")
def stack(registry: Registry) -> Iterator[LazyStack]:
    with lazy_stack() as st:
        yield st


@pytest.fixture(scope="module")
def images(registry: Registry, stack: LazyStack) -> tuple[PushedImage, str]:
    with RegistryClient() as reg:
        gzip_image = push_image(reg, f"{registry.host}/e2e-diff/app:gzip", _layers())
    lazy_ref = f"{registry.host}/e2e-diff/app:zstd"
    proc = coldstart_cli("convert", gzip_image.ref, lazy_ref, "--format", "zstd-chunked")
    assert proc.returncode == 0, proc.stderr
    return gzip_image, lazy_ref


def _diff_members(stack: LazyStack, snapshotter: str, namespace: str, key: str,
                  ) -> dict[str, tuple[object, ...]]:
    """``ctr snapshots diff`` of ``key`` against its parent, as member -> what it holds
    (times left out: the two runs happen at different times)."""
    # ctr writes the diff it stored in the content store to its standard output
    proc = subprocess.run([CTR_BIN, "--address", stack.ctd.address, "--namespace", namespace,
                           "snapshots", "--snapshotter", snapshotter, "diff", "--media-type",
                           "application/vnd.oci.image.layer.v1.tar", key],
                          capture_output=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    blob = proc.stdout
    members: dict[str, tuple[object, ...]] = {}
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
        for m in tar:
            data = tar.extractfile(m).read() if m.isfile() else b""  # type: ignore[union-attr]
            members[m.name.rstrip("/")] = (m.type, m.mode, m.uid, m.gid, m.linkname,
                                           hashlib.sha256(data).hexdigest(),
                                           sorted(m.pax_headers.items()))
    return members


def _run(stack: LazyStack, snapshotter: str, namespace: str, ref: str, name: str, *,
         running: bool) -> None:
    script = WORKLOAD + (" && exec /bin/busybox sleep 300" if running else "")
    args = ["run", "--snapshotter", snapshotter]
    if running:
        args.append("-d")
    stack.ctd.ctr(*args, ref, name, "/bin/sh", "-c", script, namespace=namespace)
    if running:   # the workload's changes are made before the sleep
        said = ""
        for i in range(200):
            proc = stack.ctd.ctr("tasks", "exec", "--exec-id", f"probe{i}", name, "/bin/sh",
                                 "-c", "test -e /data/fresh.txt && echo done",
                                 namespace=namespace, check=False)
            said = proc.stdout.strip()
            if said == "done":
                break
        assert said == "done", "the workload did not finish"


def _rootfs_lowers(namespace: str, container: str) -> list[str]:
    """The lower directories of ``container``'s rootfs overlay, as mounted at its start."""
    for m in mount_table():
        if m.fstype == "overlay" and m.point.endswith(f"/{namespace}/{container}/rootfs"):
            lower = next(o for o in m.options if o.startswith("lowerdir="))
            return lower.removeprefix("lowerdir=").split(":")
    raise AssertionError(f"no rootfs overlay of {namespace}/{container} in the mount table")


@pytest.mark.parametrize("running", [True, False], ids=["running", "exited"])
def test_containerd_diff_on_coldstart_equals_overlayfs(
        stack: LazyStack, images: tuple[PushedImage, str], running: bool) -> None:
    gzip_image, lazy_ref = images
    state = "running" if running else "exited"
    ns_cs, ns_ovl = f"diff-cs-{state}", f"diff-ovl-{state}"
    proc = coldstart_cli("pull", "--address", stack.ctd.address, "--namespace", ns_cs, lazy_ref)
    assert proc.returncode == 0 and "2 lazy" in proc.stderr, proc.stderr
    stack.ctd.ctr("images", "pull", "--plain-http", gzip_image.ref, namespace=ns_ovl,
                  timeout=180)
    _run(stack, "coldstart", ns_cs, lazy_ref, "c", running=running)
    _run(stack, "overlayfs", ns_ovl, gzip_image.ref, "c", running=running)
    try:
        if running:   # the start read its lower layers through the plain connection
            root = str(stack.snapshotter.root.resolve())
            plain = {m.dev for m in mount_table() if m.point == f"{root}/fuse-plain"}
            lowers = _rootfs_lowers(ns_cs, "c")
            assert len(lowers) == 2 and all(lo.startswith(f"{root}/snapshots/") for lo in lowers)
            seen = {m.point: m.dev for m in mount_table()}
            assert {seen[lo] for lo in lowers} == plain, (lowers, plain)
        ours = _diff_members(stack, "coldstart", ns_cs, "c")
        theirs = _diff_members(stack, "overlayfs", ns_ovl, "c")
    finally:
        for ns in (ns_cs, ns_ovl):
            if running:
                stack.ctd.ctr("tasks", "kill", "-s", "SIGKILL", "c", namespace=ns, check=False)
                stack.ctd.ctr("tasks", "delete", "--force", "c", namespace=ns, check=False)
            stack.ctd.ctr("containers", "delete", "c", namespace=ns, check=False)
    assert ours == theirs
    assert {"new.txt", "newdir/sub/f", "etc/hello.txt", "etc/mode.txt", "etc/.wh.gone.txt",
            "data/fresh.txt", "data/.wh.old"} <= set(ours), sorted(ours)
    assert ours["etc/mode.txt"][1] == 0o600


def test_a_view_of_plain_layers_answers_enodata(
        stack: LazyStack, images: tuple[PushedImage, str]) -> None:
    _, lazy_ref = images
    proc = coldstart_cli("pull", "--address", stack.ctd.address, "--namespace", "diff-view",
                         lazy_ref)
    assert proc.returncode == 0, proc.stderr
    with Containerd(stack.ctd.address, "diff-view") as client:
        image = client.get_image(lazy_ref)
        config = client.content_info(image.target.digest).labels[
            "containerd.io/gc.ref.content.config"]
        top = client.content_info(config).labels["containerd.io/gc.ref.snapshot.coldstart"]
        with mounted_view(client, "coldstart", top) as root:
            _assert_enodata(root)


def _assert_enodata(root: Path) -> None:
    """An absent attribute reads as on a local disk; the files are the layers'."""
    for path in ("etc/hello.txt", "bin", "data/keep"):
        with pytest.raises(OSError) as err:
            os.getxattr(root / path, "security.capability")
        assert err.value.errno == errno.ENODATA, path
    assert (root / "data/keep").read_bytes() == b"k\n" * 5000
