"""``coldstart node install`` / ``uninstall`` in temp dirs: byte-identical round trips, backups,
idempotence, operator edits, --dry-run, and the one-line errors of the real CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from coldstart.config import load
from coldstart.errors import FailedPrecondition, InvalidArgument, NotFound
from coldstart.node.install import NodePaths, plan_install, plan_uninstall
from coldstart.node.systemd import UNIT_NAME

CONFIGS = Path(__file__).parent / "configs"
SAMPLES = sorted(CONFIGS.glob("*.toml"))


def node_paths(tmp: Path, sample: Path) -> NodePaths:
    ctd = tmp / "etc-containerd" / "config.toml"
    ctd.parent.mkdir(parents=True, exist_ok=True)
    ctd.write_bytes(sample.read_bytes())
    os.chmod(ctd, 0o640)
    return NodePaths(containerd_config=ctd, coldstart_config=tmp / "etc-coldstart" / "c.toml",
                     state_dir=tmp / "state", systemd_dir=tmp / "systemd")


def install(paths: NodePaths, **kw: object) -> list[str]:
    kw.setdefault("root", "/var/lib/cs-test")
    kw.setdefault("socket", "/run/cs-test/s.sock")
    kw.setdefault("exec_start", ["/usr/local/bin/coldstart"])
    return plan_install(paths, **kw).apply()  # type: ignore[arg-type]


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.stem)
def test_install_then_uninstall_is_byte_identical(tmp_path: Path, sample: Path) -> None:
    paths = node_paths(tmp_path, sample)
    original = sample.read_bytes()
    install(paths)
    installed = paths.containerd_config.read_bytes()
    doc = tomllib.loads(installed.decode())
    assert doc["proxy_plugins"]["coldstart"]["address"] == "/run/cs-test/s.sock"
    assert doc["proxy_plugins"]["coldstart"]["exports"]["root"] == "/var/lib/cs-test/"
    assert os.stat(paths.containerd_config).st_mode & 0o777 == 0o640   # mode kept
    assert paths.backup.read_bytes() == original
    # the node's state (a copy of containerd's config among it) is root's alone
    assert os.stat(paths.state_dir).st_mode & 0o777 == 0o700
    assert os.stat(paths.backup).st_mode & 0o777 == 0o600
    state = json.loads(paths.state_file.read_text())
    assert state["containerd_config"] == str(paths.containerd_config)
    assert len(state["installed_sha256"]) == 64
    cfg = load(paths.coldstart_config)
    assert (cfg.root, cfg.socket) == ("/var/lib/cs-test", "/run/cs-test/s.sock")
    unit = (paths.systemd_dir / UNIT_NAME).read_text()
    assert f"ExecStart=/usr/local/bin/coldstart snapshotter --config {paths.coldstart_config}" \
        in unit

    # idempotent: the second install finds nothing to do and writes nothing
    again = plan_install(paths, exec_start=["/usr/local/bin/coldstart"])
    assert again.empty and again.notes == ("already installed: nothing to change",)
    assert again.apply() == [] and paths.containerd_config.read_bytes() == installed

    plan = plan_uninstall(paths)
    assert any("byte for byte" in n for n in plan.notes)
    plan.apply()
    assert paths.containerd_config.read_bytes() == original
    assert os.stat(paths.containerd_config).st_mode & 0o777 == 0o640
    assert not paths.coldstart_config.exists() and not (paths.systemd_dir / UNIT_NAME).exists()
    assert not paths.state_file.exists() and not paths.backup.exists()


def test_uninstall_after_an_operator_edit_removes_only_our_keys(tmp_path: Path) -> None:
    paths = node_paths(tmp_path, CONFIGS / "containerd-1.6.toml")
    install(paths)
    text = paths.containerd_config.read_text()
    paths.containerd_config.write_text(text.replace('level = "info"',
                                                    'level = "debug"  # chasing a bug'))
    plan = plan_uninstall(paths)
    assert any("changed since install: took out only coldstart's keys" in n for n in plan.notes)
    plan.apply()
    after = paths.containerd_config.read_text()
    assert 'level = "debug"  # chasing a bug' in after
    assert "proxy_plugins" not in after and '"coldstart"' not in after
    original = (CONFIGS / "containerd-1.6.toml").read_text()
    assert after == original.replace('level = "info"', 'level = "debug"  # chasing a bug')


def test_an_edited_unit_and_config_are_left_in_place(tmp_path: Path) -> None:
    paths = node_paths(tmp_path, CONFIGS / "no-cri.toml")
    install(paths)
    unit = paths.systemd_dir / UNIT_NAME
    unit.write_text(unit.read_text() + "Environment=X=1\n")
    plan = plan_uninstall(paths)
    assert any(str(unit) in n and "left in place" in n for n in plan.notes)
    plan.apply()
    assert unit.exists() and not paths.coldstart_config.exists()


def test_dry_run_prints_the_diff_and_writes_nothing(tmp_path: Path) -> None:
    paths = node_paths(tmp_path, CONFIGS / "containerd-2.x.toml")
    before = sorted(p for p in tmp_path.rglob("*"))
    r = cli("node", "install", *cli_paths(paths), "--root", "/var/lib/cs-test",
            "--socket", "/run/cs-test/s.sock", "--coldstart-bin", sys.executable, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert sorted(p for p in tmp_path.rglob("*")) == before
    assert paths.containerd_config.read_bytes() == (CONFIGS / "containerd-2.x.toml").read_bytes()
    assert f"--- {paths.containerd_config}\n+++ {paths.containerd_config}\n" in r.stdout
    assert "\n-    snapshotter = 'overlayfs'\n" in r.stdout
    # tomlkit 0.15.3 keeps a replaced string's quotes (a literal stays literal); before, it
    # wrote a basic string: either is the same TOML
    assert re.search(r"\n\+    snapshotter = (\"coldstart\"|'coldstart')\n", r.stdout), r.stdout
    assert f"+++ {paths.systemd_dir / UNIT_NAME}" in r.stdout
    assert "+Type=notify\n" in r.stdout and "+KillMode=process\n" in r.stdout


def test_the_cli_round_trip_and_its_messages(tmp_path: Path) -> None:
    paths = node_paths(tmp_path, CONFIGS / "containerd-1.6.toml")
    args = [*cli_paths(paths), "--root", "/var/lib/cs-test", "--socket", "/run/cs-test/s.sock"]
    r = cli("node", "install", *args)
    assert r.returncode == 0, r.stderr
    assert f"updated {paths.containerd_config}" in r.stdout and "next: systemctl" in r.stdout
    r = cli("node", "install", *args)
    assert (r.returncode, r.stdout.splitlines()[0]) == (0, "already installed: nothing to change")
    r = cli("node", "status", *cli_paths(paths), "-o", "json",
            "--address", str(tmp_path / "none.sock"))
    doc = json.loads(r.stdout)
    assert doc["containerd_config"]["installed"] is True
    assert doc["install_state"]["installed"] is True and doc["unit"]["as_installed"] is True
    assert "no socket at" in doc["containerd"]["error"]
    assert doc["fuse_server"]["answers"] is False and doc["fuse_server"]["error"]
    assert doc["snapshotter"]["answers"] is False
    # nothing runs here: not healthy, exit 1 (the DaemonSet's readiness probe reads it)
    assert r.returncode == 1 and doc["healthy"] is False and len(doc["problems"]) == 3
    assert r.stderr.startswith("coldstart: error: node not ready for lazy pulls: containerd "
                               "does not list")
    r = cli("node", "status", *cli_paths(paths), "--address", str(tmp_path / "none.sock"))
    assert r.returncode == 1 and "coldstart keys in place, schema 2" in r.stdout
    r = cli("node", "uninstall", *cli_paths(paths))
    assert r.returncode == 0 and "byte for byte" in r.stdout
    assert paths.containerd_config.read_bytes() == (CONFIGS / "containerd-1.6.toml").read_bytes()
    r = cli("node", "uninstall", *cli_paths(paths))
    assert r.returncode == NotFound.exit_code
    assert r.stderr.startswith("coldstart: error: nothing to uninstall:") and \
        r.stderr.count("\n") == 1


def test_errors_say_what_to_do(tmp_path: Path) -> None:
    paths = node_paths(tmp_path, CONFIGS / "no-cri.toml")
    paths.containerd_config.write_text('root = "/x"\n')
    r = cli("node", "install", *cli_paths(paths))
    assert r.returncode == FailedPrecondition.exit_code and "version = 2" in r.stderr
    assert r.stderr.count("\n") == 1
    paths.containerd_config.unlink()
    with pytest.raises(NotFound, match="containerd config default"):
        plan_install(paths)
    paths = node_paths(tmp_path, CONFIGS / "no-cri.toml")
    install(paths)
    with pytest.raises(InvalidArgument, match="already says socket"):
        plan_install(paths, socket="/run/other.sock")
    with pytest.raises(FailedPrecondition, match="other settings"):
        plan_install(paths, runtime_handler="gpu")
    other = node_paths(tmp_path / "o", CONFIGS / "no-cri.toml")
    (other.systemd_dir).mkdir(parents=True)
    (other.systemd_dir / UNIT_NAME).write_text("[Service]\nExecStart=/bin/true\n")
    with pytest.raises(FailedPrecondition, match="not written by `coldstart node install`"):
        plan_install(other, exec_start=["/x"])
    with pytest.raises(InvalidArgument, match="absolute path"):
        plan_install(node_paths(tmp_path / "r", CONFIGS / "no-cri.toml"), root="rel/root")
    with pytest.raises(InvalidArgument, match="runtime handler"):
        plan_install(node_paths(tmp_path / "s", CONFIGS / "no-cri.toml"),
                     restore_binary="/usr/local/bin/coldstart-runc")
    # a handler that runs another runtime binary: coldstart-runc must be told to hand over to it
    gpu = node_paths(tmp_path / "g", CONFIGS / "no-cri.toml")
    gpu.containerd_config.write_text(
        'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.gpu.options]\n'
        '  BinaryName = "/usr/bin/nvidia-container-runtime"\n')
    with pytest.raises(FailedPrecondition, match="nvidia-container-runtime"):
        plan_install(gpu, runtime_handler="gpu", restore_binary="/usr/local/bin/coldstart-runc")


def cli_paths(paths: NodePaths) -> list[str]:
    return ["--containerd-config", str(paths.containerd_config),
            "--config", str(paths.coldstart_config), "--state-dir", str(paths.state_dir),
            "--systemd-dir", str(paths.systemd_dir)]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coldstart.cli", *args], capture_output=True,
                          text=True, timeout=60)


def test_an_edit_before_a_reinstall_is_kept_by_uninstall(tmp_path: Path) -> None:
    # the GPU operator adds a runtime after install; a later install (a new coldstart path in
    # the unit) must not make uninstall restore the pre-edit backup, losing that runtime
    paths = node_paths(tmp_path, CONFIGS / "containerd-1.6.toml")
    install(paths)
    edited = paths.containerd_config.read_text() + \
        '\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.kata]\n' \
        'runtime_type = "io.containerd.kata.v2"\n'
    paths.containerd_config.write_text(edited)
    install(paths, exec_start=["/opt/coldstart-2/bin/coldstart"])
    plan_uninstall(paths).apply()
    doc = tomllib.loads(paths.containerd_config.read_text())
    runtimes = doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]
    assert runtimes["kata"]["runtime_type"] == "io.containerd.kata.v2"
    assert "coldstart" not in doc.get("proxy_plugins", {})


def test_our_keys_without_our_state_are_refused(tmp_path: Path) -> None:
    # the state directory was wiped: a new backup would hold our keys, and uninstall would
    # leave containerd pointing at a snapshotter that is gone
    paths = node_paths(tmp_path, CONFIGS / "containerd-1.6.toml")
    install(paths)
    for f in paths.state_dir.iterdir():
        f.unlink()
    with pytest.raises(FailedPrecondition, match="already has coldstart's keys"):
        install(paths)


def test_a_symlinked_config_stays_a_symlink(tmp_path: Path) -> None:
    paths = node_paths(tmp_path, CONFIGS / "containerd-2.x.toml")
    real = tmp_path / "managed" / "containerd.toml"
    real.parent.mkdir()
    real.write_bytes(paths.containerd_config.read_bytes())
    paths.containerd_config.unlink()
    paths.containerd_config.symlink_to(real)
    install(paths)
    assert paths.containerd_config.is_symlink() and "proxy_plugins" in real.read_text()
    plan_uninstall(paths).apply()
    assert paths.containerd_config.is_symlink()
    assert real.read_bytes() == (CONFIGS / "containerd-2.x.toml").read_bytes()
