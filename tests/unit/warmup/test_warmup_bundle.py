"""Where the caches are, what a bundle holds, how a restore writes, what counts as compile work,
and what the wrapper says: the failures a healthy node never shows."""

from __future__ import annotations

import hashlib
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from coldstart.cache.chunks import ChunkCache
from coldstart.errors import FormatError
from coldstart.format.layer import SeekableLayer, open_layer
from coldstart.format.readat import FileReadAt
from coldstart.warmup.artifacts import Fetched, cached_reader
from coldstart.warmup.bundle import (
    Evidence,
    cache_dirs,
    evidence,
    inductor_default,
    pack,
    snapshot,
    unpack,
    watched_dirs,
)
from coldstart.warmup.keys import compute_key
from coldstart.warmup.runner import Restored, verdict


def _tree(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


def _bundle(tmp_path: Path, dirs: dict[str, Path]) -> SeekableLayer:
    buf = io.BytesIO()
    packed = pack(dirs, buf)
    blob = tmp_path / "bundle.blob"
    blob.write_bytes(buf.getvalue())
    return open_layer(FileReadAt(str(blob)), annotations=packed.layer.annotations)


def test_the_directories_follow_the_compilers_own_rules(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {"HOME": "/home/u", "USER": "alice", "TMPDIR": str(scratch)}
    d = cache_dirs(env)
    assert d["inductor"] == scratch / "torchinductor_alice"    # tempfile.gettempdir()
    # a TMPDIR that is not a directory is passed over, as tempfile does
    assert cache_dirs({**env, "TMPDIR": str(tmp_path / "nope")})["inductor"] == \
        Path("/tmp/torchinductor_alice")
    assert d["triton"] == Path("/home/u/.triton/cache")
    assert d["vllm"] == Path("/home/u/.cache/vllm")
    assert d["cuda"] == Path("/home/u/.nv/ComputeCache")
    env2 = {**env, "TRITON_HOME": "/th", "XDG_CACHE_HOME": "/xdg", "USER": "a/b",
            "TORCHINDUCTOR_CACHE_DIR": "rel/ind"}
    d2 = cache_dirs(env2)
    assert d2["triton"] == Path("/th/.triton/cache") and d2["vllm"] == Path("/xdg/vllm")
    assert d2["inductor"] == Path(os.path.abspath("rel/ind"))
    # the precompiled headers stay under the default, whatever the variable says
    assert watched_dirs(env2)["headers"] == scratch / "torchinductor_a_b/precompiled_headers"
    assert inductor_default({"HOME": "/h"}).parent == Path("/tmp")


def test_pack_leaves_nested_roles_and_precompiled_headers_out(tmp_path: Path) -> None:
    ind = tmp_path / "torchinductor_u"
    _tree(ind, {"fxgraph/a/b": b"g", "ab/cab.so": b"so", "triton/0/k.cubin": b"cu",
                "precompiled_headers/x.gch": b"h" * 1000})
    buf = io.BytesIO()
    # Inductor puts Triton's cache under its own: one copy, under the inductor role
    packed = pack({"inductor": ind, "triton": ind / "triton" / "0"}, buf)
    assert packed.roles == {"inductor": 3} and packed.files == 3


def test_a_symlink_planted_in_a_cache_directory_is_not_followed(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _tree(src, {"ab/authorized_keys": b"ssh-ed25519 AAAA attacker"})
    layer = _bundle(tmp_path, {"inductor": src})
    victim = tmp_path / "victim"
    victim.mkdir()
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "ab").symlink_to(victim)            # planted by another user of /tmp
    with pytest.raises(FormatError, match="symlink"):
        unpack(layer, {"inductor": dst})
    assert list(victim.iterdir()) == []
    # a file planted where a file would go is kept, not written through
    dst2 = tmp_path / "dst2"
    (dst2 / "ab").mkdir(parents=True)
    (dst2 / "ab" / "authorized_keys").symlink_to(victim / "k")
    done = unpack(layer, {"inductor": dst2})
    assert done.kept == 1 and done.files == 0 and not (victim / "k").exists()


def test_a_restore_that_cannot_write_is_a_refusal_not_a_crash(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    from coldstart.warmup import artifacts, runner

    src = tmp_path / "src"
    _tree(src, {"ab/cab.so": b"so" * 100})
    layer = _bundle(tmp_path, {"inductor": src})
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory should be")
    found = artifacts.Found("sha256:" + "1" * 64, digest="sha256:" + "2" * 64)
    monkeypatch.setattr(artifacts, "find", lambda *a, **k: found)
    monkeypatch.setattr(artifacts, "open_bundle", lambda *a, **k: layer)
    got = runner.restore(None, "registry.example/app:v1",  # type: ignore[arg-type]
                         key=compute_key(), dirs={"inductor": blocked})
    assert got.status == "refused"
    assert "Error" in got.reason and blocked.read_text().startswith("a file")


def test_a_wrong_chunk_in_the_node_cache_is_dropped_and_read_again(tmp_path: Path) -> None:
    src = tmp_path / "src"
    data = os.urandom(300_000)
    _tree(src, {"ab/cab.so": data})
    layer = _bundle(tmp_path, {"inductor": src})
    cache = ChunkCache(tmp_path / "chunks", max_bytes=1 << 30)
    entry = layer.resolve("inductor/ab/cab.so")
    chunk = entry.chunks[0]
    assert chunk.digest
    bad = b"\0" * chunk.chunk_size
    cache.put(chunk.digest, bad, verified=True)   # a cache that lies (its disk, its owner)
    stats = Fetched()
    got = cached_reader(cache, stats)(layer, "inductor/ab/cab.so")
    assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    assert cache.get(chunk.digest) != bad
    cache.close()


def test_compile_work_is_classified_by_what_it_is_not_whose_directory() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as t:
        root = Path(t)
        dirs = {"inductor": root / "ind", "vllm": root / "vllm", "headers": root / "h"}
        for d in dirs.values():
            d.mkdir()
        before = snapshot(dirs)
        _tree(dirs["inductor"], {"triton/0/abc/k.cubin": b"c", "xy/cxy.so": b"s",
                                 "xy/cxy.cpp": b"src"})
        _tree(dirs["vllm"], {"torch_compile_cache/h/rank_0_0/fxgraph/ab/entry": b"g"})
        _tree(dirs["headers"], {"abc.gch": b"pch"})
        ev = evidence(before, dirs)
        assert ev.compiled == 3 and ev.graphs == 1 and ev.new_files == 5


def test_verdicts() -> None:
    key = compute_key()
    none = Evidence()
    work = Evidence(compiled=4, graphs=1)
    restored = Restored("restored", "", key, files=10, compiles_at_capture=4)
    assert verdict(restored, none).verdict == "hit"
    assert verdict(restored, work).verdict == "miss"          # as many as at capture
    assert verdict(restored, Evidence(compiled=1)).verdict == "partial"
    assert verdict(Restored("miss", "no artifact", key), none).verdict == "miss"
    # no restore asked: the caches were already here (a warm node) or not
    assert verdict(None, none, had_files=True).verdict == "hit"
    assert verdict(None, work, had_files=True).verdict == "partial"
    assert verdict(None, none).verdict == "miss"


def test_run_exits_as_a_shell_would_when_a_signal_ends_the_app(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "coldstart.commands.warmup", "run", "--",
                          sys.executable, "-c", "import os, signal; "
                          "os.kill(os.getpid(), signal.SIGKILL)"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "HOME": str(tmp_path), "TMPDIR": str(tmp_path)})
    assert out.returncode == 128 + signal.SIGKILL, out.stderr
    ok = subprocess.run([sys.executable, "-m", "coldstart.commands.warmup", "run", "--",
                         sys.executable, "-c", "raise SystemExit(3)"],
                        capture_output=True, text=True, timeout=60,
                        env={**os.environ, "HOME": str(tmp_path), "TMPDIR": str(tmp_path)})
    assert ok.returncode == 3
    assert "warm-up cache miss: no restore asked; 0 compiles" in ok.stderr


def test_a_cache_inside_another_counts_as_its_own(tmp_path: Path) -> None:
    """CUDA_CACHE_PATH inside TORCHINDUCTOR_CACHE_DIR: the driver's JIT files (no suffix)
    are compiles; two roles naming one directory are packed once."""
    ind = tmp_path / "cache"
    dirs = {"inductor": ind, "cuda": ind / "cuda"}
    dirs["cuda"].mkdir(parents=True)
    before = snapshot(dirs)
    _tree(ind, {"cuda/ComputeCache/a/b1c2": b"ptx jit"})
    ev = evidence(before, dirs)
    assert ev.compiled == 1 and ev.new_files == 1
    buf = io.BytesIO()
    same = pack({"inductor": ind, "triton": ind}, buf)
    assert same.roles == {"inductor": 1} and same.files == 1


def test_a_refused_restore_that_wrote_files_and_compiled_nothing_is_a_hit() -> None:
    key = compute_key()
    part = Restored("refused", "IntegrityError: …", key, files=3)
    assert verdict(part, Evidence()).verdict == "hit"
    assert verdict(part, Evidence(compiled=2), had_files=True).verdict == "partial"


def test_a_file_a_crash_cut_short_is_written_again(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _tree(src, {"ab/cab.so": b"x" * 5000, "ab/other.so": b"y" * 10})
    layer = _bundle(tmp_path, {"inductor": src})
    dst = tmp_path / "dst"
    _tree(dst, {"ab/cab.so": b"x" * 1000, "ab/other.so": b"z" * 10})  # short; same size
    done = unpack(layer, {"inductor": dst})
    assert done.files == 1 and done.kept == 1
    assert (dst / "ab/cab.so").read_bytes() == b"x" * 5000
    assert (dst / "ab/other.so").read_bytes() == b"z" * 10     # a local entry is kept
