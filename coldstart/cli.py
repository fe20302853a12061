"""The ``coldstart`` command line.

Each command lives in its own module under :mod:`coldstart.commands` and is imported only when it
is invoked (or when ``--help`` lists it), so ``coldstart probe`` never pays for importing torch.
Expected failures (:class:`coldstart.errors.ColdstartError`) print one line and exit non-zero.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import NoReturn

import click

from coldstart.commands._common import add_common_options, skopeo_bool_flags
from coldstart.errors import ColdstartError

# command name -> (module, attribute). A module that does not exist yet is simply not listed.
_COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("coldstart.commands.bench", "bench"),
    "bench-image": ("coldstart.commands.bench_image", "bench_image"),
    "completion": ("coldstart.commands.completion", "completion"),
    "demo": ("coldstart.commands.demo", "demo"),
    "convert": ("coldstart.commands.convert", "convert"),
    "index": ("coldstart.commands.index", "index"),
    "pull": ("coldstart.commands.pull", "pull"),
    "optimize": ("coldstart.commands.optimize", "optimize"),
    "snapshotter": ("coldstart.commands.snapshotter", "snapshotter"),
    "fuse-server": ("coldstart.commands.fuse_server", "fuse_server"),
    "weights": ("coldstart.commands.weights", "weights"),
    "models": ("coldstart.commands.models", "models"),
    "probe": ("coldstart.commands.probe", "probe"),
    "router": ("coldstart.commands.router", "router"),
    "node": ("coldstart.commands.node", "node"),
    "cri-proxy": ("coldstart.commands.cri_proxy", "cri_proxy"),
    "warmup": ("coldstart.commands.warmup", "warmup"),
    "snapshot": ("coldstart.commands.snapshot", "snapshot"),
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        names = [n for n, (mod, _) in _COMMANDS.items() if importlib.util.find_spec(mod)]
        return sorted(names)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = _COMMANDS.get(cmd_name)
        if entry is None or importlib.util.find_spec(entry[0]) is None:
            return None
        module = importlib.import_module(entry[0])
        command: click.Command = getattr(module, entry[1])
        return add_common_options(command)


_EPILOG = """\b
Every command takes --log-level/--debug ($COLDSTART_LOG_LEVEL) and -h/--help; commands that
print results take -o json; long operations show progress on a terminal (-q: none).
Exit codes: 0 ok, 1 failed, 2 bad arguments, 3 not found, 4 already exists, 5 wrong state,
6 unavailable (registry, containerd, S3 down), 7 deadline exceeded, 8 integrity (digest
mismatch), 9 bad format, 130 interrupted.
Shell completion: coldstart completion bash|zsh|fish.
"""


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]},
             epilog=_EPILOG)
@click.version_option(package_name="coldstart")
def cli() -> None:
    """coldstart: make big GPU containers start fast.

    Lazy-pull image layers through a containerd snapshotter, stream model weights into memory at
    the speed of the source, and push readiness to the request router within milliseconds.
    """


add_common_options(cli)


# an optional package -> the extra that installs it (pyproject.toml)
_EXTRAS = {"torch": "weights", "numpy": "weights", "boto3": "weights", "botocore": "weights",
           "yaml": "weights", "trio": "snapshotter",
           "prometheus_client": "snapshotter", "redis": "probe", "matplotlib": "plot"}


def _imported(name: str) -> bool:
    return sys.modules.get(name) is not None


def _missing_extra(exc: ModuleNotFoundError) -> str | None:
    top = (exc.name or "").split(".", 1)[0]
    extra = _EXTRAS.get(top)
    if extra is None or _imported(top):
        return None         # installed, but something inside it is missing: a real bug
    try:
        if importlib.util.find_spec(top) is not None:
            return None
    except (ImportError, ValueError):
        pass
    return (f"this command needs the {extra!r} extra ({top} is not installed): "
            f"pip install 'coldstart[{extra}]'")


def main(argv: list[str] | None = None) -> NoReturn:
    """Entry point of the console script: run the CLI, turning expected failures into one line.

    Always ends with ``SystemExit``: 0 on success (``--help`` included), the error's exit code
    otherwise.
    """
    args = skopeo_bool_flags(sys.argv[1:] if argv is None else list(argv))
    try:
        rv = cli.main(args=args, prog_name="coldstart", standalone_mode=False)
        sys.exit(rv if isinstance(rv, int) else 0)
    except ColdstartError as exc:
        click.echo(f"coldstart: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("coldstart: aborted", err=True)
        sys.exit(130)
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.format_message())
        sys.exit(0)
    except click.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "coldstart"
        click.echo(f"coldstart: error: {exc.format_message()} (see '{where} --help')", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        click.echo(f"coldstart: error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("coldstart: interrupted", err=True)
        sys.exit(130)
    except ModuleNotFoundError as exc:
        message = _missing_extra(exc)
        if message is None:
            raise
        click.echo(f"coldstart: error: {message}", err=True)
        sys.exit(1)


if __name__ == "__main__":  # pragma: no cover
    main()
