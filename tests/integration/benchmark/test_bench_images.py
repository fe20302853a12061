"""The bench images: ``tiny`` built into a temporary cache is a valid OCI layout (diff_ids match
the layers' uncompressed digests), is reused from the cache, rebuilds to the same digests, and an
incomplete build is redone; the model server runs on this host's Python and reports its phases.

torch, server and cuda-like are not built here (minutes, root and downloads).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import socket
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

import pytest

from coldstart.benchmark import imagecontent, images
from coldstart.benchmark.imagelayers import MTIME
from coldstart.benchmark.images import BUILTIN, BenchImage, build_image, load_image
from coldstart.errors import InvalidArgument
from coldstart.oci.layout import OciLayout
from coldstart.oci.manifest import OCI_LAYER_GZIP, parse_manifest
from coldstart.stack.procs import coldstart_cli, free_port, stop_process

pytestmark = pytest.mark.integration


def _manifest_and_config(image: BenchImage) -> tuple[list[dict[str, object]], dict[str, object]]:
    layout = OciLayout(image.layout)
    mdesc = layout.resolve("latest")
    manifest = parse_manifest(layout.read_blob(mdesc.digest), mdesc.media_type)
    config = json.loads(layout.read_blob(manifest.config.digest))
    return [d.to_json() for d in manifest.layers], config


def _digests(image: BenchImage) -> list[str]:
    layers, config = _manifest_and_config(image)
    return [str(d["digest"]) for d in layers] + [str(config["rootfs"])]


def _uncompressed_digest(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    n = 0
    with gzip.open(path, "rb") as f:          # checks the gzip CRC and length too
        while block := f.read(1 << 20):
            h.update(block)
            n += len(block)
    return f"sha256:{h.hexdigest()}", n


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench-images")


@pytest.fixture(scope="module")
def tiny(cache: Path) -> BenchImage:
    return build_image("tiny", cache)


def test_tiny_is_a_valid_gzip_oci_layout(tiny: BenchImage, cache: Path) -> None:
    assert tiny.name == "tiny" and tiny.layout == cache / "tiny"
    assert tiny.command == ["/app/start.sh"] and tiny.ready == "exit"
    assert tiny.description == BUILTIN["tiny"]
    layers, config = _manifest_and_config(tiny)
    assert len(layers) == 2
    assert config["config"] == {"Cmd": ["/app/start.sh"], "Env": tiny.env, "WorkingDir": "/"}
    diff_ids = config["rootfs"]["diff_ids"]                             # type: ignore[index]
    layout = OciLayout(tiny.layout)
    total = 0
    for desc, diff_id in zip(layers, diff_ids, strict=True):
        assert desc["mediaType"] == OCI_LAYER_GZIP
        blob = layout.blob_path(str(desc["digest"]))
        assert blob.stat().st_size == desc["size"]
        assert "sha256:" + hashlib.sha256(blob.read_bytes()).hexdigest() == desc["digest"]
        digest, size = _uncompressed_digest(blob)
        assert digest == diff_id
        total += size
    assert tiny.uncompressed_bytes == total
    assert tiny.compressed_bytes == sum(int(str(d["size"])) for d in layers)
    # the app layer: the start script, the big library, 2000 modules; fixed mtimes
    with tarfile.open(layout.blob_path(str(layers[1]["digest"])), "r:gz") as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members["app/start.sh"].mode == 0o755
    assert members["app/lib/libbig.so"].size == 48 << 20
    assert sum(n.endswith(".py") for n in members) == 2000
    assert {m.mtime for m in members.values()} == {MTIME}
    recipe = json.loads((tiny.layout / "recipe.json").read_text())
    assert recipe["recipe_version"] >= 1
    assert recipe["image"]["command"] == tiny.command
    assert [la["digest"] for la in recipe["layers"]] == [d["digest"] for d in layers]


def test_second_build_reuses_the_cache(tiny: BenchImage, cache: Path) -> None:
    blob = next((tiny.layout / "blobs" / "sha256").iterdir())
    inode = blob.stat().st_ino
    lines: list[str] = []
    again = build_image("tiny", cache, progress=lines.append)
    assert again == tiny
    assert lines == []                          # nothing was built
    assert blob.stat().st_ino == inode          # the same files, not rewritten
    assert load_image("tiny", cache) == tiny


def test_force_rebuilds_to_the_same_digests(tiny: BenchImage, cache: Path) -> None:
    before = _digests(tiny)
    inode = (tiny.layout / "recipe.json").stat().st_ino
    lines: list[str] = []
    rebuilt = build_image("tiny", cache, progress=lines.append, force=True)
    assert any(line.startswith("layer app") for line in lines)
    assert (rebuilt.layout / "recipe.json").stat().st_ino != inode
    assert _digests(rebuilt) == before
    assert rebuilt.uncompressed_bytes == tiny.uncompressed_bytes
    assert not list(cache.glob(".tmp-*"))       # no temp dirs left


def test_a_build_without_recipe_is_incomplete_and_rebuilt(tiny: BenchImage, cache: Path) -> None:
    before = _digests(tiny)
    (tiny.layout / "recipe.json").unlink()
    (tiny.layout / "junk").write_text("left by a crash")
    assert load_image("tiny", cache) is None
    rebuilt = build_image("tiny", cache)
    assert _digests(rebuilt) == before
    assert not (rebuilt.layout / "junk").exists()
    # a missing layer blob makes the cached build incomplete as well
    layers, _ = _manifest_and_config(rebuilt)
    OciLayout(rebuilt.layout).blob_path(str(layers[0]["digest"])).unlink()
    assert load_image("tiny", cache) is None
    assert _digests(build_image("tiny", cache)) == before


def test_unknown_image_names_the_built_in_ones(cache: Path) -> None:
    with pytest.raises(InvalidArgument, match="tiny, torch, server, cuda-like"):
        build_image("nope", cache)
    with pytest.raises(InvalidArgument, match="unknown bench image 'nope'"):
        load_image("nope", cache)
    assert not (cache / "nope").exists()


def test_cli_build_and_list(tiny: BenchImage, cache: Path) -> None:
    built = coldstart_cli("bench-image", "build", "tiny", "--cache-dir", str(cache), "-o", "json")
    assert built.returncode == 0, built.stderr
    assert json.loads(built.stdout) == [tiny.to_json()]
    listed = coldstart_cli("bench-image", "list", "--cache-dir", str(cache), "-o", "json")
    assert listed.returncode == 0, listed.stderr
    rows = {r["name"]: r for r in json.loads(listed.stdout)}
    assert list(rows) == list(BUILTIN)
    assert rows["tiny"]["built"] and rows["tiny"]["layout"] == str(tiny.layout)
    assert not rows["cuda-like"]["built"]
    bad = coldstart_cli("bench-image", "build", "tiny", "nope", "--cache-dir", str(cache))
    assert bad.returncode != 0
    assert "unknown bench image 'nope'" in bad.stderr and "cuda-like" in bad.stderr


def test_default_cache_dir_honours_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    monkeypatch.setenv("COLDSTART_BENCH_IMAGES", str(tmp_path / "imgs"))
    assert images.default_cache_dir() == tmp_path / "imgs"
    monkeypatch.delenv("COLDSTART_BENCH_IMAGES")
    checkout = Path(images.__file__).resolve().parents[2]
    assert images.default_cache_dir() == checkout / "bench" / "images"


# -- the model server (server_app.py), on this host's Python -------------------------------------

def _write_checkpoint(path: Path) -> None:
    tensors = imagecontent.llama_tensors(64, 128, range(2), 100, embed=True, head=True)
    pool = imagecontent.bf16_pool(1, 1 << 16)
    with open(path, "wb") as f:
        for chunk in imagecontent.safetensors_chunks(tensors, pool, 2):
            f.write(chunk)
    assert path.stat().st_size == imagecontent.safetensors_size(tensors)


@pytest.mark.parametrize("loader", ["safetensors", "coldstart"])
def test_server_app_reports_phases_and_serves(tmp_path: Path, loader: str) -> None:
    model = tmp_path / "model"
    model.mkdir()
    _write_checkpoint(model / "model.safetensors")
    libs = tmp_path / "libs"
    libs.mkdir()
    (libs / "libfake.so.1").write_bytes(os.urandom(3 << 20))
    mods = tmp_path / "mods" / "fakepkg"
    mods.mkdir(parents=True)
    (mods / "__init__.py").write_text("")
    (mods / "mod1.py").write_text("VALUE = 1\n")
    (tmp_path / "imports.txt").write_text("fakepkg.mod1\n")
    sock_path = tmp_path / "n.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(60)
    port = free_port()
    env = {**os.environ, "NOTIFY_SOCKET": str(sock_path), "PORT": str(port),
           "MODEL_PATH": str(model), "SERVER_LOADER": loader,
           "PYTHONPATH": str(tmp_path / "mods")}
    argv = [sys.executable, str(Path(images.__file__).with_name("server_app.py")),
            "--imports", str(tmp_path / "imports.txt"), "--touch-libs", str(libs)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        phases: list[str] = []
        progress: list[float] = []
        while True:
            fields = dict(line.split("=", 1) for line in sock.recv(4096).decode().split("\n"))
            if "X_PHASE" in fields and (not phases or phases[-1] != fields["X_PHASE"]):
                phases.append(fields["X_PHASE"])
            if "X_PROGRESS" in fields:
                progress.append(float(fields["X_PROGRESS"]))
            if fields.get("READY") == "1":
                assert fields["STATUS"] == "ready"
                break
        assert phases == ["importing", "libraries", "loading", "inference", "ready"]
        assert progress[0] == 0.0 and progress[-1] == 1.0 and progress == sorted(progress)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/infer", timeout=30) as resp:
            assert resp.status == 200
            result = json.loads(resp.read())
        assert result["ok"] and result["shape"] == [1, 100]
        assert result["weight"] == "lm_head.weight" and result["tensors"] == 21
    finally:
        stop_process(proc)
        sock.close()
    assert proc.stdout is not None
    out = proc.stdout.read().decode()
    for name in ("importing", "libraries", "loading", "inference", "ready"):
        assert f"coldstart-phase {name}" in out
    assert "imported torch" in out and "and 1 modules" in out
