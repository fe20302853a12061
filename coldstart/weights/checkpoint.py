"""Find the files of a checkpoint: one ``.safetensors`` file, a sharded checkpoint's
``model.safetensors.index.json``, or a folder (local directory, S3 prefix, URL base) holding either.

One :class:`Opener` per load shares one S3 client / one HTTP connection pool across every file.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from coldstart.config import SourceConfig
from coldstart.errors import FormatError, NotFound
from coldstart.remote.locations import scheme_of
from coldstart.remote.s3 import map_s3_error, s3_client, split_s3_url
from coldstart.weights.header import Header, parse_header, parse_length
from coldstart.weights.nodefile import node_source
from coldstart.weights.sources import Source, name_of, open_source

__all__ = ["INDEX_NAME", "Checkpoint", "Opener", "ShardFile", "read_header"]

INDEX_NAME = "model.safetensors.index.json"
_SINGLE_NAME = "model.safetensors"
# First read of a file: most headers fit, so one request usually gets all of it.
_HEAD_GUESS = 1 << 20
_SOURCE = SourceConfig()


@dataclass
class ShardFile:
    """One file of a checkpoint, open, with its validated header."""

    source: Source
    header: Header


@dataclass
class Checkpoint:
    """All files of a checkpoint; ``metadata`` is the index's metadata for sharded ones."""

    location: str
    files: list[ShardFile]
    metadata: dict[str, Any]

    def close(self) -> None:
        for f in self.files:
            f.source.close()


def read_header(source: Source) -> Header:
    """Read and validate the header of the file behind ``source`` (one request when it is small).

    >>> from coldstart.weights import LocalSource
    >>> read_header(LocalSource("model.safetensors")).tensors  # doctest: +SKIP
    """
    size = source.size()
    name = name_of(source)
    # a source where a second request is cheap reads less ahead (a lazily mounted file: what
    # it reads is fetched whole, in chunks, and a bad one would fail the header, not a tensor)
    first = bytearray(min(size, getattr(source, "head_guess", _HEAD_GUESS)))
    if first:
        source.read_into(0, [memoryview(first)])
    n = parse_length(bytes(first[:8]), size, name)
    if 8 + n > len(first):
        rest = bytearray(8 + n - len(first))
        source.read_into(len(first), [memoryview(rest)])
        first += rest
    return parse_header(bytes(first[: 8 + n]), size, name)


