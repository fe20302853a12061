"""``coldstart snapshotter``: the containerd remote snapshotter daemon (gRPC on a unix socket),
and ``coldstart snapshotter status``: what its FUSE server serves, layer by layer.

Example::

    coldstart snapshotter --config /etc/coldstart/config.toml
    coldstart snapshotter --root /var/lib/coldstart --socket /run/coldstart/snapshotter.sock
    coldstart snapshotter --print-config > config.toml
    coldstart snapshotter status --config /etc/coldstart/config.toml [-o json]
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import click

from coldstart import config as configmod
from coldstart.commands._common import (
    configure_logging,
    echo_json,
    explicit_log_format,
    explicit_log_level,
    output_option,
)

_CONFIG_HELP = "TOML config file (every key and its default: --print-config)."


@click.group(invoke_without_command=True)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              envvar="COLDSTART_CONFIG", help=_CONFIG_HELP)
@click.option("--root", default=None, envvar="COLDSTART_ROOT",
              help="Metadata and snapshot directories (config: root).")
@click.option("--socket", default=None, envvar="COLDSTART_SOCKET",
              help="gRPC unix socket containerd dials (config: socket).")
@click.option("--print-config", is_flag=True, help="Print the effective config as TOML, exit.")
@click.pass_context
def snapshotter(ctx: click.Context, config_path: str | None, root: str | None,
                socket: str | None, print_config: bool) -> None:
    """Serve containerd's snapshots API; lazily pulled layers are mounted by the FUSE server.

    Without a subcommand, runs the daemon until SIGTERM. It logs at the config's log_level
    unless --log-level/--debug says otherwise.
    """
    if ctx.invoked_subcommand is not None:
        ctx.obj = config_path      # `snapshotter --config F status` reads F too
        return
    cfg = configmod.load(config_path)
    if root is not None:
        cfg = dataclasses.replace(cfg, root=root)
    if socket is not None:
        cfg = dataclasses.replace(cfg, socket=socket)
    level, fmt = explicit_log_level(), explicit_log_format()
    if level is not None:
        cfg = dataclasses.replace(cfg, log_level=level)
    if fmt is not None:         # the spawned FUSE server reads the config: it logs alike
        cfg = dataclasses.replace(cfg, log_format=fmt)
    if print_config:
        click.echo("# coldstart snapshotter config (TOML): every key with its default and "
                   "meaning.\n# Durations are seconds; sizes are bytes or \"20G\", "
                   "\"512MiB\", \"4K\" (binary units).\n")
        click.echo(configmod.dump(cfg), nl=False)
        return
    configure_logging(cfg.log_level, daemon=True, fmt=cfg.log_format)
    from coldstart.snapshotter.daemon import run

    run(cfg)


def _mb(n: object) -> str:
    return f"{n / 1e6:.1f}" if isinstance(n, int) else "-"


def _not_lazy_rows(root: str) -> list[dict[str, object]]:
    """Layers offered for lazy pulling but pulled normally (labelled so by the daemon), from
    its metadata, read-only; a one-line warning on stderr when it cannot be read."""
    from coldstart.errors import ColdstartError
    from coldstart.snapshotter.daemon import METADATA_DB
    from coldstart.snapshotter.snapshotter import (
        IMAGE_LABEL,
        LAYER_LABEL,
        LAZY_LABEL,
        REASON_LABEL,
    )
    from coldstart.snapshotter.store import read_infos

    try:
        infos = read_infos(os.path.join(root, METADATA_DB))
    except ColdstartError as exc:
        click.echo(f"coldstart: warning: {exc}", err=True)
        return []
    return [{"digest": i.labels.get(LAYER_LABEL, ""), "state": "not-lazy",
             "reason": i.labels.get(REASON_LABEL, "other"), "snapshot": i.name,
             "kind": i.kind.word, "image": i.labels.get(IMAGE_LABEL, "")}
            for i in infos if i.labels.get(LAZY_LABEL) == "false"]


def _restore_row(cfg: configmod.Config) -> dict[str, Any] | None:
    """The node's snapshot restores as coldstart-runc counted them (None: it never tried)."""
    from coldstart.snapshot.state import NodeState

    state = NodeState(Path(cfg.snapshot.state_dir))
    try:
        if not (state.root / "counters.json").exists():
            return None
    except OSError:         # not ours to read (0700, another user): not shown
        return None
    counts = state.counters()
    raw = counts.get("fallbacks")
    fallbacks = {str(k): int(v) for k, v in raw.items() if isinstance(v, int)} \
        if isinstance(raw, dict) else {}
    restored = counts.get("restored")
    return {"state": "snapshot-restores", "restored": restored if isinstance(restored, int)
            else 0, "fallbacks": fallbacks, "state_dir": str(state.root)}


