"""The SQLite metadata store: containerd's storage rules, transactions, persistence."""

from __future__ import annotations

from pathlib import Path

import pytest

from coldstart.errors import (
    AlreadyExists,
    ColdstartError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from coldstart.snapshotter.store import Kind, Store, Usage


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "metadata.db")


def test_parent_chain_and_commit_keep_ids(store: Store) -> None:
    with store.transaction(writable=True) as tx:
        a = tx.create(Kind.ACTIVE, "a", "", {"x": "1"})
        assert tx.commit_active("a", "a-c", Usage(10, 2), {"y": "2"}) == a.id
        b = tx.create(Kind.ACTIVE, "b", "a-c", {})
        tx.commit_active("b", "b-c", Usage(), {})
        c = tx.create(Kind.VIEW, "c", "b-c", {})
    assert c.parent_ids == (b.id, a.id)
    with store.transaction() as tx:
        sid, info, usage = tx.get_info("a-c")
        assert (sid, info.kind, info.parent, info.labels, usage) == \
            (a.id, Kind.COMMITTED, "", {"y": "2"}, Usage(10, 2))
        assert tx.get_info("c")[1].parent == "b-c"
        assert tx.get_snapshot("c") == c
        with pytest.raises(FailedPrecondition):
            tx.get_snapshot("a-c")


def test_containerd_errors(store: Store) -> None:
    with store.transaction(writable=True) as tx:
        tx.create(Kind.ACTIVE, "a", "", {})
        tx.create(Kind.VIEW, "v", "", {})
        with pytest.raises(AlreadyExists):
            tx.create(Kind.VIEW, "a", "", {})
        with pytest.raises(NotFound):
            tx.create(Kind.ACTIVE, "x", "nope", {})
        with pytest.raises(InvalidArgument, match="not committed"):
            tx.create(Kind.ACTIVE, "x", "a", {})
        with pytest.raises(InvalidArgument):
            tx.create(Kind.COMMITTED, "x", "", {})
        with pytest.raises(FailedPrecondition, match="not active"):
            tx.commit_active("v", "v-c", Usage(), {})
        tx.commit_active("a", "a-c", Usage(), {})
        tx.create(Kind.ACTIVE, "b", "a-c", {})
        with pytest.raises(AlreadyExists):
            tx.commit_active("b", "a-c", Usage(), {})
        with pytest.raises(FailedPrecondition, match="child"):
            tx.remove("a-c")
        with pytest.raises(InvalidArgument, match="4096"):
            tx.create(Kind.ACTIVE, "big", "", {"k": "v" * 4096})
        with pytest.raises(InvalidArgument):
            tx.update_info("b", {}, ["name"])


def test_a_failed_transaction_changes_nothing(store: Store) -> None:
    with pytest.raises(RuntimeError), store.transaction(writable=True) as tx:
        tx.create(Kind.ACTIVE, "a", "", {})
        raise RuntimeError("boom")
    with store.transaction() as tx:
        assert tx.walk() == []
        # Store._need_write raises the bare base class (no more specific kind): not sqlite's
        # "readonly database", but coldstart's refusal before any SQL runs
        with pytest.raises(ColdstartError, match="write in a read-only transaction"):
            tx.create(Kind.ACTIVE, "a", "", {})
        assert tx.walk() == []


def test_ids_are_never_reused(store: Store) -> None:
    with store.transaction(writable=True) as tx:
        first = tx.create(Kind.ACTIVE, "a", "", {}).id
        tx.remove("a")
        second = tx.create(Kind.ACTIVE, "a", "", {}).id
    assert int(second) > int(first)


def test_update_labels_by_field_paths(store: Store) -> None:
    with store.transaction(writable=True) as tx:
        tx.create(Kind.ACTIVE, "a", "", {"x": "1", "y": "2"})
        assert tx.update_info("a", {"x": "9", "y": "no", "z": "3"},
                              ["labels.x", "labels.z"]).labels == {"x": "9", "y": "2", "z": "3"}
        assert tx.update_info("a", {}, ["labels.x"]).labels == {"y": "2", "z": "3"}
        assert tx.update_info("a", {"q": "1", "e": ""}, ["labels"]).labels == {"q": "1"}
        assert tx.update_info("a", {"all": "new"}, []).labels == {"all": "new"}
        with pytest.raises(NotFound):
            tx.update_info("nope", {}, [])


def test_the_store_survives_reopening(tmp_path: Path) -> None:
    s1 = Store(tmp_path / "m.db")
    with s1.transaction(writable=True) as tx:
        tx.create(Kind.ACTIVE, "a", "", {"k": "v"})
        tx.commit_active("a", "a-c", Usage(1, 1), {"k": "v"})
    s1.close()
    s2 = Store(tmp_path / "m.db")
    with s2.transaction() as tx:
        assert [(i.name, i.kind, i.labels) for i in tx.walk()] == \
            [("a-c", Kind.COMMITTED, {"k": "v"})]
        assert tx.counts() == {Kind.COMMITTED: 1}
    assert s2._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
