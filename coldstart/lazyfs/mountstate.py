"""What the FUSE server has mounted, persisted so that a restarted server restores it.

One JSON file per mountpoint under ``<root>/fuse-state/``, written atomically (temp file, fsync,
rename, fsync of the directory). Credentials are not stored: they stay in the docker config file
on disk, which the restarted server reads again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from coldstart.errors import InvalidArgument
from coldstart.lazyfs.spec import LayerSpec

__all__ = ["MountRecord", "MountState"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MountRecord:
    mountpoint: str
    spec: LayerSpec
    #: the layer's directory name in the FUSE mount and its first inode number (a successor
    #: that takes over the connection must answer for the same ones); None in old records
    key: str | None = None
    base: int | None = None
    end: int | None = None
    #: bound from the connection that answers no getxattr (``<root>/fuse-plain``), kept under
    #: the key ``plain_layer`` in place of ``layer``: a server older than that connection reads
    #: such a record as one with no layer name and binds the layer afresh (the records it
    #: wrote were all bound from ``<root>/fuse``)
    plain: bool = False


class MountState:
    """The persisted mount table in ``directory``."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, mountpoint: str) -> Path:
        return self.dir / (hashlib.sha256(mountpoint.encode()).hexdigest()[:32] + ".json")

    def save(self, mountpoint: str, spec: LayerSpec, *, key: str | None = None,
             base: int | None = None, end: int | None = None, plain: bool = False) -> None:
        """Record (or replace) the mount at ``mountpoint``, atomically (``key``, ``base``,
        ``end``: the layer's name in the FUSE mount and its inode range; ``plain``: which
        connection its bind is from)."""
        doc: dict[str, object] = {"mountpoint": mountpoint, "spec": json.loads(spec.to_json())}
        if key is not None and base is not None and end is not None:
            doc["plain_layer" if plain else "layer"] = {"key": key, "base": base, "end": end}
        body = json.dumps(doc, sort_keys=True).encode()
        path = self._path(mountpoint)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, body)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
        self._sync_dir()

    def remove(self, mountpoint: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(mountpoint))
            self._sync_dir()

    def load(self) -> list[MountRecord]:
        """Every recorded mount; unreadable records are logged and skipped."""
        out: list[MountRecord] = []
        for path in sorted(self.dir.glob("*.json")):
            try:
                data = json.loads(path.read_text())
                spec = LayerSpec.from_json(json.dumps(data["spec"]))
                mp = data["mountpoint"]
                if not isinstance(mp, str):
                    raise InvalidArgument("mountpoint is not a string")
                plain = "plain_layer" in data
                layer = data.get("plain_layer" if plain else "layer") or {}
                key, base, end = layer.get("key"), layer.get("base"), layer.get("end")
                if (isinstance(key, str) and key and "/" not in key
                        and type(base) is int and type(end) is int and 1 < base < end):
                    out.append(MountRecord(mp, spec, key, base, end, plain))
                else:
                    out.append(MountRecord(mp, spec, plain=plain))
            except (OSError, ValueError, KeyError, TypeError, InvalidArgument) as exc:
                log.error("mount state %s is unreadable, skipped: %s", path, exc)
        return out

    def _sync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
