"""``coldstart bench --memory hot``: how much memory is written and freed before each run."""

from __future__ import annotations

from pathlib import Path

from coldstart.benchmark.node import hot_memory_bytes

GiB = 1 << 30
NONE = "/nonexistent/cgroup"      # no cgroup file: no cgroup limit


def _meminfo(tmp_path: Path, text: str) -> str:
    path = tmp_path / "meminfo"
    path.write_text(text)
    return str(path)


def test_at_most_half_of_the_available_memory(tmp_path: Path) -> None:
    info = "MemTotal:  8000000 kB\nMemFree:  500000 kB\nMemAvailable:  2097152 kB\n"
    assert hot_memory_bytes(3 * GiB, _meminfo(tmp_path, info), NONE) == GiB
    info = "MemAvailable: 20971520 kB\n"
    assert hot_memory_bytes(3 * GiB, _meminfo(tmp_path, info), NONE) == 3 * GiB


def test_the_most_when_the_kernel_does_not_say(tmp_path: Path) -> None:
    assert hot_memory_bytes(GiB, _meminfo(tmp_path, "MemTotal: 1 kB\n"), NONE) == GiB
    assert hot_memory_bytes(GiB, str(tmp_path / "missing"), NONE) == GiB
    assert hot_memory_bytes(GiB, _meminfo(tmp_path, "MemAvailable: lots\n"), NONE) == GiB



def _cgroup(tmp_path: Path, line: str, files: dict[str, str]) -> tuple[str, str]:
    tmp_path.mkdir()
    (tmp_path / "cgroup").write_text(line)
    root = tmp_path / "fs"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return str(tmp_path / "cgroup"), str(root)


def test_at_most_half_of_what_the_cgroup_has_left(tmp_path: Path) -> None:
    info = _meminfo(tmp_path, "MemAvailable: 20971520 kB\n")
    v2 = _cgroup(tmp_path / "v2", "0::/box\n", {"box/memory.max": f"{3 * GiB}\n",
                                                "box/memory.current": f"{GiB}\n"})
    assert hot_memory_bytes(3 * GiB, info, *v2) == GiB
    v1 = _cgroup(tmp_path / "v1", "4:memory:/box\n0::/\n",
                 {"memory/box/memory.limit_in_bytes": f"{2 * GiB}",
                  "memory/box/memory.usage_in_bytes": f"{GiB}"})
    assert hot_memory_bytes(3 * GiB, info, *v1) == GiB // 2
    unlimited = _cgroup(tmp_path / "none", "0::/box\n", {"box/memory.max": "max\n",
                                                         "box/memory.current": "5\n"})
    assert hot_memory_bytes(3 * GiB, info, *unlimited) == 3 * GiB
    over = _cgroup(tmp_path / "over", "0::/box\n", {"box/memory.max": "10\n",
                                                    "box/memory.current": "20\n"})
    assert hot_memory_bytes(3 * GiB, info, *over) == 0