@snapshotter.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              envvar="COLDSTART_CONFIG", help=_CONFIG_HELP)
@click.option("--fuse-socket", default=None, metavar="PATH",
              help="The FUSE server's control socket (config: fuse.socket).")
@click.option("--root", default=None, metavar="DIR",
              help="The snapshotter's root, whose metadata names the layers not mounted "
                   "lazily (config: root).")
@output_option("a list with one object per layer; layers pulled normally have state "
               "\"not-lazy\" and a reason; last, on a node that restores snapshots, one "
               "object with state \"snapshot-restores\": restored, fallbacks by reason",
               json_alias=True)
def status(config_path: str | None, fuse_socket: str | None, root: str | None,
           output: str) -> None:
    """Per lazily mounted layer: state (prefetching, filling, complete, on-demand), bytes
    prefetched, filled and fetched on demand, requests, errors. Then the layers offered for
    lazy pulling that containerd pulled normally, with the reason (state not-lazy). Then, on
    a node whose runtime is coldstart-runc, its snapshot restores: how many restored, how many
    started normally and why."""
    from coldstart.lazyfs.client import FuseServerClient

    parent = click.get_current_context().parent
    given = config_path or (parent.obj if parent is not None else None)
    cfg = configmod.load(given)
    from coldstart.lazyfs.client import FuseServerUnreachable

    # the metadata is read only for a snapshotter named by --root or a config, or when the
    # FUSE server is named by neither (the defaults): --fuse-socket alone names another one
    metadata_root = root or (cfg.root if given or not fuse_socket else None)
    not_lazy = _not_lazy_rows(metadata_root) if metadata_root else []
    where = fuse_socket or cfg.fuse.socket
    try:
        rows = FuseServerClient(where, timeout=10.0).status()
    except FuseServerUnreachable as exc:
        for n in not_lazy:       # the layers that fell back are what to look at now
            click.echo(f"not lazy: {n['digest']} ({n['reason']}) {n['image']}", err=True)
        raise FuseServerUnreachable(
            f"{exc} (is the snapshotter running with this config? its FUSE server listens on "
            "fuse.socket: give --config or --fuse-socket)") from None
    restores = _restore_row(cfg)
    if output == "json":
        echo_json([*rows, *not_lazy, *([restores] if restores else [])])
        return
    if not rows:
        click.echo("no lazily mounted layers")
    else:
        click.echo(f"{'LAYER':<19}  {'STATE':<11} {'PREFETCH MB':>11} {'FILL MB':>8} "
                   f"{'DEMAND MB':>9} {'LOCAL':>6} {'REQS':>5} {'ERRS':>4}  MOUNTPOINT")
    for r in rows:
        total, local = r.get("total_bytes") or 0, r.get("local_bytes") or 0
        share = f"{100 * local / total:.0f}%" if total else "-"
        click.echo(f"{str(r['digest'])[:19]:<19}  {r.get('state', '-'):<11} "
                   f"{_mb(r.get('prefetched_bytes')):>11} {_mb(r.get('filled_bytes')):>8} "
                   f"{_mb(r.get('on_demand_bytes')):>9} {share:>6} {r.get('requests', 0):>5} "
                   f"{r.get('errors', 0):>4}  {r['mountpoint']}")
    if not_lazy:
        click.echo("\nnot mounted lazily (containerd pulled them):")
        click.echo(f"{'LAYER':<19}  {'REASON':<14} {'KIND':<9}  {'SNAPSHOT':<19}  IMAGE")
        for n in not_lazy:
            click.echo(f"{str(n['digest'])[:19]:<19}  {n['reason']!s:<14} {n['kind']!s:<9}  "
                       f"{str(n['snapshot'])[:19]:<19}  {n['image']}")
    if restores:
        why = ", ".join(f"{k} {v}" for k, v in sorted(restores["fallbacks"].items()) if v)
        click.echo(f"\nsnapshot restores (coldstart-runc): {restores['restored']} restored, "
                   f"{sum(restores['fallbacks'].values())} started normally"
                   + (f" ({why})" if why else "") + "; `coldstart snapshot status` says why")
