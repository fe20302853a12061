"""``coldstart fuse-server``: run the FUSE server (see :mod:`coldstart.lazyfs.server`)."""

from __future__ import annotations

import dataclasses
import logging
import os

import click

from coldstart.commands._common import configure_logging, explicit_log_level
from coldstart.config import load
from coldstart.errors import InvalidArgument


def _host_port(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Refuse a malformed ``--metrics-address`` before anything starts (no traceback)."""
    if not value:
        return value
    from coldstart.lazyfs.server import parse_metrics_address

    try:
        parse_metrics_address(value)
    except InvalidArgument as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None
    return value


@click.command("fuse-server")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              envvar="COLDSTART_CONFIG", help="TOML config file (default: built-in defaults).")
@click.option("--root", default=None, help="State root (overrides config `root`).")
@click.option("--socket", "socket_path", default=None,
              help="Control socket (overrides config `fuse.socket`).")
@click.option("--metrics-address", default=None, callback=_host_port,
              help="host:port for Prometheus metrics of this process (default: the config's "
                   "fuse.metrics_address, none by default; use a port other than the "
                   "snapshotter's).")
def fuse_server(config_path: str | None, root: str | None, socket_path: str | None,
                metrics_address: str | None) -> None:
    """Serve lazily pulled layers over FUSE; restore persisted mounts at start.

    A holder process keeps the FUSE connection open; a server started while its dead
    predecessor's connection is still held takes it over, so running containers keep their
    mounts and no read fails. SIGTERM/SIGINT: unmount and exit. SIGUSR2: exit and leave the
    mounts to the next server (an upgrade).

    Refuses to start (exit status 5, nothing touched) when another fuse-server serves the same
    root or already answers on the control socket. Logs at the config's log_level unless
    --log-level/--debug (or COLDSTART_FUSE_DEBUG=1, which the snapshotter passes on) says
    otherwise."""
    cfg = load(config_path)
    if root:
        cfg = dataclasses.replace(cfg, root=root)
    level = explicit_log_level() or (
        "debug" if os.environ.get("COLDSTART_FUSE_DEBUG") == "1" else cfg.log_level)
    configure_logging(level, daemon=True, fmt=cfg.log_format)
    # one line per range request would drown the data path's own log lines
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from coldstart.lazyfs.server import FuseServer

    FuseServer(cfg, root=root, socket_path=socket_path,
               metrics_address=metrics_address).run()
