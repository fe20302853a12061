"""``coldstart weights`` and ``coldstart models`` through the real CLI entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.unit.weights.repo_suite import make_version


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coldstart.cli", *args], capture_output=True,
                          text=True, timeout=300)  # a hang guard, not a stopwatch


def test_weights_load_and_bench(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(100, 100), "b": torch.zeros(3, dtype=torch.int8)}, str(path))
    out = run("weights", "load", str(path), "-o", "json", "--list", "--dtype", "bf16")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["tensors"] == 2 and report["bytes"] == 40003
    assert report["shapes"]["a"] == ["bfloat16", [100, 100]]
    assert report["path"].startswith("cpu")
    assert report["staging_bytes"] == 0     # nothing staged: the bytes land in the tensors
    text = run("weights", "load", str(path))
    assert "GB/s" in text.stdout and text.returncode == 0
    bench = run("weights", "bench", str(path), "--runs", "2", "--evict", "-o", "json")
    assert bench.returncode == 0, bench.stderr
    assert len(json.loads(bench.stdout)["runs"]) == 2


def test_weights_dtype_takes_torchs_names(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(4, 4)}, str(path))
    for name, want in (("bfloat16", "bfloat16"), ("float16", "float16"), ("half", "float16"),
                       ("FP32", "float32"), ("float64", "float64")):
        out = run("weights", "load", str(path), "-o", "json", "--list", "--dtype", name)
        assert out.returncode == 0, (name, out.stderr)
        assert json.loads(out.stdout)["shapes"]["a"][0] == want
    bad = run("weights", "load", str(path), "--dtype", "int4")
    assert bad.returncode == 2 and "'int4' is not one of" in bad.stderr


def test_weights_oci_means_a_layout_registry_blobs_are_registry_urls(tmp_path: Path) -> None:
    for source in ("oci://127.0.0.1:5000/w/m@sha256:" + "0" * 64, f"oci:{tmp_path}"):
        out = run("weights", "load", source, "-q")
        assert out.returncode == 2, (source, out.stderr)
        assert "registry://REGISTRY/REPO@sha256:" in out.stderr and "OCI image layout" in \
            out.stderr
        assert out.stderr.strip().count("\n") == 0


def test_weights_errors_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x05\x00")
    out = run("weights", "load", str(bad))
    assert out.returncode == 9  # FormatError
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
    assert "HeaderTooSmall" in out.stderr
    missing = run("weights", "load", str(tmp_path / "nope.safetensors"))
    assert missing.returncode == 3 and "Traceback" not in missing.stderr


def test_help_explains_commands() -> None:
    for args in (("weights", "--help"), ("weights", "load", "--help"),
                 ("weights", "bench", "--help"), ("models", "--help"),
                 ("models", "publish", "--help"), ("models", "watch", "--help")):
        out = run(*args)
        assert out.returncode == 0, out.stderr
        assert "Usage:" in out.stdout and len(out.stdout) > 200


def test_models_publish_activate_rollback_list_watch(tmp_path: Path) -> None:
    root = str(tmp_path / "repo")
    v1 = run("models", "publish", str(make_version(tmp_path / "a", 1.0)), "--root", root,
             "--model", "m")
    assert v1.returncode == 0 and "m/1" in v1.stdout, v1.stderr
    first = run("models", "activate", "--root", root, "--model", "m", "1")
    # the new-user review's bug: a first activation said "(was None)"
    assert first.returncode == 0 and "None" not in first.stdout, first.stdout
    assert "first active version" in first.stdout
    v2 = run("models", "publish", str(make_version(tmp_path / "b", 2.0)), "--root", root,
             "--model", "m")
    assert v2.returncode == 0, v2.stderr
    listing = run("models", "list", "--root", root)
    assert "* m/1" in listing.stdout and "  m/2" in listing.stdout
    rows = json.loads(run("models", "list", "--root", root, "-o", "json").stdout)
    assert [(r["version"], r["active"], r["complete"]) for r in rows] == [
        ("1", True, True), ("2", False, True)]
    assert run("models", "activate", "--root", root, "--model", "m", "2").returncode == 0
    watch = run("models", "watch", "--root", root, "--model", "m", "--once")
    assert "serving version 2" in watch.stdout, watch.stderr
    back = run("models", "rollback", "--root", root, "--model", "m")
    assert "version 1" in back.stdout
    # the new-user review's bug: a version that does not exist said "not complete … still
    # uploading"
    missing = run("models", "activate", "--root", root, "--model", "m", "9")
    assert missing.returncode == 3, missing.stderr  # NotFound
    assert "no such version: m/9" in missing.stderr and "1, 2" in missing.stderr
    assert "Traceback" not in missing.stderr and "uploading" not in missing.stderr
    half = Path(root) / "m" / "3"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"partial")
    refused = run("models", "activate", "--root", root, "--model", "m", "3")
    assert refused.returncode == 5 and "not complete" in refused.stderr  # FailedPrecondition
    assert "Traceback" not in refused.stderr
    again = run("models", "activate", "--root", root, "--model", "m", "1", "-o", "json")
    assert json.loads(again.stdout) == {"model": "m", "version": "1", "previous": "1"}


def test_weights_load_bad_device_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(4)}, str(path))
    for device in ("tpu", "cuda:x", ""):
        out = run("weights", "load", str(path), "--device", device, "-q")
        assert out.returncode == 2, (device, out.stderr)  # InvalidArgument
        assert "Traceback" not in out.stderr and out.stderr.strip().count("\n") == 0
        assert f"device {device!r}" in out.stderr and "cpu, cuda or cuda:N" in out.stderr
    if not torch.cuda.is_available():
        out = run("weights", "load", str(path), "--device", "cuda:0", "-q")
        assert out.returncode == 2 and "CUDA is not available" in out.stderr
        assert "Traceback" not in out.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU present (CUDA unavailable)")
def test_weights_load_to_cuda(tmp_path: Path) -> None:  # pragma: no cover
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(7)}, str(path))
    out = run("weights", "load", str(path), "--device", "cuda:0", "--max-host-mb", "1",
              "-o", "json", "--list")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["path"].startswith("cuda") and report["tensors"] == 2
    assert report["shapes"]["a"] == ["float32", [300_000]]
    assert 0 < report["staging_bytes"] <= 1 << 20


def test_models_list_of_a_missing_or_file_root_is_an_error(tmp_path: Path) -> None:
    missing = run("models", "list", "--root", str(tmp_path / "nonexistent"))
    assert missing.returncode == 3, missing  # NotFound
    assert "no such repository directory" in missing.stderr and missing.stdout == ""
    assert missing.stderr.strip().count("\n") == 0 and "Traceback" not in missing.stderr
    with_model = run("models", "list", "--root", str(tmp_path / "nonexistent"), "--model", "m")
    assert with_model.returncode == 3, with_model
    a_file = tmp_path / "root.txt"
    a_file.write_text("not a directory")
    out = run("models", "list", "--root", str(a_file))
    assert out.returncode == 2, out  # InvalidArgument
    assert "not a directory" in out.stderr and out.stderr.strip().count("\n") == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    ok = run("models", "list", "--root", str(empty))  # an existing empty repository: fine
    assert ok.returncode == 0 and ok.stdout == "", ok.stderr
