"""`coldstart probe` and `coldstart router`: help texts and one-line errors for bad input."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from coldstart.cli import cli


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
        if isinstance(param, click.Option):
            assert param.help and len(param.help) > 10, param.name
            assert param.opts[0] in result.output


@pytest.mark.parametrize(("args", "message", "code"), [
    (["probe"], "nothing to probe", 2),
    (["probe", "--target", "ftp://x"], "unknown target", 2),
    (["probe", "--target", "http://127.0.0.1:1/", "--sink", "mongodb://x"], "unknown sink", 2),
    (["probe", "--target", "http://127.0.0.1:1/", "--interval", "0"], "interval", 2),
    (["probe", "--target", "http://127.0.0.1:1/", "--listen", "nope"], "--listen", 2),
    (["probe", "--target", "http://127.0.0.1:1/", "--sink", "k8s://"], "namespace", 2),
    (["router", "list", "bad{name}"], "bad service name", 2),
    (["router", "pick", "svc", "--redis", "redis://127.0.0.1:1/0", "--timeout", "0.5"],
     "coldstart_pick", 6),
])
def test_bad_input_is_one_line_and_an_exit_code(args: list[str], message: str, code: int) -> None:
    result = run_cli(*args)
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("coldstart: error:") and message in err[0]
