"""The CRI proxy against a fake containerd (a real gRPC server on a unix socket): every call is
forwarded with its status; PullImage's credentials are kept, root-only, before forwarding;
no secret reaches the log."""

from __future__ import annotations

import base64
import logging
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from click.testing import CliRunner

from coldstart._proto.cri.runtime.v1 import api_pb2 as cri
from coldstart._proto.cri.runtime.v1 import api_pb2_grpc as cri_grpc
from coldstart.cri import CriProxy, ImageServiceClient, credentials_from_auth
from coldstart.errors import NotFound, Unavailable
from coldstart.oci.credentials import Credentials
from coldstart.oci.keychain import Keychain

SECRET = "pa55-w0rd-never-logged"


@dataclass
class Upstream(cri_grpc.ImageServiceServicer, cri_grpc.RuntimeServiceServicer):  # type: ignore[misc]
    """containerd as far as the proxy can tell."""

    keychain: Keychain | None = None
    pulls: list[cri.PullImageRequest] = field(default_factory=list)
    seen_keychain: list[Credentials | None] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)

    def PullImage(self, request: cri.PullImageRequest, context: grpc.ServicerContext
                  ) -> cri.PullImageResponse:
        self.pulls.append(request)
        self.metadata.append({k: v for k, v in context.invocation_metadata()
                              if isinstance(v, str)})
        if self.keychain is not None:   # what the FUSE server would find now
            self.seen_keychain.append(self.keychain.get("registry.test", "app"))
        if request.image.image.endswith(":missing"):
            context.abort(grpc.StatusCode.NOT_FOUND, "no such image: " + request.image.image)
        return cri.PullImageResponse(image_ref="sha256:" + "a" * 64)

    def ImageStatus(self, request: cri.ImageStatusRequest, context: grpc.ServicerContext
                    ) -> cri.ImageStatusResponse:
        if request.image.image == "unknown":
            return cri.ImageStatusResponse()
        return cri.ImageStatusResponse(image=cri.Image(id="sha256:" + "b" * 64, size=42,
                                                       repo_tags=[request.image.image]))

    def Version(self, request: cri.VersionRequest, context: grpc.ServicerContext
                ) -> cri.VersionResponse:
        return cri.VersionResponse(version="0.1.0", runtime_name="fake",
                                   runtime_api_version="v1")


class _Echo(grpc.GenericRpcHandler):  # type: ignore[misc]
    """A method of no CRI service (proxies must not care), unary and server-streaming."""

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if details.method == "/test.Echo/Unary":
            return grpc.unary_unary_rpc_method_handler(lambda req, ctx: req[::-1])
        if details.method == "/containerd.services.events.v1.Events/Subscribe":
            return grpc.unary_stream_rpc_method_handler(lambda req, ctx: iter([req, req * 2]))
        if details.method == "/test.Echo/Slow":
            def slow(req: bytes, ctx: grpc.ServicerContext) -> bytes:
                threading.Event().wait(5)
                return req
            return grpc.unary_unary_rpc_method_handler(slow)
        return None


@dataclass
class Rig:
    base: Path
    upstream: Upstream
    proxy: CriProxy
    keychain: Keychain

    def client(self) -> ImageServiceClient:
        return ImageServiceClient(self.proxy.listen, timeout=10)


