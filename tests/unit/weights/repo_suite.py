"""The model-repository conformance suite: every store (local dir, S3) passes the same tests.

Subclasses provide the ``repo`` fixture and ``corrupt(repo, key, data)`` which overwrites one
object behind the repository's back.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from coldstart.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    FormatError,
    IntegrityError,
    InvalidArgument,
)
from coldstart.weights import ModelRepository, ModelWatcher, Served


def make_version(folder: Path, value: float, *, sharded: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if sharded:
        from tests.unit.weights.weights_data import save_sharded

        save_sharded({"w": torch.full((64, 64), value), "b": torch.full((64,), value)}, folder, 2)
    else:
        save_file({"w": torch.full((64, 64), value), "b": torch.full((64,), value)},
                  str(folder / "model.safetensors"))
    (folder / "config.yaml").write_text(f"value: {value}\n")
    return folder


class RepositorySuite:
    """Collected through subclasses named Test*."""

    def corrupt(self, repo: ModelRepository, key: str, data: bytes) -> None:
        raise NotImplementedError

    def test_publish_activate_list(self, repo: ModelRepository, tmp_path: Path) -> None:
        v1 = repo.publish(make_version(tmp_path / "a", 1.0), "m")
        assert v1 == "1"
        assert repo.active_version("m") is None
        v2 = repo.publish(make_version(tmp_path / "b", 2.0, sharded=True), "m", activate=True)
        assert v2 == "2"
        assert repo.active_version("m") == "2"
        listing = repo.list_versions("m")
        assert [(i.version, i.complete, i.active) for i in listing] == [
            ("1", True, False), ("2", True, True)]
        assert listing[1].files == 4  # 2 shards, the index, config.yaml
        assert "m" in repo.models()
        with pytest.raises(AlreadyExists):
            repo.publish(make_version(tmp_path / "c", 3.0), "m", "2")
        with pytest.raises(InvalidArgument):
            repo.publish(tmp_path / "a", "../evil")

    def test_publish_refuses_an_invalid_checkpoint(self, repo: ModelRepository,
                                                  tmp_path: Path) -> None:
        src = make_version(tmp_path / "bad", 1.0)
        data = (src / "model.safetensors").read_bytes()
        (src / "model.safetensors").write_bytes(data[:-10])
        with pytest.raises(FormatError):
            repo.publish(src, "refused")
        assert repo.versions("refused") == []  # nothing uploaded

    def test_incomplete_version_cannot_be_activated(self, repo: ModelRepository,
                                                    tmp_path: Path) -> None:
        repo.publish(make_version(tmp_path / "a", 1.0), "half", "1")
        # An upload that died before its marker: files there, no _complete.yaml.
        repo.store.upload(make_version(tmp_path / "b", 2.0) / "model.safetensors",
                          "half/2/model.safetensors")
        assert repo.versions("half") == ["1", "2"]
        with pytest.raises(FailedPrecondition, match="not complete"):
            repo.activate("half", "2")
        assert [i.complete for i in repo.list_versions("half")] == [True, False]

    def test_activate_refuses_truncated_version(self, repo: ModelRepository,
                                                tmp_path: Path) -> None:
        src = make_version(tmp_path / "a", 1.0)
        repo.publish(src, "trunc", "1")
        self.corrupt(repo, "trunc/1/model.safetensors",
                     (src / "model.safetensors").read_bytes()[:100])
        with pytest.raises(IntegrityError, match="truncated"):
            repo.activate("trunc", "1")

    def test_rollback(self, repo: ModelRepository, tmp_path: Path) -> None:
        for i in (1, 2, 3):
            repo.publish(make_version(tmp_path / str(i), float(i)), "rb", activate=True)
        assert repo.active_version("rb") == "3"
        assert repo.rollback("rb") == "2"
        assert repo.rollback("rb") == "1"
        with pytest.raises(FailedPrecondition):
            repo.rollback("rb")
        assert repo.active_version("rb") == "1"
        assert repo.activate("rb", "3") == "1"

    def test_watch_swaps_on_the_next_poll(self, repo: ModelRepository, tmp_path: Path) -> None:
        repo.publish(make_version(tmp_path / "a", 1.0), "hot", activate=True)
        swaps: list[tuple[str | None, str]] = []

        def on_swap(old: Served[dict[str, torch.Tensor]] | None,
                    new: Served[dict[str, torch.Tensor]]) -> None:
            swaps.append((old.version if old else None, new.version))

        watcher: ModelWatcher[dict[str, torch.Tensor]] = ModelWatcher(
            repo, "hot", poll_interval=3600, on_swap=on_swap)
        assert watcher.poll_once() is True
        first = watcher.current()
        assert first is not None and first.version == "1"
        assert float(first.value["w"][0, 0]) == 1.0
        assert watcher.poll_once() is False  # nothing changed

        repo.publish(make_version(tmp_path / "b", 2.0, sharded=True), "hot", activate=True)
        assert watcher.poll_once() is True  # one poll after activation: swapped
        now = watcher.current()
        assert now is not None and now.version == "2"
        assert float(now.value["w"][0, 0]) == 2.0
        assert float(first.value["w"][0, 0]) == 1.0  # old one untouched for in-flight users
        assert swaps == [(None, "1"), ("1", "2")]

    def test_watch_thread_follows_activation(self, repo: ModelRepository,
                                             tmp_path: Path) -> None:
        repo.publish(make_version(tmp_path / "a", 1.0), "bg", activate=True)
        bg: ModelWatcher[dict[str, torch.Tensor]] = ModelWatcher(repo, "bg", poll_interval=0.05)
        with bg as watcher:
            first = watcher.current()
            assert first is not None and first.version == "1"
            repo.publish(make_version(tmp_path / "b", 2.0), "bg", activate=True)
            served = watcher.wait_for("2", timeout=60)
            assert float(served.value["b"][0]) == 2.0

    def test_corrupt_new_version_is_refused_and_old_keeps_serving(
            self, repo: ModelRepository, tmp_path: Path) -> None:
        repo.publish(make_version(tmp_path / "a", 1.0), "keep", activate=True)
        watcher: ModelWatcher[dict[str, torch.Tensor]] = ModelWatcher(
            repo, "keep", poll_interval=3600)
        watcher.poll_once()
        src = make_version(tmp_path / "b", 2.0)
        repo.publish(src, "keep", "2")
        repo.activate("keep", "2")
        # Truncated after activation (bad disk, rogue writer): the marker's sizes catch it.
        self.corrupt(repo, "keep/2/model.safetensors",
                     (src / "model.safetensors").read_bytes()[:-64])
        assert watcher.poll_once() is False
        served = watcher.current()
        assert served is not None and served.version == "1"
        assert isinstance(watcher.last_error, IntegrityError)
        assert watcher.poll_once() is False  # refused version is not reloaded every poll

        # Marker rewritten to match the truncated file: the loader's header checks catch it.
        import yaml

        marker = repo.marker("keep", "2")
        assert marker is not None
        marker["files"]["model.safetensors"]["size"] -= 64
        self.corrupt(repo, "keep/2/_complete.yaml", yaml.safe_dump(marker).encode())
        assert watcher.poll_once() is False  # still refused: the pointer did not move
        repo.activate("keep", "1")
        assert watcher.poll_once() is False  # back on the serving version
        repo.activate("keep", "2")
        assert watcher.poll_once() is False  # tried again, refused again
        assert isinstance(watcher.last_error, FormatError)
        served = watcher.current()
        assert served is not None and served.version == "1"

        # A version the caller's validation refuses is not served either.
        repo.publish(make_version(tmp_path / "c", float("nan")), "keep", "3", activate=True)

        def finite(t: dict[str, torch.Tensor]) -> None:
            if not all(bool(torch.isfinite(v).all()) for v in t.values()):
                raise ValueError("non-finite weights")

        strict: ModelWatcher[dict[str, torch.Tensor]] = ModelWatcher(
            repo, "keep", poll_interval=3600, validate=finite)
        assert strict.poll_once() is False
        assert isinstance(strict.last_error, ValueError)
        with pytest.raises(DeadlineExceeded, match="refused"):
            strict.wait_for("3", timeout=0.1)
