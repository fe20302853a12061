"""The bench's warm-cache helpers: the wrapped command, the recording's cache mounts, the
floor's per-run copies."""

from __future__ import annotations

from pathlib import Path

from coldstart.benchmark import warmcache
from coldstart.benchmark.node import IO_MOUNT, WARMUP_REPORT


def test_the_app_runs_under_the_wrapper_against_the_image_registry() -> None:
    argv = warmcache.warm_command(["python3", "/app/a.py"], "127.0.0.1:5000/bench/c:zstd",
                                  capture=True)
    assert argv[:4] == ["python3", "-m", "coldstart.commands.warmup", "run"]
    assert argv[argv.index("--image") + 1] == "127.0.0.1:5000/bench/c:zstd"
    assert argv[argv.index("--insecure") + 1] == "127.0.0.1:5000"
    assert argv[argv.index("--report") + 1] == f"{IO_MOUNT}/{WARMUP_REPORT}"
    assert "--capture" in argv
    assert argv[argv.index("--") + 1:] == ["python3", "/app/a.py"]
    assert "--capture" not in warmcache.warm_command(["x"], "r.example/a:b")


def test_recording_mounts_put_empty_dirs_where_the_container_env_has_each_cache(
        tmp_path: Path) -> None:
    dst = tmp_path / "caches"
    (dst / "inductor").mkdir(parents=True)
    (dst / "inductor" / "left-over").write_text("from an earlier recording")
    mounts = dict(warmcache.recording_mounts(
        ["PATH=/usr/bin", "TORCHINDUCTOR_CACHE_DIR=/var/cache/warmup/inductor",
         "TRITON_CACHE_DIR=/var/cache/triton"], dst))
    assert mounts == {
        str(dst / "cuda"): "/root/.nv/ComputeCache",
        str(dst / "inductor"): "/var/cache/warmup/inductor",
        str(dst / "triton"): "/var/cache/triton",
        str(dst / "vllm"): "/root/.cache/vllm",
    }
    for host in mounts:
        assert Path(host).is_dir() and not any(Path(host).iterdir())


def test_each_floor_run_gets_its_own_copy_of_the_caches(tmp_path: Path) -> None:
    src = tmp_path / "local" / "inductor"
    (src / "fx").mkdir(parents=True)
    (src / "fx" / "entry").write_bytes(b"graph")
    first = warmcache.fresh_copies([(str(src), "/var/cache/i")], tmp_path / "run")
    (Path(first[0][0]) / "fx" / "new").write_bytes(b"written by a run")
    second = warmcache.fresh_copies([(str(src), "/var/cache/i")], tmp_path / "run")
    assert second == first == ((str(tmp_path / "run" / "inductor"), "/var/cache/i"),)
    assert sorted(p.name for p in (Path(second[0][0]) / "fx").iterdir()) == ["entry"]
