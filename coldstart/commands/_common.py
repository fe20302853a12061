"""What every ``coldstart`` command shares: logging options, ``-o/--output``, the registry options.

The CLI group adds ``--log-level`` and ``--debug`` to every command it loads
(:func:`add_common_options`) and shows each option's environment variable in ``--help``; a command
only declares what is its own. ``-o/--output text|json`` is the one machine-readable output flag
(kubectl's spelling); ``--insecure``, ``--tls-verify`` and ``--authfile`` mean the same wherever a
registry is spoken to (skopeo's spellings).
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import click

__all__ = [
    "FORMAT_CHOICE",
    "FORMAT_HELP",
    "LOG_LEVELS",
    "LOG_LEVEL_ENV",
    "AliasChoice",
    "add_common_options",
    "check_authfile",
    "configure_logging",
    "echo_json",
    "explicit_log_format",
    "explicit_log_level",
    "output_option",
    "registry_client",
    "registry_options",
    "skopeo_bool_flags",
    "split_commas",
]

F = TypeVar("F", bound=Callable[..., Any])

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_LEVEL_ENV = "COLDSTART_LOG_LEVEL"
LOG_FORMAT_ENV = "COLDSTART_LOG_FORMAT"
_LEVEL_KEY = "coldstart.log_level"
_FORMAT_KEY = "coldstart.log_format"
_DAEMON_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_DONE = "_coldstart_common"


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time (a test's capture, rich's redirect)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


class _CommandFormatter(logging.Formatter):
    """``coldstart: warning: …`` like the error lines (the logger's name too when debugging)."""

    def format(self, record: logging.LogRecord) -> str:
        where = f" {record.name}" if logging.getLogger().level <= logging.DEBUG else ""
        text = f"coldstart: {record.levelname.lower()}{where}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _JsonFormatter(logging.Formatter):
    """One JSON object per line with a UTC timestamp (journald, Kubernetes log pipelines)."""

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        doc: dict[str, Any] = {
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(), "logger": record.name,
            "msg": record.getMessage(), "pid": record.process, "thread": record.threadName}
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure_logging(level: str, *, daemon: bool = False, fmt: str | None = None) -> None:
    """Log ``level`` and above to stderr (one handler, added once; pytest's stay as they are):
    one-line ``coldstart: warning: …`` for commands, timestamped lines for daemons, or JSON
    lines (``fmt="json"``, or ``--log-format json`` given to the command)."""
    root = logging.getLogger()
    handler = next((h for h in root.handlers if getattr(h, _DONE, False)), None)
    if handler is None:
        handler = _StderrHandler()
        setattr(handler, _DONE, True)
        root.addHandler(handler)
    fmt = explicit_log_format() or fmt or "text"
    handler.setFormatter(_JsonFormatter() if fmt == "json" else
                         logging.Formatter(_DAEMON_FORMAT) if daemon else _CommandFormatter())
    root.setLevel(level.upper())
    # a line per HTTP request drowns everything else unless debugging
    logging.getLogger("httpx").setLevel(logging.DEBUG if level == "debug" else logging.WARNING)


def explicit_log_level(ctx: click.Context | None = None) -> str | None:
    """The level the user asked for (``--debug``, ``--log-level`` or ``$COLDSTART_LOG_LEVEL``),
    on this command or a parent; ``None`` when nobody asked (daemons then use their config)."""
    c = ctx or click.get_current_context(silent=True)
    while c is not None:
        level = c.meta.get(_LEVEL_KEY)
        if level:
            return str(level)
        c = c.parent
    return None


def explicit_log_format(ctx: click.Context | None = None) -> str | None:
    """``--log-format``/``$COLDSTART_LOG_FORMAT`` when given (daemons else use their config)."""
    c = ctx or click.get_current_context(silent=True)
    return None if c is None else c.meta.get(_FORMAT_KEY)


def _common_params() -> list[click.Option]:
    return [
        click.Option(["--log-level"],
                     type=AliasChoice(LOG_LEVELS, {"warn": "warning", "critical": "error",
                                                   "fatal": "error"}),
                     default=None, envvar=LOG_LEVEL_ENV, show_envvar=True, expose_value=True,
                     help="Log verbosity on stderr [default: warning; daemons: the config's "
                          "log_level]."),
        click.Option(["--debug"], is_flag=True, default=False, expose_value=True,
                     help="Same as --log-level debug."),
        click.Option(["--log-format"], type=click.Choice(["text", "json"]), default=None,
                     envvar=LOG_FORMAT_ENV, show_envvar=True,
                     help="Log lines as text, or as JSON objects with UTC timestamps "
                          "[default: text; daemons: the config's log_format]."),
    ]


def add_common_options(command: click.Command) -> click.Command:
    """Give ``command`` (and every subcommand of a group) ``--log-level`` and ``--debug``, show
    each option's environment variable in ``--help``; idempotent."""
    if getattr(command, _DONE, False):
        return command
    setattr(command, _DONE, True)
    names = {n for p in command.params for n in getattr(p, "opts", [])}
    if "--log-level" not in names:
        command.params.extend(_common_params())
        command.callback = _with_logging(command.callback)
    for p in command.params:
        if isinstance(p, click.Option) and p.envvar:
            p.show_envvar = True
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            add_common_options(sub)
    return command


def _with_logging(callback: Callable[..., Any] | None) -> Callable[..., Any]:
    def run(*args: Any, log_level: str | None = None, debug: bool = False,
            log_format: str | None = None, **kwargs: Any) -> Any:
        ctx = click.get_current_context()
        level = "debug" if debug else (log_level.lower() if log_level else None)
        if level:
            ctx.meta[_LEVEL_KEY] = level
        if log_format:
            ctx.meta[_FORMAT_KEY] = log_format
        configure_logging(explicit_log_level(ctx) or "warning")
        return callback(*args, **kwargs) if callback is not None else None

    if callback is not None:
        run = functools.update_wrapper(run, callback)
    return run


# -- choices with the names people type --------------------------------------------------------

class AliasChoice(click.Choice):  # type: ignore[type-arg]
    """A choice that also takes other spellings of its values (``zstd:chunked`` for
    ``zstd-chunked``, torch's ``bfloat16`` for ``bf16``); ``--help`` lists the main ones."""

    def __init__(self, choices: Iterable[str], aliases: dict[str, str]) -> None:
        super().__init__(list(choices), case_sensitive=False)
        self.aliases = {k.lower(): v for k, v in aliases.items()}

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        if isinstance(value, str):
            value = self.aliases.get(value.lower(), value)
        return super().convert(value, param, ctx)


FORMAT_CHOICE = AliasChoice(["zstd-chunked", "estargz"],
                            {"zstd:chunked": "zstd-chunked", "zstdchunked": "zstd-chunked",
                             "stargz": "estargz"})
FORMAT_HELP = " (zstd:chunked, podman's spelling, is the same as zstd-chunked)"


# -- output --------------------------------------------------------------------------------------

_JSON_ALIAS = "coldstart.json_alias"


def _json_alias(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        ctx.meta[_JSON_ALIAS] = True
        click.echo("coldstart: warning: --json is deprecated here: use -o json", err=True)


def _output(ctx: click.Context, _param: click.Parameter, value: str) -> str:
    return "json" if ctx.meta.get(_JSON_ALIAS) else value


def output_option(help_json: str = "one JSON document on stdout", *,
                  json_alias: bool = False) -> Callable[[F], F]:
    """``-o/--output text|json``: what the command prints on stdout (``table`` and ``wide``
    are read as ``text``, kubectl habits). ``json_alias``: the command had a ``--json`` flag
    before; it stays, hidden, as a deprecated spelling of ``-o json``."""
    def decorate(f: F) -> F:
        f = click.option("-o", "--output", "output",
                         type=AliasChoice(["text", "json"], {"table": "text", "wide": "text"}),
                         default="text", show_default=True, callback=_output,
                         help=f"Output format: text for people, json for scripts "
                              f"({help_json}).")(f)
        if json_alias:
            f = click.option("--json", "_json_alias", is_flag=True, hidden=True,
                             is_eager=True, expose_value=False, callback=_json_alias,
                             help="Deprecated: the same as -o json.")(f)
        return f
    return decorate


def echo_json(doc: Any) -> None:
    """Print ``doc`` as indented JSON on stdout."""
    click.echo(json.dumps(doc, indent=2, default=str))


# -- registries ----------------------------------------------------------------------------------

def split_commas(values: Iterable[str]) -> list[str]:
    """Repeatable options that also take comma lists: ``--x a,b --x c`` → ``[a, b, c]``."""
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def registry_options(f: F) -> F:
    """``--insecure HOST[:PORT]``, ``--tls-verify``, ``--authfile`` and ``--hosts-dir``, the
    same everywhere."""
    f = click.option("--hosts-dir", type=click.Path(file_okay=False, path_type=Path),
                     default=None, envvar="COLDSTART_HOSTS_DIR",
                     help="containerd certs.d directory with <host>/hosts.toml (mirrors, TLS, "
                          "as containerd reads it; e.g. /etc/containerd/certs.d).")(f)
    f = click.option("--authfile", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     envvar="REGISTRY_AUTH_FILE",
                     help="Registry credentials in Docker's config.json format (auths, "
                          "credential helpers) [default: $DOCKER_CONFIG/config.json, else "
                          "~/.docker/config.json].")(f)
    f = click.option("--tls-verify/--no-tls-verify", default=True, show_default=True,
                     help="Verify registries' TLS certificates; --no-tls-verify (or skopeo's "
                          "--tls-verify=false) trusts any certificate (test registries "
                          "only).")(f)
    f = click.option("--insecure", "insecure", multiple=True, metavar="HOST[:PORT]",
                     help="Speak plain HTTP to this registry (repeatable or comma list; a HOST "
                          "without a port means every port of it; loopback always is).")(f)
    return f


def check_authfile(authfile: Path | None) -> Path | None:
    """The credentials file to use: ``--authfile`` must exist; ``$REGISTRY_AUTH_FILE`` naming a
    file not written yet (podman exports it before its first login) only warns, and the
    default Docker config is used."""
    from coldstart.errors import InvalidArgument

    if authfile is None or authfile.is_file():
        return authfile
    ctx = click.get_current_context(silent=True)
    source = ctx.get_parameter_source("authfile") if ctx is not None else None
    if source is click.core.ParameterSource.ENVIRONMENT:
        logging.getLogger(__name__).warning(
            "$REGISTRY_AUTH_FILE=%s does not exist; using the default Docker config", authfile)
        return None
    raise InvalidArgument(f"--authfile {authfile}: no such file (give a Docker config.json "
                          "with \"auths\", as `docker login` or `podman login` writes)")


def registry_client(insecure: Iterable[str], tls_verify: bool, authfile: Path | None,
                    hosts_dir: Path | None, **kwargs: Any) -> Any:
    """A :class:`~coldstart.oci.registry.RegistryClient` from :func:`registry_options`."""
    from coldstart.oci.registry import RegistryClient

    return RegistryClient(insecure_hosts=split_commas(insecure), tls_verify=tls_verify,
                          docker_config=check_authfile(authfile), hosts_dir=hosts_dir,
                          **kwargs)


def skopeo_bool_flags(argv: list[str]) -> list[str]:
    """``--tls-verify=false`` (skopeo's spelling) as click's flag pair: ``--no-tls-verify``."""
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        if eq and name == "--tls-verify":
            try:
                flag = click.BOOL.convert(value, None, None)
            except click.BadParameter:
                out.append(arg)            # click then says the option takes no value
                continue
            arg = "--tls-verify" if flag else "--no-tls-verify"
        out.append(arg)
    return out
