"""What ``coldstart node install`` did, kept for ``uninstall`` and ``status``.

In the state directory (default ``/var/lib/coldstart/node``): ``containerd-config.orig``, the
containerd config's bytes before the first install, and ``install.json``, :class:`InstallState`:
which keys were changed (and what they held), which tables were made, the SHA-256 of every file
as installed (so an operator's later edit is seen), and which files install created.

Example::

    state = load_state(Path("/var/lib/coldstart/node"))
    if state is not None and sha256(config_bytes) == state.installed_sha256: ...
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from coldstart.errors import FormatError
from coldstart.node.containerd_config import Edit, TablePath, Target
from coldstart.node.files import read_optional

__all__ = ["BACKUP_FILE", "STATE_FILE", "InstallState", "load_state"]

STATE_FILE = "install.json"
BACKUP_FILE = "containerd-config.orig"
_FORMAT = 1


@dataclass(frozen=True)
class InstallState:
    containerd_config: str
    schema: int
    target: Target
    original_sha256: str                 # of containerd-config.orig
    installed_sha256: str                # of the containerd config as install wrote it
    edits: tuple[Edit, ...] = ()
    created_tables: tuple[TablePath, ...] = ()
    unit_path: str = ""
    unit_sha256: str = ""                # "" when install did not write the unit
    coldstart_config: str = ""
    coldstart_config_sha256: str = ""    # "" when it was there before install
    installed_at: str = ""

    def to_json(self) -> bytes:
        doc = {
            "format": _FORMAT,
            "containerd_config": self.containerd_config,
            "schema": self.schema,
            "target": {"socket": self.target.socket, "root": self.target.root,
                       "runtime_handler": self.target.runtime_handler,
                       "restore_binary": self.target.restore_binary},
            "original_sha256": self.original_sha256,
            "installed_sha256": self.installed_sha256,
            "edits": [e.to_json() for e in self.edits],
            "created_tables": [list(t) for t in self.created_tables],
            "unit_path": self.unit_path,
            "unit_sha256": self.unit_sha256,
            "coldstart_config": self.coldstart_config,
            "coldstart_config_sha256": self.coldstart_config_sha256,
            "installed_at": self.installed_at,
        }
        return (json.dumps(doc, indent=2) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> InstallState:
        try:
            doc = json.loads(data)
            t = doc["target"]
            return cls(
                containerd_config=doc["containerd_config"], schema=int(doc["schema"]),
                target=Target(t["socket"], t["root"], t.get("runtime_handler"),
                              t.get("restore_binary")),
                original_sha256=doc["original_sha256"],
                installed_sha256=doc["installed_sha256"],
                edits=tuple(Edit.from_json(e) for e in doc.get("edits", [])),
                created_tables=tuple(tuple(p) for p in doc.get("created_tables", [])),
                unit_path=doc.get("unit_path", ""), unit_sha256=doc.get("unit_sha256", ""),
                coldstart_config=doc.get("coldstart_config", ""),
                coldstart_config_sha256=doc.get("coldstart_config_sha256", ""),
                installed_at=doc.get("installed_at", ""))
        except (ValueError, KeyError, TypeError) as exc:
            raise FormatError(f"{where}: not an install state ({exc!r}); move it away to start "
                              "afresh (the original containerd config is beside it)") from None


def load_state(state_dir: Path) -> InstallState | None:
    """The state in ``state_dir``, or None when nothing is installed."""
    path = state_dir / STATE_FILE
    data = read_optional(path)
    return None if data is None else InstallState.from_json(data, str(path))
