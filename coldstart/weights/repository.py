"""A versioned model repository: ``<root>/<model>/<version>/…`` and ``<root>/<model>/active.yaml``.

A version is immutable once published. ``publish`` uploads every file of a folder and writes the
completion marker ``<version>/_complete.yaml`` (file list with sizes and sha256) **last**; a
version without it is half-written and cannot be activated. ``active.yaml`` names the active
version and keeps the previously active ones, so ``rollback`` is a pointer change::

    version: "3"
    history: ["1", "2"]
    updated: "2026-11-30T08:00:00+00:00"
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from coldstart.errors import (
    AlreadyExists,
    FailedPrecondition,
    FormatError,
    IntegrityError,
    InvalidArgument,
    NotFound,
)
from coldstart.progress import ByteProgress
from coldstart.weights.stores import Store, open_store

__all__ = ["ACTIVE", "MARKER", "ModelRepository", "VersionInfo"]

ACTIVE = "active.yaml"
MARKER = "_complete.yaml"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HISTORY = 20


def _check_name(kind: str, value: str) -> str:
    if not _NAME.fullmatch(value):
        raise InvalidArgument(f"bad {kind} name {value!r}: use letters, digits, '.', '_', '-' "
                              "(not starting with a punctuation mark)")
    return value


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class VersionInfo:
    """One version of a model as ``list`` reports it."""

    model: str
    version: str
    complete: bool
    active: bool
    files: int
    bytes: int


class ModelRepository:
    """Publish, activate, roll back and list model versions on a local directory or S3.

    >>> repo = ModelRepository("s3://models/repo")  # doctest: +SKIP
    >>> v = repo.publish("./llama-out", "llama", activate=True)  # doctest: +SKIP
    >>> repo.active_version("llama") == v  # doctest: +SKIP
    True
    """

    def __init__(self, root: str | os.PathLike[str] | Store) -> None:
        self.store: Store = open_store(root) if isinstance(root, str | os.PathLike) else root

    # -- reading -----------------------------------------------------------------------------

    def models(self) -> list[str]:
        """Names of the models in the repository."""
        return [m for m in self.store.children("") if _NAME.fullmatch(m)]

    def versions(self, model: str) -> list[str]:
        """Versions of ``model`` (complete or not), numeric ones in numeric order."""
        _check_name("model", model)
        names = [v for v in self.store.children(model) if _NAME.fullmatch(v)]
        return sorted(names, key=lambda v: (0, int(v), "") if v.isdigit() else (1, 0, v))

    def marker(self, model: str, version: str) -> dict[str, Any] | None:
        """The completion marker of a version, or None while it is incomplete."""
        try:
            raw = self.store.read(f"{model}/{version}/{MARKER}")
        except NotFound:
            return None
        try:
            doc = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise FormatError(f"{model}/{version}/{MARKER}: not valid YAML: {exc}") from exc
        if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
            raise FormatError(f"{model}/{version}/{MARKER}: has no 'files' mapping")
        return doc

    def pointer(self, model: str) -> dict[str, Any] | None:
        """The parsed ``active.yaml`` of ``model``, or None when no version was ever activated."""
        _check_name("model", model)
        try:
            raw = self.store.read(f"{model}/{ACTIVE}")
        except NotFound:
            return None
        try:
            doc = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise FormatError(f"{model}/{ACTIVE}: not valid YAML: {exc}") from exc
        if not isinstance(doc, dict) or not isinstance(doc.get("version"), str | int):
            raise FormatError(f"{model}/{ACTIVE}: must hold 'version: <name>'")
        doc["version"] = str(doc["version"])
        hist = doc.get("history") or []
        doc["history"] = [str(h) for h in hist] if isinstance(hist, list) else []
        return doc

    def active_version(self, model: str) -> str | None:
        """The version ``active.yaml`` names, or None."""
        doc = self.pointer(model)
        return None if doc is None else str(doc["version"])

    def location(self, model: str, version: str) -> str:
        """The folder of a version, as :func:`coldstart.weights.load` takes it."""
        return self.store.location(f"{_check_name('model', model)}/"
                                   f"{_check_name('version', version)}/")

    def verify(self, model: str, version: str) -> dict[str, Any]:
        """Check a version is complete and every listed file is there with its size.

        Raises :class:`FailedPrecondition` if the marker is missing (half-written version) and
        :class:`IntegrityError` if a file is missing or has another size (truncated upload).
        """
        marker = self.marker(model, version)
        if marker is None:
            known = self.versions(model)
            if version not in known:
                listed = ", ".join(known[-5:]) if known else "none"
                raise NotFound(f"no such version: {model}/{version} (versions of {model}: "
                               f"{listed}; see `coldstart models list`)")
            raise FailedPrecondition(f"{model}/{version} is not complete (no {MARKER}): "
                                     "it is still uploading, or its upload failed: publish it "
                                     "again as a new version")
        for rel, meta in marker["files"].items():
            want = int(meta["size"]) if isinstance(meta, dict) else -1
            have = self.store.size(f"{model}/{version}/{rel}")
            if have is None:
                raise IntegrityError(f"{model}/{version}/{rel}: listed in {MARKER} but missing")
            if have != want:
                raise IntegrityError(f"{model}/{version}/{rel}: {have} bytes, "
                                     f"{MARKER} says {want} (truncated or replaced)")
        return marker

    def list_versions(self, model: str | None = None) -> list[VersionInfo]:
        """Every version of ``model`` (or of every model), with completeness and the active one.

        A root that does not exist is :class:`NotFound` (a root that is a file,
        :class:`InvalidArgument`), not an empty list: a mistyped root must not look empty.
        """
        check_root = getattr(self.store, "check_root", None)
        if callable(check_root):
            check_root()
        out: list[VersionInfo] = []
        for m in [model] if model else self.models():
            active = self.active_version(m)
            for v in self.versions(m):
                mk = self.marker(m, v)
                files = mk["files"] if mk else {}
                size = sum(int(f.get("size", 0)) for f in files.values() if isinstance(f, dict))
                out.append(VersionInfo(m, v, mk is not None, v == active, len(files), size))
        return out

    # -- writing -----------------------------------------------------------------------------

    def next_version(self, model: str) -> str:
        """One more than the highest numeric version (``"1"`` for a new model)."""
        numbers = [int(v) for v in self.versions(model) if v.isdigit()]
        return str(max(numbers, default=0) + 1)

    def publish(self, folder: str | os.PathLike[str], model: str, version: str | None = None,
                *, activate: bool = False, validate: bool = True,
                progress: ByteProgress | None = None) -> str:
        """Upload ``folder`` as a new version; write the completion marker last.

        ``validate`` checks every safetensors file (and index) before uploading anything.
        ``progress`` counts the files' bytes through ``hash`` and ``upload``. Returns the
        version name.

        >>> ModelRepository("/srv/models").publish("out/", "llama", "7")  # doctest: +SKIP
        '7'
        """
        src = Path(folder)
        _check_name("model", model)
        if not src.is_dir():
            raise InvalidArgument(f"{src}: not a directory")
        files = sorted(p for p in src.rglob("*") if p.is_file() and p.name != MARKER)
        if not files:
            raise InvalidArgument(f"{src}: no files to publish")
        if validate and any(p.suffix == ".safetensors" for p in files):
            from coldstart.weights.checkpoint import Opener

            with Opener() as opener:
                opener.checkpoint(src).close()
        version = _check_name("version", version or self.next_version(model))
        if self.marker(model, version) is not None:
            raise AlreadyExists(f"{model}/{version} is already published (versions are "
                                "immutable: publish a new version)")
        listing: dict[str, dict[str, Any]] = {}
        if progress is not None:
            progress.expect(sum(p.stat().st_size for p in files))
        for path in files:
            rel = path.relative_to(src).as_posix()
            listing[rel] = {"size": path.stat().st_size, "sha256": _sha256(path, progress)}
            uploaded = None if progress is None else functools.partial(progress.advance,
                                                                        "upload")
            self.store.upload(path, f"{model}/{version}/{rel}", progress=uploaded)
        marker = {"model": model, "version": version, "published": _now(), "files": listing}
        self.store.write(f"{model}/{version}/{MARKER}",
                         yaml.safe_dump(marker, sort_keys=False).encode())
        if activate:
            self.activate(model, version)
        return version

    def activate(self, model: str, version: str) -> str | None:
        """Point ``active.yaml`` at a complete, intact version; return the previous one.

        >>> ModelRepository("/srv/models").activate("llama", "7")  # doctest: +SKIP
        '6'
        """
        _check_name("version", version)
        self.verify(model, version)
        doc = self.pointer(model)
        previous = None if doc is None else str(doc["version"])
        history: list[str] = [] if doc is None else list(doc["history"])
        if previous is not None and previous != version:
            history = [*history, previous][-_HISTORY:]
        self._write_pointer(model, version, history)
        return previous

    def rollback(self, model: str) -> str:
        """Re-activate the previously active version (skipping ones no longer intact).

        >>> ModelRepository("/srv/models").rollback("llama")  # doctest: +SKIP
        '6'
        """
        doc = self.pointer(model)
        if doc is None:
            raise FailedPrecondition(f"{model}: no active version to roll back from")
        history: list[str] = [str(h) for h in doc["history"]]
        while history:
            candidate = history.pop()
            try:
                self.verify(model, candidate)
            except (FailedPrecondition, IntegrityError):
                continue
            self._write_pointer(model, candidate, history)
            return candidate
        raise FailedPrecondition(f"{model}: no earlier intact version to roll back to")

    def _write_pointer(self, model: str, version: str, history: list[str]) -> None:
        body = {"version": version, "history": history, "updated": _now()}
        self.store.write(f"{model}/{ACTIVE}", yaml.safe_dump(body, sort_keys=False).encode())


def _sha256(path: Path, progress: ByteProgress | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            if progress is not None:
                progress.advance("hash", len(chunk))
    return "sha256:" + h.hexdigest()
