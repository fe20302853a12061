"""A small typed client over containerd's gRPC socket (content, images, leases, diff, snapshots).

Every call carries the ``containerd-namespace`` header (and ``containerd-lease`` while a lease is
held) and a deadline; failures come out as :mod:`coldstart.errors` (mapped in ``_errors``).

>>> with Containerd("/run/containerd/containerd.sock", "default") as ctd:   # doctest: +SKIP
...     with ctd.lease():
...         ctd.write_content(b"{}", digest_of(b"{}"), labels={"a": "b"})
...         info = ctd.stat_snapshot("overlayfs", "sha256:…")
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import socket
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import grpc

from coldstart._proto.containerd.services.content.v1 import content_pb2, content_pb2_grpc
from coldstart._proto.containerd.services.diff.v1 import diff_pb2, diff_pb2_grpc
from coldstart._proto.containerd.services.images.v1 import images_pb2, images_pb2_grpc
from coldstart._proto.containerd.services.leases.v1 import leases_pb2, leases_pb2_grpc
from coldstart._proto.containerd.services.snapshots.v1 import snapshots_pb2, snapshots_pb2_grpc
from coldstart._proto.containerd.types import descriptor_pb2, mount_pb2
from coldstart.containerd._errors import map_rpc_error
from coldstart.errors import (
    AlreadyExists,
    ColdstartError,
    DeadlineExceeded,
    IntegrityError,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from coldstart.oci.manifest import Descriptor

__all__ = [
    "DEFAULT_ADDRESS",
    "DEFAULT_NAMESPACE",
    "Containerd",
    "ContentInfo",
    "ImageRecord",
    "Mount",
    "SnapshotInfo",
]

DEFAULT_ADDRESS = "/run/containerd/containerd.sock"
DEFAULT_NAMESPACE = "default"
_CHUNK = 1 << 20            # bytes per WRITE message (containerd accepts up to 16 MiB)
_MAX_MESSAGE = 16 << 20
_T = TypeVar("_T")


@dataclass(frozen=True)
class Mount:
    """One mount of a snapshot (``containerd.types.Mount``)."""

    type: str
    source: str
    target: str = ""
    options: tuple[str, ...] = ()

    def to_pb(self) -> Any:
        return mount_pb2.Mount(type=self.type, source=self.source, target=self.target,
                               options=list(self.options))

    @classmethod
    def from_pb(cls, m: Any) -> Mount:
        return cls(type=m.type, source=m.source, target=m.target, options=tuple(m.options))


@dataclass(frozen=True)
class SnapshotInfo:
    """What containerd's snapshots service says about one snapshot."""

    name: str
    parent: str
    kind: str                           # "VIEW", "ACTIVE", "COMMITTED"
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ContentInfo:
    digest: str
    size: int
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ImageRecord:
    name: str
    target: Descriptor
    labels: Mapping[str, str] = field(default_factory=dict)


def _desc_to_pb(d: Descriptor) -> Any:
    return descriptor_pb2.Descriptor(media_type=d.media_type, digest=d.digest, size=d.size,
                                     annotations=dict(d.annotations))


def _desc_from_pb(d: Any) -> Descriptor:
    return Descriptor(media_type=d.media_type, digest=d.digest, size=d.size,
                      annotations=dict(d.annotations))


