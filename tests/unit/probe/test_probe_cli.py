"""`coldstart probe` and `coldstart router`: help texts and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from coldstart.cli import cli
from tests.fixtures.procs import free_port


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coldstart.cli", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args", [["probe"], ["router"], ["router", "pick"],
                                  ["router", "release"], ["router", "list"],
                                  ["router", "quarantine"], ["router", "forget"]])
def test_help_explains_the_command_and_every_option(args: list[str]) -> None:
    result = CliRunner().invoke(cli, [*args, "--help"])
    assert result.exit_code == 0, result.output
    ctx = click.Context(cli)
    command: click.Command | None = cli
    for name in args:
        assert isinstance(command, click.Group)
        command = command.get_command(ctx, name)
    assert command is not None and command.help and len(command.help) > 20
    for param in command.params:
        if isinstance(param, click.Option) and not param.hidden:
            assert param.help and len(param.help) > 10, param.name
            assert param.opts[0] in result.output


@pytest.mark.parametrize(("args", "message", "code"), [
    (["probe"], "nothing to probe", 2),
    (["probe", "--target", "ftp://x"], "unknown target", 2),
    (["probe", "--target", "http://127.0.0.1:1/", "--sink", "mongodb://x"], "unknown sink", 2),
    (["probe", "--target", "http://127.0.0.1:1/", "--interval", "0"], "interval", 2),
    (["probe", "--target", "http://127.0.0.1:1/", "--listen", "nope"], "--listen", 2),
    (["probe", "--target", "http://127.0.0.1:1/", "--sink", "k8s://"], "namespace", 2),
    (["probe", "--target", "exec:/nonexistent", "--startup-timeout", "5"],
     "/nonexistent does not exist", 2),
    (["probe", "--target", "http://127.0.0.1:abc/", "--startup-timeout", "5"],
     "bad target URL", 2),
    (["probe", "--keep-probing", "--target", "http://127.0.0.1:1/", "--", "true"],
     "--keep-probing is for the sidecar", 2),
    (["router", "list", "bad{name}"], "bad service name", 2),
    (["router", "pick", "svc", "--redis", "redis://127.0.0.1:1/0", "--timeout", "0.5"],
     "coldstart_v2_pick", 6),
])
def test_bad_input_is_one_line_and_an_exit_code(args: list[str], message: str, code: int) -> None:
    result = run_cli(*args)
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("coldstart: error:") and message in err[0]


def test_sidecar_failed_is_on_stderr_and_exits_1() -> None:
    """Issue 16, bug 1, as a user runs it: a target that never gets ready used to print
    nothing and never exit. Now one ERROR line says FAILED, why, and what follows; exit 1."""
    target = f"http://127.0.0.1:{free_port()}/"
    result = subprocess.run(
        [sys.executable, "-m", "coldstart.cli", "probe", "--target", target,
         "--startup-timeout", "1"],
        capture_output=True, text=True, timeout=30,  # it used to run until killed
    )
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if "FAILED" in line]
    assert len(lines) == 1, result.stderr
    assert "ERROR" in lines[0] and "not ready after 1 s" in lines[0]
    assert "ConnectionRefusedError" in lines[0] and "exiting with 1" in lines[0]
    assert "Traceback" not in result.stderr


_NO_CONFIG = """
import json, logging, sys
from coldstart.commands.probe import probe
own = sorted(o for p in probe.params for o in getattr(p, "opts", []))
try:
    probe.main(sys.argv[1:], standalone_mode=False)
finally:
    root = logging.getLogger()
    print(json.dumps({"own": own, "handlers": [type(h).__name__ for h in root.handlers],
                      "level": logging.getLevelName(root.level)}))
"""


def test_probe_leaves_logging_to_the_cli() -> None:
    """Issue 16, bug 5: the CLI group gives every command --log-level/--debug; the probe had
    its own --log-level and logging.basicConfig. It now declares neither and configures the
    root logger through the CLI's one helper (timestamped lines, as for the daemons, at the
    level --log-level chose, WARNING by default): its FAILED line reaches stderr."""
    target = f"http://127.0.0.1:{free_port()}/"
    result = subprocess.run(
        [sys.executable, "-c", _NO_CONFIG, "--target", target, "--startup-timeout", "0.5"],
        capture_output=True, text=True, timeout=30,
    )
    seen = json.loads(result.stdout)
    assert "--log-level" not in seen["own"] and "--debug" not in seen["own"], seen
    assert seen["handlers"] == ["_StderrHandler"] and seen["level"] == "WARNING", seen
    assert "FAILED: not ready after 0.5 s" in result.stderr, result.stderr
    help_text = CliRunner().invoke(cli, ["probe", "--help"]).output
    assert "Exit codes:" in help_text and "--keep-probing" in help_text
