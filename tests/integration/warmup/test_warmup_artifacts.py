"""Warm-up caches end to end with real torch, g++ (Inductor's C++ backend) and a real registry:
capture → push → a fresh node (new cache directories, new chunk cache) → restore → the app
starts without compiling; foreign keys and tampered chunks are never used, and the app still
reaches READY by compiling."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from coldstart.oci.registry import RegistryClient
from coldstart.stack.registry import Registry
from coldstart.warmup import artifacts
from coldstart.warmup.bundle import OFF_IN_CONTAINERS, cache_dirs, evidence, snapshot
from coldstart.warmup.keys import compute_key
from coldstart.warmup.runner import capture, restore, verdict
from tests.integration.pull.pull_env import push_image

# a compiled function small enough to compile in seconds, with a C++ kernel (Inductor, CPU)
APP = r"""
import json, os, socket, sys
def notify(msg):
    path = os.environ.get("NOTIFY_SOCKET")
    if path:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(msg.encode(), path)
import torch
from torch._dynamo.utils import counters
torch.manual_seed(0)
x = torch.randn(64, 64)
f = torch.compile(lambda t: (t.sin() * t.cos() + t.exp().tanh()).sum(dim=1))
notify("STATUS=warm-up")
y = f(x)
notify("READY=1\nSTATUS=ready")
print(json.dumps({"result": [round(v, 5) for v in y[:4].tolist()],
                  "hit": counters["inductor"].get("fxgraph_cache_hit", 0),
                  "miss": counters["inductor"].get("fxgraph_cache_miss", 0)}))
