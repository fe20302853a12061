"""Where safetensors bytes come from: the sources of :mod:`coldstart.remote`, by location.

Every source meets :class:`coldstart.remote.Source` (``size``, ``read_at``/``read_into`` with a
per-call deadline, ``close``); this module only adds what the weights need on top:
``registry://``
locations (a registry blob checked against its digest before any tensor is handed out:
:class:`RegistrySource`), and :func:`open_source` for every scheme. Sources, retries and the
mapping of third-party errors all live in :mod:`coldstart.remote`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from coldstart.config import SourceConfig, WeightsConfig
from coldstart.errors import InvalidArgument
from coldstart.oci.reference import Reference
from coldstart.remote.local import LocalFileBlob
from coldstart.remote.locations import open_source as _open_location
from coldstart.remote.locations import scheme_of
from coldstart.remote.registry_verify import VerifiedRegistryBlob
from coldstart.remote.source import Source

if TYPE_CHECKING:  # at run time: module __getattr__ below (httpx, boto3 only when used)
    from coldstart.remote.http import HttpSource
    from coldstart.remote.s3 import S3Source

__all__ = [
    "REGISTRY_SCHEME",
    "HttpSource",
    "LocalSource",
    "RegistrySource",
    "S3Source",
    "Source",
    "check_not_layout",
    "name_of",
    "open_source",
]

_SOURCE = SourceConfig()
_WEIGHTS = WeightsConfig()

LocalSource = LocalFileBlob
"""A local file (``preadv`` into the tensors, ``O_DIRECT``, ``mmap`` + populate): the one
local-file source of :mod:`coldstart.remote`."""


REGISTRY_SCHEME = "registry://"


def check_not_layout(location: str) -> None:
    """Refuse ``oci:…`` (an OCI image layout, not a file) with what to write instead."""
    if location.startswith("oci:"):
        raise InvalidArgument(
            f"{location}: oci: names an OCI image layout; weights are read from a file, a "
            "folder, s3://, http(s):// or a registry blob: registry://REGISTRY/REPO@sha256:… "
            "(oci://… was its old spelling)")


def name_of(source: Source) -> str:
    """What error messages call ``source`` (its location, where it has one)."""
    return str(getattr(source, "name", type(source).__name__))


class RegistrySource(VerifiedRegistryBlob):
    """A blob in an OCI registry, ``registry://registry/repo@sha256:...``, read with range GETs and
    verified against its digest (:meth:`verify`; the loader calls it before handing out tensors).

    Goes through :class:`coldstart.oci.registry.RegistryClient` (auth, mirrors, deadlines), made
    with ``timeout`` unless ``client`` is given; ``timeout`` bounds each request (with its
    retries). :meth:`close` closes the client.

    >>> url = "registry://127.0.0.1:5000/models/llama@sha256:" + "0" * 64
    >>> src = RegistrySource(url)  # doctest: +SKIP
    """

    def __init__(self, url: str, *, client: Any = None, timeout: float = _SOURCE.timeout,
                 hold_bytes: int = _WEIGHTS.verify_hold_bytes,
                 registry: Mapping[str, Any] | None = None) -> None:
        if not url.startswith(REGISTRY_SCHEME):
            raise InvalidArgument(f"{url}: not a registry://REGISTRY/REPO@sha256:... URL")
        ref = Reference.parse(url[len(REGISTRY_SCHEME):])
        if not ref.digest:
            raise InvalidArgument(f"{url}: a registry source needs a blob digest (@sha256:...)")
        algo = ref.digest.split(":", 1)[0]
        if algo not in hashlib.algorithms_available:
            raise InvalidArgument(f"{url}: digest algorithm {algo!r} is not supported")
        if client is None:
            from coldstart.oci.registry import RegistryClient

            client = RegistryClient(timeout=timeout, **dict(registry or {}))
        super().__init__(client, ref, ref.digest, timeout=timeout, hold_bytes=hold_bytes,
                         name=url)

    @property
    def _client(self) -> Any:
        return self.client

    def close(self) -> None:
        close = getattr(self.client, "close", None)
        if callable(close):
            close()


def open_source(location: str | os.PathLike[str], *, concurrency: int = _SOURCE.concurrency,
                timeout: float = _SOURCE.timeout, direct: bool = False,
                http_client: Any = None, s3_client: Any = None,
                registry: Mapping[str, Any] | None = None) -> Source:
    """Open one file by location: a local path, ``s3://``, ``http(s)://`` or ``registry://``.

    ``oci:`` means an OCI image layout everywhere in coldstart (skopeo's meaning), so it is
    refused here with the spelling to use instead. ``registry``: keyword arguments of the
    :class:`~coldstart.oci.registry.RegistryClient` a ``registry://`` source makes
    (``insecure_hosts``, ``tls_verify``, ``docker_config``).

    >>> src = open_source("/tmp/model.safetensors")  # doctest: +SKIP
    """
    text = os.fspath(location)
    check_not_layout(text)
    if scheme_of(text) == "registry":
        return RegistrySource(text, timeout=timeout, registry=registry)
    return _open_location(text, concurrency=concurrency, timeout=timeout, direct=direct,
                          http_client=http_client, s3_client=s3_client)


def __getattr__(name: str) -> Any:
    # HttpSource and S3Source load their client libraries (httpx, boto3 on use) only when
    # asked for: `import coldstart.weights` stays light for local loads.
    if name == "HttpSource":
        from coldstart.remote.http import HttpSource
        return HttpSource
    if name == "S3Source":
        from coldstart.remote.s3 import S3Source
        return S3Source
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
