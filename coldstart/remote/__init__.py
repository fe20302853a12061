"""coldstart.remote: the one source layer. Every blob (local file, HTTP(S) URL, S3 object,
registry blob) behind one protocol, :class:`Source` (``size``, ``read_at``/``read_into`` with a
per-call deadline, ``close``); one retry policy (:mod:`.retry`); one mapping of httpx errors
(:mod:`.errors`) and of botocore errors (:mod:`.s3`); one ``coalesce``.

Layering: remote imports only ``coldstart.errors``, ``coldstart.config`` and
``coldstart.format``; ``coldstart.oci`` builds on it (its registry client is what
:class:`RegistryBlob` reads through, taken as a :class:`RangeClient`).

Modules: ``source`` (protocol, adapters), ``local``, ``http``, ``s3``, ``registry_blob``,
``registry_verify`` (digest-checked blobs), ``locations`` (a location string to a source),
``retry``, ``errors``, ``ranges``. Importing the package does not import httpx or boto3
(``HttpSource`` and ``S3Source`` load them on first use).

>>> from coldstart.remote import open_source
>>> src = open_source("/etc/hostname"); n = src.size(); src.close()
"""

from typing import Any

from coldstart.remote.local import LocalFileBlob
from coldstart.remote.locations import open_source
from coldstart.remote.ranges import coalesce
from coldstart.remote.registry_blob import RangeClient, RegistryBlob, open_blob
from coldstart.remote.registry_verify import VerifiedRegistryBlob
from coldstart.remote.retry import Backoff, Deadline, retry
from coldstart.remote.source import ReadAtSource, Source, as_source

__all__ = ["Backoff", "Deadline", "HttpSource", "LocalFileBlob", "RangeClient", "ReadAtSource",
           "RegistryBlob", "S3Source", "Source", "VerifiedRegistryBlob", "as_source", "coalesce",
           "open_blob", "open_source", "retry"]


def __getattr__(name: str) -> Any:
    # httpx and boto3 load only when a network source is asked for
    if name == "HttpSource":
        from coldstart.remote.http import HttpSource

        return HttpSource
    if name == "S3Source":
        from coldstart.remote.s3 import S3Source

        return S3Source
    raise AttributeError(f"module 'coldstart.remote' has no attribute {name!r}")
