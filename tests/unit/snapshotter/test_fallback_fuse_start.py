"""A FUSE server that cannot start is an error at the snapshotter's start-up, not a warning
followed by a daemon with no lazy pulls (issue 13); with fuse.spawn off it stays a warning."""

from __future__ import annotations

import dataclasses
import fcntl
import re
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import pytest

from coldstart.config import load
from coldstart.snapshotter import daemon
from coldstart.snapshotter.daemon import FuseServerFailed, ensure_fuse_server


def _config(tmp_path: Path, extra: str = "") -> Path:
    conf = tmp_path / "c.toml"
    conf.write_text(f'root = "{tmp_path}/root"\nsocket = "{tmp_path}/s.sock"\n'
                    f'[fuse]\nsocket = "{tmp_path}/f.sock"\nstart_timeout = 20\n{extra}')
    (tmp_path / "root").mkdir()
    return conf


def test_a_spawned_server_that_exits_fails_with_its_logs_last_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load(_config(tmp_path))
    log = tmp_path / "root" / "fuse-server.log"

    def spawn(_cfg: object) -> subprocess.Popen[bytes]:
        return subprocess.Popen(["sh", "-c", f"echo 'some detail' >> {log}; "
                                 f"echo 'coldstart: error: boom' >> {log}; exit 2"])

    monkeypatch.setattr(daemon, "spawn_fuse_server", spawn)
    with pytest.raises(FuseServerFailed) as err:
        ensure_fuse_server(cfg)
    assert str(err.value) == (f"the FUSE server exited with status 2 at start (log {log}): "
                              "coldstart: error: boom")


def test_the_daemon_does_not_start_when_its_fuse_server_cannot(tmp_path: Path) -> None:
    # a chunk cache the FUSE server cannot create: it exits at once
    conf = _config(tmp_path, '[cache]\ndir = "/dev/null/cache"\n')
    r = subprocess.run([sys.executable, "-m", "coldstart.cli", "snapshotter", "--config",
                        str(conf)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("coldstart: error: the FUSE server exited with status"), r.stderr
    assert str(tmp_path / "root" / "fuse-server.log") in last and "/dev/null/cache" in last
    assert "Traceback" not in r.stderr
    assert not Path(tmp_path / "s.sock").exists()


def test_exit_5_is_another_server_only_when_the_root_is_locked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # exit 5 is also a busy metrics port: with the root's lock free, it is an error at once
    # (it used to wait start_timeout, then serve with no lazy pulls)
    cfg = load(_config(tmp_path))
    log = tmp_path / "root" / "fuse-server.log"

    def spawn(_cfg: object) -> subprocess.Popen[bytes]:
        return subprocess.Popen(["sh", "-c", f"echo 'coldstart: error: 127.0.0.1:9: address "
                                 f"in use' >> {log}; exit 5"])

    monkeypatch.setattr(daemon, "spawn_fuse_server", spawn)
    # start_timeout an hour: waiting it out (the old way) cannot end within the join
    waiting = dataclasses.replace(cfg, fuse=dataclasses.replace(cfg.fuse,
                                                                start_timeout=3600.0))
    raised: list[BaseException] = []

    def ensure() -> None:
        try:
            ensure_fuse_server(waiting)
        except BaseException as exc:    # handed to the test's thread
            raised.append(exc)

    t = threading.Thread(target=ensure, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "exit 5 with the root's lock free: it waits for start_timeout"
    assert len(raised) == 1 and isinstance(raised[0], FuseServerFailed), raised
    assert re.search(r"status 5 .*address in use", str(raised[0])), raised[0]
    # with the lock held by another server, exit 5 means "it serves this root": wait for it
    with open(tmp_path / "root" / "fuse-server.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        cfg = dataclasses.replace(cfg, fuse=dataclasses.replace(cfg.fuse, start_timeout=1.0))
        assert ensure_fuse_server(cfg) is False


def test_without_spawn_a_missing_server_stays_a_warning(tmp_path: Path) -> None:
    cfg = load(_config(tmp_path, "spawn = false\n"))
    assert ensure_fuse_server(cfg) is False


def test_the_spawned_servers_config_has_absolute_paths(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a relative root would name another directory for a server that runs in /
    monkeypatch.chdir(tmp_path)
    cfg = load(_config(tmp_path))
    cfg = dataclasses.replace(cfg, root="root",
                              fuse=dataclasses.replace(cfg.fuse, socket="f.sock"))
    started: list[tuple[list[str], str]] = []

    class NoProcess:
        pid = 4242

        def __init__(self, argv: list[str], **kw: object) -> None:
            started.append((argv, str(kw["cwd"])))

    monkeypatch.setattr(daemon.subprocess, "Popen", NoProcess)
    daemon.spawn_fuse_server(cfg)
    assert started[0][1] == "/"
    written = tomllib.loads((tmp_path / "root" / "fuse-server.toml").read_text())
    assert written["root"] == str(tmp_path / "root")
    assert written["fuse"]["socket"] == str(tmp_path / "f.sock")
