"""A location string to a source: a path, ``file://``, ``http(s)://`` or ``s3://``.

``registry://registry/repo@sha256:...`` needs a registry client, which lives above this layer
(``coldstart.oci``): ``coldstart.weights.open_source`` adds that scheme.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

from coldstart.config import SourceConfig
from coldstart.errors import InvalidArgument
from coldstart.remote.local import LocalFileBlob
from coldstart.remote.source import Source

__all__ = ["open_source", "scheme_of"]

_DEFAULTS = SourceConfig()


def scheme_of(location: str) -> str:
    """``"s3"``, ``"http"``, ..., or ``""`` for a plain path.

    >>> scheme_of("s3://b/k"), scheme_of("/srv/m.safetensors")
    ('s3', '')
    """
    return urlsplit(location).scheme if "://" in location else ""


def open_source(location: str | os.PathLike[str], *,
                concurrency: int = _DEFAULTS.concurrency, timeout: float = _DEFAULTS.timeout,
                direct: bool = False, http_client: Any = None, s3_client: Any = None) -> Source:
    """Open one blob by location; ``http_client``/``s3_client`` share one pool among many.

    >>> src = open_source("/etc/hostname"); src.close()
    """
    text = os.fspath(location)
    scheme = scheme_of(text)
    if scheme == "s3":
        from coldstart.remote.s3 import S3Source

        return S3Source(text, client=s3_client, concurrency=concurrency, timeout=timeout)
    if scheme in ("http", "https"):
        from coldstart.remote.http import HttpSource

        return HttpSource(text, client=http_client, concurrency=concurrency, timeout=timeout)
    if scheme in ("", "file"):
        return LocalFileBlob(text[len("file://"):] if scheme == "file" else text, direct=direct)
    raise InvalidArgument(f"{text}: unsupported source scheme {scheme!r} "
                          "(use a path, s3://, http(s):// or registry://)")
