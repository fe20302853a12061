"""The runtime half of the CRI subset: field numbers are the real API's (k8s.io/cri-api
runtime/v1), and the client's pod config asks for the node's network (no CNI)."""

from __future__ import annotations

import pytest

from coldstart._proto.cri.runtime.v1 import api_pb2 as cri
from coldstart.cri import RuntimeServiceClient

# (message, field, number) as in k8s.io/cri-api pkg/apis/runtime/v1/api.proto
REAL = [
    ("PodSandboxConfig", "dns_config", 4), ("PodSandboxConfig", "linux", 8),
    ("LinuxPodSandboxConfig", "security_context", 2), ("LinuxPodSandboxConfig", "sysctls", 3),
    ("LinuxSandboxSecurityContext", "namespace_options", 1),
    ("LinuxSandboxSecurityContext", "privileged", 6),
    ("NamespaceOption", "network", 1), ("NamespaceOption", "pid", 2),
    ("NamespaceOption", "ipc", 3), ("NamespaceOption", "target_id", 4),
    ("RunPodSandboxRequest", "runtime_handler", 2),
    ("ContainerConfig", "envs", 6), ("ContainerConfig", "labels", 9),
    ("ContainerConfig", "log_path", 11), ("ContainerConfig", "tty", 14),
    ("ContainerConfig", "linux", 15), ("LinuxContainerConfig", "security_context", 2),
    ("LinuxContainerSecurityContext", "namespace_options", 3),
    ("CreateContainerRequest", "sandbox_config", 3),
    ("ContainerStatus", "state", 3), ("ContainerStatus", "finished_at", 6),
    ("ContainerStatus", "exit_code", 7), ("ContainerStatus", "image_ref", 9),
    ("ContainerStatus", "reason", 10), ("ContainerStatus", "log_path", 15),
    ("StopContainerRequest", "timeout", 2),
]


@pytest.mark.parametrize(("message", "field", "number"), REAL)
def test_field_numbers_are_the_real_apis(message: str, field: str, number: int) -> None:
    assert cri.DESCRIPTOR.message_types_by_name[message].fields_by_name[field].number == number


def test_enums_are_the_real_apis() -> None:
    assert (cri.POD, cri.CONTAINER, cri.NODE, cri.TARGET) == (0, 1, 2, 3)
    assert (cri.CONTAINER_CREATED, cri.CONTAINER_RUNNING, cri.CONTAINER_EXITED,
            cri.CONTAINER_UNKNOWN) == (0, 1, 2, 3)


def test_pod_config_uses_the_node_network() -> None:
    pod = RuntimeServiceClient.pod_config("web", uid="u1", log_directory="/var/log/pods/x")
    ns = pod.linux.security_context.namespace_options
    assert ns.network == cri.NODE and ns.pid == cri.CONTAINER
    assert (pod.metadata.name, pod.metadata.namespace, pod.metadata.uid) == ("web", "default",
                                                                              "u1")
    again = cri.PodSandboxConfig.FromString(pod.SerializeToString())
    assert again == pod
    pod_net = RuntimeServiceClient.pod_config("web", host_network=False)
    assert pod_net.linux.security_context.namespace_options.network == cri.POD
