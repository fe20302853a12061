"""The model repository on a local directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from coldstart.errors import InvalidArgument, NotFound
from coldstart.weights import ModelRepository
from tests.unit.weights.repo_suite import RepositorySuite


class TestLocalRepository(RepositorySuite):
    @pytest.fixture
    def repo(self, tmp_path: Path) -> ModelRepository:
        return ModelRepository(tmp_path / "repo")

    def corrupt(self, repo: ModelRepository, key: str, data: bytes) -> None:
        (Path(repo.store.root) / key).write_bytes(data)


def test_unknown_scheme_is_refused() -> None:
    with pytest.raises(InvalidArgument):
        ModelRepository("gs://bucket/x")


def test_listing_a_missing_or_file_root_is_refused(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="no such repository directory"):
        ModelRepository(tmp_path / "absent").list_versions()
    with pytest.raises(NotFound):
        ModelRepository(tmp_path / "absent").list_versions("m")
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidArgument, match="not a directory"):
        ModelRepository(tmp_path / "file").list_versions()
    (tmp_path / "empty").mkdir()
    assert ModelRepository(tmp_path / "empty").list_versions() == []
