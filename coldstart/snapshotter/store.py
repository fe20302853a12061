"""The snapshotter's metadata: containerd's snapshot records in SQLite (WAL), behind transactions.

Like containerd's ``snapshots/storage`` (its bolt metastore), every read and write happens inside
``with store.transaction(writable=...) as tx:``; the methods of :class:`Tx` are the only way in.
One snapshot has a numeric ``id`` (its directory name, never reused) that survives ``Commit``,
a ``key`` (for a committed snapshot: its ``name``), a ``kind`` and an optional committed parent.

Example::

    store = Store("/var/lib/coldstart/metadata.db")
    with store.transaction(writable=True) as tx:
        snap = tx.create(Kind.ACTIVE, "k1", parent="", labels={})
        tx.commit_active("k1", "layer-1", Usage(0, 0), labels={})
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from coldstart.errors import (
    AlreadyExists,
    ColdstartError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from coldstart.lazyfs.spec import LABEL_LIMIT

__all__ = ["Info", "Kind", "Snapshot", "Store", "Tx", "Usage", "read_infos", "validate_labels"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS snapshots (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,   -- never reused: it names a directory
    key       TEXT NOT NULL UNIQUE,                -- key (active/view) or name (committed)
    parent_id INTEGER REFERENCES snapshots(id),    -- a committed snapshot or NULL
    kind      INTEGER NOT NULL,
    created   INTEGER NOT NULL,                    -- ns since the epoch, UTC
    updated   INTEGER NOT NULL,
    labels    TEXT NOT NULL DEFAULT '{}',          -- JSON object
    size      INTEGER NOT NULL DEFAULT 0,          -- usage recorded at commit
    inodes    INTEGER NOT NULL DEFAULT 0,
    remote    INTEGER NOT NULL DEFAULT 0           -- 1: fs is a lazily mounted layer
);
CREATE INDEX IF NOT EXISTS snapshots_parent ON snapshots(parent_id);
"""


class Kind(enum.IntEnum):
    """containerd's snapshot kinds, with the numbers of the ``Kind`` proto enum."""

    UNKNOWN = 0
    VIEW = 1
    ACTIVE = 2
    COMMITTED = 3

    @property
    def word(self) -> str:
        """The word containerd's filters use (``kind==committed``)."""
        return self.name.lower()


@dataclass(frozen=True)
class Usage:
    size: int = 0
    inodes: int = 0


@dataclass(frozen=True)
class Info:
    """What Stat/List report: ``name`` is the key of an active/view snapshot."""

    name: str
    parent: str
    kind: Kind
    created_ns: int
    updated_ns: int
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Snapshot:
    """An active or view snapshot and the ids of its parents, nearest first."""

    id: str
    kind: Kind
    parent_ids: tuple[str, ...] = ()


def validate_labels(labels: Mapping[str, str]) -> None:
    """containerd's rule: a label's key + value is at most 4096 bytes."""
    for k, v in labels.items():
        if len(k.encode()) + len(v.encode()) > LABEL_LIMIT:
            raise InvalidArgument(
                f"label key and value length ({len(k.encode()) + len(v.encode())} bytes) "
                f"greater than maximum size ({LABEL_LIMIT} bytes), key: {k[:64]}")


def _clean(labels: Mapping[str, str]) -> dict[str, str]:
    # containerd does not store labels with empty values: setting "" deletes the label
    return {k: v for k, v in labels.items() if v != ""}


def _now() -> int:
    return time.time_ns()


