"""The CLI's edge: usage errors are one line and exit 2; no arguments shows the help."""

from __future__ import annotations

import subprocess
import sys


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coldstart.cli", *args], capture_output=True,
                          text=True, timeout=60)


def test_usage_errors_are_one_line() -> None:
    for args, text in [(("convert",), "Missing argument 'SRC'"),
                       (("nosuch",), "No such command 'nosuch'"),
                       (("pull", "--timeout", "abc", "x"), "'abc' is not a valid float")]:
        r = cli(*args)
        assert r.returncode == 2, args
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("coldstart: error: "), r.stderr
        assert text in lines[0] and "--help" in lines[0]


def test_no_arguments_shows_the_commands() -> None:
    r = cli()
    assert r.returncode == 0
    for command in ("convert", "pull", "snapshotter", "weights", "probe", "demo"):
        assert f"  {command} " in r.stdout
