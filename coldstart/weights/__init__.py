"""coldstart.weights: stream safetensors checkpoints into CPU or GPU memory at source speed.

>>> from coldstart.weights import load
>>> tensors = load("s3://models/llama/3/", device="cuda")  # doctest: +SKIP

``safetensors``' own API, for a server that switches with one import: :func:`load_file`,
:class:`safe_open`. Also: header parsing and validation (:func:`parse_header`), byte sources
behind one protocol (:class:`Source`), and a versioned model repository with hot swap
(:mod:`.repository`, :mod:`.hotswap`).
"""

from typing import TYPE_CHECKING

from coldstart.weights.checkpoint import INDEX_NAME, Checkpoint, Opener, read_header
from coldstart.weights.compat import load_file, safe_open
from coldstart.weights.header import Header, TensorInfo, parse_header
from coldstart.weights.hotswap import ModelWatcher, Served
from coldstart.weights.loader import LoadStats, Slice, iter_load, load, tensor_parallel
from coldstart.weights.repository import ModelRepository, VersionInfo
from coldstart.weights.sources import LocalSource, RegistrySource, Source, open_source
from coldstart.weights.stores import LocalStore, S3Store, Store, open_store

if TYPE_CHECKING:  # at run time: module __getattr__ below (httpx, boto3 only when used)
    from coldstart.remote.http import HttpSource
    from coldstart.remote.s3 import S3Source

__all__ = [
    "INDEX_NAME",
    "Checkpoint",
    "Header",
    "HttpSource",
    "LoadStats",
    "LocalSource",
    "LocalStore",
    "ModelRepository",
    "ModelWatcher",
    "Opener",
    "RegistrySource",
    "S3Source",
    "S3Store",
    "Served",
    "Slice",
    "Source",
    "Store",
    "TensorInfo",
    "VersionInfo",
    "iter_load",
    "load",
    "load_file",
    "open_source",
    "open_store",
    "parse_header",
    "read_header",
    "safe_open",
    "tensor_parallel",
]


def __getattr__(name: str) -> object:
    # HttpSource, S3Source: imported on first use (see coldstart.weights.sources)
    if name in ("HttpSource", "S3Source"):
        from coldstart.weights import sources
        return getattr(sources, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