"""


@dataclass
class Captured:
    image: str
    result: list[float]
    files: dict[str, bytes]        # role/relative path → content, as captured
    artifact: str


def _env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_"))}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"),
               TRITON_CACHE_DIR=str(root / "triton"), VLLM_CACHE_ROOT=str(root / "vllm"),
               CUDA_CACHE_PATH=str(root / "cuda"), HOME=str(root / "home"),
               # as `coldstart warmup run` sets it (the headers live outside the cache dirs)
               **OFF_IN_CONTAINERS)
    return env


def _run_app(app: Path, env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run([sys.executable, str(app)], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _dirs(root: Path) -> dict[str, Path]:
    return cache_dirs(_env(root))


def _files(dirs: dict[str, Path]) -> dict[str, bytes]:
    out = {}
    for role, root in dirs.items():
        for p in root.rglob("*"):
            if p.is_file() and not p.name.endswith(".lock") and not p.name.startswith("tmp"):
                out[f"{role}/{p.relative_to(root).as_posix()}"] = p.read_bytes()
    return out


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("app") / "app.py"
    path.write_text(APP)
    return path


@pytest.fixture(scope="module")
def client(registry: Registry) -> Iterator[RegistryClient]:
    with RegistryClient(insecure_hosts=[registry.host], timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def captured(registry: Registry, client: RegistryClient, app: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Captured:
    """A node that compiled from scratch, then captured its caches for an image."""
    image = f"{registry.host}/warmup/app:v1"
    push_image(client, image, [[]])
    node = tmp_path_factory.mktemp("node-a")
    dirs = _dirs(node)
    before = snapshot(dirs)
    cold = _run_app(app, _env(node))
    assert cold["miss"] == 1 and cold["hit"] == 0
    ev = evidence(before, dirs)
    assert ev.compiled >= 1, "a cold compile leaves compiled kernels in the cache"
    got = capture(client, image, key=compute_key(), dirs=dirs, compiles=ev.compiled)
    assert got.files > 0
    return Captured(image, list(cold["result"]), _files(dirs), got.artifact)  # type: ignore[arg-type]


def test_a_fresh_node_restores_and_compiles_nothing(captured: Captured, client: RegistryClient,
                                                    app: Path, tmp_path: Path) -> None:
    dirs = _dirs(tmp_path)
    got = restore(client, captured.image, key=compute_key(), dirs=dirs,
                  chunk_cache=tmp_path / "chunks")
    assert got.status == "restored", got.reason
    assert got.artifact == captured.artifact and got.files > 0
    assert got.fetched_bytes > 0 and got.chunks_fetched > 0
    assert _files(dirs) == captured.files     # every file, byte for byte
    before = snapshot(dirs)
    warm = _run_app(app, _env(tmp_path))
    assert warm["result"] == captured.result
    assert warm["hit"] == 1 and warm["miss"] == 0       # Inductor's own counters agree
    v = verdict(got, evidence(before, dirs))
    assert v.verdict == "hit", v.reason
    assert v.evidence.compiled == 0 and v.evidence.graphs == 0


def test_the_chunk_cache_serves_a_second_restore(captured: Captured, client: RegistryClient,
                                                 tmp_path: Path) -> None:
    chunks = tmp_path / "chunks"
    first = restore(client, captured.image, dirs=_dirs(tmp_path / "a"), chunk_cache=chunks)
    second = restore(client, captured.image, dirs=_dirs(tmp_path / "b"), chunk_cache=chunks)
    assert first.status == second.status == "restored"
    # (files with the same content share chunks: the first restore fetches each once)
    assert first.chunks_fetched > 0
    assert second.chunks_fetched == 0
    assert second.chunks_cached == first.chunks_fetched + first.chunks_cached
    assert second.fetched_bytes < first.fetched_bytes   # the TOC only
    assert _files(_dirs(tmp_path / "b")) == captured.files


def test_a_foreign_cpu_is_a_miss_with_its_reason(captured: Captured, client: RegistryClient,
                                                 app: Path, tmp_path: Path) -> None:
    here = compute_key()
    isa = here.components["isa"]
    machine, _, flags = isa.partition(":")
    fewer = f"{machine}:" + " ".join(f for f in flags.split() if not f.startswith("avx512"))
    foreign = compute_key(overrides={"isa": fewer})
    dirs = _dirs(tmp_path)
    got = restore(client, captured.image, key=foreign, dirs=dirs)
    assert got.status == "miss"
    assert "isa: the artifact's CPU lacked" not in got.reason
    assert "this CPU lacks avx512" in got.reason, got.reason
    assert _files(dirs) == {}
    out = _run_app(app, _env(tmp_path))          # the app compiles and gets its result
    assert out["result"] == captured.result and out["miss"] == 1


def test_another_torch_build_is_a_miss(captured: Captured, client: RegistryClient,
                                       tmp_path: Path) -> None:
    other = compute_key(overrides={"torch": "2.13.0+cpu record:0000000000000000"})
    got = restore(client, captured.image, key=other, dirs=_dirs(tmp_path))
    assert got.status == "miss" and "torch: artifact" in got.reason, got.reason
    assert _files(_dirs(tmp_path)) == {}


def test_keys_side_by_side_each_node_gets_its_own(captured: Captured, client: RegistryClient,
                                                  tmp_path: Path) -> None:
    # a second hardware class pushes its own artifact for the same image
    other_key = compute_key(overrides={"gpu": "NVIDIA H100 80GB HBM3 cc 9.0",
                                       "driver": "570.86.15", "cuda": "12.8"})
    src = _dirs(tmp_path / "gpu")
    (src["triton"] / "abc").mkdir(parents=True)
    (src["triton"] / "abc" / "k.cubin").write_bytes(b"not really a cubin")
    pushed = capture(client, captured.image, key=other_key, dirs=src)
    mine = restore(client, captured.image, dirs=_dirs(tmp_path / "cpu"))
    theirs = restore(client, captured.image, key=other_key, dirs=_dirs(tmp_path / "h100"))
    assert mine.artifact == captured.artifact
    assert theirs.artifact == pushed.artifact != captured.artifact
    assert _files(_dirs(tmp_path / "h100")) == {"triton/abc/k.cubin": b"not really a cubin"}


def test_without_a_chunk_cache_the_bundle_comes_in_one_request(
        captured: Captured, client: RegistryClient, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from coldstart.oci.reference import Reference
    from coldstart.warmup.runner import CHUNK_CACHE_ENV

    monkeypatch.delenv(CHUNK_CACHE_ENV, raising=False)

    found = artifacts.find(client, Reference.parse(captured.image), compute_key())
    got = restore(client, captured.image, dirs=_dirs(tmp_path))
    assert got.status == "restored", got.reason
    assert got.requests == 1 and got.fetched_bytes == found.layer["size"]
    assert _files(_dirs(tmp_path)) == captured.files


def test_a_restart_keeps_what_its_directories_hold(captured: Captured, client: RegistryClient,
                                                   tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from coldstart.warmup.runner import CHUNK_CACHE_ENV

    monkeypatch.delenv(CHUNK_CACHE_ENV, raising=False)
    dirs = _dirs(tmp_path)
    first = restore(client, captured.image, dirs=dirs)
    again = restore(client, captured.image, dirs=dirs)    # a restarted pod, its volume kept
    assert first.status == again.status == "restored", again.reason
    assert again.files == 0 and again.kept == first.files > 0
    assert _files(dirs) == captured.files


# the bundle fetched whole (its digest) and chunk by chunk through a chunk cache (each chunk's)
@pytest.mark.parametrize("chunk_cache", [False, True], ids=["whole", "chunks"])
def test_a_flipped_byte_is_never_restored(captured: Captured, client: RegistryClient,
                                          registry: Registry, app: Path, tmp_path: Path,
                                          chunk_cache: bool,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from coldstart.oci.reference import Reference
    from coldstart.warmup.runner import CHUNK_CACHE_ENV

    monkeypatch.delenv(CHUNK_CACHE_ENV, raising=False)

    found = artifacts.find(client, Reference.parse(captured.image), compute_key())
    digest = str(found.layer["digest"]).removeprefix("sha256:")
    blob = registry.root / "docker/registry/v2/blobs/sha256" / digest[:2] / digest / "data"
    original = blob.read_bytes()
    layer = artifacts.open_bundle(client, Reference.parse(captured.image), found)
    biggest = max((e for e in layer.toc.entries.values() if e.type == "reg" and e.chunks),
                  key=lambda e: e.size)
    at = biggest.chunks[0].offset + 20         # inside the first chunk's compressed frame
    try:
        blob.write_bytes(original[:at] + bytes([original[at] ^ 0x01]) + original[at + 1:])
        dirs = _dirs(tmp_path)
        got = restore(client, captured.image, dirs=dirs,
                      chunk_cache=tmp_path / "chunks" if chunk_cache else None)
        assert got.status == "refused"
        assert "IntegrityError" in got.reason or "FormatError" in got.reason, got.reason
        for name, data in _files(dirs).items():    # what was written is what was captured
            assert captured.files[name] == data
        assert biggest.name not in {n.split("/", 1)[1] for n in _files(dirs)}
        out = _run_app(app, _env(tmp_path))     # and the app still starts
        assert out["result"] == captured.result
    finally:
        blob.write_bytes(original)


def test_run_wraps_an_unmodified_app_and_tells_ready(captured: Captured, registry: Registry,
                                                     app: Path, tmp_path: Path) -> None:
    sock_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(120)
    got: list[str] = []

    def listen() -> None:
        while not any("READY=1" in m for m in got):
            got.append(sock.recv(4096).decode())

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    report = tmp_path / "report.json"
    env = {**_env(tmp_path / "node"), "NOTIFY_SOCKET": sock_path}
    out = subprocess.run([sys.executable, "-m", "coldstart.commands.warmup", "run", "--image",
                          captured.image, "--insecure", registry.host, "--report", str(report),
                          "--", sys.executable, str(app)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    listener.join(10)
    sock.close()
    ready = [m for m in got if "READY=1" in m]
    assert ready and "X_WARMUP=hit" in ready[0].split("\n"), got
    # the restore is reported as a phase before the app's own
    assert "X_PHASE=warmcache-restore" in got[0].split("\n"), got
    assert any("STATUS=warm-up" in m for m in got[1:]), got
    doc = json.loads(report.read_text())
    assert doc["restore"]["status"] == "restored"
    assert doc["verdict"]["verdict"] == "hit" and doc["judged_at"] == "ready"
    assert doc["exit_code"] == 0
    assert "warm-up cache hit" in out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["result"] == captured.result
