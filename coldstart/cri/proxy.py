"""A CRI proxy: kubelet's ``--image-service-endpoint`` (and, if wanted, its
``--container-runtime-endpoint``) points at it; it forwards every call to containerd.

Why a proxy: kubelet sends a pull's registry credentials (from an ``imagePullSecret`` or a
credential provider) only inside CRI ``PullImage``, to containerd, which uses them for the
manifest and config and forgets them. The layers are then fetched lazily, later and by another
process: coldstart's FUSE server. So the proxy parses each ``PullImage``, keeps its credentials
in the node's CRI keychain (:class:`~coldstart.oci.keychain.Keychain`, root-only files, keyed by
repository) *before* forwarding it, and the FUSE server reads them there when containerd's
snapshotter prepares the layers (and on every later authentication, so a rotated password that
kubelet sends with a new pull reaches the layers already mounted). This is stargz-snapshotter's
"CRI keychain" design.

Every other call (any method of any service, unary or streaming) is forwarded as raw bytes, with
its metadata and deadline; the upstream's status code and details come back unchanged.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc

from coldstart._proto.cri.runtime.v1 import api_pb2 as cri
from coldstart.errors import ColdstartError, FailedPrecondition
from coldstart.oci.credentials import Credentials
from coldstart.oci.keychain import Keychain

__all__ = ["PULL_IMAGE", "CriProxy", "credentials_from_auth"]

log = logging.getLogger(__name__)

PULL_IMAGE = "/runtime.v1.ImageService/PullImage"
# a pull of a big image can take long; kubelet sets its own deadline (2 min by default), which
# is passed on. Without one, calls are bounded anyway.
DEFAULT_TIMEOUT = 3600.0
# metadata gRPC sets by itself: forwarding them would duplicate or contradict the new call's
_HOP_BY_HOP = frozenset({"grpc-timeout", "grpc-encoding", "grpc-accept-encoding",
                         "content-type", "te", "user-agent", ":authority"})

_MAX_MESSAGE = 64 * 1024 * 1024   # ListImages/ListContainers on a busy node can be large
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", _MAX_MESSAGE),
                    ("grpc.max_send_message_length", _MAX_MESSAGE)]


def credentials_from_auth(auth: cri.AuthConfig) -> Credentials | None:
    """The credentials a CRI ``AuthConfig`` carries, or None (anonymous, or a bearer
    ``registry_token`` that coldstart's registry client cannot use).

    >>> credentials_from_auth(cri.AuthConfig(username="u", password="p"))
    Credentials(username='u', secret=***)
    """
    if auth.username and auth.password:
        return Credentials(auth.username, auth.password)
    if auth.auth:
        try:
            user, sep, password = base64.b64decode(auth.auth, validate=False).decode().partition(
                ":")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            user, sep, password = "", "", ""
        if sep and user:
            return Credentials(user, password)
    if auth.identity_token:
        return Credentials("<token>", auth.identity_token)
    return None


def _metadata(context: grpc.ServicerContext) -> list[tuple[str, str | bytes]]:
    return [(k, v) for k, v in context.invocation_metadata()
            if k not in _HOP_BY_HOP and not k.startswith("grpc-")]


def _timeout(context: grpc.ServicerContext) -> float:
    left = context.time_remaining()
    return DEFAULT_TIMEOUT if left is None or left > DEFAULT_TIMEOUT else max(left, 0.001)


def _abort_with(context: grpc.ServicerContext, exc: grpc.RpcError) -> None:
    """Pass the upstream's status (code, details, trailing metadata) back to the caller."""
    call: Any = exc
    code = call.code() if hasattr(call, "code") else grpc.StatusCode.UNKNOWN
    details = call.details() if hasattr(call, "details") else str(exc)
    trailing = call.trailing_metadata() if hasattr(call, "trailing_metadata") else None
    if trailing:
        context.set_trailing_metadata(
            [(k, v) for k, v in trailing if not k.startswith("grpc-")])
    context.abort(code, details or "")


def _relay(responses: Any, context: grpc.ServicerContext) -> Iterator[bytes]:
    """Yield an upstream call's streamed responses; the caller going away cancels the call,
    and the upstream's error status is passed back."""
    context.add_callback(responses.cancel)
    try:
        yield from responses
    except grpc.RpcError as exc:
        _abort_with(context, exc)


class _Forwarder(grpc.GenericRpcHandler):  # type: ignore[misc]
    """Handles every method: bytes in, bytes out, through one channel to the upstream."""

    def __init__(self, channel: grpc.Channel, on_pull: Callable[[bytes], None]) -> None:
        self._channel = channel
        self._on_pull = on_pull

    def service(self, handler_call_details: grpc.HandlerCallDetails
                ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        ch = self._channel

        def unary_unary(request: bytes, context: grpc.ServicerContext) -> bytes:
            if method == PULL_IMAGE:
                self._on_pull(request)
            try:
                response, call = ch.unary_unary(method).with_call(
                    request, metadata=_metadata(context), timeout=_timeout(context))
            except grpc.RpcError as exc:
                _abort_with(context, exc)
                raise   # abort raised already; keeps type checkers content
            _pass_metadata(context, call)
            out: bytes = response
            return out

        def unary_stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            yield from _relay(ch.unary_stream(method)(request, metadata=_metadata(context),
                                                      timeout=_timeout(context)), context)

        def stream_unary(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
            try:
                response, call = ch.stream_unary(method).with_call(
                    requests, metadata=_metadata(context), timeout=_timeout(context))
            except grpc.RpcError as exc:
                _abort_with(context, exc)
                raise
            _pass_metadata(context, call)
            out: bytes = response
            return out

        def stream_stream(requests: Iterator[bytes], context: grpc.ServicerContext
                          ) -> Iterator[bytes]:
            yield from _relay(ch.stream_stream(method)(requests, metadata=_metadata(context),
                                                       timeout=_timeout(context)), context)

        # Nothing in the wire format says whether a method streams; CRI's only streaming call
        # is RuntimeService's GetContainerEvents (server-streaming). Everything else is unary.
        if method.endswith("/GetContainerEvents") or method in _SERVER_STREAMING:
            return grpc.unary_stream_rpc_method_handler(unary_stream)
        if method in _CLIENT_STREAMING:
            return grpc.stream_unary_rpc_method_handler(stream_unary)
        if method in _BIDI_STREAMING:
            return grpc.stream_stream_rpc_method_handler(stream_stream)
        return grpc.unary_unary_rpc_method_handler(unary_unary)


def _pass_metadata(context: grpc.ServicerContext, call: Any) -> None:
    initial = call.initial_metadata()
    if initial:
        context.send_initial_metadata([(k, v) for k, v in initial if not k.startswith("grpc-")
                                       and k not in _HOP_BY_HOP])
    trailing = call.trailing_metadata()
    if trailing:
        context.set_trailing_metadata([(k, v) for k, v in trailing
                                       if not k.startswith("grpc-")])


# containerd's own services stream in a few places; the proxy stays correct for them too when
# kubelet's runtime endpoint (or ctr) is pointed at it.
_SERVER_STREAMING = frozenset({
    "/containerd.services.events.v1.Events/Subscribe",
    "/containerd.services.content.v1.Content/Read",
})
_CLIENT_STREAMING: frozenset[str] = frozenset()
_BIDI_STREAMING = frozenset({"/containerd.services.content.v1.Content/Write"})


class CriProxy:
    """A gRPC server on ``listen`` (a unix socket) forwarding everything to ``upstream``.

    ``PullImage`` credentials are kept in ``keychain`` first. Use as a context manager, or call
    :meth:`start` and :meth:`stop`.

    >>> with CriProxy("/run/coldstart/cri.sock", "/run/containerd/containerd.sock",
    ...               Keychain(Path("/var/lib/coldstart/cri-credentials"))) as proxy:
    ...     proxy.wait()                                              # doctest: +SKIP
    """

    def __init__(self, listen: str | os.PathLike[str], upstream: str | os.PathLike[str],
                 keychain: Keychain, *, workers: int = 32) -> None:
        self.listen = str(listen)
        self.upstream = str(upstream)
        self.keychain = keychain
        self._workers = workers
        self._server: grpc.Server | None = None
        self._channel: grpc.Channel | None = None
        self._warned_bearer = False
        self._lock = threading.Lock()
        self.pulls = 0

    # -- PullImage ---------------------------------------------------------------------------
    def _on_pull(self, request: bytes) -> None:
        """Keep the pull's credentials before containerd (and so the FUSE server) needs them.

        A request that does not parse is forwarded untouched (containerd answers it)."""
        req = cri.PullImageRequest()
        try:
            req.ParseFromString(request)
        except Exception:  # protobuf's DecodeError; containerd will say more
            log.warning("PullImage: a request that does not parse; forwarded as it is")
            return
        image = req.image.image
        creds = credentials_from_auth(req.auth) if req.HasField("auth") else None
        kept = "no credentials"
        if creds is not None and image:
            try:
                self.keychain.put(image, creds)
                kept = ("identity token kept" if creds.is_identity_token
                        else "credentials kept")
            except ColdstartError as exc:
                # the pull itself may still work (containerd has the credentials); the lazy
                # layers will not authenticate, which the FUSE server reports
                kept = f"credentials NOT kept: {exc}"
                log.warning("PullImage %s: %s", image, kept)
            except ValueError as exc:   # an image name Reference cannot parse
                kept = f"credentials NOT kept (image name: {exc})"
        elif req.HasField("auth") and req.auth.registry_token:
            kept = "registry token not supported"
            with self._lock:
                if not self._warned_bearer:
                    self._warned_bearer = True
                    log.warning("PullImage with a registry_token (bearer token): coldstart's "
                                "lazy layers cannot use it; they fail to authenticate unless "
                                "the node's docker config has credentials for the registry")
        with self._lock:
            self.pulls += 1
        log.info("PullImage %s (%s)", image, kept)

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> CriProxy:
        if self._server is not None:
            raise FailedPrecondition("the CRI proxy is already started")
        path = Path(self.listen)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_socket():
            path.unlink()   # a socket left by a previous run; kubelet reconnects by itself
        self._channel = grpc.insecure_channel(f"unix://{self.upstream}",
                                              options=_CHANNEL_OPTIONS)
        server = grpc.server(ThreadPoolExecutor(self._workers, thread_name_prefix="cri-proxy"),
                             handlers=[_Forwarder(self._channel, self._on_pull)],
                             options=_CHANNEL_OPTIONS)
        if server.add_insecure_port(f"unix://{self.listen}") == 0:
            self._channel.close()
            raise FailedPrecondition(f"cannot listen on {self.listen}")
        server.start()
        try:
            os.chmod(self.listen, 0o660)   # kubelet runs as root; nobody else talks CRI
        except OSError:
            pass
        self._server = server
        log.info("CRI proxy on %s, forwarding to %s; credentials kept in %s", self.listen,
                 self.upstream, self.keychain.directory)
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops (or ``timeout``); True if it stopped."""
        if self._server is None:
            return True
        return bool(self._server.wait_for_termination(timeout))

    def stop(self, grace: float = 5.0) -> None:
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        Path(self.listen).unlink(missing_ok=True)

    def __enter__(self) -> CriProxy:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


