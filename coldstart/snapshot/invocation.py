"""runc's command line as coldstart-runc reads it, the runc it hands over to, and the line it
leaves in runc's own log (what the shim shows)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coldstart.snapshot.state import NodeState

__all__ = ["ANNOTATION", "CONFIG_ENV", "CRI_CONTAINER_TYPE", "CRI_IMAGE", "Invocation",
           "cleanup_leftovers", "parse_argv", "real_runc", "runc_log", "spec_of"]

ANNOTATION = "dev.coldstart.snapshot"
CRI_IMAGE = "io.kubernetes.cri.image-name"
CRI_CONTAINER_TYPE = "io.kubernetes.cri.container-type"
CONFIG_ENV = "COLDSTART_CONFIG"
DEFAULT_CONFIG = "/etc/coldstart/config.toml"
#: runc's global flags that take a value
_GLOBAL_VALUED = {"--root", "--log", "--log-format", "--criu", "--rootless"}
#: ``runc create`` flags that take a value
_CREATE_VALUED = {"--bundle", "-b", "--pid-file", "--console-socket", "--preserve-fds"}


@dataclass
class Invocation:
    """runc's command line: global flags, the subcommand and its arguments."""

    globals: list[str]
    command: str
    args: list[str]
    flags: dict[str, str | bool] = field(default_factory=dict)   # the subcommand's
    cid: str = ""

    def global_value(self, name: str, default: str = "") -> str:
        for i, a in enumerate(self.globals):
            if a == name and i + 1 < len(self.globals):
                return self.globals[i + 1]
            if a.startswith(name + "="):
                return a.partition("=")[2]
        return default


def parse_argv(argv: Sequence[str]) -> Invocation:
    """Split runc's ``argv`` (without the program) into an :class:`Invocation`."""
    i, glob = 0, []
    while i < len(argv) and argv[i].startswith("-"):
        glob.append(argv[i])
        if argv[i] in _GLOBAL_VALUED and i + 1 < len(argv):
            glob.append(argv[i + 1])
            i += 1
        i += 1
    if i >= len(argv):
        return Invocation(glob, "", [])
    inv = Invocation(glob, argv[i], list(argv[i + 1:]))
    if inv.command in ("create", "start", "delete"):
        rest, j = inv.args, 0
        positional = []
        while j < len(rest):
            a = rest[j]
            name, eq, value = a.partition("=")
            if a.startswith("-") and not eq and name in _CREATE_VALUED and j + 1 < len(rest):
                inv.flags[name] = rest[j + 1]
                j += 2
                continue
            if a.startswith("-"):
                inv.flags[name] = value if eq else True
            else:
                positional.append(a)
            j += 1
        inv.cid = positional[-1] if positional else ""
    return inv


def real_runc(configured: str) -> str:
    """The runc to run: ``configured``, else ``runc`` on PATH that is not this wrapper."""
    if configured:
        return configured
    me = os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    for d in os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin").split(os.pathsep):
        cand = os.path.join(d, "runc")
        if os.access(cand, os.X_OK) and os.path.realpath(cand) != me:
            return cand
    for cand in ("/usr/sbin/runc", "/usr/bin/runc", "/usr/local/sbin/runc"):
        if os.access(cand, os.X_OK):
            return cand
    return "runc"


def runc_log(inv: Invocation, level: str, msg: str) -> None:
    """A line in runc's own log (JSON, as runc writes it): what the shim shows on an error."""
    path = inv.global_value("--log")
    if not path:
        return
    line = {"level": level, "msg": f"coldstart-runc: {msg}",
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
    except OSError:
        pass


def spec_of(inv: Invocation) -> tuple[Path, dict[str, Any]] | None:
    bundle = Path(str(inv.flags.get("--bundle") or inv.flags.get("-b") or "."))
    try:
        doc = json.loads((bundle / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return (bundle, doc) if isinstance(doc, dict) else None


def cleanup_leftovers(state: NodeState, runc: str, inv: Invocation) -> None:
    """Remove runc's record of a half-restored container (``runc delete --force``) and all the
    attempt kept (its work directory, a restored marker)."""
    import subprocess

    if inv.cid:
        try:
            subprocess.run([runc, *inv.globals, "delete", "--force", inv.cid], check=False,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        root = inv.global_value("--root", "/run/runc")
        state.container(root, inv.cid).unlink(missing_ok=True)
        shutil.rmtree(state.work(root, inv.cid), ignore_errors=True)
