"""The systemd unit that runs ``coldstart snapshotter`` on a node, and systemctl.

``Type=notify``: the daemon says ``READY=1`` once it serves containerd's snapshots API, so
``Before=containerd.service`` really means containerd starts after the snapshotter answers.
``KillMode=process``: stopping or restarting the unit stops only the gRPC process; the FUSE
server it started (same cgroup) keeps serving running containers' layers. ``Restart=always``.

Example::

    text = unit_text(["/usr/local/bin/coldstart"], Path("/etc/coldstart/config.toml"))
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from coldstart.errors import Unavailable

__all__ = ["UNIT_NAME", "Runner", "activate", "deactivate", "default_exec", "reload_and_restart",
           "systemctl", "systemd_running", "unit_text"]

UNIT_NAME = "coldstart-snapshotter.service"
Runner = Callable[..., "subprocess.CompletedProcess[str]"]


def default_exec() -> list[str]:
    """How systemd should start coldstart: the ``coldstart`` script beside this Python (a
    virtual environment's), else the one on PATH, else ``python -m coldstart.cli``."""
    beside = Path(sys.executable).parent / "coldstart"
    if beside.is_file():
        return [str(beside.absolute())]
    found = shutil.which("coldstart")
    if found:
        return [str(Path(found).absolute())]
    return [str(Path(sys.executable).absolute()), "-m", "coldstart.cli"]


def _systemd_quote(arg: str) -> str:
    """An ExecStart word: systemd expands ``%`` specifiers and ``$VAR`` (doubled to stay
    literal) and reads backslashes as escapes (doubled); quotes as a shell's."""
    text = arg.replace("\\", "\\\\").replace("%", "%%").replace("$", "$$")
    return shlex.quote(text)


def unit_text(exec_start: Sequence[str], config_path: Path) -> str:
    """The unit file for ``exec_start`` (a coldstart command line) with ``config_path``."""
    command = " ".join(_systemd_quote(a) for a in
                       [*exec_start, "snapshotter", "--config", str(config_path)])
    return f"""\
# Written by `coldstart node install`; `coldstart node uninstall` removes it.
[Unit]
Description=coldstart snapshotter: lazy image pulls for containerd
After=local-fs.target network-online.target
Wants=network-online.target
Before=containerd.service

[Service]
# READY=1 once the snapshots API serves, so containerd starts after that
Type=notify
ExecStart={command}
Restart=always
RestartSec=2
# only the gRPC process: the FUSE server it started keeps serving running containers
KillMode=process
# the FUSE server may be started and waited for (fuse.start_timeout)
TimeoutStartSec=120
LimitNOFILE=1048576

[Install]
WantedBy=multi-user.target
"""


def systemd_running() -> bool:
    """Whether this machine was booted with systemd (``sd_booted``: /run/systemd/system)."""
    return Path("/run/systemd/system").is_dir()


def systemctl(*args: str, run: Runner = subprocess.run) -> None:
    """``systemctl ARGS``; a failure is :class:`Unavailable` with systemctl's own message."""
    argv = ["systemctl", *args]
    try:
        r = run(argv, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Unavailable(f"{' '.join(argv)}: {exc}") from None
    if r.returncode != 0:
        why = (r.stderr or r.stdout).strip().splitlines()
        raise Unavailable(f"{' '.join(argv)} failed: {why[-1] if why else r.returncode} "
                          "(see `journalctl -xe`)")


def activate(run: Runner = subprocess.run, *, restart_containerd: bool = True) -> list[str]:
    """Enable and (re)start the unit, so that an upgrade's new files run (``KillMode=process``:
    the FUSE server keeps serving), then restart containerd when its config changed; returns
    what it ran."""
    steps: list[tuple[str, ...]] = [("daemon-reload",), ("enable", UNIT_NAME),
                                    ("restart", UNIT_NAME)]
    if restart_containerd:
        steps.append(("restart", "containerd"))
    return _run_steps(steps, run)


def deactivate(run: Runner = subprocess.run) -> list[str]:
    """Stop and disable the unit (while its file is still there); returns what it ran."""
    return _run_steps([("disable", "--now", UNIT_NAME)], run)


def reload_and_restart(run: Runner = subprocess.run) -> list[str]:
    """After the unit's file is gone and the config restored: reload, restart containerd."""
    return _run_steps([("daemon-reload",), ("restart", "containerd")], run)


def _run_steps(steps: list[tuple[str, ...]], run: Runner) -> list[str]:
    for step in steps:
        systemctl(*step, run=run)
    return ["systemctl " + " ".join(s) for s in steps]
