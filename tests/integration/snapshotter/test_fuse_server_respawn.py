"""The snapshotter restarts the FUSE server only when the server is gone, not when the server
answered with an error it met (a registry 503 while it opened a TOC is the call's result)."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from coldstart import config
from coldstart.errors import FailedPrecondition, Unavailable
from coldstart.lazyfs.client import FuseServerClient, FuseServerUnreachable
from coldstart.lazyfs.server import LOCK_FILE
from coldstart.lazyfs.spec import LayerSpec
from coldstart.snapshotter import daemon
from coldstart.snapshotter.daemon import RespawningMounter
from tests.integration.lazy.lazy_helpers import fuse_server, unmount_under, write_config

pytestmark = pytest.mark.integration


@pytest.fixture
def registry_503() -> Iterator[tuple[str, list[str]]]:
    """A "registry" that answers 503 to everything; yields its host and the paths asked."""
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            asked.append(self.path)
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def respawns(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every (re)start the mounter asks for; none really happens."""
    calls: list[str] = []

    def ensure(cfg: config.Config, answers: object = None) -> bool:
        calls.append(cfg.fuse.socket)
        return False

    monkeypatch.setattr(daemon, "ensure_fuse_server", ensure)
    return calls


def _spec(host: str) -> LayerSpec:
    return LayerSpec(reference=f"{host}/lazy/down:v1", digest="sha256:" + "ab" * 32,
                     size=1 << 20, media_type="application/vnd.oci.image.layer.v1.tar+zstd",
                     manifest_digest="sha256:" + "cd" * 32,
                     annotations={"io.github.containers.zstd-chunked.manifest-checksum":
                                  "sha256:" + "ef" * 32})


def test_a_registry_503_forwarded_by_the_server_does_not_restart_it(
        tmp_path: Path, registry_503: tuple[str, list[str]], respawns: list[str]) -> None:
    host, asked = registry_503
    with fuse_server(tmp_path, registry_host=host) as (_proc, client, root):
        cfg = config.load(str(tmp_path / "config.toml"))
        assert cfg.fuse.spawn and cfg.fuse.socket == str(root / "fuse.sock")
        mounter = RespawningMounter(cfg, client)
        mp = tmp_path / "mp"
        mp.mkdir()
        with pytest.raises(Unavailable) as exc:
            mounter.mount(str(mp), _spec(host))
        assert not isinstance(exc.value, FuseServerUnreachable), exc.value
        assert "503" in str(exc.value)
        assert respawns == []            # the server is alive: no restart
        assert len(asked) == 1           # and the call was not sent twice
        assert client.ping()["pid"] > 0


def test_an_unreachable_server_is_started_again(tmp_path: Path, respawns: list[str]) -> None:
    sock = tmp_path / "nobody.sock"
    cfg = config.load(None)
    cfg = dataclasses.replace(cfg, fuse=dataclasses.replace(cfg.fuse, socket=str(sock)))
    mounter = RespawningMounter(cfg, FuseServerClient(str(sock), timeout=5.0))
    with pytest.raises(FuseServerUnreachable):
        mounter.check(str(tmp_path / "mp"))
    assert respawns == [str(sock)]


def test_a_spawn_refused_by_a_starting_server_waits_for_that_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another fuse-server holds the root but does not answer yet: ours is refused (exit 5,
    nothing touched), the pid file keeps naming the other one, and we wait for it."""
    root = tmp_path / "root"
    root.mkdir()
    cfg = config.load(str(write_config(tmp_path / "config.toml", root,
                                       registry_host="127.0.0.1:1")))
    (root / daemon.FUSE_PID).write_text("4242\n")
    lock = open(root / LOCK_FILE, "a+")  # noqa: SIM115 - "the other server", still starting
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    spawned: list[subprocess.Popen[bytes]] = []
    real_spawn = daemon.spawn_fuse_server

    def spawn(c: config.Config) -> subprocess.Popen[bytes]:
        spawned.append(real_spawn(c))
        return spawned[-1]

    monkeypatch.setattr(daemon, "spawn_fuse_server", spawn)
    other: list[subprocess.Popen[bytes]] = []

    def the_other_server_comes_up() -> None:
        while not spawned:
            time.sleep(0.02)
        spawned[0].wait(30)
        lock.close()
        other.append(real_spawn(cfg))

    t = threading.Thread(target=the_other_server_comes_up, daemon=True)
    t.start()
    try:
        assert daemon.ensure_fuse_server(cfg)
        t.join(30)
        assert spawned[0].returncode == FailedPrecondition.exit_code
        assert len(spawned) == 1 and len(other) == 1
        assert FuseServerClient(cfg.fuse.socket).ping()["pid"] == other[0].pid
        assert (root / daemon.FUSE_PID).read_text().strip() == str(other[0].pid)
    finally:
        lock.close()
        for p in spawned + other:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(15)
        unmount_under(tmp_path)
