"""A small CRI client, calling as kubelet does (tests, ``node status``): the image service,
and the runtime calls that run a pod's container.

>>> c = ImageServiceClient("/run/coldstart/cri.sock")                 # doctest: +SKIP
>>> c.pull_image("registry.example/app:v1", username="ci", password="s3cret")  # doctest: +SKIP
'sha256:…'
>>> rt = RuntimeServiceClient("/run/containerd/containerd.sock")      # doctest: +SKIP
>>> pod = rt.pod_config("web", log_directory="/var/log/pods/web")    # doctest: +SKIP
>>> sid = rt.run_pod_sandbox(pod)                                    # doctest: +SKIP
>>> cid = rt.create_container(sid, pod, "app", "registry.example/app:v1",
...                           command=["/bin/sh", "-c", "echo hi"])  # doctest: +SKIP
>>> rt.start_container(cid)                                          # doctest: +SKIP
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping, Sequence
from types import TracebackType

import grpc

from coldstart._proto.cri.runtime.v1 import api_pb2 as cri
from coldstart._proto.cri.runtime.v1 import api_pb2_grpc as cri_grpc
from coldstart.containerd._errors import map_rpc_error
from coldstart.errors import ColdstartError, DeadlineExceeded

__all__ = ["ImageServiceClient", "RuntimeServiceClient"]


def _mapped(exc: grpc.RpcError, what: str) -> ColdstartError:
    return map_rpc_error(exc, what, peer="CRI")


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


class RuntimeServiceClient(ImageServiceClient):
    """The image calls and the runtime calls kubelet makes to run a pod: ``RunPodSandbox``,
    ``CreateContainer``, ``StartContainer``, ``ContainerStatus``, and the stop/remove calls."""

    @staticmethod
    def pod_config(name: str, *, namespace: str = "default", uid: str | None = None,
                   attempt: int = 0, log_directory: str = "", host_network: bool = True,
                   hostname: str = "", labels: Mapping[str, str] | None = None,
                   annotations: Mapping[str, str] | None = None) -> cri.PodSandboxConfig:
        """A pod sandbox's config as kubelet builds it; ``host_network`` puts the pod in the
        node's network namespace (mode NODE), so the runtime sets up no CNI network."""
        ns = cri.NamespaceOption(network=cri.NODE if host_network else cri.POD,
                                 pid=cri.CONTAINER, ipc=cri.POD)
        return cri.PodSandboxConfig(
            metadata=cri.PodSandboxMetadata(name=name, namespace=namespace,
                                            uid=uid or str(uuid.uuid4()), attempt=attempt),
            hostname=hostname, log_directory=log_directory,
            labels=dict(labels or {}), annotations=dict(annotations or {}),
            linux=cri.LinuxPodSandboxConfig(
                security_context=cri.LinuxSandboxSecurityContext(namespace_options=ns)))

    def run_pod_sandbox(self, config: cri.PodSandboxConfig, *, runtime_handler: str = "",
                        timeout: float | None = None) -> str:
        """Create and start the pod's sandbox; returns its id."""
        try:
            resp: cri.RunPodSandboxResponse = self._runtime.RunPodSandbox(
                cri.RunPodSandboxRequest(config=config, runtime_handler=runtime_handler),
                timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise _mapped(exc, f"RunPodSandbox {config.metadata.name}") from exc
        return str(resp.pod_sandbox_id)

    def stop_pod_sandbox(self, sandbox_id: str, *, timeout: float | None = None) -> None:
        try:
            self._runtime.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sandbox_id),
                                         timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise _mapped(exc, f"StopPodSandbox {sandbox_id}") from exc

    def remove_pod_sandbox(self, sandbox_id: str, *, timeout: float | None = None) -> None:
        try:
            self._runtime.RemovePodSandbox(
                cri.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id),
                timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise _mapped(exc, f"RemovePodSandbox {sandbox_id}") from exc

    def create_container(self, sandbox_id: str, sandbox_config: cri.PodSandboxConfig,
                         name: str, image: str, *, command: Sequence[str] = (),
                         args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                         working_dir: str = "", log_path: str = "", attempt: int = 0,
                         timeout: float | None = None) -> str:
        """Create container ``name`` from ``image`` (a reference or an image id) in the
        sandbox; ``log_path`` is relative to the sandbox's log directory. Returns its id."""
        config = cri.ContainerConfig(
            metadata=cri.ContainerMetadata(name=name, attempt=attempt),
            image=cri.ImageSpec(image=image), command=list(command), args=list(args),
            working_dir=working_dir, log_path=log_path,
            envs=[cri.KeyValue(key=k, value=v) for k, v in (env or {}).items()])
        try:
            resp: cri.CreateContainerResponse = self._runtime.CreateContainer(
                cri.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=config,
                                           sandbox_config=sandbox_config),
                timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise _mapped(exc, f"CreateContainer {name}") from exc
        return str(resp.container_id)

    def start_container(self, container_id: str, *, timeout: float | None = None) -> None:
        try:
            self._runtime.StartContainer(cri.StartContainerRequest(container_id=container_id),
                                         timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise _mapped(exc, f"StartContainer {container_id}") from exc

    def stop_container(self, container_id: str, *, grace_s: int = 0,
                       timeout: float | None = None) -> None:
        try:
            self._runtime.StopContainer(
                cri.StopContainerRequest(container_id=container_id, timeout=grace_s),
                timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise _mapped(exc, f"StopContainer {container_id}") from exc

    def remove_container(self, container_id: str, *, timeout: float | None = None) -> None:
        try:
            self._runtime.RemoveContainer(cri.RemoveContainerRequest(container_id=container_id),
                                          timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise _mapped(exc, f"RemoveContainer {container_id}") from exc

    def container_status(self, container_id: str, *,
                         timeout: float | None = None) -> cri.ContainerStatus:
        try:
            resp: cri.ContainerStatusResponse = self._runtime.ContainerStatus(
                cri.ContainerStatusRequest(container_id=container_id),
                timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise _mapped(exc, f"ContainerStatus {container_id}") from exc
        return resp.status

    def wait_exited(self, container_id: str, *, timeout: float = 60.0,
                    interval: float = 0.2) -> cri.ContainerStatus:
        """Poll ``ContainerStatus`` until the container has exited (as kubelet's PLEG would)."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.container_status(container_id)
            if status.state == cri.CONTAINER_EXITED:
                return status
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"container {container_id} still "
                                       f"{cri.ContainerState.Name(status.state)} after "
                                       f"{timeout:g}s")
            time.sleep(interval)

    def __enter__(self) -> RuntimeServiceClient:
        return self
