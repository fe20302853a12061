"""A node's files: written atomically (:mod:`coldstart.files`), compared by SHA-256."""

from __future__ import annotations

import hashlib

from coldstart.files import atomic_write, private_dir, read_optional, remove

__all__ = ["atomic_write", "private_dir", "read_optional", "remove", "sha256"]


def sha256(data: bytes) -> str:
    """The hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()
