"""Start the snapshots gRPC service on a unix socket (what containerd's proxy plugin dials).

Example::

    server = start_server(service, "/run/coldstart/snapshotter.sock", workers=8)
    ...
    server.stop(grace=10).wait()
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import grpc

from coldstart.errors import FailedPrecondition, InvalidArgument
from coldstart.snapshotter.service import SnapshotService, add_service
from coldstart.unixsock import socket_answers

__all__ = ["socket_answers", "start_server"]


def start_server(service: SnapshotService, path: str, *, workers: int = 8) -> grpc.Server:
    """Bind ``path`` (a stale socket file left by a killed process is replaced) and serve."""
    if len(path.encode()) > 107:
        raise InvalidArgument(f"socket path is too long for a unix socket: {path}")
    # a directory we create: others may pass through (the socket itself is root-only), as
    # containerd's /run/containerd
    os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o711, exist_ok=True)
    if os.path.exists(path):
        if socket_answers(path):
            raise FailedPrecondition(f"another process already serves {path}")
        os.unlink(path)
    server = grpc.server(ThreadPoolExecutor(max_workers=workers,
                                            thread_name_prefix="snapshots-rpc"))
    add_service(server, service)
    if server.add_insecure_port(f"unix:{path}") == 0:
        raise FailedPrecondition(f"cannot listen on unix:{path}")
    server.start()
    os.chmod(path, 0o600)      # containerd (root) only: it is the node's snapshots
    return server
