"""A small CRI image-service client, calling as kubelet does (tests, ``node status``).

>>> c = ImageServiceClient("/run/coldstart/cri.sock")                 # doctest: +SKIP
>>> c.pull_image("registry.example/app:v1", username="ci", password="s3cret")  # doctest: +SKIP
'sha256:…'
"""

from __future__ import annotations

import os
from types import TracebackType

import grpc

from coldstart._proto.cri.runtime.v1 import api_pb2 as cri
from coldstart._proto.cri.runtime.v1 import api_pb2_grpc as cri_grpc
from coldstart.errors import (
    ColdstartError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)

__all__ = ["ImageServiceClient"]

_MAP: dict[grpc.StatusCode, type[ColdstartError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


def _mapped(exc: grpc.RpcError, what: str) -> ColdstartError:
    code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    return _MAP.get(code, ColdstartError)(f"{what}: {code.name}: {details}")


class ImageServiceClient:
    """CRI ``runtime.v1`` image (and version) calls on a unix socket."""

    def __init__(self, socket: str | os.PathLike[str], *, timeout: float = 120.0) -> None:
        self.socket = str(socket)
        self.timeout = timeout
        self._channel = grpc.insecure_channel(f"unix://{self.socket}")
        self._images = cri_grpc.ImageServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self._runtime = cri_grpc.RuntimeServiceStub(self._channel)  # type: ignore[no-untyped-call]

    def version(self, *, timeout: float | None = None) -> cri.VersionResponse:
        try:
            resp: cri.VersionResponse = self._runtime.Version(
                cri.VersionRequest(version="v1"), timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise _mapped(exc, "Version") from exc
        return resp

    def pull_image(self, image: str, *, username: str | None = None,
                   password: str | None = None, auth: cri.AuthConfig | None = None,
                   timeout: float | None = None) -> str:
        """Pull ``image`` (with these credentials, as kubelet passes an imagePullSecret's);
        returns the image reference containerd gives (its config digest)."""
        if auth is None and (username or password):
            auth = cri.AuthConfig(username=username or "", password=password or "")
        req = cri.PullImageRequest(image=cri.ImageSpec(image=image), auth=auth)
        try:
            resp: cri.PullImageResponse = self._images.PullImage(
                req, timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise _mapped(exc, f"PullImage {image}") from exc
        return str(resp.image_ref)

    def image_status(self, image: str, *, timeout: float | None = None) -> cri.Image | None:
        """The image as the runtime knows it, or None when it does not have it."""
        try:
            resp: cri.ImageStatusResponse = self._images.ImageStatus(
                cri.ImageStatusRequest(image=cri.ImageSpec(image=image)),
                timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise _mapped(exc, f"ImageStatus {image}") from exc
        return resp.image if resp.HasField("image") else None

    def list_images(self, *, timeout: float | None = None) -> list[cri.Image]:
        try:
            resp: cri.ListImagesResponse = self._images.ListImages(
                cri.ListImagesRequest(), timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise _mapped(exc, "ListImages") from exc
        return list(resp.images)

    def remove_image(self, image: str, *, timeout: float | None = None) -> None:
        try:
            self._images.RemoveImage(cri.RemoveImageRequest(image=cri.ImageSpec(image=image)),
                                     timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise _mapped(exc, f"RemoveImage {image}") from exc

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ImageServiceClient:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
