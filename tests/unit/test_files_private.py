"""coldstart.files.private_dir: node state directories only their owner can enter."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from coldstart.errors import FailedPrecondition
from coldstart.files import private_dir


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_directory_and_the_missing_ones_above_it_are_made_0700(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o755)
    d = tmp_path / "a" / "b" / "root"
    assert private_dir(d, "root") == d
    assert d.is_dir()
    assert [_mode(x) for x in (tmp_path, d.parent.parent, d.parent, d)] == [0o755] + [0o700] * 3


def test_an_existing_private_directory_is_left_as_it_is(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = tmp_path / "root"
    d.mkdir(mode=0o700)
    os.chmod(d, 0o700)
    with caplog.at_level(logging.WARNING, logger="coldstart.files"):
        private_dir(d, "root")
    assert _mode(d) == 0o700 and not caplog.records


@pytest.mark.parametrize("wide", [0o755, 0o711, 0o770, 0o1777])
def test_a_wider_directory_is_narrowed_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, wide: int) -> None:
    d = tmp_path / "cache"
    d.mkdir()
    (d / "chunk").write_bytes(b"x")
    os.chmod(d, wide)
    with caplog.at_level(logging.WARNING, logger="coldstart.files"):
        private_dir(d, "chunk cache")
    assert _mode(d) == (wide & ~0o077)          # the owner's bits (and sticky) kept
    assert (d / "chunk").read_bytes() == b"x"   # nothing inside touched
    [rec] = caplog.records
    assert f"chunk cache {d} was mode {wide:04o}" in rec.getMessage()


def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another user")
    d = tmp_path / "root"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    with pytest.raises(FailedPrecondition, match=r"belongs to uid 65534, not to this process"):
        private_dir(d, "snapshotter root")
    assert _mode(d) == 0o700 and d.stat().st_uid == 65534    # left alone


def test_a_file_where_the_directory_should_be_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "root"
    f.write_bytes(b"")
    with pytest.raises(FailedPrecondition, match=r"the snapshotter root .* is not a directory"):
        private_dir(f, "snapshotter root")


def test_a_symlink_is_refused_and_its_target_left_alone(tmp_path: Path) -> None:
    target = tmp_path / "etc"
    target.mkdir()
    os.chmod(target, 0o755)
    link = tmp_path / "cache"
    link.symlink_to(target)
    with pytest.raises(FailedPrecondition, match=r"the chunk cache .* is a symlink \(to .*etc\)"):
        private_dir(link, "chunk cache")
    assert _mode(target) == 0o755


def test_the_chunk_cache_keeps_its_own_directories_private_not_the_one_it_is_given(
        tmp_path: Path) -> None:
    """cache.dir may be a disk's mount point that other software shares: left as it is; the
    directories the cache makes in it are 0700 (a new cache.dir is made 0700 too)."""
    from coldstart.cache import ChunkCache

    shared = tmp_path / "ssd0"
    shared.mkdir()
    os.chmod(shared, 0o755)
    (shared / "sha256").mkdir()
    os.chmod(shared / "sha256", 0o755)                  # left by an older version
    ChunkCache(shared, max_bytes=1 << 20).close()
    assert _mode(shared) == 0o755
    assert [_mode(shared / d) for d in ("sha256", "wip", "packs")] == [0o700] * 3
    ChunkCache(tmp_path / "new" / "cache", max_bytes=1 << 20).close()
    assert _mode(tmp_path / "new" / "cache") == _mode(tmp_path / "new") == 0o700


def test_the_metadata_database_is_0600_also_when_an_older_version_left_it_wider(
        tmp_path: Path) -> None:
    from coldstart.snapshotter.store import Store

    Store(tmp_path / "new.db").close()
    assert _mode(tmp_path / "new.db") == 0o600
    old = tmp_path / "old.db"
    Store(old).close()
    for f in (old, tmp_path / "old.db-wal"):
        f.touch()
        os.chmod(f, 0o644)
    store = Store(old)
    try:
        assert _mode(old) == 0o600 and _mode(tmp_path / "old.db-wal") == 0o600
    finally:
        store.close()
