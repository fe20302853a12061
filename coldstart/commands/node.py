"""``coldstart node install|uninstall|status``: make containerd on this node use coldstart.

Example::

    coldstart node install --dry-run
    coldstart node install --restart-containerd
    coldstart node status -o json
    coldstart node uninstall --restart-containerd
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from coldstart.commands._common import echo_json, output_option

F = TypeVar("F", bound=Callable[..., Any])

_PATH = click.Path(dir_okay=False, path_type=Path)
_DIR = click.Path(file_okay=False, path_type=Path)


def _paths_options(f: F) -> F:
    f = click.option("--systemd-dir", type=_DIR, default=Path("/etc/systemd/system"),
                     show_default=True, help="Where the coldstart-snapshotter.service unit "
                     "goes.")(f)
    f = click.option("--state-dir", type=_DIR, default=Path("/var/lib/coldstart/node"),
                     show_default=True, help="Backup of containerd's config and what install "
                     "did (install.json).")(f)
    f = click.option("--config", "coldstart_config", type=_PATH,
                     default=Path("/etc/coldstart/config.toml"), show_default=True,
                     help="coldstart's own config (install writes the defaults if absent).")(f)
    f = click.option("--containerd-config", type=_PATH,
                     default=Path("/etc/containerd/config.toml"), show_default=True,
                     help="containerd's config file.")(f)
    return f


def _paths(containerd_config: Path, coldstart_config: Path, state_dir: Path,
           systemd_dir: Path) -> Any:
    from coldstart.node.install import NodePaths

    return NodePaths(containerd_config=containerd_config.absolute(),
                     coldstart_config=coldstart_config.absolute(),
                     state_dir=state_dir.absolute(), systemd_dir=systemd_dir.absolute())


_RESTART_HELP = ("Then run systemctl: daemon-reload, start the unit, restart containerd "
                 "(without it, the commands to run are printed).")


@click.group(epilog="""\b
Examples:
  coldstart node install --dry-run              # the diff of every file, nothing written
  coldstart node install --restart-containerd   # edit, start the unit, restart containerd
  coldstart node install --runtime-handler coldstart   # only that RuntimeClass (containerd >= 1.7)
  coldstart node install --runtime-handler coldstart --snapshot-restore
  coldstart node status -o json
  coldstart node uninstall --restart-containerd
""")
def node() -> None:
    """Install coldstart on this node: containerd's config, a systemd unit, a backup."""


@node.command(epilog="""\b
Examples:
  coldstart node install --dry-run
  coldstart node install --restart-containerd
  coldstart node install --containerd-config /tmp/c.toml --state-dir /tmp/s \\
      --systemd-dir /tmp/u --config /tmp/cs.toml --root /tmp/cs --socket /tmp/cs.sock
""")
@_paths_options
@click.option("--root", default=None, help="Snapshotter root for a new coldstart config "
              "[default: /var/lib/coldstart].")
@click.option("--socket", default=None, help="Snapshotter gRPC socket for a new coldstart "
              "config [default: /run/coldstart/snapshotter.sock].")
@click.option("--runtime-handler", default=None, metavar="NAME",
              help="Use coldstart only for pods of this runtime handler (RuntimeClass "
                   "handler), not as containerd's default snapshotter. containerd applies a "
                   "runtime's snapshotter to pulls from 1.7 on, for pods annotated "
                   "io.containerd.cri.runtime-handler=NAME (1.7 to 2.1) or with kubelet's "
                   "RuntimeClassInImageCriApi gate; other pods of it pull normally.")
@click.option("--snapshot-restore", is_flag=True,
              help="With --runtime-handler: that handler's runc is coldstart-runc (its runc "
                   "BinaryName), and the annotation dev.coldstart.snapshot passes from pods to "
                   "their containers (pod_annotations): a pod annotated "
                   "dev.coldstart.snapshot=<image> (or =auto) is restored from its image's "
                   "snapshot, and starts normally when there is none. Needs CRIU >= 4.2 "
                   "(scripts/install.sh; `coldstart snapshot check` says whether this node "
                   "can restore). The DaemonSet needs privileged, hostPID and /run/containerd.")
@click.option("--coldstart-bin", default=None, metavar="PATH",
              help="The coldstart executable the unit runs [default: the one running now].")
