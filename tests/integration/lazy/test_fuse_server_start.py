"""Starting ``coldstart fuse-server``: one per root, and a failed start leaves nothing behind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldstart.lazyfs.mountsys import is_mountpoint
from tests.fixtures.registry import Registry
from tests.integration.lazy.lazy_helpers import (
    REPO_ROOT,
    convert,
    fuse_server,
    metadata_tar,
    push_layer,
    unmount_under,
    write_config,
)

pytestmark = pytest.mark.integration


def run_fuse_server(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run ``coldstart fuse-server ARGS`` to its end; one that keeps running fails the test."""
    proc = subprocess.Popen([sys.executable, "-m", "coldstart.cli", "fuse-server", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), cwd=REPO_ROOT,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"fuse-server {' '.join(args)} did not refuse to start:\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_one_line_error(result: subprocess.CompletedProcess[str], code: int,
                          *words: str) -> None:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and all(w in lines[-1] for w in words), result.stderr


@pytest.fixture
def tmp(tmp_path: Path) -> Iterator[Path]:
    try:
        yield tmp_path
    finally:
        unmount_under(tmp_path)


def test_a_second_server_on_the_same_root_is_refused_and_touches_nothing(
        tmp: Path, registry: Registry) -> None:
    tree = metadata_tar(big_size=200_000, seed=7)
    blob, res = convert(tree.tar, "zstd:chunked")
    spec = push_layer(registry.host, "lazy/second-server", blob, res)
    with fuse_server(tmp, registry_host=registry.host) as (_proc, client, root):
        mp = tmp / "mp"
        mp.mkdir()
        client.mount(str(mp), spec)
        pid = client.ping()["pid"]
        sock = root / "fuse.sock"
        ino = sock.stat().st_ino
        config = tmp / "config.toml"

        same_root = run_fuse_server("--config", str(config))
        assert_one_line_error(same_root, 5, "coldstart: error:", "another", str(root))
        # another root, the same control socket: it answers, so refused as well
        other = tmp / "other"
        same_socket = run_fuse_server("--config", str(config), "--root", str(other))
        assert_one_line_error(same_socket, 5, "coldstart: error:", "already answers",
                              str(sock))
        assert not (other / "fuse").exists()

        # the running server is untouched: its mount, its socket, its layers
        assert is_mountpoint(str(root / "fuse"))
        assert sock.stat().st_ino == ino
        assert client.ping()["pid"] == pid
        for name, data in list(tree.files.items())[:5]:
            assert (mp / name).read_bytes() == data, name
        client.check(str(mp))


def test_a_bad_metrics_address_is_one_line_and_leaves_no_mount(tmp: Path) -> None:
    root = tmp / "root"
    root.mkdir()
    config = write_config(tmp / "config.toml", root, registry_host="127.0.0.1:1")

    def nothing_left() -> None:
        assert not is_mountpoint(str(root / "fuse"))
        assert not (root / "fuse.sock").exists()

    bad = run_fuse_server("--config", str(config), "--metrics-address", "nonsense")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert "--metrics-address" in bad.stderr and "host:port" in bad.stderr
    nothing_left()

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        taken = run_fuse_server("--config", str(config), "--metrics-address", address)
        # the same from the config file (fuse.metrics_address; [fuse] is its last table)
        with config.open("a") as f:
            f.write(f'metrics_address = "{address}"\n')
        from_config = run_fuse_server("--config", str(config))
        config.write_text(config.read_text().replace(f'metrics_address = "{address}"\n', ""))
    assert_one_line_error(taken, 5, "coldstart: error:", address, "in use")
    assert_one_line_error(from_config, 5, "coldstart: error:", address, "in use")
    nothing_left()

    # and the root is free again: a good start works
    with fuse_server(tmp, registry_host="127.0.0.1:1") as (_proc, client, _root):
        assert client.ping()["pid"] > 0
        assert is_mountpoint(str(root / "fuse"))