class Tx:
    """One transaction; obtained from :meth:`Store.transaction`, valid inside its ``with``."""

    def __init__(self, conn: sqlite3.Connection, writable: bool) -> None:
        self._conn = conn
        self.writable = writable

    def _need_write(self) -> None:
        if not self.writable:
            raise FailedPrecondition("write in a read-only transaction")

    def _row(self, key: str) -> sqlite3.Row:
        row: sqlite3.Row | None = self._conn.execute(
            "SELECT * FROM snapshots WHERE key = ?", (key,)).fetchone()
        if row is None:
            raise NotFound(f"snapshot {key} does not exist")
        return row

    def _key_of(self, snapshot_id: int | None) -> str:
        if snapshot_id is None:
            return ""
        row = self._conn.execute("SELECT key FROM snapshots WHERE id = ?",
                                 (snapshot_id,)).fetchone()
        if row is None:
            raise NotFound(f"parent snapshot id {snapshot_id} does not exist")
        return str(row["key"])

    def _info(self, row: sqlite3.Row) -> Info:
        return Info(name=row["key"], parent=self._key_of(row["parent_id"]),
                    kind=Kind(row["kind"]), created_ns=row["created"],
                    updated_ns=row["updated"], labels=json.loads(row["labels"]))

    def _parent_ids(self, parent_id: int | None) -> tuple[str, ...]:
        ids: list[str] = []
        while parent_id is not None:
            ids.append(str(parent_id))
            row = self._conn.execute("SELECT parent_id FROM snapshots WHERE id = ?",
                                     (parent_id,)).fetchone()
            if row is None:
                raise NotFound(f"parent snapshot id {parent_id} does not exist")
            parent_id = row["parent_id"]
        return tuple(ids)

    def get_info(self, key: str) -> tuple[str, Info, Usage]:
        """The id, info and recorded usage of snapshot ``key`` (any kind)."""
        row = self._row(key)
        return str(row["id"]), self._info(row), Usage(row["size"], row["inodes"])

    def is_remote(self, key: str) -> bool:
        return bool(self._row(key)["remote"])

    def get_snapshot(self, key: str) -> Snapshot:
        """An active or view snapshot with its parent chain (for its mounts)."""
        row = self._row(key)
        kind = Kind(row["kind"])
        if kind not in (Kind.ACTIVE, Kind.VIEW):
            raise FailedPrecondition(f"requested snapshot {key} not active or view")
        return Snapshot(id=str(row["id"]), kind=kind,
                        parent_ids=self._parent_ids(row["parent_id"]))

    def create(self, kind: Kind, key: str, parent: str,
               labels: Mapping[str, str]) -> Snapshot:
        """Record a new active or view snapshot ``key`` on the committed ``parent``."""
        self._need_write()
        if kind not in (Kind.ACTIVE, Kind.VIEW):
            raise InvalidArgument(f"snapshot type {kind.word} invalid; only snapshots of type "
                                  "Active or View can be created")
        if not key:
            raise InvalidArgument("snapshot key must not be empty")
        validate_labels(labels)
        parent_id: int | None = None
        if parent:
            try:
                prow = self._row(parent)
            except NotFound:
                raise NotFound(f"missing parent {parent!r} bucket: not found") from None
            if prow["kind"] != Kind.COMMITTED:
                raise InvalidArgument(f"parent {parent!r} is not committed snapshot")
            parent_id = int(prow["id"])
        now = _now()
        try:
            cur = self._conn.execute(
                "INSERT INTO snapshots (key, parent_id, kind, created, updated, labels) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (key, parent_id, int(kind), now, now, json.dumps(_clean(labels))))
        except sqlite3.IntegrityError:
            raise AlreadyExists(f"snapshot {key}: already exists") from None
        assert cur.lastrowid is not None
        return Snapshot(id=str(cur.lastrowid), kind=kind,
                        parent_ids=self._parent_ids(parent_id))

    def commit_active(self, key: str, name: str, usage: Usage, labels: Mapping[str, str],
                      *, remote: bool = False) -> str:
        """Turn active ``key`` into committed ``name`` (same id); returns the id."""
        self._need_write()
        if not name:
            raise InvalidArgument("committed snapshot name must not be empty")
        validate_labels(labels)
        if self._conn.execute("SELECT 1 FROM snapshots WHERE key = ?", (name,)).fetchone():
            raise AlreadyExists(f"committed snapshot {name}: already exists")
        try:
            row = self._row(key)
        except NotFound:
            raise NotFound(f"failed to get active snapshot {key!r}: not found") from None
        if row["kind"] != Kind.ACTIVE:
            raise FailedPrecondition(f"snapshot {key!r} is not active")
        now = _now()
        self._conn.execute(
            "UPDATE snapshots SET key = ?, kind = ?, created = ?, updated = ?, labels = ?, "
            "size = ?, inodes = ?, remote = ? WHERE id = ?",
            (name, int(Kind.COMMITTED), now, now, json.dumps(_clean(labels)), usage.size,
             usage.inodes, int(remote), row["id"]))
        return str(row["id"])

    def remove(self, key: str) -> tuple[str, Kind]:
        """Delete the record of ``key``; it must have no children."""
        self._need_write()
        row = self._row(key)
        if self._conn.execute("SELECT 1 FROM snapshots WHERE parent_id = ? LIMIT 1",
                              (row["id"],)).fetchone():
            raise FailedPrecondition("cannot remove snapshot with child")
        self._conn.execute("DELETE FROM snapshots WHERE id = ?", (row["id"],))
        return str(row["id"]), Kind(row["kind"])

    def update_info(self, name: str, labels: Mapping[str, str],
                    fieldpaths: list[str]) -> Info:
        """Change labels only: all of them (no paths, or ``labels``) or ``labels.<key>`` ones."""
        self._need_write()
        row = self._row(name)
        current: dict[str, str] = json.loads(row["labels"])
        if fieldpaths:
            for path in fieldpaths:
                if path.startswith("labels."):
                    k = path[len("labels."):]
                    current[k] = labels.get(k, "")
                elif path == "labels":
                    current = dict(labels)
                else:
                    raise InvalidArgument(f"cannot update {path!r} field on snapshot {name!r}")
        else:
            current = dict(labels)
        current = _clean(current)
        validate_labels(current)
        self._conn.execute("UPDATE snapshots SET labels = ?, updated = ? WHERE id = ?",
                           (json.dumps(current), _now(), row["id"]))
        return self._info(self._row(name))

    def walk(self, match: Callable[[Info], bool] | None = None) -> list[Info]:
        """Every snapshot's info (in id order) for which ``match`` holds."""
        rows = self._conn.execute("SELECT * FROM snapshots ORDER BY id").fetchall()
        infos = [self._info(r) for r in rows]
        return [i for i in infos if match is None or match(i)]

    def id_map(self) -> dict[str, str]:
        """id → key of every snapshot (which directories are still wanted)."""
        return {str(r["id"]): r["key"]
                for r in self._conn.execute("SELECT id, key FROM snapshots")}

    def counts(self) -> dict[Kind, int]:
        return {Kind(r[0]): r[1] for r in self._conn.execute(
            "SELECT kind, COUNT(*) FROM snapshots GROUP BY kind")}


def read_infos(path: str | Path) -> list[Info]:
    """Every snapshot's info in the metadata file ``path``, opened read-only (another process,
    e.g. ``coldstart snapshotter status``, beside the running daemon); [] if there is none.

    Raises :class:`~coldstart.errors.Unavailable` when the file cannot be read."""
    p = Path(path)
    if not p.exists():
        return []
    try:
        conn = sqlite3.connect(f"{p.resolve().as_uri()}?mode=ro", uri=True, timeout=10.0,
                               isolation_level=None)
        try:
            conn.row_factory = sqlite3.Row
            conn.execute("BEGIN")
            return Tx(conn, writable=False).walk()
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise Unavailable(f"cannot read the snapshotter's metadata {p}: {exc}") from exc


class Store:
    """SQLite metadata file (WAL) shared by the threads of one process."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # root-only (SQLite gives its -wal and -shm files the database file's mode); one that an
        # older version left 0644 is narrowed, its -wal and -shm files with it
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.fchmod(fd, 0o600)
            finally:
                os.close(fd)
            for side in ("-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.chmod(f"{self.path}{side}", 0o600)
        except OSError as exc:
            raise Unavailable(f"cannot open the snapshotter's metadata {self.path}: "
                              f"{exc.strerror}") from None
        # one connection, serialised by a lock: writes are serialised by SQLite anyway, and
        # the directory work in a transaction must not interleave (containerd's bolt does same)
        self._lock = threading.RLock()
        self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                                     timeout=30.0)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        self._conn.executescript(_SCHEMA)
        self._in_tx = False

    @contextlib.contextmanager
    def transaction(self, writable: bool = False) -> Iterator[Tx]:
        """A transaction: committed when the block ends, rolled back if it raises."""
        with self._lock:
            if self._in_tx:
                raise ColdstartError("nested store transactions are not supported")
            self._conn.execute("BEGIN IMMEDIATE" if writable else "BEGIN")
            self._in_tx = True
            try:
                yield Tx(self._conn, writable)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            else:
                self._conn.execute("COMMIT")
            finally:
                self._in_tx = False

    def close(self) -> None:
        with self._lock:
            self._conn.close()
