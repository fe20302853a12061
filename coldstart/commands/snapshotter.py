"""``coldstart snapshotter``: the containerd remote snapshotter daemon (gRPC on a unix socket).

Example::

    coldstart snapshotter --config /etc/coldstart/config.toml
    coldstart snapshotter --root /var/lib/coldstart --socket /run/coldstart/snapshotter.sock
    coldstart snapshotter --print-config > config.toml
"""

from __future__ import annotations

import dataclasses

import click

from coldstart import config as configmod


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="TOML config file (every key and its default: --print-config).")
@click.option("--root", default=None, help="Metadata and snapshot directories (config: root).")
@click.option("--socket", default=None, help="gRPC unix socket containerd dials "
                                             "(config: socket).")
@click.option("--print-config", is_flag=True, help="Print the effective config as TOML, exit.")
def snapshotter(config_path: str | None, root: str | None, socket: str | None,
                print_config: bool) -> None:
    """Serve containerd's snapshots API; lazily pulled layers are mounted by the FUSE server."""
    cfg = configmod.load(config_path)
    if root is not None:
        cfg = dataclasses.replace(cfg, root=root)
    if socket is not None:
        cfg = dataclasses.replace(cfg, socket=socket)
    if print_config:
        click.echo(configmod.dump(cfg), nl=False)
        return
    from coldstart.snapshotter.daemon import run

    run(cfg)
