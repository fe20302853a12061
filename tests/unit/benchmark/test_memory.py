"""``coldstart bench --memory hot``: how much memory is written and freed before each run."""

from __future__ import annotations

from pathlib import Path

from coldstart.benchmark.node import hot_memory_bytes

GiB = 1 << 30


def _meminfo(tmp_path: Path, text: str) -> str:
    path = tmp_path / "meminfo"
    path.write_text(text)
    return str(path)


def test_at_most_half_of_the_available_memory(tmp_path: Path) -> None:
    info = "MemTotal:  8000000 kB\nMemFree:  500000 kB\nMemAvailable:  2097152 kB\n"
    assert hot_memory_bytes(3 * GiB, _meminfo(tmp_path, info)) == GiB
    info = "MemAvailable: 20971520 kB\n"
    assert hot_memory_bytes(3 * GiB, _meminfo(tmp_path, info)) == 3 * GiB


def test_the_most_when_the_kernel_does_not_say(tmp_path: Path) -> None:
    assert hot_memory_bytes(GiB, _meminfo(tmp_path, "MemTotal: 1 kB\n")) == GiB
    assert hot_memory_bytes(GiB, str(tmp_path / "missing")) == GiB
    assert hot_memory_bytes(GiB, _meminfo(tmp_path, "MemAvailable: lots\n")) == GiB