@click.option("--dry-run", is_flag=True, help="Print the diff of every file; write nothing.")
@click.option("--restart-containerd", is_flag=True, help=_RESTART_HELP)
def install(containerd_config: Path, coldstart_config: Path, state_dir: Path, systemd_dir: Path,
            root: str | None, socket: str | None, runtime_handler: str | None,
            snapshot_restore: bool, coldstart_bin: str | None, dry_run: bool,
            restart_containerd: bool) -> None:
    """Point containerd at the coldstart snapshotter and install its systemd unit.

    Keeps a backup of containerd's config (uninstall restores it byte for byte), keeps its
    comments and other settings; running it twice changes nothing the second time.
    """
    from coldstart.node.install import plan_install

    if runtime_handler is not None and not runtime_handler.replace("-", "").replace(
            "_", "").replace(".", "").isalnum():
        raise click.BadParameter("letters, digits, '-', '_' and '.' only",
                                 param_hint="--runtime-handler")
    paths = _paths(containerd_config, coldstart_config, state_dir, systemd_dir)
    exec_start = [str(Path(coldstart_bin).absolute())] if coldstart_bin else None
    restore_binary = None
    if snapshot_restore:
        restore_binary = _restore_binary(coldstart_bin)
        _say_criu()
    plan = plan_install(paths, root=root, socket=socket, runtime_handler=runtime_handler,
                        restore_binary=restore_binary, exec_start=exec_start)
    if dry_run:
        click.echo(plan.diff() or "nothing to change", nl=False)
        return
    containerd_changed = any(c.changes and c.path == paths.containerd_config
                             for c in plan.changes)
    for line in [*plan.apply(), *plan.notes]:
        click.echo(line)
    if not plan.empty or restart_containerd:
        _activate(restart_containerd, install=True, paths=paths,
                  containerd_changed=containerd_changed)


def _restore_binary(coldstart_bin: str | None) -> str:
    """coldstart-runc beside the coldstart executable (the unit's, else the running one)."""
    base = Path(coldstart_bin).absolute().parent if coldstart_bin else \
        Path(sys.argv[0]).absolute().parent
    for cand in (base / "coldstart-runc", Path(sys.executable).absolute().parent /
                 "coldstart-runc"):
        if cand.exists():
            return str(cand)
    raise click.UsageError(f"coldstart-runc is not installed beside {base} (pip install "
                           "coldstart installs it)")


def _say_criu() -> None:
    """Whether this node can restore (restores fall back to normal starts when it cannot)."""
    from coldstart.errors import FailedPrecondition
    from coldstart.snapshot.criu import find_criu

    try:
        criu = find_criu(check=True)
    except FailedPrecondition as exc:
        click.echo(f"warning: this node cannot restore snapshots: {exc}; pods start "
                   "normally (scripts/install-criu.sh installs CRIU 4.2.1)", err=True)
        return
    if criu.usable:
        click.echo(f"CRIU {criu.version} ({criu.path}) passes criu check: this node can "
                   "restore snapshots", err=True)
    else:
        click.echo(f"warning: this node cannot restore snapshots ({'; '.join(criu.problems)})"
                   "; pods start normally", err=True)


@node.command(epilog="""\b
Examples:
  coldstart node uninstall --dry-run
  coldstart node uninstall --restart-containerd
""")
@_paths_options
@click.option("--dry-run", is_flag=True, help="Print the diff of every file; write nothing.")
@click.option("--restart-containerd", is_flag=True,
              help="Stop and disable the unit first, then reload systemd and restart "
                   "containerd.")
def uninstall(containerd_config: Path, coldstart_config: Path, state_dir: Path,
              systemd_dir: Path, dry_run: bool, restart_containerd: bool) -> None:
    """Undo install: restore containerd's config (byte for byte when unchanged since), remove
    the unit and the config install wrote. Lazily mounted layers of running containers keep
    being served by the FUSE server until it is stopped."""
    from coldstart.node.install import plan_uninstall

    paths = _paths(containerd_config, coldstart_config, state_dir, systemd_dir)
    plan = plan_uninstall(paths)
    if dry_run:
        click.echo(plan.diff() or "nothing to change", nl=False)
        for note in plan.notes:
            click.echo(f"note: {note}")
        return
    if restart_containerd and _systemd_ready() and paths.unit.exists():
        from coldstart.node.systemd import deactivate

        for line in deactivate():
            click.echo(f"ran {line}")
    for line in [*plan.apply(), *plan.notes]:
        click.echo(line)
    _activate(restart_containerd, install=False, paths=paths)


def _systemd_ready() -> bool:
    from coldstart.node.systemd import systemd_running

    return systemd_running()


