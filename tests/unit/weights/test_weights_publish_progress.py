"""`models publish` reports progress by bytes: every byte hashed and uploaded, once."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from coldstart.weights import ModelRepository
from tests.unit.weights.repo_suite import make_version


class _Counting:
    def __init__(self) -> None:
        self.expected = 0
        self.phases: Counter[str] = Counter()

    def expect(self, n: int) -> None:
        self.expected += n

    def advance(self, phase: str, n: int) -> None:
        self.phases[phase] += n


def test_publish_counts_every_byte(tmp_path: Path) -> None:
    folder = make_version(tmp_path / "src", 1.0, sharded=True)
    total = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    progress = _Counting()
    version = ModelRepository(str(tmp_path / "repo")).publish(folder, "m", progress=progress)
    assert version == "1"
    assert progress.expected == total
    assert progress.phases == {"hash": total, "upload": total}
    copied = tmp_path / "repo" / "m" / "1"
    assert sorted(p.name for p in copied.iterdir() if not p.name.startswith("_")) == sorted(
        p.name for p in folder.iterdir())
