"""A small client of ``containerd.services.snapshots.v1.Snapshots`` for the tests, plus helpers
that mount a returned mount list for real."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import field_mask_pb2

from coldstart._proto.containerd.services.snapshots.v1 import snapshots_pb2 as pb
from coldstart._proto.containerd.services.snapshots.v1 import snapshots_pb2_grpc as pb_grpc
from coldstart._proto.containerd.types import mount_pb2

TIMEOUT = 30.0


class SnapClient:
    """Talks to containerd's snapshots service (``namespace`` set) or to ours directly."""

    def __init__(self, address: str, snapshotter: str, namespace: str | None,
                 lease: str | None = None) -> None:
        self.channel = grpc.insecure_channel(f"unix:{address}")
        self.stub = pb_grpc.SnapshotsStub(self.channel)  # type: ignore[no-untyped-call]
        self.snapshotter = snapshotter
        self.md = [("containerd-namespace", namespace)] if namespace else []
        if lease:  # protects what the test creates from containerd's garbage collector
            self.md.append(("containerd-lease", lease))

    def close(self) -> None:
        self.channel.close()

    def _call(self, method: str, req: Any) -> Any:
        return getattr(self.stub, method)(req, metadata=self.md, timeout=TIMEOUT)

    def prepare(self, key: str, parent: str = "",
                labels: dict[str, str] | None = None) -> list[mount_pb2.Mount]:
        return list(self._call("Prepare", pb.PrepareSnapshotRequest(
            snapshotter=self.snapshotter, key=key, parent=parent, labels=labels or {})).mounts)

    def view(self, key: str, parent: str = "",
             labels: dict[str, str] | None = None) -> list[mount_pb2.Mount]:
        return list(self._call("View", pb.ViewSnapshotRequest(
            snapshotter=self.snapshotter, key=key, parent=parent, labels=labels or {})).mounts)

    def mounts(self, key: str) -> list[mount_pb2.Mount]:
        return list(self._call("Mounts", pb.MountsRequest(snapshotter=self.snapshotter,
                                                          key=key)).mounts)

    def commit(self, name: str, key: str, labels: dict[str, str] | None = None) -> None:
        self._call("Commit", pb.CommitSnapshotRequest(snapshotter=self.snapshotter, name=name,
                                                      key=key, labels=labels or {}))

    def remove(self, key: str) -> None:
        self._call("Remove", pb.RemoveSnapshotRequest(snapshotter=self.snapshotter, key=key))

    def stat(self, key: str) -> pb.Info:
        info: pb.Info = self._call("Stat", pb.StatSnapshotRequest(
            snapshotter=self.snapshotter, key=key)).info
        return info

    def update(self, name: str, labels: dict[str, str],
               paths: Sequence[str] | None = None) -> pb.Info:
        req = pb.UpdateSnapshotRequest(snapshotter=self.snapshotter,
                                       info=pb.Info(name=name, labels=labels))
        if paths is not None:
            req.update_mask.CopyFrom(field_mask_pb2.FieldMask(paths=list(paths)))
        info: pb.Info = self._call("Update", req).info
        return info

    def list(self, *filters: str) -> list[pb.Info]:
        out: list[pb.Info] = []
        for resp in self.stub.List(pb.ListSnapshotsRequest(snapshotter=self.snapshotter,
                                                           filters=list(filters)),
                                   metadata=self.md, timeout=TIMEOUT):
            out.extend(resp.info)
        return out

    def usage(self, key: str) -> pb.UsageResponse:
        usage: pb.UsageResponse = self._call("Usage", pb.UsageRequest(
            snapshotter=self.snapshotter, key=key))
        return usage

    def cleanup(self) -> None:
        self._call("Cleanup", pb.CleanupRequest(snapshotter=self.snapshotter))


def code_of(fn: Callable[[], object]) -> grpc.StatusCode:
    """The status code ``fn`` fails with (AssertionError if it succeeds)."""
    try:
        fn()
    except grpc.RpcError as exc:
        code: grpc.StatusCode = exc.code()
        return code
    raise AssertionError("call succeeded; an error was expected")


def mount_all(mounts: Sequence[mount_pb2.Mount], target: Path) -> None:
    """Mount a snapshot's mount list on ``target`` (what containerd does for a rootfs)."""
    for m in mounts:
        opts = ",".join(m.options)
        if m.type == "bind":
            argv = ["mount", "-o", opts, m.source, str(target)]
        else:
            argv = ["mount", "-t", m.type, "-o", opts, m.source, str(target)]
        subprocess.run(argv, check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def mounted(mounts: Sequence[mount_pb2.Mount], target: Path) -> Iterator[Path]:
    target.mkdir(parents=True, exist_ok=True)
    mount_all(mounts, target)
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=True, capture_output=True, timeout=30)