class Opener:
    """Opens sources of one scheme family with shared clients (S3 client, HTTP pool).

    >>> with Opener(concurrency=8) as opener:  # doctest: +SKIP
    ...     ckpt = opener.checkpoint("s3://models/llama/3/")
    """

    def __init__(self, *, concurrency: int = _SOURCE.concurrency,
                 timeout: float = _SOURCE.timeout, direct: bool = False,
                 registry: Mapping[str, Any] | None = None) -> None:
        self.concurrency = concurrency
        self.registry = registry
        self.timeout = timeout
        self.direct = direct
        self._s3: Any = None
        self._http: Any = None

    def __enter__(self) -> Opener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    def _scheme(self, location: str) -> str:
        return scheme_of(location)

    def s3(self) -> Any:
        if self._s3 is None:
            self._s3 = s3_client(concurrency=self.concurrency, timeout=self.timeout)
        return self._s3

    def http(self) -> Any:
        if self._http is None:
            from coldstart.remote.http import http_client  # httpx: only when HTTP is used

            self._http = http_client(timeout=self.timeout, concurrency=self.concurrency)
        return self._http

    def open(self, location: str) -> Source:
        """Open one file (network sources share this opener's S3 client / HTTP pool). A local
        file on a lazily mounted layer goes through the node's files socket where there is
        one (:func:`~coldstart.weights.nodefile.node_source`)."""
        scheme = self._scheme(location)
        if not scheme and not self.direct:
            node = node_source(location, timeout=self.timeout)
            if node is not None:
                return node
        return open_source(location, concurrency=self.concurrency, timeout=self.timeout,
                           direct=self.direct, registry=self.registry,
                           http_client=self.http() if scheme in ("http", "https") else None,
                           s3_client=self.s3() if scheme == "s3" else None)

    def read_small(self, location: str) -> bytes:
        """Read a small whole file (an index)."""
        src = self.open(location)
        try:
            size = src.size()
            if size > 64 << 20:
                raise FormatError(f"{location}: {size} bytes is too big for an index file")
            buf = bytearray(size)
            src.read_into(0, [memoryview(buf)])
            return bytes(buf)
        finally:
            src.close()

    def exists(self, location: str) -> bool:
        try:
            src = self.open(location)
        except NotFound:
            return False
        try:
            src.size()
            return True
        except NotFound:
            return False
        finally:
            src.close()

    def _join(self, base: str, name: str) -> str:
        scheme = self._scheme(base)
        if scheme == "":
            return os.path.join(base if base.endswith("/") else os.path.dirname(base), name)
        parts = urlsplit(base)
        path = parts.path if parts.path.endswith("/") else posixpath.dirname(parts.path) + "/"
        return urlunsplit(parts._replace(path=posixpath.normpath(path + name)))

    def _folder_files(self, location: str) -> list[str]:
        """The checkpoint files in a folder: its index's files, else every ``*.safetensors``."""
        scheme = self._scheme(location)
        base = location if location.endswith("/") else location + "/"
        index = self._join(base, INDEX_NAME)
        if scheme == "" and os.path.isfile(index):
            return [index]
        if scheme == "":
            names = sorted(n for n in os.listdir(location) if n.endswith(".safetensors"))
            return [os.path.join(location, n) for n in names]
        if scheme == "s3":
            bucket, prefix = split_s3_url(base)
            keys: list[str] = []
            try:
                pages = self.s3().get_paginator("list_objects_v2").paginate(
                    Bucket=bucket, Prefix=prefix, Delimiter="/")
                for page in pages:
                    keys += [o["Key"] for o in page.get("Contents", [])]
            except Exception as exc:
                raise map_s3_error(exc, base) from exc
            if prefix + INDEX_NAME in keys:
                return [f"s3://{bucket}/{prefix}{INDEX_NAME}"]
            return [f"s3://{bucket}/{k}" for k in sorted(keys) if k.endswith(".safetensors")]
        # HTTP cannot list: try the index, then the conventional single-file name.
        for candidate in (index, self._join(base, _SINGLE_NAME)):
            if self.exists(candidate):
                return [candidate]
        return []

    def checkpoint(self, location: str | os.PathLike[str]) -> Checkpoint:
        """Open every file of the checkpoint at ``location`` and validate every header."""
        text = os.fspath(location)
        scheme = self._scheme(text)
        is_folder = text.endswith("/") or (scheme == "" and os.path.isdir(text))
        if text.endswith((".json", ".safetensors")) or scheme == "registry" or not is_folder:
            targets = [text]
        else:
            targets = self._folder_files(text)
            if not targets:
                raise NotFound(f"{text}: no {INDEX_NAME} and no *.safetensors files there")
        if len(targets) == 1 and targets[0].endswith(".json"):
            return self._sharded(targets[0])
        files: list[ShardFile] = []
        try:
            for t in targets:
                src = self.open(t)
                files.append(ShardFile(src, read_header(src)))
        except BaseException:
            for f in files:
                f.source.close()
            raise
        _check_unique(text, files)
        return Checkpoint(location=text, files=files, metadata={})

    def _sharded(self, index_location: str) -> Checkpoint:
        raw = self.read_small(index_location)
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FormatError(f"{index_location}: not valid JSON: {exc}") from exc
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise FormatError(f"{index_location}: weight_map must map tensor names to files")
        metadata = doc.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise FormatError(f"{index_location}: metadata must be an object")
        files: list[ShardFile] = []
        try:
            for name in sorted(set(weight_map.values())):
                if name.startswith("/") or ".." in name.split("/"):
                    raise FormatError(f"{index_location}: shard file name {name!r} leaves the "
                                      "checkpoint's folder")
                src = self.open(self._join(index_location, name))
                files.append(ShardFile(src, read_header(src)))
            by_file = {posixpath.basename(name_of(f.source)): f for f in files}
            for tensor, fname in weight_map.items():
                shard = by_file[posixpath.basename(fname)]
                if tensor not in shard.header.tensors:
                    raise FormatError(f"{index_location}: tensor {tensor!r} is mapped to "
                                      f"{fname} but that file does not hold it")
            _check_unique(index_location, files)
        except BaseException:
            for f in files:
                f.source.close()
            raise
        return Checkpoint(location=index_location, files=files, metadata=metadata)


def _check_unique(location: str, files: list[ShardFile]) -> None:
    seen: dict[str, str] = {}
    for f in files:
        for name in f.header.tensors:
            if name in seen:
                raise FormatError(f"{location}: tensor {name!r} is in both {seen[name]} and "
                                  f"{name_of(f.source)}")
            seen[name] = name_of(f.source)
