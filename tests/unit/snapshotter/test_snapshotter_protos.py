"""The protos compile from a clean tree and carry containerd's names and field numbers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from google.protobuf.descriptor import FieldDescriptor

from coldstart._proto import build
from coldstart._proto.containerd.services.snapshots.v1 import snapshots_pb2 as pb
from coldstart._proto.containerd.types import mount_pb2


def fields(msg: type) -> dict[str, int]:
    return {f.name: f.number for f in msg.DESCRIPTOR.fields}  # type: ignore[attr-defined]


def test_field_numbers_are_containerds() -> None:
    assert fields(mount_pb2.Mount) == {"type": 1, "source": 2, "target": 3, "options": 4}
    assert fields(pb.PrepareSnapshotRequest) == {"snapshotter": 1, "key": 2, "parent": 3,
                                                 "labels": 4}
    assert fields(pb.ViewSnapshotRequest) == fields(pb.PrepareSnapshotRequest)
    assert fields(pb.CommitSnapshotRequest) == {"snapshotter": 1, "name": 2, "key": 3,
                                                "labels": 4, "parent": 5}
    assert fields(pb.Info) == {"name": 1, "parent": 2, "kind": 3, "created_at": 4,
                               "updated_at": 5, "labels": 6}
    assert fields(pb.UpdateSnapshotRequest) == {"snapshotter": 1, "info": 2, "update_mask": 3}
    assert fields(pb.ListSnapshotsRequest) == {"snapshotter": 1, "filters": 2}
    assert fields(pb.UsageResponse) == {"size": 1, "inodes": 2}
    for m in (pb.MountsRequest, pb.RemoveSnapshotRequest, pb.StatSnapshotRequest,
              pb.UsageRequest):
        assert fields(m) == {"snapshotter": 1, "key": 2}
    assert {v.name: v.number for v in pb.Kind.DESCRIPTOR.values} == {
        "UNKNOWN": 0, "VIEW": 1, "ACTIVE": 2, "COMMITTED": 3}
    labels = pb.Info.DESCRIPTOR.fields_by_name["labels"]
    assert labels.message_type.GetOptions().map_entry
    assert labels.message_type.fields_by_name["value"].type == FieldDescriptor.TYPE_STRING


def test_service_paths_and_streaming() -> None:
    svc = pb.DESCRIPTOR.services_by_name["Snapshots"]
    assert svc.full_name == "containerd.services.snapshots.v1.Snapshots"
    assert [m.name for m in svc.methods] == ["Prepare", "View", "Mounts", "Commit", "Remove",
                                             "Stat", "Update", "List", "Usage", "Cleanup"]
    list_method = svc.methods_by_name["List"]
    assert list_method.output_type.full_name == \
        "containerd.services.snapshots.v1.ListSnapshotsResponse"
    assert svc.methods_by_name["Commit"].output_type.full_name == "google.protobuf.Empty"
    assert mount_pb2.Mount.DESCRIPTOR.full_name == "containerd.types.Mount"


def test_build_into_a_fresh_directory_rewrites_imports(tmp_path: Path) -> None:
    out = tmp_path / "gen"
    written = build.build(build.PROTO_ROOT, out)
    assert set(written) >= set(build.expected_outputs(build.PROTO_ROOT, out))
    grpc_mod = (out / "containerd/services/snapshots/v1/snapshots_pb2_grpc.py").read_text()
    assert "from coldstart._proto.containerd.services.snapshots.v1 import snapshots_pb2" \
        in grpc_mod
    pb_mod = (out / "containerd/services/snapshots/v1/snapshots_pb2.py").read_text()
    assert "from containerd." not in pb_mod
    assert "from coldstart._proto.containerd.types import mount_pb2" in pb_mod


def test_python_m_build_regenerates_missing_modules(tmp_path: Path) -> None:
    # a fresh clone: no generated code; `python -m coldstart._proto.build` makes it importable
    repo = Path(build.__file__).resolve().parents[2]
    clone = tmp_path / "clone"
    (clone / "coldstart" / "_proto").mkdir(parents=True)
    subprocess.run(["cp", "-r", str(repo / "protos"), str(clone / "protos")], check=True)
    for name in ("__init__.py", "build.py"):
        (clone / "coldstart" / "_proto" / name).write_text(
            (repo / "coldstart" / "_proto" / name).read_text())
    (clone / "coldstart" / "__init__.py").write_text("")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "from coldstart._proto.containerd.services.snapshots.v1 import snapshots_pb2_grpc;"
            "print(snapshots_pb2_grpc.__file__)")
    r = subprocess.run([sys.executable, "-c", code, str(clone)], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path,
                       env={"PATH": "/usr/bin:/bin", "PYTHONNOUSERSITE": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith(str(clone))
