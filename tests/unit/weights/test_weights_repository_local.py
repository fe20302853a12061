"""The model repository on a local directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from coldstart.errors import InvalidArgument
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
