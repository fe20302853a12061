"""The gRPC face of :class:`~coldstart.snapshotter.snapshotter.Snapshotter`:
``containerd.services.snapshots.v1.Snapshots``, as containerd's proxy plugin calls it.

The only module that imports gRPC for the snapshotter. Errors are translated here, once: a
:class:`~coldstart.errors.ColdstartError` becomes the status named by its ``grpc_code`` with its
message; anything else is logged with its traceback and answered ``UNKNOWN``.

Example::

    server = grpc.server(ThreadPoolExecutor(8))
    add_service(server, SnapshotService(snapshotter, metrics))
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import NoReturn, TypeVar

import grpc
from google.protobuf import empty_pb2, timestamp_pb2

from coldstart._proto.containerd.services.snapshots.v1 import snapshots_pb2 as pb
from coldstart._proto.containerd.services.snapshots.v1 import snapshots_pb2_grpc as pb_grpc
from coldstart._proto.containerd.types import mount_pb2
from coldstart.errors import ColdstartError
from coldstart.snapshotter.mounts import Mount
from coldstart.snapshotter.service_metrics import ServiceMetrics
from coldstart.snapshotter.snapshotter import Snapshotter
from coldstart.snapshotter.store import Info

__all__ = ["LIST_BATCH", "SnapshotService", "add_service", "info_to_proto", "mounts_to_proto"]

log = logging.getLogger("coldstart.snapshotter.service")

# infos per ListSnapshotsResponse message (containerd's own service sends 100)
LIST_BATCH = 100

R = TypeVar("R")


def _ts(ns: int) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(ns)
    return ts


def info_to_proto(info: Info) -> pb.Info:
    return pb.Info(name=info.name, parent=info.parent, kind=info.kind.name,
                   created_at=_ts(info.created_ns), updated_at=_ts(info.updated_ns),
                   labels=info.labels)


def mounts_to_proto(mounts: list[Mount]) -> list[mount_pb2.Mount]:
    return [mount_pb2.Mount(type=m.type, source=m.source, target=m.target,
                            options=list(m.options)) for m in mounts]


def _abort(context: grpc.ServicerContext, exc: BaseException, method: str) -> NoReturn:
    if isinstance(exc, ColdstartError):
        code = getattr(grpc.StatusCode, exc.grpc_code, grpc.StatusCode.UNKNOWN)
        log.debug("%s: %s: %s", method, exc.grpc_code, exc)
        context.abort(code, exc.message)
    log.error("%s failed unexpectedly", method, exc_info=exc)
    context.abort(grpc.StatusCode.UNKNOWN, f"{method}: {type(exc).__name__}: {exc}")
    raise AssertionError("context.abort returned")  # pragma: no cover


class SnapshotService(pb_grpc.SnapshotsServicer):
    """One servicer per process; ``snapshotter`` fields of requests are ignored (we are one)."""

    def __init__(self, snapshotter: Snapshotter, metrics: ServiceMetrics | None = None) -> None:
        self.sn = snapshotter
        self.metrics = metrics or ServiceMetrics()

    def _call(self, method: str, context: grpc.ServicerContext, fn: Callable[[], R]) -> R:
        try:
            with self.metrics.rpc(method):
                return fn()
        except Exception as exc:
            _abort(context, exc, method)

    def Prepare(self, request: pb.PrepareSnapshotRequest,
                context: grpc.ServicerContext) -> pb.PrepareSnapshotResponse:
        mounts = self._call("Prepare", context, lambda: self.sn.prepare(
            request.key, request.parent, dict(request.labels)))
        return pb.PrepareSnapshotResponse(mounts=mounts_to_proto(mounts))

    def View(self, request: pb.ViewSnapshotRequest,
             context: grpc.ServicerContext) -> pb.ViewSnapshotResponse:
        mounts = self._call("View", context, lambda: self.sn.view(
            request.key, request.parent, dict(request.labels)))
        return pb.ViewSnapshotResponse(mounts=mounts_to_proto(mounts))

    def Mounts(self, request: pb.MountsRequest,
               context: grpc.ServicerContext) -> pb.MountsResponse:
        mounts = self._call("Mounts", context, lambda: self.sn.mounts(request.key))
        return pb.MountsResponse(mounts=mounts_to_proto(mounts))

    def Commit(self, request: pb.CommitSnapshotRequest,
               context: grpc.ServicerContext) -> empty_pb2.Empty:
        # request.parent (containerd >= 2.2, "rebase") is accepted and ignored
        self._call("Commit", context, lambda: self.sn.commit(
            request.name, request.key, dict(request.labels)))
        return empty_pb2.Empty()

    def Remove(self, request: pb.RemoveSnapshotRequest,
               context: grpc.ServicerContext) -> empty_pb2.Empty:
        self._call("Remove", context, lambda: self.sn.remove(request.key))
        return empty_pb2.Empty()

    def Stat(self, request: pb.StatSnapshotRequest,
             context: grpc.ServicerContext) -> pb.StatSnapshotResponse:
        info = self._call("Stat", context, lambda: self.sn.stat(request.key))
        return pb.StatSnapshotResponse(info=info_to_proto(info))

    def Update(self, request: pb.UpdateSnapshotRequest,
               context: grpc.ServicerContext) -> pb.UpdateSnapshotResponse:
        paths = list(request.update_mask.paths) if request.HasField("update_mask") else []
        info = self._call("Update", context, lambda: self.sn.update(
            request.info.name, dict(request.info.labels), paths))
        return pb.UpdateSnapshotResponse(info=info_to_proto(info))

    def List(self, request: pb.ListSnapshotsRequest,
             context: grpc.ServicerContext) -> Iterator[pb.ListSnapshotsResponse]:
        infos = self._call("List", context, lambda: self.sn.walk(list(request.filters)))
        for i in range(0, len(infos), LIST_BATCH):
            yield pb.ListSnapshotsResponse(
                info=[info_to_proto(x) for x in infos[i:i + LIST_BATCH]])

    def Usage(self, request: pb.UsageRequest,
              context: grpc.ServicerContext) -> pb.UsageResponse:
        usage = self._call("Usage", context, lambda: self.sn.usage(request.key))
        return pb.UsageResponse(size=usage.size, inodes=usage.inodes)

    def Cleanup(self, request: pb.CleanupRequest,
                context: grpc.ServicerContext) -> empty_pb2.Empty:
        self._call("Cleanup", context, self.sn.cleanup)
        return empty_pb2.Empty()


def add_service(server: grpc.Server, service: SnapshotService) -> None:
    pb_grpc.add_SnapshotsServicer_to_server(service, server)  # type: ignore[no-untyped-call]