@pytest.fixture
def rig() -> Iterator[Rig]:
    base = Path(tempfile.mkdtemp(prefix="cs-cri-", dir="/tmp"))
    keychain = Keychain(base / "creds")
    up = Upstream(keychain=keychain)
    server = grpc.server(ThreadPoolExecutor(4), handlers=[_Echo()])
    cri_grpc.add_ImageServiceServicer_to_server(up, server)  # type: ignore[no-untyped-call]
    cri_grpc.add_RuntimeServiceServicer_to_server(up, server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(f"unix://{base / 'containerd.sock'}")
    server.start()
    proxy = CriProxy(base / "cri.sock", base / "containerd.sock", keychain, workers=4)
    try:
        with proxy:
            yield Rig(base, up, proxy, keychain)
    finally:
        server.stop(0).wait()
        shutil.rmtree(base, ignore_errors=True)


def test_pull_with_credentials_keeps_them_root_only_before_forwarding(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with rig.client() as c:
        ref = c.pull_image("registry.test/app:v1", username="ci", password=SECRET)
    assert ref == "sha256:" + "a" * 64
    # forwarded unchanged, with the credentials (containerd needs them for the manifest)
    (req,) = rig.upstream.pulls
    assert req.image.image == "registry.test/app:v1"
    assert (req.auth.username, req.auth.password) == ("ci", SECRET)
    # ... and already in the keychain when containerd got the call
    assert rig.upstream.seen_keychain == [Credentials("ci", SECRET)]
    files = list((rig.base / "creds").glob("*.json"))
    assert len(files) == 1
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert stat.S_IMODE((rig.base / "creds").stat().st_mode) == 0o700
    assert "registry.test/app:v1" in caplog.text and "credentials kept" in caplog.text
    assert SECRET not in caplog.text


def test_rotated_credentials_replace_the_old(rig: Rig) -> None:
    with rig.client() as c:
        c.pull_image("registry.test/app:v1", username="ci", password="old")
        c.pull_image("registry.test/app:v2", username="ci", password="new")
    assert rig.keychain.get("registry.test", "app") == Credentials("ci", "new")


def test_auth_forms(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    token = base64.b64encode(f"robot:{SECRET}".encode()).decode()
    with rig.client() as c:
        c.pull_image("registry.test/app:v1", auth=cri.AuthConfig(auth=token))
        assert rig.keychain.get("registry.test", "app") == Credentials("robot", SECRET)
        c.pull_image("registry.test/app:v1", auth=cri.AuthConfig(identity_token=SECRET))
        assert rig.keychain.get("registry.test", "app") == Credentials("<token>", SECRET)
        c.pull_image("registry.test/other:v1", auth=cri.AuthConfig(registry_token=SECRET))
        c.pull_image("registry.test/other:v2", auth=cri.AuthConfig(registry_token=SECRET))
        c.pull_image("registry.test/anon:v1")
    assert rig.keychain.get("registry.test", "other") == Credentials("<token>", SECRET)  # newest
    assert caplog.text.count("registry_token") == 1      # warned once
    assert SECRET not in caplog.text and token not in caplog.text
    assert len(rig.upstream.pulls) == 5


def test_credentials_from_auth() -> None:
    assert credentials_from_auth(cri.AuthConfig()) is None
    assert credentials_from_auth(cri.AuthConfig(auth="!!not base64")) is None
    assert credentials_from_auth(cri.AuthConfig(username="u", password="p")) == \
        Credentials("u", "p")


def test_errors_come_back_with_their_code_and_details(rig: Rig) -> None:
    with rig.client() as c, pytest.raises(NotFound, match=r"no such image: registry\.test/app"):
        c.pull_image("registry.test/app:missing")
    ch = grpc.insecure_channel(f"unix://{rig.proxy.listen}")
    with pytest.raises(grpc.RpcError) as info:
        ch.unary_unary("/runtime.v1.ImageService/NoSuchMethod")(b"", timeout=10)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    ch.close()


def test_every_method_is_forwarded(rig: Rig) -> None:
    with rig.client() as c:
        assert c.version().runtime_name == "fake"
        status = c.image_status("registry.test/app:v1")
        assert status is not None and status.size == 42
        assert c.image_status("unknown") is None
    ch = grpc.insecure_channel(f"unix://{rig.proxy.listen}")
    assert ch.unary_unary("/test.Echo/Unary")(b"abc", timeout=10) == b"cba"
    stream = ch.unary_stream("/containerd.services.events.v1.Events/Subscribe")(b"x",
                                                                                  timeout=10)
    assert list(stream) == [b"x", b"xx"]
    ch.close()


def test_metadata_and_deadline_are_passed_on(rig: Rig) -> None:
    ch = grpc.insecure_channel(f"unix://{rig.proxy.listen}")
    stub: Any = cri_grpc.ImageServiceStub(ch)  # type: ignore[no-untyped-call]
    stub.PullImage(cri.PullImageRequest(image=cri.ImageSpec(image="registry.test/app:v1")),
                   metadata=[("containerd-namespace", "k8s.io")], timeout=10)
    assert rig.upstream.metadata[-1].get("containerd-namespace") == "k8s.io"
    with pytest.raises(grpc.RpcError) as info:
        ch.unary_unary("/test.Echo/Slow")(b"x", timeout=0.5)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    ch.close()


def test_upstream_down_is_unavailable(tmp_path: Path) -> None:
    base = Path(tempfile.mkdtemp(prefix="cs-cri-", dir="/tmp"))
    try:
        with CriProxy(base / "cri.sock", base / "none.sock", Keychain(base / "k")), \
                ImageServiceClient(base / "cri.sock", timeout=5) as c, \
                pytest.raises(Unavailable):
            c.version()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_command_help_names_kubelets_flag() -> None:
    from coldstart.cli import cli

    r = CliRunner().invoke(cli, ["cri-proxy", "--help"])
    assert r.exit_code == 0, r.output
    for text in ("--image-service-endpoint", "COLDSTART_CRI_LISTEN", "/run/coldstart/cri.sock",
                 "/run/containerd/containerd.sock", "/var/lib/coldstart/cri-credentials"):
        assert text in r.output
