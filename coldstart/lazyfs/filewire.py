"""The files socket's protocol, both sides of it: how a process inside a container asks the
node for the bytes of a file on a lazily mounted layer (the server: :mod:`.fileshare`; the
client: :mod:`coldstart.weights.nodefile`).

The trust boundary is the file itself. The FUSE file system answers ``getxattr`` of
:data:`FILE_XATTR` on a regular file with a *file token*: the layer's digest, the file's slot
and size, and an HMAC of the three under a secret only the FUSE server holds. The name is never
listed (``listxattr``), so copies of the tree (``tar``, overlayfs' copy-up of a file the
container changes) do not carry it. The kernel lets a process read a ``user.*`` attribute only
where it may read the file (``default_permissions``; through overlayfs, checked with the
caller's credentials on the container's own inode), so a token proves that its holder can read
that file of its own image, and the socket serves nothing else: a container reaches the bytes
of files it can already read, at the speed of the node, and no other layer's.

One JSON object per line, as on the control socket (:mod:`coldstart.lazyfs.control`: framing,
replies and error payloads are that module's)::

    {"op": "open", "token": T}  + one descriptor (SCM_RIGHTS): the caller's staging file
                                          -> {"ok": true, "result": {"size": S, "name": N}}
    {"op": "read", "offset": O, "length": L, "at": A}
                                          -> {"ok": true, "result": K}

``open`` names the file and hands over the staging file (a ``memfd`` the caller maps), once per
connection. ``read`` puts the file's bytes ``[O, O+L)`` (``K`` of them: fewer only at the end
of the file), fetched in parallel, each chunk verified against its digest and cached on the
node, into the staging file at ``A``; the caller copies them from its mapping into its own
buffers (tensors, pinned memory). A failure is one error reply (an :class:`IntegrityError` names
the layer, the file and the chunk) and the connection stays usable.

This module does no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from typing import Any

from coldstart.errors import FailedPrecondition, InvalidArgument

__all__ = [
    "DEFAULT_SOCKET",
    "FILE_XATTR",
    "OPEN",
    "READ",
    "SOCKET_ENV",
    "FileToken",
    "open_request",
    "read_request",
    "socket_path",
]

#: the attribute a lazily mounted regular file answers with its token (never listed)
FILE_XATTR = "user.coldstart.file"
#: where a process finds the files socket: this variable ("" turns the fast path off), else
#: :data:`DEFAULT_SOCKET` if it exists (the node's ``/run/coldstart/files``, mounted in)
SOCKET_ENV = "COLDSTART_FILES_SOCKET"
DEFAULT_SOCKET = "/run/coldstart/files/files.sock"

OPEN = "open"
READ = "read"

_VERSION = "cs1"


@dataclass(frozen=True)
class FileToken:
    """What a file token says: the layer, the file's slot in it, its size; and the MAC."""

    digest: str
    slot: int
    size: int
    mac: str

    @staticmethod
    def _mac(secret: bytes, digest: str, slot: int, size: int) -> str:
        msg = f"{_VERSION}\n{digest}\n{slot}\n{size}".encode()
        return hmac.new(secret, msg, hashlib.sha256).hexdigest()

    @classmethod
    def issue(cls, secret: bytes, digest: str, slot: int, size: int) -> FileToken:
        return cls(digest, slot, size, cls._mac(secret, digest, slot, size))

    def encode(self) -> bytes:
        return f"{_VERSION}:{self.digest}:{self.slot}:{self.size}:{self.mac}".encode()

    @classmethod
    def parse(cls, text: str) -> FileToken:
        """A token's wire form back (InvalidArgument if it is not one).

        >>> FileToken.parse(FileToken.issue(b"k", "sha256:ab", 3, 10).encode().decode()).slot
        3
        """
        parts = text.split(":")
        # cs1:<algo>:<hex>:<slot>:<size>:<mac>
        if (len(parts) != 6 or parts[0] != _VERSION or not parts[3].isdigit()
                or not parts[4].isdigit() or len(parts[5]) != 64):
            raise InvalidArgument("not a coldstart file token")
        return cls(f"{parts[1]}:{parts[2]}", int(parts[3]), int(parts[4]), parts[5])

    def check(self, secret: bytes) -> None:
        """FailedPrecondition unless this server's secret made the MAC (a token from another
        node or an earlier server, or a forged one)."""
        want = self._mac(secret, self.digest, self.slot, self.size)
        if not hmac.compare_digest(want, self.mac):
            raise FailedPrecondition("the file token was not issued by this node's FUSE server "
                                   "(forged, or from before a restart)")


def open_request(token: str) -> dict[str, Any]:
    return {"op": OPEN, "token": token}


def read_request(offset: int, length: int, at: int) -> dict[str, Any]:
    return {"op": READ, "offset": offset, "length": length, "at": at}


def socket_path() -> str | None:
    """The files socket this process should use, or None: off (``$COLDSTART_FILES_SOCKET``
    set empty) or none there."""
    path = os.environ.get(SOCKET_ENV)
    if path is not None:
        return path or None
    return DEFAULT_SOCKET if os.path.exists(DEFAULT_SOCKET) else None
