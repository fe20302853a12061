"""What the runc wrapper keeps on the node: per-container restore state, an events log and
counters, under ``snapshot.state_dir`` (root only).

* ``containers/<runc root hash>-<id>.json``: a container that was restored (its ``start`` is
  then a no-op: the process already runs); removed by ``delete``.
* ``<work_root>/<runc root hash>-<id>/``: CRIU's images and work files while a restore runs
  (on disk: ``snapshot.work_dir``); removed when it ends, whatever the outcome (the restore
  log is kept in ``logs/`` until ``delete``).
* ``events.jsonl``: one line per restore attempt (outcome, reason, phases, bytes), appended.
* ``counters.json``: restores, and fallbacks by reason, updated under a lock; what
  ``coldstart snapshot status`` prints.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["FALLBACK_KINDS", "NodeState"]

#: events.jsonl is cut to its newest half past this size
EVENTS_MAX = 4 << 20
#: why a restore falls back (``kind`` of a fallback event): each counted, shown at 0 until
#: it happens
FALLBACK_KINDS = ("no-image", "no-snapshot", "terminal", "preserve-fds", "criu", "registry",
                  "integrity", "timeout", "restore-failed", "privileges", "internal")


@dataclass(frozen=True)
class NodeState:
    root: Path
    #: CRIU's images while a restore runs: on disk, not in /run's tmpfs (a snapshot's pages
    #: are as big as the process's memory); default: ``<root>/work``
    work_root: Path | None = None

    def _name(self, runc_root: str, cid: str) -> str:
        return f"{hashlib.sha256(runc_root.encode()).hexdigest()[:8]}-{cid}"

    def container(self, runc_root: str, cid: str) -> Path:
        return self.root / "containers" / f"{self._name(runc_root, cid)}.json"

    def work(self, runc_root: str, cid: str) -> Path:
        return (self.work_root or self.root / "work") / self._name(runc_root, cid)

    def log(self, runc_root: str, cid: str) -> Path:
        return self.root / "logs" / f"{self._name(runc_root, cid)}.log"

    def ensure(self) -> None:
        for sub in ("containers", "work", "logs"):
            (self.root / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.work_root is not None:
            self.work_root.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(self.root, 0o700)

    def mark_restored(self, runc_root: str, cid: str, doc: Mapping[str, Any]) -> None:
        path = self.container(runc_root, cid)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**doc, "started": False}))
        os.replace(tmp, path)

    def take_start(self, runc_root: str, cid: str) -> bool:
        """Whether ``cid`` was restored and not started yet (marking it started)."""
        path = self.container(runc_root, cid)
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        if doc.get("started"):
            return False
        doc["started"] = True
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
        return True

    def forget(self, runc_root: str, cid: str) -> None:
        """Drop everything kept for ``cid`` (its ``delete``)."""
        self.container(runc_root, cid).unlink(missing_ok=True)
        self.log(runc_root, cid).unlink(missing_ok=True)
        self.log(runc_root, cid).with_suffix(".pager.log").unlink(missing_ok=True)
        shutil.rmtree(self.work(runc_root, cid), ignore_errors=True)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def record(self, event: Mapping[str, Any]) -> None:
        """Append ``event`` to the events log and count it (``outcome``: restored, fallback
        (``kind``: its reason), or the lazy pager's pages-in and pages-failed)."""
        line = json.dumps({"time": time.time(), **event}, separators=(",", ":")) + "\n"
        with self._locked():
            events = self.root / "events.jsonl"
            with open(events, "a") as f:
                f.write(line)
            if events.stat().st_size > EVENTS_MAX:
                keep = events.read_bytes()[-EVENTS_MAX // 2:]
                events.write_bytes(keep[keep.find(b"\n") + 1:])
            counters = self.counters()
            outcome = str(event.get("outcome"))
            if outcome == "restored":
                counters["restored"] = int(counters.get("restored", 0)) + 1
            elif outcome == "fallback":
                by = counters.setdefault("fallbacks", {})
                kind = str(event.get("kind", "unknown"))
                by[kind] = int(by.get(kind, 0)) + 1
            else:       # after a restore: the lazy pager's end (pages-in, pages-failed)
                by = counters.setdefault("pager", {})
                by[outcome] = int(by.get(outcome, 0)) + 1
            tmp = self.root / "counters.tmp"
            tmp.write_text(json.dumps(counters, indent=1, sort_keys=True))
            os.replace(tmp, self.root / "counters.json")

    def counters(self) -> dict[str, Any]:
        try:
            doc = json.loads((self.root / "counters.json").read_text())
        except (OSError, ValueError):
            return {"restored": 0, "fallbacks": {}}
        return doc if isinstance(doc, dict) else {"restored": 0, "fallbacks": {}}

    def events(self, last: int = 20) -> list[dict[str, Any]]:
        try:
            lines = (self.root / "events.jsonl").read_text().splitlines()
        except OSError:
            return []
        out = []
        for line in lines[-last:]:
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out
