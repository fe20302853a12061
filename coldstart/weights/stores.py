"""Where a model repository lives: a local directory or an S3 prefix, behind one small protocol.

Keys are ``/``-separated paths relative to the repository root. Writes of small files are
atomic (a rename locally; a single PUT on S3), so a reader never sees half a pointer file.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from coldstart.config import SourceConfig
from coldstart.errors import InvalidArgument, NotFound
from coldstart.remote.s3 import map_s3_error, s3_client, s3_errors, split_s3_url

__all__ = ["LocalStore", "S3Store", "Store", "open_store"]

_SOURCE = SourceConfig()


class Store(Protocol):
    """The few operations a model repository needs from its storage."""

    root: str

    def read(self, key: str) -> bytes:
        """The whole (small) object; :class:`NotFound` if it does not exist."""
        ...

    def write(self, key: str, data: bytes) -> None:
        """Write atomically: readers see the old bytes or the new ones."""
        ...

    def upload(self, local: Path, key: str,
               progress: Callable[[int], None] | None = None) -> None:
        """Copy a local file to ``key``; ``progress(n)`` as bytes are sent."""
        ...

    def size(self, key: str) -> int | None:
        """Size in bytes, or None if the object does not exist."""
        ...

    def children(self, prefix: str) -> list[str]:
        """Names of the folders directly under ``prefix`` (no trailing slash)."""
        ...

    def location(self, key: str) -> str:
        """What :func:`coldstart.weights.load` takes for ``key`` (path or ``s3://`` URL)."""
        ...


class LocalStore:
    """A repository in a local (or network-mounted) directory.

    >>> store = LocalStore("/srv/models")  # doctest: +SKIP
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.fspath(root)
        self._root = Path(self.root)

    def _path(self, key: str) -> Path:
        return self._root / key

    def read(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError as exc:
            raise NotFound(f"{self._path(key)}: no such file") from exc

    def write(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def upload(self, local: Path, key: str,
               progress: Callable[[int], None] | None = None) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.part")
        with open(local, "rb") as src, open(tmp, "wb") as out:
            while chunk := src.read(8 << 20):
                out.write(chunk)
                if progress is not None:
                    progress(len(chunk))
        os.replace(tmp, dest)

    def size(self, key: str) -> int | None:
        try:
            st = self._path(key).stat()
        except FileNotFoundError:
            return None
        return st.st_size if self._path(key).is_file() else None

    def children(self, prefix: str) -> list[str]:
        folder = self._path(prefix) if prefix else self._root
        if not folder.is_dir():
            return []
        return sorted(p.name for p in folder.iterdir() if p.is_dir()
                      and not p.name.startswith("."))

    def location(self, key: str) -> str:
        return str(self._path(key))

    def check_root(self) -> None:
        """:class:`NotFound` if the root does not exist, :class:`InvalidArgument` if it is not
        a directory (listing either would otherwise look like an empty repository)."""
        if not self._root.exists():
            raise NotFound(f"{self.root}: no such repository directory")
        if not self._root.is_dir():
            raise InvalidArgument(f"{self.root}: not a directory (a model repository root is a "
                                  "directory or s3://bucket/prefix)")


class S3Store:
    """A repository under ``s3://bucket/prefix`` (standard credentials, ``AWS_ENDPOINT_URL``).

    >>> store = S3Store("s3://models/repo")  # doctest: +SKIP
    """

    def __init__(self, url: str, *, client: Any = None,
                 timeout: float = _SOURCE.timeout) -> None:
        self.root = url.rstrip("/")
        self.bucket, prefix = split_s3_url(url)
        self.prefix = prefix.strip("/")
        self._client = client or s3_client(concurrency=_SOURCE.concurrency, timeout=timeout)
        self._errors = s3_errors()

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def read(self, key: str) -> bytes:
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
            data: bytes = resp["Body"].read()
            return data
        except self._errors as exc:
            raise map_s3_error(exc, f"s3://{self.bucket}/{self._key(key)}") from exc

    def write(self, key: str, data: bytes) -> None:
        try:
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except self._errors as exc:
            raise map_s3_error(exc, f"s3://{self.bucket}/{self._key(key)}") from exc

    def upload(self, local: Path, key: str,
               progress: Callable[[int], None] | None = None) -> None:
        try:
            self._client.upload_file(str(local), self.bucket, self._key(key),
                                     Callback=progress)
        except self._errors as exc:
            raise map_s3_error(exc, f"s3://{self.bucket}/{self._key(key)}") from exc
        except Exception as exc:  # boto3.s3.transfer wraps errors in its own S3UploadFailedError
            raise map_s3_error(exc, f"s3://{self.bucket}/{self._key(key)}") from exc

    def size(self, key: str) -> int | None:
        try:
            head = self._client.head_object(Bucket=self.bucket, Key=self._key(key))
        except self._errors as exc:
            err = map_s3_error(exc, key)
            if isinstance(err, NotFound):
                return None
            raise err from exc
        return int(head["ContentLength"])

    def children(self, prefix: str) -> list[str]:
        base = self._key(prefix).strip("/")
        base = f"{base}/" if base else ""
        names: list[str] = []
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base, Delimiter="/")
            for page in pages:
                names += [p["Prefix"][len(base):].rstrip("/")
                          for p in page.get("CommonPrefixes", [])]
        except self._errors as exc:
            raise map_s3_error(exc, f"s3://{self.bucket}/{base}") from exc
        return sorted(names)

    def location(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"

    def check_root(self) -> None:
        """:class:`NotFound` if the bucket does not exist (an empty prefix is an empty
        repository: S3 has no folders to be missing)."""
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except self._errors as exc:
            raise map_s3_error(exc, f"s3://{self.bucket}") from exc


def open_store(root: str | os.PathLike[str]) -> Store:
    """A store for ``root``: ``s3://bucket/prefix`` or a local directory.

    >>> open_store("/srv/models").root  # doctest: +SKIP
    '/srv/models'
    """
    text = os.fspath(root)
    if text.startswith("s3://"):
        return S3Store(text)
    if "://" in text:
        raise InvalidArgument(f"{text}: a model repository is a local directory or s3://bucket/prefix")
    return LocalStore(text)
