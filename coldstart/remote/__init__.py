"""Blob sources behind one protocol (``read_at`` with a per-call timeout, ``size``)."""

from coldstart.remote.blob import BlobSource, LocalFileBlob
from coldstart.remote.registry_blob import RegistryBlob, coalesce
from coldstart.remote.source import ReadAtSource, Source, as_source

__all__ = ["BlobSource", "LocalFileBlob", "ReadAtSource", "RegistryBlob", "Source", "as_source",
           "coalesce"]
