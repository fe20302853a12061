"""``coldstart node install`` / ``uninstall`` as plans: the files to write or remove, in order.

A :class:`Plan` is computed without touching anything (``--dry-run`` prints its diff) and then
applied. Install writes, in this order: the backup of containerd's config (first install only),
the state, coldstart's own config (only when absent), the systemd unit, containerd's config; so
a crash at any point leaves a state from which ``install`` or ``uninstall`` go on correctly.
Uninstall restores containerd's config byte for byte when it is unchanged since install; when
the operator edited it since, only coldstart's keys are taken out (tomlkit) and it says so.

Example::

    plan = plan_install(NodePaths(containerd_config=Path("/tmp/c.toml")))
    print(plan.diff()); plan.apply()
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from coldstart import config as configmod
from coldstart.errors import FailedPrecondition, FormatError, InvalidArgument, NotFound
from coldstart.node.containerd_config import Edit, TablePath, Target, apply, handler_binary, revert
from coldstart.node.files import atomic_write, private_dir, read_optional, remove, sha256
from coldstart.node.state import BACKUP_FILE, STATE_FILE, InstallState, load_state
from coldstart.node.systemd import UNIT_NAME, default_exec, unit_text

__all__ = ["FileChange", "NodePaths", "Plan", "plan_install", "plan_uninstall"]


@dataclass(frozen=True)
class NodePaths:
    """Where a node keeps what install touches (every one overridable, for tests)."""

    containerd_config: Path = Path("/etc/containerd/config.toml")
    coldstart_config: Path = Path("/etc/coldstart/config.toml")
    state_dir: Path = Path("/var/lib/coldstart/node")
    systemd_dir: Path = Path("/etc/systemd/system")

    @property
    def unit(self) -> Path:
        return self.systemd_dir / UNIT_NAME

    @property
    def state_file(self) -> Path:
        return self.state_dir / STATE_FILE

    @property
    def backup(self) -> Path:
        return self.state_dir / BACKUP_FILE


@dataclass(frozen=True)
class FileChange:
    """``path`` goes from ``before`` to ``after`` (None: absent); ``shown`` in the diff."""

    path: Path
    before: bytes | None
    after: bytes | None
    shown: bool = True
    mode: int = 0o644

    @property
    def changes(self) -> bool:
        return self.before != self.after

    def diff(self) -> str:
        def lines(data: bytes | None) -> list[str]:
            return data.decode(errors="replace").splitlines(keepends=True) if data else []

        out = "".join(difflib.unified_diff(
            lines(self.before), lines(self.after),
            fromfile=str(self.path) if self.before is not None else "/dev/null",
            tofile=str(self.path) if self.after is not None else "/dev/null"))
        return out if out.endswith("\n") or not out else out + "\n"


@dataclass(frozen=True)
class Plan:
    changes: tuple[FileChange, ...]
    notes: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not any(c.changes for c in self.changes)

    def diff(self) -> str:
        """The unified diff of every file a person cares about (not the backup or state)."""
        return "".join(c.diff() for c in self.changes if c.shown and c.changes)

    def apply(self) -> list[str]:
        """Write (or remove) each changed file in order; returns one line per file."""
        done = []
        for c in self.changes:
            if not c.changes:
                continue
            if c.after is None:
                remove(c.path)
                done.append(f"removed {c.path}")
            else:
                if not c.mode & 0o077:      # the node's state: in a directory of ours alone
                    private_dir(c.path.parent, "node state directory")
                atomic_write(c.path, c.after, mode=c.mode)
                done.append(f"{'wrote' if c.before is None else 'updated'} {c.path}")
        return done


def _decode(data: bytes, where: Path) -> str:
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        raise FormatError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start}); containerd "
                          "configs are UTF-8 TOML") from None


def _coldstart_config(path: Path, data: bytes | None, root: str | None,
                      socket: str | None) -> tuple[configmod.Config, bytes | None]:
    """The config the unit will run with, and its bytes when install must write it."""
    if data is None:
        cfg = configmod.load(None)
        cfg = dataclasses.replace(cfg, root=root or cfg.root, socket=socket or cfg.socket)
        written: bytes | None = configmod.dump(cfg).encode()
    else:
        cfg, written = configmod.load(path), None
        for flag, given, has in (("--root", root, cfg.root), ("--socket", socket, cfg.socket)):
            if given is not None and Path(given) != Path(has):
                raise InvalidArgument(f"{path} already says {flag[2:]} = {has!r}, not {given!r}: "
                                      f"edit {path} or leave out {flag}")
    for key, value in (("root", cfg.root), ("socket", cfg.socket)):
        if not Path(value).is_absolute():
            raise InvalidArgument(f"{path}: {key} {value!r} must be an absolute path "
                                  "(containerd and systemd do not share our working directory)")
    return cfg, written


def _merge_edits(old: Sequence[Edit], new: Sequence[Edit]) -> tuple[Edit, ...]:
    """One edit per key: what it held before the first install, what it holds now."""
    out = {(e.table, e.key): e for e in old}
    for e in new:
        first = out.get((e.table, e.key))
        out[(e.table, e.key)] = e if first is None else dataclasses.replace(first, value=e.value)
    return tuple(out.values())


def _merge_tables(old: Sequence[TablePath], new: Sequence[TablePath]) -> tuple[TablePath, ...]:
    return tuple(dict.fromkeys([*old, *new]))


def plan_install(paths: NodePaths, *, root: str | None = None, socket: str | None = None,
                 runtime_handler: str | None = None, restore_binary: str | None = None,
                 exec_start: Sequence[str] | None = None) -> Plan:
    """What install would write; empty when everything is in place already."""
    ctd = paths.containerd_config
    original = read_optional(ctd)
    if original is None:
        raise NotFound(f"{ctd} does not exist: write containerd's defaults first "
                       f"(`containerd config default > {ctd}`), or give --containerd-config")
    state = load_state(paths.state_dir)
    if state is not None and Path(state.containerd_config) != ctd:
        raise FailedPrecondition(
            f"coldstart is installed into {state.containerd_config} (see {paths.state_file}): "
            "`coldstart node uninstall` it first, or give another --state-dir")
    cfg, cfg_bytes = _coldstart_config(paths.coldstart_config,
                                       read_optional(paths.coldstart_config), root, socket)
    if restore_binary and runtime_handler is None:
        raise InvalidArgument("snapshot restore goes with a runtime handler (--runtime-handler): "
                              "only the pods of that RuntimeClass run through coldstart-runc")
    if restore_binary and runtime_handler is not None:
        had = handler_binary(_decode(original, ctd), runtime_handler, str(ctd))
        if had and had != restore_binary and not cfg.snapshot.runc:
            raise FailedPrecondition(
                f"runtime handler {runtime_handler} runs {had}: set `runc = \"{had}\"` under "
                f"[snapshot] in {paths.coldstart_config} (coldstart-runc hands every call to "
                "it), then install again")
    target = Target(cfg.socket, cfg.root, runtime_handler, restore_binary)
    if state is not None and state.target != target:
        raise FailedPrecondition(
            f"coldstart is installed with other settings ({state.target}): run "
            "`coldstart node uninstall`, then install again")
    change = apply(_decode(original, ctd), target, str(ctd))
    installed = change.text.encode()
    if state is None and not change.edits and not change.created:
        # our keys are there but our state is not (its directory was wiped): a backup taken
        # now would hold our keys, and uninstall would "restore" containerd to point at a
        # snapshotter that is gone
        raise FailedPrecondition(
            f"{ctd} already has coldstart's keys but {paths.state_file} does not exist (was "
            f"{paths.state_dir} removed?): take coldstart's keys out of {ctd} (or restore your "
            "own backup), then run install again")

    unit_after = unit_text(list(exec_start or default_exec()),
                           paths.coldstart_config.absolute()).encode()
    unit_before = read_optional(paths.unit)
    if unit_before is not None and unit_before != unit_after and \
            (state is None or sha256(unit_before) != state.unit_sha256):
        raise FailedPrecondition(f"{paths.unit} exists and was not written by `coldstart node "
                                 "install`: move it away (or give --systemd-dir), then run again")

    files = [FileChange(paths.coldstart_config, None, cfg_bytes)] if cfg_bytes else []
    files += [FileChange(paths.unit, unit_before, unit_after),
              FileChange(ctd, original, installed)]
    if state is not None and not any(f.changes for f in files):
        return Plan(tuple(files), ("already installed: nothing to change",))

    cfg_sha = sha256(cfg_bytes) if cfg_bytes else (state.coldstart_config_sha256 if state else "")
    new_state = InstallState(
        containerd_config=str(ctd), schema=change.schema, target=target,
        original_sha256=state.original_sha256 if state else sha256(original),
        # someone edited the file since the last install: the backup predates their edits, so
        # uninstall must take our keys out rather than restore it ("" never matches)
        installed_sha256=("" if state is not None and (not state.installed_sha256 or
                                                        sha256(original) != state.installed_sha256)
                          else sha256(installed)),
        edits=_merge_edits(state.edits if state else (), change.edits),
        created_tables=_merge_tables(state.created_tables if state else (), change.created),
        unit_path=str(paths.unit), unit_sha256=sha256(unit_after),
        coldstart_config=str(paths.coldstart_config), coldstart_config_sha256=cfg_sha,
        installed_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    head = [] if state is not None else [
        FileChange(paths.backup, read_optional(paths.backup), original, shown=False, mode=0o600)]
    state_change = FileChange(paths.state_file, read_optional(paths.state_file),
                              new_state.to_json(), shown=False, mode=0o600)
    return Plan((*head, state_change, *files))


def plan_uninstall(paths: NodePaths) -> Plan:
    """What uninstall would write or remove."""
    state = load_state(paths.state_dir)
    if state is None:
        raise NotFound(f"nothing to uninstall: {paths.state_file} does not exist (`coldstart "
                       "node install` writes it; give --state-dir if it used another)")
    ctd = Path(state.containerd_config)
    notes: list[str] = []
    files: list[FileChange] = []
    current, backup = read_optional(ctd), read_optional(paths.backup)
    if current is None:
        notes.append(f"{ctd} is gone: nothing to restore")
    elif sha256(current) == state.installed_sha256 and backup is not None \
            and sha256(backup) == state.original_sha256:
        files.append(FileChange(ctd, current, backup))
        notes.append(f"{ctd}: restored as it was before install, byte for byte")
    else:
        like = _decode(backup, paths.backup) if backup is not None else None
        text, kept = revert(_decode(current, ctd), state.edits, state.created_tables, str(ctd),
                            like=like)
        files.append(FileChange(ctd, current, text.encode()))
        notes.append(f"{ctd} changed since install: took out only coldstart's keys, kept "
                     "the rest")
        notes += kept
    for path, sha in ((state.unit_path, state.unit_sha256),
                      (state.coldstart_config, state.coldstart_config_sha256)):
        data = read_optional(Path(path)) if path and sha else None
        if data is None:
            continue
        if sha256(data) == sha:
            files.append(FileChange(Path(path), data, None))
        else:
            notes.append(f"{path} changed since install: left in place (remove it by hand)")
    files += [FileChange(paths.state_file, read_optional(paths.state_file), None, shown=False),
              FileChange(paths.backup, backup, None, shown=False)]
    return Plan(tuple(files), tuple(notes))
