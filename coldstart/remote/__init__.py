"""Blob sources behind one protocol (``read_at``, ``size``): registry blobs, local files."""

from coldstart.remote.blob import BlobSource, LocalFileBlob
from coldstart.remote.registry_blob import RegistryBlob, coalesce

__all__ = ["BlobSource", "LocalFileBlob", "RegistryBlob", "coalesce"]
