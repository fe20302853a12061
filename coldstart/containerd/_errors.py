"""The one place where gRPC status codes become :mod:`coldstart.errors`: containerd's, and the
CRI's (containerd's CRI plugin, through ``coldstart cri-proxy``)."""

from __future__ import annotations

import grpc

from coldstart.errors import (
    AlreadyExists,
    ColdstartError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)

__all__ = ["map_rpc_error"]

_BY_CODE: dict[grpc.StatusCode, type[ColdstartError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Unavailable,
    grpc.StatusCode.UNIMPLEMENTED: FailedPrecondition,
    grpc.StatusCode.CANCELLED: Unavailable,
}


def map_rpc_error(exc: grpc.RpcError, what: str, peer: str = "containerd") -> ColdstartError:
    """The most specific :class:`ColdstartError` for a failed call to ``peer``.

    >>> err = map_rpc_error(some_rpc_error, "stat snapshot sha256:…")   # doctest: +SKIP
    >>> raise err from some_rpc_error                                    # doctest: +SKIP
    """
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    kind = _BY_CODE.get(code, ColdstartError) if code is not None else Unavailable
    name = code.name if code is not None else "error"
    return kind(f"{peer}: {what}: {details or name} ({name})")
