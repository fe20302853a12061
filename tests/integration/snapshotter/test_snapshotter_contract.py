"""containerd's snapshotter contract, through the real containerd's snapshots service.

Every test runs twice: with ``snapshotter = "overlayfs"`` (containerd's built-in one) and with
``snapshotter = "coldstart"`` (our daemon behind ``[proxy_plugins.coldstart]``). The expected
results are written once; the overlayfs run proves that they are containerd's behaviour, the
coldstart run that we match it. Mounts are mounted for real.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from coldstart._proto.containerd.services.snapshots.v1 import snapshots_pb2 as pb
from coldstart._proto.containerd.types import mount_pb2
from tests.fixtures.containerd import Containerd
from tests.integration.snapshotter.snapclient import SnapClient, code_of, mounted

pytestmark = pytest.mark.integration

C = grpc.StatusCode


@pytest.fixture(params=["overlayfs", "coldstart"])
def snap(request: pytest.FixtureRequest, containerd: Containerd) -> Iterator[SnapClient]:
    ns = f"t-{uuid.uuid4().hex[:10]}"
    containerd.ctr("leases", "create", "--id", ns, namespace=ns)
    client = SnapClient(containerd.address, request.param, ns, lease=ns)
    try:
        yield client
    finally:
        client.close()


def shape(mounts: list[mount_pb2.Mount]) -> list[tuple[str, tuple[str, ...]]]:
    """Mount lists with paths replaced by what they are (lowerdir: how many)."""
    out = []
    for m in mounts:
        opts = []
        for o in m.options:
            name, eq, value = o.partition("=")
            if name == "lowerdir":
                opts.append(f"lowerdir:{len(value.split(':'))}")
            elif eq and name in ("upperdir", "workdir"):
                assert os.path.isdir(value), o
                opts.append(name)
            else:
                opts.append(o)
        if m.type == "bind":
            assert os.path.isdir(m.source), m.source
        out.append((m.type, tuple(opts)))
    return out


def wait_until(check: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {timeout} s: {what}")
        time.sleep(0.1)


def snapshot_dir(mounts: list[mount_pb2.Mount]) -> Path:
    """The snapshot's own directory (``…/snapshots/<id>``) from an ACTIVE's mounts."""
    m = mounts[0]
    if m.type == "bind":
        return Path(m.source).parent
    upper = next(o for o in m.options if o.startswith("upperdir="))
    return Path(upper.partition("=")[2]).parent


def test_kinds_parents_and_mount_shapes(snap: SnapClient) -> None:
    assert shape(snap.prepare("a")) == [("bind", ("rw", "rbind"))]
    snap.commit("a-c", "a")
    assert shape(snap.prepare("b", "a-c")) == [
        ("overlay", ("index=off", "workdir", "upperdir", "lowerdir:1"))]
    snap.commit("b-c", "b")
    assert shape(snap.prepare("c", "b-c")) == [
        ("overlay", ("index=off", "workdir", "upperdir", "lowerdir:2"))]
    assert shape(snap.view("v0")) == [("bind", ("ro", "rbind"))]
    assert shape(snap.view("v1", "a-c")) == [("bind", ("ro", "rbind"))]
    assert shape(snap.view("v2", "b-c")) == [("overlay", ("index=off", "lowerdir:2"))]
    assert shape(snap.mounts("c")) == shape(snap.prepare("c2", "b-c"))

    kinds = {k: (snap.stat(k).kind, snap.stat(k).parent)
             for k in ("a-c", "b-c", "c", "v0", "v1", "v2")}
    assert kinds == {"a-c": (pb.COMMITTED, ""), "b-c": (pb.COMMITTED, "a-c"),
                     "c": (pb.ACTIVE, "b-c"), "v0": (pb.VIEW, ""), "v1": (pb.VIEW, "a-c"),
                     "v2": (pb.VIEW, "b-c")}
    info = snap.stat("b-c")
    assert info.name == "b-c"
    assert info.created_at.seconds > 0 and info.updated_at.seconds > 0
    assert code_of(lambda: snap.stat("a")) == C.NOT_FOUND  # committed: the key is gone


def test_files_written_through_mounts_are_seen_by_children(snap: SnapClient,
                                                           tmp_path: Path) -> None:
    with mounted(snap.prepare("l1"), tmp_path / "m1") as root:
        (root / "etc").mkdir()
        (root / "etc" / "hello").write_text("hello\n")
        (root / "gone").write_text("x")
    snap.commit("l1-c", "l1")
    with mounted(snap.prepare("l2", "l1-c"), tmp_path / "m2") as root:
        assert (root / "etc" / "hello").read_text() == "hello\n"
        (root / "gone").unlink()  # a whiteout in the upper dir
        (root / "etc" / "world").write_text("world\n")
    snap.commit("l2-c", "l2")
    with mounted(snap.view("v", "l2-c"), tmp_path / "v") as root:
        assert sorted(os.listdir(root)) == ["etc"]
        assert (root / "etc" / "world").read_text() == "world\n"
        assert (root / "etc" / "hello").read_text() == "hello\n"
        with pytest.raises(OSError):
            (root / "new").write_text("read-only view")
    with mounted(snap.view("v1", "l1-c"), tmp_path / "v1") as root:
        assert sorted(os.listdir(root)) == ["etc", "gone"]


def test_errors_and_their_codes(snap: SnapClient) -> None:
    snap.prepare("a")
    assert code_of(lambda: snap.prepare("a")) == C.ALREADY_EXISTS
    assert code_of(lambda: snap.view("a")) == C.ALREADY_EXISTS
    assert code_of(lambda: snap.prepare("x", "no-such-parent")) == C.NOT_FOUND
    assert code_of(lambda: snap.stat("no-such")) == C.NOT_FOUND
    assert code_of(lambda: snap.mounts("no-such")) == C.NOT_FOUND
    assert code_of(lambda: snap.remove("no-such")) == C.NOT_FOUND
    assert code_of(lambda: snap.commit("n", "no-such")) == C.NOT_FOUND
    assert code_of(lambda: snap.usage("no-such")) == C.NOT_FOUND
    snap.commit("a-c", "a")
    snap.prepare("b")
    assert code_of(lambda: snap.commit("a-c", "b")) == C.ALREADY_EXISTS
    assert snap.stat("b").kind == pb.ACTIVE  # the failed commit lost nothing
    snap.view("v", "a-c")
    assert code_of(lambda: snap.commit("v-c", "v")) == C.FAILED_PRECONDITION
    assert snap.stat("v").kind == pb.VIEW
    assert code_of(lambda: snap.remove("a-c")) == C.FAILED_PRECONDITION  # has a child
    assert code_of(lambda: snap.update("a-c", {}, ["name"])) == C.INVALID_ARGUMENT


def test_remove_removes_directories_after_children(snap: SnapClient) -> None:
    d_a = snapshot_dir(snap.prepare("a"))
    snap.commit("a-c", "a")
    d_b = snapshot_dir(snap.prepare("b", "a-c"))
    assert d_a.is_dir() and d_b.is_dir()
    assert code_of(lambda: snap.remove("a-c")) == C.FAILED_PRECONDITION
    assert d_a.is_dir()
    snap.remove("b")
    assert code_of(lambda: snap.stat("b")) == C.NOT_FOUND
    snap.remove("a-c")
    assert [i.name for i in snap.list()] == []
    # containerd forgets at once and removes from the backend in its garbage collection
    wait_until(lambda: not d_a.exists() and not d_b.exists(), "directories removed by GC")


def test_update_labels_with_field_masks(snap: SnapClient) -> None:
    snap.prepare("a", labels={"x": "1", "y": "2"})
    assert dict(snap.stat("a").labels) == {"x": "1", "y": "2"}
    before = snap.stat("a").updated_at.ToNanoseconds()
    info = snap.update("a", {"x": "10", "y": "ignored", "z": "3"}, ["labels.x", "labels.z"])
    assert dict(info.labels) == {"x": "10", "y": "2", "z": "3"}
    assert info.updated_at.ToNanoseconds() >= before
    info = snap.update("a", {"y": "20"}, ["labels.x"])  # absent from info: deleted
    assert dict(info.labels) == {"y": "2", "z": "3"}
    info = snap.update("a", {"only": "this"}, ["labels"])
    assert dict(info.labels) == {"only": "this"}
    info = snap.update("a", {"all": "replaced"})  # no mask: every label
    assert dict(info.labels) == {"all": "replaced"}
    assert dict(snap.stat("a").labels) == {"all": "replaced"}
    assert code_of(lambda: snap.update("no-such", {"a": "b"})) == C.NOT_FOUND
    assert code_of(lambda: snap.prepare("big", labels={"k": "v" * 4096})) \
        == C.INVALID_ARGUMENT


def test_list_with_filters(snap: SnapClient) -> None:
    snap.prepare("a", labels={"team": "ml", "containerd.io/snapshot.ref": "sha256:aa"})
    snap.commit("a-c", "a", labels={"team": "ml", "containerd.io/snapshot.ref": "sha256:aa"})
    snap.prepare("b", "a-c", labels={"team": "infra"})
    snap.view("v", "a-c")

    def names(*filters: str) -> list[str]:
        return sorted(i.name for i in snap.list(*filters))

    assert names() == ["a-c", "b", "v"]
    assert names("kind==committed") == ["a-c"]
    assert names("kind==active", "kind==view") == ["b", "v"]  # OR
    assert names('parent=="a-c"') == ["b", "v"]
    assert names('parent=="a-c",kind!=view') == ["b"]  # AND
    assert names("labels.team") == ["a-c", "b"]  # present
    assert names("labels.team~=^in") == ["b"]
    assert names('labels."containerd.io/snapshot.ref"==sha256:aa,parent==""') == ["a-c"]
    assert names("name~=/^[ab]/") == ["a-c", "b"]
    assert names("labels.team!=ml") == ["b", "v"]
    # containerd's metadata layer parses the filter itself and answers UNKNOWN
    assert code_of(lambda: snap.list("kind==")) == C.UNKNOWN


def test_usage_counts_the_upper_dir(snap: SnapClient, tmp_path: Path) -> None:
    mounts = snap.prepare("a")
    empty = snap.usage("a")
    assert empty.inodes == 1  # the fs directory itself
    with mounted(mounts, tmp_path / "m") as root:
        (root / "data").write_bytes(os.urandom(256 * 1024))
        (root / "d").mkdir()
    used = snap.usage("a")
    assert used.inodes == 3
    assert used.size >= 256 * 1024 + empty.size
    snap.commit("a-c", "a")
    assert snap.usage("a-c").inodes == 3  # recorded at commit
    assert snap.usage("a-c").size == used.size
    snap.view("v", "a-c")
    assert (snap.usage("v").size, snap.usage("v").inodes) == (0, 0)


def test_cleanup_is_not_offered_by_containerd_1_6(snap: SnapClient) -> None:
    # containerd 1.6's metadata snapshotter has no Cleanup; ours is tested directly
    assert code_of(snap.cleanup) == C.UNIMPLEMENTED
