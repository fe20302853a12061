"""One CLI a container engineer already knows: the same flags mean the same everywhere.

Every command has ``--log-level``/``--debug``; every command that prints results has
``-o/--output text|json``; every option read from the environment shows its variable in
``--help``; ``completion`` prints a script the shell can use; the errors of a stale containerd
socket and of a missing optional package say the cause in one line.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from coldstart.cli import cli

# commands whose output is a result a script may read (daemons, the probe and `completion`
# print none: their machine-readable faces are `snapshotter status`, `probe --listen` /status
# and the sinks)
PRINTS_RESULTS = {
    "bench", "bench-image build", "bench-image list", "convert", "demo", "models activate",
    "models list", "models publish", "models rollback", "models watch", "optimize", "pull",
    "router forget", "router list", "router pick", "router quarantine", "router release",
    "snapshotter status", "weights bench", "weights load",
}


def _commands(group: click.Group = cli, prefix: str = "") -> Iterator[tuple[str, click.Command]]:
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        assert cmd is not None, name
        path = f"{prefix}{name}"
        yield path, cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, f"{path} ")


ALL = dict(_commands())


def _options(cmd: click.Command) -> dict[str, click.Option]:
    return {o: p for p in cmd.params if isinstance(p, click.Option) for o in p.opts}


def test_the_commands_are_all_there() -> None:
    assert set(ALL) >= PRINTS_RESULTS
    assert {"completion", "fuse-server", "probe", "snapshotter"} <= set(ALL)


@pytest.mark.parametrize("path", sorted(ALL))
def test_every_command_takes_log_level_and_debug(path: str) -> None:
    opts = _options(ALL[path])
    assert "--log-level" in opts and "--debug" in opts, path
    assert opts["--log-level"].envvar == "COLDSTART_LOG_LEVEL"


@pytest.mark.parametrize("path", sorted(PRINTS_RESULTS))
def test_every_command_that_prints_results_takes_output_json(path: str) -> None:
    opts = _options(ALL[path])
    assert "-o" in opts and "--output" in opts, path
    out = opts["--output"]
    assert isinstance(out.type, click.Choice) and list(out.type.choices) == ["text", "json"]
    if "--json" in opts and path not in ("bench", "convert"):
        # only the old flag, kept hidden as a deprecated spelling of -o json
        assert opts["--json"].hidden and opts["--json"].is_flag, path


@pytest.mark.parametrize("path", sorted(ALL))
def test_environment_variables_are_shown_in_help(path: str) -> None:
    for opt in _options(ALL[path]).values():
        if opt.envvar:
            assert opt.show_envvar, f"{path} {opt.opts}"


def test_parallelism_is_jobs_everywhere() -> None:
    for path, cmd in ALL.items():
        opts = _options(cmd)
        visible = {o for o, p in opts.items() if not p.hidden}
        assert "--concurrency" not in visible and "--workers" not in visible, path
    assert "-j" in _options(ALL["convert"]) and "-j" in _options(ALL["weights load"])


def test_registry_flags_mean_the_same_everywhere() -> None:
    for path in ("pull", "convert", "optimize", "weights load", "weights bench"):
        opts = _options(ALL[path])
        for flag in ("--insecure", "--tls-verify", "--authfile", "--hosts-dir"):
            assert flag in opts, (path, flag)
        assert opts["--insecure"].metavar == "HOST[:PORT]" and opts["--insecure"].multiple
        assert opts["--authfile"].envvar == "REGISTRY_AUTH_FILE"


def cli_run(*args: str, env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coldstart.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_help_of_every_command_shows_env_vars_and_exits_0() -> None:
    runner_env = {**os.environ, "COLUMNS": "100"}
    for path in ("pull", "snapshotter status", "models list", "router list"):
        r = subprocess.run([sys.executable, "-m", "coldstart.cli", *path.split(), "--help"],
                           capture_output=True, text=True, timeout=60, env=runner_env)
        assert r.returncode == 0, r.stderr
        assert "env var:" in r.stdout and "COLDSTART_LOG_LEVEL" in r.stdout, path


def test_output_table_is_read_as_text(tmp_path: Path) -> None:
    r = cli_run("models", "list", "--root", str(tmp_path), "-o", "table")
    assert r.returncode == 0, r.stderr
    bad = cli_run("models", "list", "--root", str(tmp_path), "-o", "xml")
    assert bad.returncode == 2 and "'xml' is not one of" in bad.stderr


def test_a_bad_log_level_is_a_usage_error() -> None:
    r = cli_run("models", "list", "--root", "/", env={"COLDSTART_LOG_LEVEL": "loud"})
    assert r.returncode == 2 and "--log-level" in r.stderr and "'loud'" in r.stderr


def test_debug_sets_the_root_logger_level(tmp_path: Path) -> None:
    code = ("import logging, sys\n"
            "from coldstart.cli import main\n"
            "try:\n"
            f"    main(['models', 'list', '--root', {str(tmp_path)!r}] + sys.argv[1:])\n"
            "except SystemExit:\n"
            "    print(logging.getLevelName(logging.getLogger().level))\n")
    for extra, want in (([], "WARNING"), (["--debug"], "DEBUG"),
                        (["--log-level", "info"], "INFO")):
        r = subprocess.run([sys.executable, "-c", code, *extra], capture_output=True,
                           text=True, timeout=60)
        assert r.stdout.strip() == want, (extra, r.stdout, r.stderr)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "COLDSTART_LOG_LEVEL": "error"})
    assert r.stdout.strip() == "ERROR", r.stderr


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_scripts(shell: str) -> None:
    r = cli_run("completion", shell)
    assert r.returncode == 0, r.stderr
    assert "_COLDSTART_COMPLETE" in r.stdout and "coldstart" in r.stdout


def test_completion_completes_commands_and_choices() -> None:
    env = {"_COLDSTART_COMPLETE": "bash_complete", "COMP_WORDS": "coldstart rou",
           "COMP_CWORD": "1"}
    r = cli_run(env=env)
    assert r.returncode == 0 and "router" in r.stdout, r.stderr
    env.update(COMP_WORDS="coldstart convert --format ", COMP_CWORD="3")
    r = cli_run(env=env)
    assert "zstd-chunked" in r.stdout and "estargz" in r.stdout


def test_a_missing_extra_names_the_extra(tmp_path: Path) -> None:
    # a core-only install has no pyyaml: `models` says which extra to install, no traceback
    code = ("import sys\nsys.modules['yaml'] = None\n"
            "from coldstart.cli import main\n"
            f"main(['models', 'list', '--root', {str(tmp_path)!r}])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip() == ("coldstart: error: this command needs the 'weights' extra "
                                "(yaml is not installed): pip install 'coldstart[weights]'")


@pytest.fixture
def stale_socket(tmp_path: Path) -> Iterator[Path]:
    """A unix socket nothing listens on: what a containerd killed with -9 leaves behind."""
    path = tmp_path / "containerd.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()
    yield path


def test_pull_reports_a_stale_socket_at_once(stale_socket: Path) -> None:
    # the new-user review's bug: it waited 10 s (not --timeout) and then said "did not accept
    # a connection" where the cause is "connection refused". What it says is the behaviour:
    # "connection refused" comes from the one connect that is refused at once, and waiting
    # (for the 10 s, or for --timeout) ends in "did not accept a connection" (exit 7,
    # DeadlineExceeded). An hour of --timeout, so that waiting it out cannot pass either.
    try:
        r = cli_run("pull", "--address", str(stale_socket), "--timeout", "3600",
                    "127.0.0.1:5/a:b", timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("pull kept waiting on a socket nothing listens on (its --timeout?)")
    assert r.returncode == 6, r.stderr                     # Unavailable, not DeadlineExceeded
    assert "connection refused" in r.stderr and "containerd is not running" in r.stderr
    assert "did not accept a connection" not in r.stderr
    assert r.stderr.count("\n") == 1


def test_pull_checks_its_arguments_before_dialling(stale_socket: Path) -> None:
    for args, want in ((["Bad Ref"], "invalid image reference"),
                       (["a/b:c", "--platform", "linux/amd64,linux/arm64"], "several platforms"),
                       (["a/b:c", "--timeout", "0"], "--timeout must be > 0"),
                       (["a/b:c", "--authfile", "/nonexistent/auth.json"], "--authfile")):
        r = cli_run("pull", "--address", str(stale_socket), *args)
        assert r.returncode == 2, (args, r.stderr)           # InvalidArgument, not Unavailable
        assert want in r.stderr and "connection refused" not in r.stderr, r.stderr


def test_convert_and_pull_json_parse() -> None:
    # -o json is a JSON document, the same flag on every command
    r = cli_run("bench-image", "list", "-o", "json", "--cache-dir", "/nonexistent-cache")
    assert r.returncode == 0, r.stderr
    assert {row["name"] for row in json.loads(r.stdout)} >= {"tiny", "torch"}


def test_old_json_flags_still_work_as_deprecated_aliases(tmp_path: Path) -> None:
    r = cli_run("models", "list", "--root", str(tmp_path), "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == []
    assert "deprecated" in r.stderr and "-o json" in r.stderr
    assert "--json" not in cli_run("models", "list", "--help").stdout


def test_skopeos_tls_verify_false(stale_socket: Path) -> None:
    # --tls-verify=false is skopeo's spelling of --no-tls-verify; a bad value is refused
    for args, rc in ((["--tls-verify=false"], 6), (["--tls-verify=true"], 6),
                     (["--no-tls-verify"], 6), (["--tls-verify=maybe"], 2)):
        r = cli_run("pull", "--address", str(stale_socket), *args, "127.0.0.1:5/a:b")
        assert r.returncode == rc, (args, r.stderr)
    # the flag does not swallow the next word
    r = cli_run("pull", "--address", str(stale_socket), "--tls-verify", "127.0.0.1:5/a:b")
    assert r.returncode == 6 and "connection refused" in r.stderr


def test_authfile_from_the_environment_may_not_exist_yet(stale_socket: Path,
                                                         tmp_path: Path) -> None:
    missing = str(tmp_path / "containers" / "auth.json")
    r = cli_run("pull", "--address", str(stale_socket), "127.0.0.1:5/a:b",
                env={"REGISTRY_AUTH_FILE": missing})
    assert r.returncode == 6, r.stderr                     # on to containerd: only a warning
    assert "coldstart: warning: $REGISTRY_AUTH_FILE" in r.stderr
    r = cli_run("pull", "--address", str(stale_socket), "127.0.0.1:5/a:b", "--authfile", missing)
    assert r.returncode == 2 and "--authfile" in r.stderr


def test_errors_say_what_to_do() -> None:
    # a few of the new-user review's inputs: each one line, its cause and what to do
    r = cli_run("router", "pick", "llama", "--redis", "redis://127.0.0.1:1/0", "--timeout", "1")
    assert r.returncode == 6 and "Connection refused" in r.stderr, r.stderr
    assert "is Valkey/Redis running there? see --redis" in r.stderr
    r = cli_run("bench", "builtin:nope", "--embedded", "--runs", "1", timeout=20)
    assert r.returncode == 2, r.stderr                 # before anything is built or started
    assert r.stderr.strip().splitlines() == [
        "coldstart: error: unknown bench image 'nope' (built-in: tiny, torch, server, "
        "cuda-like, compile; see `coldstart bench-image list`)"]
    r = cli_run("weights", "load", "oci:./model", timeout=20)
    assert r.returncode == 2 and "registry://REGISTRY/REPO@sha256:" in r.stderr


def test_log_format_json_is_one_object_per_line_in_utc(tmp_path: Path) -> None:
    r = cli_run("convert", f"oci:{tmp_path}/none", f"oci:{tmp_path}/out", "--log-format", "json",
                env={"REGISTRY_AUTH_FILE": str(tmp_path / "auth.json")})
    assert r.returncode == 3, r.stderr
    first = json.loads(r.stderr.splitlines()[0])
    assert first["level"] == "warning" and "REGISTRY_AUTH_FILE" in first["msg"]
    assert first["time"].endswith("Z") and "T" in first["time"]
    assert r.stderr.splitlines()[-1].startswith("coldstart: error: ")
