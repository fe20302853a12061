"""A small typed client over containerd's gRPC API, and the ``coldstart pull`` logic on top.

>>> from coldstart.containerd import Containerd, pull_image          # doctest: +SKIP
>>> from coldstart.oci.registry import RegistryClient                # doctest: +SKIP
>>> with Containerd("/run/containerd/containerd.sock", "default") as ctd, \\
...         RegistryClient() as registry:                             # doctest: +SKIP
...     result = pull_image(ctd, registry, "127.0.0.1:5000/app:v1-zstd")
...     print(result.lazy_layers, result.downloaded_bytes)
"""

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
from coldstart.containerd.pull import LayerResult, PullResult, chain_ids, pull_image

__all__ = [
    "DEFAULT_ADDRESS",
    "DEFAULT_NAMESPACE",
    "Containerd",
    "ContentInfo",
    "ImageRecord",
    "LayerResult",
    "Mount",
    "PullResult",
    "SnapshotInfo",
    "chain_ids",
    "map_rpc_error",
    "pull_image",
]
