"""The files socket's protocol, both sides of it: how a process inside a container asks the
node for the bytes of a file on a lazily mounted layer (the server: :mod:`.fileshare`; the
client: :mod:`coldstart.weights.nodefile`).

The trust boundary is the file itself. The FUSE file system answers ``getxattr`` of
:data:`FILE_XATTR` on a regular file of a layer served where getxattr is answered (one that holds
a :data:`TOKEN_SUFFIXES` file or shows an attribute, or any with ``fuse.split_xattrs`` off) with a
*file token*: the layer's
digest, the file's slot and size, and an HMAC of the three under a secret only the FUSE server
holds. The name is never listed (``listxattr``), so copies of the tree (``tar``, overlayfs'
copy-up of a file the container changes) do not carry it. The kernel lets a process read a
``user.*`` attribute only where it may read the file (``default_permissions``; through
overlayfs, checked with the caller's credentials on the container's own inode), so a token
proves that its holder can read that file of its own image, and the socket serves nothing else:
a container reaches the bytes of files it can already read, at the speed of the node, and no
other layer's. A token is served only to a caller that can see its file itself (a mount of the
layer's FUSE connection in its mount table, or the file at the same path of its root:
:func:`~coldstart.lazyfs.fileshare.sees_file`), so one passed to a process of another container
is worth nothing there.

One JSON object per line, as on the control socket (:mod:`coldstart.lazyfs.control`: framing,
replies and error payloads are that module's); every request names its file by token, so a
connection serves any file and a process keeps a few, whatever it loads::

    {"op": "stat", "token": T}            -> {"ok": true, "result": {"size": S, "name": N}}
    {"op": "read", "token": T, "offset": O, "length": L, "at": A}
      + one descriptor (SCM_RIGHTS): a memfd of the caller's
                                          -> {"ok": true, "result": K}

``read`` puts the file's bytes ``[O, O+L)`` (``K`` of them: fewer only at the end of the
file; ``L`` at most :data:`MAX_READ`), fetched in parallel, each chunk verified against its
digest and cached on the node, into the memfd at ``A``; the caller reads them from its
mapping (or views them: tensors). The memfd must be sealed against growing and shrinking
(:data:`SEALS`) and its pages in ``[A, A+L)`` must exist already (the caller faults them in
first): the memory is the caller's, charged to its own cgroup. A failure is one error reply
(an :class:`IntegrityError` names the layer, the file and the chunk) and the connection stays
usable; one with ``"retry": true`` beside its error (:data:`RETRY`) may succeed if sent again
with the token read again (a restarted server, a layer still being restored, a full socket).

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
    "MAX_READ",
    "NODE_XATTR",
    "READ",
    "RETRY",
    "SEALS",
    "SOCKET_ENV",
    "STAT",
    "TOKEN_SUFFIXES",
    "FileToken",
    "read_request",
    "socket_path",
    "stat_request",
]

#: the attribute a lazily mounted regular file answers with its token (never listed)
FILE_XATTR = "user.coldstart.file"
#: the same token under a name only a process with CAP_SYS_ADMIN may read or set (never
#: listed): what the node itself asks through a container's root, where a ``user.*`` attribute
#: of that name could be the container's own (set on a file of its own)
NODE_XATTR = "trusted.coldstart.file"
#: the files loaders read through the socket (:mod:`coldstart.weights` reads safetensors): a
#: layer holding one is served on the FUSE connection that answers extended attributes (the
#: others answer none: see :mod:`coldstart.lazyfs.fusefs`), so only their files have a token
TOKEN_SUFFIXES = (".safetensors",)
#: where a process finds the files socket: this variable ("" turns the fast path off), else
#: :data:`DEFAULT_SOCKET` if it exists (the node's ``/run/coldstart/files``, mounted in)
SOCKET_ENV = "COLDSTART_FILES_SOCKET"
DEFAULT_SOCKET = "/run/coldstart/files/files.sock"

STAT = "stat"
READ = "read"
#: the most bytes one ``read`` may ask for (what the node holds in memory for one request)
MAX_READ = 16 << 20
#: the seals a ``read``'s memfd must carry (its size fixed: the node writes only into pages
#: that exist, and they stay the caller's)
SEALS = 0x0002 | 0x0004     # F_SEAL_SHRINK | F_SEAL_GROW
#: key of an error reply that is worth sending again (a token of an earlier server, a layer
#: not restored yet, the socket full): the caller reads the token again and retries
RETRY = "retry"

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


def stat_request(token: str) -> dict[str, Any]:
    return {"op": STAT, "token": token}


def read_request(token: str, offset: int, length: int, at: int) -> dict[str, Any]:
    return {"op": READ, "token": token, "offset": offset, "length": length, "at": at}


def socket_path() -> str | None:
    """The files socket this process should use, or None: off (``$COLDSTART_FILES_SOCKET``
    set empty) or none there."""
    path = os.environ.get(SOCKET_ENV)
    if path is not None:
        return path or None
    return DEFAULT_SOCKET if os.path.exists(DEFAULT_SOCKET) else None