def _activate(restart: bool, *, install: bool, paths: Any,
              containerd_changed: bool = True) -> None:
    from coldstart.node.systemd import UNIT_NAME, activate, reload_and_restart

    if restart and _systemd_ready():
        # an unchanged containerd config (the agent pod restarted, or only coldstart was
        # upgraded) needs no containerd restart: only the unit restarts, on the new files
        ran = (activate(restart_containerd=containerd_changed) if install
               else reload_and_restart())
        for line in ran:
            click.echo(f"ran {line}")
        return
    if restart:
        click.echo("systemd is not running here: nothing restarted", err=True)
    if install:
        click.echo(f"next: systemctl daemon-reload && systemctl enable --now {UNIT_NAME} && "
                   "systemctl restart containerd (or run with --restart-containerd; without "
                   f"systemd: coldstart snapshotter --config {paths.coldstart_config}, then "
                   "restart containerd)")
    else:
        click.echo(f"next: systemctl disable --now {UNIT_NAME}; systemctl daemon-reload && "
                   "systemctl restart containerd (or run with --restart-containerd)")


@node.command(epilog="""\b
Examples:
  coldstart node status
  coldstart node status -o json --address /run/k3s/containerd/containerd.sock
""")
@_paths_options
@click.option("--address", default="/run/containerd/containerd.sock", show_default=True,
              envvar="CONTAINERD_ADDRESS", help="containerd's gRPC socket.")
@output_option("one object: containerd_config, install_state, unit, coldstart_config, "
               "containerd, snapshotter, fuse_server")
def status(containerd_config: Path, coldstart_config: Path, state_dir: Path, systemd_dir: Path,
           address: str, output: str) -> None:
    """What install put on this node, whether containerd lists the coldstart snapshotter, and
    the FUSE server's health with its lazily mounted layers."""
    from coldstart.node.status import node_status

    doc = node_status(_paths(containerd_config, coldstart_config, state_dir, systemd_dir),
                      address=address)
    problems = _problems(doc)
    doc["healthy"] = not problems
    doc["problems"] = problems
    if output == "json":
        echo_json(doc)
        _exit_unhealthy(problems)
        return
    c, s, u, d, g, f = (doc[k] for k in ("containerd_config", "install_state", "unit",
                                         "containerd", "snapshotter", "fuse_server"))
    if c["error"]:
        config_line = f"error: {c['error']}"
    elif not c["exists"]:
        config_line = "does not exist"
    elif c["installed"]:
        changed = " (edited since install)" if c["changed_since_install"] else ""
        config_line = f"coldstart keys in place, schema {c['schema']}{changed}"
    else:
        config_line = "missing " + "; ".join(c["missing"])
    handler = f", runtime handler {s['runtime_handler']}" if s["runtime_handler"] else ""
    state_line = (f"installed {s['installed_at']}{handler}, backup {s['backup']}"
                  if s["installed"] else (f"error: {s['error']}" if s["error"]
                                          else "not installed"))
    unit_line = ("absent" if not u["exists"] else
                 "as installed" if u["as_installed"] else
                 "present" if u["as_installed"] is None else "changed since install")
    ctd_line = (f"error: {d['error']}" if d["error"] else
                f"lists the coldstart snapshotter ({d['status']})" if d["listed"] else
                "does not list the coldstart snapshotter (restart containerd?)")
    fuse_line = (f"answers, {f['lazy_layers']} lazily mounted layer(s)" if f["answers"]
                 else f"error: {f['error']}")
    for name, where, line in (
            ("containerd config", c["path"], config_line),
            ("install state", s["path"], state_line),
            ("systemd unit", u["path"], unit_line),
            ("containerd", d["address"], ctd_line),
            ("snapshotter", g["socket"], "answers" if g["answers"] else f"error: {g['error']}"),
            ("FUSE server", f["socket"], fuse_line)):
        click.echo(f"{name + ':':<19}{where}: {line}")
    _exit_unhealthy(problems)


def _problems(doc: dict[str, Any]) -> list[str]:
    """What keeps this node from pulling lazily (empty: healthy); `node status` exits 1 on
    any, which the DaemonSet's readiness probe reads."""
    out = []
    c = doc["containerd_config"]
    if c["error"] or not c["exists"] or not c["installed"]:
        out.append("containerd's config lacks the coldstart keys (run `coldstart node "
                   "install`)")
    if doc["containerd"]["error"] or not doc["containerd"]["listed"]:
        out.append("containerd does not list the coldstart snapshotter (restart containerd)")
    if not doc["snapshotter"]["answers"]:
        out.append("the snapshotter does not answer on its socket (systemctl status "
                   "coldstart-snapshotter)")
    if not doc["fuse_server"]["answers"]:
        out.append("the FUSE server does not answer (see <root>/fuse-server.log)")
    return out


def _exit_unhealthy(problems: list[str]) -> None:
    if problems:
        click.echo(f"coldstart: error: node not ready for lazy pulls: {problems[0]}"
                   + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""), err=True)
        sys.exit(1)
