"""``coldstart snapshotter --print-config`` and config errors, through the real CLI."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from coldstart.config import Config, dump, load


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coldstart.cli", *args], capture_output=True,
                          text=True, timeout=60)


def test_print_config_is_loadable_and_applies_flags(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text('log_level = "debug"\n[fuse]\nspawn = false\nrequest_timeout = 5\n')
    r = cli("snapshotter", "--config", str(conf), "--root", "/srv/cs", "--print-config")
    assert r.returncode == 0, r.stderr
    printed = tmp_path / "printed.toml"
    printed.write_text(r.stdout)
    cfg = load(printed)
    assert cfg == dataclasses.replace(
        Config(), root="/srv/cs", log_level="debug",
        fuse=dataclasses.replace(Config().fuse, spawn=False, request_timeout=5.0))
    assert load(None) == Config()
    assert dump(Config()) in cli("snapshotter", "--print-config").stdout


def test_a_bad_config_is_one_line_and_a_non_zero_exit(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text("[fuse]\nspwan = true\n")
    r = cli("snapshotter", "--config", str(conf))
    assert r.returncode == 2
    assert r.stderr.strip() == "coldstart: error: config: unknown key 'fuse.spwan'"
    conf.write_text('log_level = "chatty"\n')
    r = cli("snapshotter", "--config", str(conf), "--root", str(tmp_path / "r"))
    assert (r.returncode, r.stderr.strip()) == (
        2, "coldstart: error: config: log_level must be one of debug, info, warning, error, "
           "not 'chatty'")
    r = cli("snapshotter", "--config", str(tmp_path / "missing.toml"), "--print-config")
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_out_of_range_values_and_unreadable_files_are_one_line(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    for text, message in [
        ("grpc_workers = 0\n", "config: grpc_workers must be > 0, not 0"),
        ("[fetch]\nrequest_timeout = -3\n", "config: request_timeout must be > 0, not -3.0"),
        ("[fetch]\nbackground_rate = -5\n", "config: background_rate must be >= 0, not -5"),
        ("shutdown_grace = -1\n", "config: shutdown_grace must be >= 0, not -1.0"),
    ]:
        conf.write_text(text)
        r = cli("snapshotter", "--config", str(conf), "--root", str(tmp_path / "r"))
        assert (r.returncode, r.stderr.strip()) == (2, f"coldstart: error: {message}"), text
    conf.write_bytes(b"root = \"\xff\xfe\"\n")
    for command in ("snapshotter", "fuse-server"):
        r = cli(command, "--config", str(conf), "--root", str(tmp_path / "r"))
        assert r.returncode == 2 and "is not UTF-8 text" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    # zero is allowed where it means "off"
    conf.write_text("[fetch]\nbackground_rate = 0\n")
    assert load(conf).fetch.background_rate == 0


def test_status_without_a_fuse_server_is_one_line(tmp_path: Path) -> None:
    r = cli("snapshotter", "status", "--fuse-socket", str(tmp_path / "nothing.sock"))
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "not reachable" in lines[0], r.stderr
    assert "nothing.sock" in lines[0]


def test_print_config_explains_every_key_and_sizes_take_units(tmp_path: Path) -> None:
    text = cli("snapshotter", "--print-config").stdout
    lines = text.splitlines()
    keys = [i for i, line in enumerate(lines) if " = " in line and not line.startswith("#")]
    assert len(keys) > 40
    for i in keys:                       # each key has its meaning right above it (or shares
        j = i                            # the comment of the group it belongs to)
        while j > 0 and " = " in lines[j - 1] and not lines[j - 1].startswith("#"):
            j -= 1
        assert lines[j - 1].startswith("#"), lines[i]
    assert 'max_bytes = "20G"' in text and "# size limit" in text
    conf = tmp_path / "c.toml"
    conf.write_text('[cache]\nmax_bytes = "512MiB"\n[fetch]\nbackground_rate = "1.5G"\n'
                    'neighbor_bytes = 4096\n')
    cfg = load(conf)
    assert cfg.cache.max_bytes == 512 << 20 and cfg.fetch.background_rate == int(1.5 * (1 << 30))
    assert cfg.fetch.neighbor_bytes == 4096
    conf.write_text('[cache]\nmax_bytes = "lots"\n')
    r = cli("snapshotter", "--config", str(conf), "--print-config")
    assert r.returncode == 2 and "cache.max_bytes must be bytes or a size like" in r.stderr
    conf.write_text('[fuse]\nrequest_timeout = "5s"\n')    # a size suffix is for sizes only
    assert cli("snapshotter", "--config", str(conf), "--print-config").returncode == 2


def test_fuse_server_metrics_and_log_format_are_in_the_config(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text('log_format = "json"\n[fuse]\nmetrics_address = "127.0.0.1:9102"\n')
    cfg = load(conf)
    assert cfg.log_format == "json" and cfg.fuse.metrics_address == "127.0.0.1:9102"
    conf.write_text('metrics_address = "127.0.0.1:9102"\n'
                    '[fuse]\nmetrics_address = "127.0.0.1:9102"\n')
    r = cli("snapshotter", "--config", str(conf), "--print-config")
    assert r.returncode == 2 and "must differ" in r.stderr
    conf.write_text('log_format = "xml"\n')
    r = cli("snapshotter", "--config", str(conf), "--print-config")
    assert r.returncode == 2 and "log_format must be one of text, json" in r.stderr
