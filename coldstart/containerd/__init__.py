"""A small typed client over containerd's gRPC API, and the ``coldstart pull`` logic on top."""

from coldstart.containerd._errors import map_rpc_error
from coldstart.containerd.client import (
    DEFAULT_ADDRESS,
    DEFAULT_NAMESPACE,
    Containerd,
    ContentInfo,
    ImageRecord,
    Mount,
    SnapshotInfo,
)

__all__ = [
    "DEFAULT_ADDRESS",
    "DEFAULT_NAMESPACE",
    "Containerd",
    "ContentInfo",
    "ImageRecord",
    "Mount",
    "SnapshotInfo",
    "map_rpc_error",
]