def _check_listening(path: str, timeout: float) -> None:
    """Connect to the socket once, so that a stale socket says so at once (gRPC would retry
    a refused connection until its deadline and then only say it did not connect)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(timeout)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        raise Unavailable(f"containerd at {path}: connection refused: nothing listens on the "
                          "socket (containerd is not running, or died and left it behind; "
                          "start it or see --address)") from None
    except PermissionError:
        raise Unavailable(f"containerd at {path}: permission denied (run as root, or as a user "
                          "allowed on the socket)") from None
    except TimeoutError:
        raise DeadlineExceeded(f"containerd at {path} did not accept a connection within "
                               f"{timeout:g} s") from None
    except OSError as exc:
        raise Unavailable(f"containerd at {path}: {exc.strerror or exc}") from None
    finally:
        probe.close()


class Containerd:
    """A connection to one containerd (``address`` = its gRPC unix socket) in one namespace.

    ``timeout`` is the default deadline of each call in seconds; calls that move data
    (``write_content``, ``apply_diff``) take their own, longer one.
    """

    def __init__(self, address: str = DEFAULT_ADDRESS, namespace: str = DEFAULT_NAMESPACE, *,
                 timeout: float = 30.0, connect_timeout: float = 10.0) -> None:
        if not namespace:
            raise InvalidArgument("containerd namespace must not be empty")
        if timeout <= 0:
            raise InvalidArgument("timeout must be > 0")
        path = address.removeprefix("unix://")
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            raise Unavailable(f"containerd socket {path} does not exist "
                              "(is containerd running? see --address)") from None
        except OSError as exc:
            raise Unavailable(f"containerd socket {path}: {exc.strerror}") from exc
        if not stat.S_ISSOCK(mode):
            raise InvalidArgument(f"{path} is not a unix socket")
        _check_listening(path, min(connect_timeout, timeout))
        self.address = path
        self.namespace = namespace
        self.timeout = timeout
        self.lease_id: str | None = None
        self._channel = grpc.insecure_channel(
            f"unix://{path}",
            options=[("grpc.max_receive_message_length", _MAX_MESSAGE),
                     ("grpc.max_send_message_length", _MAX_MESSAGE)])
        try:
            grpc.channel_ready_future(self._channel).result(timeout=min(connect_timeout,
                                                                        timeout))
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise DeadlineExceeded(f"containerd at {path} did not answer within "
                                   f"{min(connect_timeout, timeout):g} s (is it overloaded "
                                   "or hung?)") from None
        # generated stubs are untyped; their methods are checked through _call's signature
        grpc_modules: Any = (content_pb2_grpc, images_pb2_grpc, leases_pb2_grpc, diff_pb2_grpc,
                             snapshots_pb2_grpc)
        self._content: Any = grpc_modules[0].ContentStub(self._channel)
        self._images: Any = grpc_modules[1].ImagesStub(self._channel)
        self._leases: Any = grpc_modules[2].LeasesStub(self._channel)
        self._diff: Any = grpc_modules[3].DiffStub(self._channel)
        self._snapshots: Any = grpc_modules[4].SnapshotsStub(self._channel)

    # -- plumbing --------------------------------------------------------------------------

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Containerd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _metadata(self) -> list[tuple[str, str]]:
        md = [("containerd-namespace", self.namespace)]
        if self.lease_id:
            md.append(("containerd-lease", self.lease_id))
        return md

    def _call(self, method: Callable[..., _T], request: Any, what: str,
              timeout: float | None = None) -> _T:
        try:
            return method(request, timeout=timeout or self.timeout, metadata=self._metadata())
        except grpc.RpcError as exc:
            raise map_rpc_error(exc, what) from exc

    # -- leases ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def lease(self, *, expire: float = 3600.0) -> Iterator[str]:
        """Hold a lease for the block: content and snapshots made inside survive GC.

        The lease expires by itself after ``expire`` seconds should we die before deleting it.
        """
        lease_id = self.create_lease(expire=expire)
        try:
            yield lease_id
        except BaseException:
            # the original failure matters more; the lease expires by itself anyway
            self.release_lease(check=False)
            raise
        self.release_lease()

    def create_lease(self, *, expire: float = 3600.0) -> str:
        """Create a lease that every later call of this client holds (from any thread) until
        :meth:`release_lease`; its id. :meth:`lease` is the block form. The lease expires by
        itself after ``expire`` seconds should we die before deleting it."""
        if self.lease_id is not None:
            raise InvalidArgument("a lease is already held by this client")
        lease_id = f"coldstart-{secrets.token_hex(8)}"
        labels = {"containerd.io/gc.expire": _rfc3339_in(expire)}
        self._call(self._leases.Create, leases_pb2.CreateRequest(id=lease_id, labels=labels),
                   f"create lease {lease_id}")
        self.lease_id = lease_id
        return lease_id

    def release_lease(self, *, check: bool = True) -> None:
        """Delete the lease :meth:`create_lease` made (none held: nothing to do). ``check``
        False: a failure is ignored (the lease expires by itself)."""
        lease_id, self.lease_id = self.lease_id, None
        if lease_id is None:
            return
        try:
            self._call(self._leases.Delete, leases_pb2.DeleteRequest(id=lease_id),
                       f"delete lease {lease_id}")
        except ColdstartError:
            if check:
                raise

    def list_leases(self) -> list[str]:
        resp = self._call(self._leases.List, leases_pb2.ListRequest(), "list leases")
        return [lease.id for lease in resp.leases]

    # -- content ---------------------------------------------------------------------------

    def content_info(self, digest: str) -> ContentInfo:
        """The content store's record of ``digest``; :class:`NotFound` when absent."""
        resp = self._call(self._content.Info, content_pb2.InfoRequest(digest=digest),
                          f"content info {digest}")
        return ContentInfo(digest=resp.info.digest, size=resp.info.size,
                           labels=dict(resp.info.labels))

    def has_content(self, digest: str) -> bool:
        try:
            self.content_info(digest)
        except NotFound:
            return False
        return True

    def update_content_labels(self, digest: str, labels: Mapping[str, str]) -> ContentInfo:
        """Set ``labels`` on ``digest`` (other labels are kept)."""
        info = content_pb2.Info(digest=digest, labels=dict(labels))
        req = content_pb2.UpdateRequest(info=info)
        req.update_mask.paths.extend(f"labels.{k}" for k in labels)
        resp = self._call(self._content.Update, req, f"update labels of {digest}")
        return ContentInfo(digest=resp.info.digest, size=resp.info.size,
                           labels=dict(resp.info.labels))

    def write_content(self, data: bytes | Path | BinaryIO, digest: str, *, size: int = -1,
                      labels: Mapping[str, str] | None = None, ref: str | None = None,
                      timeout: float | None = None,
                      progress: Callable[[int], None] | None = None) -> bool:
        """Put a blob into the content store, committed under ``digest`` with ``labels``.

        Returns ``False`` when the store already had it (its labels are then updated).
        containerd verifies size and digest on COMMIT (:class:`IntegrityError` if wrong).
        """
        if isinstance(data, bytes):
            total = len(data)
        elif isinstance(data, Path):
            total = data.stat().st_size
        else:
            total = os.fstat(data.fileno()).st_size
        if size >= 0 and size != total:
            raise IntegrityError(f"blob {digest}: {total} bytes, descriptor says {size}")
        labels = dict(labels or {})
        if self.has_content(digest):
            if labels:
                self.update_content_labels(digest, labels)
            return False
        ref = ref or f"coldstart-{digest}"
        deadline = timeout or max(self.timeout, 60.0 + total / (20 << 20))

        def chunks() -> Iterator[bytes]:
            if isinstance(data, bytes):
                for off in range(0, total, _CHUNK):
                    yield data[off:off + _CHUNK]
                return
            with contextlib.ExitStack() as stack:
                f: BinaryIO = (stack.enter_context(open(data, "rb"))
                               if isinstance(data, Path) else data)
                while block := f.read(_CHUNK):
                    yield block

        # the request iterator runs on a gRPC thread; it waits here for the STAT answer
        responses: queue.Queue[Any] = queue.Queue()

        def requests() -> Iterator[Any]:
            yield content_pb2.WriteContentRequest(action=content_pb2.STAT, ref=ref,
                                                  total=total, expected=digest)
            # the STAT answer says where a previous, interrupted write of this ref stopped
            status = responses.get(timeout=deadline)
            if isinstance(status, BaseException) or status is None:
                return
            resume = int(status.offset)
            offset = 0
            for block in chunks():
                end = offset + len(block)
                if end <= resume:
                    offset = end
                    continue
                if offset < resume:
                    block, offset = block[resume - offset:], resume
                yield content_pb2.WriteContentRequest(action=content_pb2.WRITE, ref=ref,
                                                      offset=offset, data=block)
                offset += len(block)
                if progress is not None:
                    progress(len(block))
            yield content_pb2.WriteContentRequest(action=content_pb2.COMMIT, ref=ref,
                                                  total=total, expected=digest,
                                                  offset=offset, labels=labels)

        what = f"write content {digest}"
        try:
            call = self._content.Write(requests(), timeout=deadline, metadata=self._metadata())
            first = True
            for resp in call:
                if first:
                    responses.put(resp)
                    first = False
                if resp.action == content_pb2.COMMIT:
                    if resp.digest and resp.digest != digest:
                        raise IntegrityError(f"{what}: containerd committed {resp.digest}")
                    break
        except grpc.RpcError as exc:
            responses.put(None)
            err = map_rpc_error(exc, what)
            if isinstance(err, AlreadyExists):
                if labels:
                    self.update_content_labels(digest, labels)
                return False
            raise err from exc
        return True

    # -- images ----------------------------------------------------------------------------

    def get_image(self, name: str) -> ImageRecord:
        resp = self._call(self._images.Get, images_pb2.GetImageRequest(name=name),
                          f"get image {name}")
        img = resp.image
        return ImageRecord(name=img.name, target=_desc_from_pb(img.target),
                           labels=dict(img.labels))

    def put_image(self, name: str, target: Descriptor,
                  labels: Mapping[str, str] | None = None) -> ImageRecord:
        """Create image ``name`` pointing at ``target``, or repoint the existing one."""
        img = images_pb2.Image(name=name, target=_desc_to_pb(target), labels=dict(labels or {}))
        try:
            resp = self._call(self._images.Create, images_pb2.CreateImageRequest(image=img),
                              f"create image {name}")
        except AlreadyExists:
            req = images_pb2.UpdateImageRequest(image=img)
            req.update_mask.paths.append("target")
            req.update_mask.paths.extend(f"labels.{k}" for k in (labels or {}))
            resp = self._call(self._images.Update, req, f"update image {name}")
        return ImageRecord(name=resp.image.name, target=_desc_from_pb(resp.image.target),
                           labels=dict(resp.image.labels))

    def delete_image(self, name: str) -> None:
        self._call(self._images.Delete, images_pb2.DeleteImageRequest(name=name, sync=True),
                   f"delete image {name}")

    # -- snapshots (containerd's own service, any snapshotter) ------------------------------

    def stat_snapshot(self, snapshotter: str, key: str) -> SnapshotInfo:
        """:class:`NotFound` when ``key`` does not exist."""
        resp = self._call(self._snapshots.Stat,
                          snapshots_pb2.StatSnapshotRequest(snapshotter=snapshotter, key=key),
                          f"stat snapshot {key} ({snapshotter})")
        return _info(resp.info)

    def has_snapshot(self, snapshotter: str, key: str) -> bool:
        try:
            self.stat_snapshot(snapshotter, key)
        except NotFound:
            return False
        return True

    def prepare_snapshot(self, snapshotter: str, key: str, parent: str = "",
                         labels: Mapping[str, str] | None = None,
                         timeout: float | None = None) -> list[Mount]:
        """An ACTIVE snapshot; :class:`AlreadyExists` when a remote snapshotter took it over."""
        req = snapshots_pb2.PrepareSnapshotRequest(snapshotter=snapshotter, key=key,
                                                   parent=parent, labels=dict(labels or {}))
        resp = self._call(self._snapshots.Prepare, req,
                          f"prepare snapshot {key} ({snapshotter})", timeout)
        return [Mount.from_pb(m) for m in resp.mounts]

    def view_snapshot(self, snapshotter: str, key: str, parent: str,
                      labels: Mapping[str, str] | None = None) -> list[Mount]:
        req = snapshots_pb2.ViewSnapshotRequest(snapshotter=snapshotter, key=key,
                                                parent=parent, labels=dict(labels or {}))
        resp = self._call(self._snapshots.View, req, f"view snapshot {key} ({snapshotter})")
        return [Mount.from_pb(m) for m in resp.mounts]

    def snapshot_mounts(self, snapshotter: str, key: str) -> list[Mount]:
        resp = self._call(self._snapshots.Mounts,
                          snapshots_pb2.MountsRequest(snapshotter=snapshotter, key=key),
                          f"mounts of snapshot {key} ({snapshotter})")
        return [Mount.from_pb(m) for m in resp.mounts]

    def commit_snapshot(self, snapshotter: str, name: str, key: str,
                        labels: Mapping[str, str] | None = None) -> None:
        req = snapshots_pb2.CommitSnapshotRequest(snapshotter=snapshotter, name=name, key=key,
                                                  labels=dict(labels or {}))
        self._call(self._snapshots.Commit, req, f"commit snapshot {key} as {name}")

    def remove_snapshot(self, snapshotter: str, key: str) -> None:
        self._call(self._snapshots.Remove,
                   snapshots_pb2.RemoveSnapshotRequest(snapshotter=snapshotter, key=key),
                   f"remove snapshot {key} ({snapshotter})")

    def list_snapshots(self, snapshotter: str,
                       filters: Sequence[str] = ()) -> list[SnapshotInfo]:
        req = snapshots_pb2.ListSnapshotsRequest(snapshotter=snapshotter, filters=list(filters))
        what = f"list snapshots ({snapshotter})"
        out: list[SnapshotInfo] = []
        try:
            for resp in self._snapshots.List(req, timeout=self.timeout,
                                             metadata=self._metadata()):
                out.extend(_info(i) for i in resp.info)
        except grpc.RpcError as exc:
            raise map_rpc_error(exc, what) from exc
        return out

    # -- diff ------------------------------------------------------------------------------

    def apply_diff(self, layer: Descriptor, mounts: Sequence[Mount], *,
                   timeout: float | None = None) -> Descriptor:
        """Unpack ``layer`` (already in the content store) onto ``mounts``.

        Returns the applied (uncompressed) descriptor: its digest is the layer's diff ID.
        """
        req = diff_pb2.ApplyRequest(diff=_desc_to_pb(layer), mounts=[m.to_pb() for m in mounts])
        resp = self._call(self._diff.Apply, req, f"apply layer {layer.digest}",
                          timeout or max(self.timeout, 120.0 + layer.size / (5 << 20)))
        return _desc_from_pb(resp.applied)


def _info(i: Any) -> SnapshotInfo:
    kind = snapshots_pb2.Kind.Name(i.kind)
    return SnapshotInfo(name=i.name, parent=i.parent, kind=kind, labels=dict(i.labels))


def _rfc3339_in(seconds: float) -> str:
    import datetime as _dt

    when = _dt.datetime.now(_dt.UTC) + _dt.timedelta(seconds=seconds)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")

