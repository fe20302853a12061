"""The one exception tree of coldstart.

Every expected failure raised by coldstart is a :class:`ColdstartError`. Third-party errors are
mapped to the most specific kind in one place per edge (``raise Unavailable(...) from exc``) and
translated once more at the outer edges only: to a gRPC status in the snapshotter service, to an
errno in FUSE handlers, and to a one-line message plus exit code in the CLI.

::

    ColdstartError
    ├── NotFound              the thing named does not exist (image, blob, snapshot, tensor)
    ├── AlreadyExists         a key or name is taken
    ├── FailedPrecondition    the state does not allow it (remove with children, commit a view)
    ├── InvalidArgument       the caller's input is wrong (bad reference, bad flag, bad config)
    ├── Unavailable           a dependency did not answer or answered an error (registry 500, S3)
    │   └── DeadlineExceeded  ... within its deadline
    ├── IntegrityError        bytes do not match their digest (chunk, TOC, blob)
    └── FormatError           bytes are not what the format allows (tar, TOC, footer, safetensors)
"""

from __future__ import annotations

import errno as _errno

__all__ = [
    "AlreadyExists",
    "ColdstartError",
    "DeadlineExceeded",
    "FailedPrecondition",
    "FormatError",
    "IntegrityError",
    "InvalidArgument",
    "NotFound",
    "Unavailable",
]


class ColdstartError(Exception):
    """Base of every expected coldstart failure.

    ``exit_code`` is what the CLI exits with, ``grpc_code`` the name of the ``grpc.StatusCode``
    the snapshotter service answers with, ``errno`` what a FUSE handler returns.
    """

    exit_code: int = 1
    grpc_code: str = "UNKNOWN"
    errno: int = _errno.EIO

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class NotFound(ColdstartError):
    exit_code = 3
    grpc_code = "NOT_FOUND"
    errno = _errno.ENOENT


class AlreadyExists(ColdstartError):
    exit_code = 4
    grpc_code = "ALREADY_EXISTS"
    errno = _errno.EEXIST


class FailedPrecondition(ColdstartError):
    exit_code = 5
    grpc_code = "FAILED_PRECONDITION"
    errno = _errno.EBUSY


class InvalidArgument(ColdstartError):
    exit_code = 2
    grpc_code = "INVALID_ARGUMENT"
    errno = _errno.EINVAL


class Unavailable(ColdstartError):
    exit_code = 6
    grpc_code = "UNAVAILABLE"
    errno = _errno.EIO


class DeadlineExceeded(Unavailable):
    exit_code = 7
    grpc_code = "DEADLINE_EXCEEDED"
    errno = _errno.EIO


class IntegrityError(ColdstartError):
    exit_code = 8
    grpc_code = "DATA_LOSS"
    errno = _errno.EIO


class FormatError(ColdstartError):
    exit_code = 9
    grpc_code = "INVALID_ARGUMENT"
    errno = _errno.EIO
