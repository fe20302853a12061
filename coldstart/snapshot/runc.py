"""``coldstart-runc``: runc, except that a container asking for it is restored from a snapshot.

containerd's runc shim runs the binary its runtime options name (``BinaryName``; ``ctr run
--runc-binary``) for every container operation. This wrapper passes each one to the real runc
unchanged, but for a ``create`` whose OCI spec carries the annotation
``dev.coldstart.snapshot`` (the image reference; ``auto`` takes the CRI's
``io.kubernetes.cri.image-name``) it first tries a restore:

1. CRIU is there and passes ``criu check`` (the result kept per boot), the container has no
   terminal and no extra file descriptors;
2. the snapshot of that image whose key (:mod:`coldstart.snapshot.keys`) matches this
   container's command and this node is found through the referrers API;
3. its bundle is fetched, every chunk verified, through the node's snapshot chunk cache;
4. the rootfs changes go into the container's root (:mod:`coldstart.snapshot.rootdiff`);
5. ``runc restore --detach`` with the shim's own arguments and standard I/O (runc maps the
   dumped process's pipes onto them); ``start`` is then a no-op, the process already runs;
6. each restored process that handles ``snapshot.signal`` gets it (the after-restore hook).

Any failure on the way (no snapshot, a key that differs, a chunk whose digest does not match,
CRIU missing or failing, a deadline) is undone (runc's state, the rootfs changes, CRIU's files)
and the wrapper runs ``runc create`` as asked: a snapshot may make a start faster, never make
it fail. Each attempt is logged in ``<state_dir>/events.jsonl`` with its reason and counted
(``coldstart snapshot status``); a fallback also leaves a warning in runc's own log, which
the shim reads.

Why a runc wrapper: it is the one hook that every path to a container on this containerd
takes (kubelet through the CRI plugin, ``ctr``, nerdctl), needs no change to containerd 1.6
(restore through the CRI landed in containerd 2.1), and sees the container's real bundle,
rootfs mount, cgroup and standard I/O, which are what ``runc restore`` needs.

Nothing is written on the container's standard output or error (they are its log): the wrapper
speaks through its events log and runc's log file.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from coldstart.config import Config
    from coldstart.snapshot.state import NodeState

__all__ = ["ANNOTATION", "Invocation", "main", "parse_argv"]

ANNOTATION = "dev.coldstart.snapshot"
CRI_IMAGE = "io.kubernetes.cri.image-name"
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


def _load_config() -> Config:
    from coldstart.config import load

    path = os.environ.get(CONFIG_ENV) or (DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG)
                                          else None)
    return load(path)


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


def _exec(runc: str, argv: Sequence[str]) -> NoReturn:
    os.execv(runc, [runc, *argv])


def _runc_log(inv: Invocation, level: str, msg: str) -> None:
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


def _spec(inv: Invocation) -> tuple[Path, dict[str, Any]] | None:
    bundle = Path(str(inv.flags.get("--bundle") or inv.flags.get("-b") or "."))
    try:
        doc = json.loads((bundle / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return (bundle, doc) if isinstance(doc, dict) else None


def main(argv: Sequence[str] | None = None) -> NoReturn:
    args = list(sys.argv[1:] if argv is None else argv)
    inv = parse_argv(args)
    spec = _spec(inv) if inv.command == "create" else None
    wants = spec is not None and isinstance(spec[1].get("annotations"), dict) and \
        ANNOTATION in spec[1]["annotations"]
    if not wants and inv.command not in ("start", "delete"):
        # the common case, kept fast: no config read, no import beyond this module
        _exec(real_runc(os.environ.get("COLDSTART_RUNC", "")), args)
    try:
        cfg = _load_config()
    except Exception as exc:     # a broken config must not stop containers
        _runc_log(inv, "warning", f"config unreadable, no restore: {exc}")
        _exec(real_runc(os.environ.get("COLDSTART_RUNC", "")), args)
    runc = real_runc(cfg.snapshot.runc or os.environ.get("COLDSTART_RUNC", ""))
    from coldstart.snapshot.state import NodeState

    state = NodeState(Path(cfg.snapshot.state_dir))
    root = inv.global_value("--root", "/run/runc")
    if inv.command == "start" and inv.cid and state.take_start(root, inv.cid):
        sys.exit(0)         # restored by create: the process already runs
    if inv.command == "delete":
        import subprocess

        rc = subprocess.run([runc, *args], check=False).returncode
        if inv.cid and (rc == 0 or "--force" in inv.flags):
            state.forget(root, inv.cid)
        sys.exit(rc)
    if wants and spec is not None:
        from coldstart.snapshot.restore import try_restore

        if try_restore(inv, spec[0], spec[1], cfg, runc, state):
            sys.exit(0)
    _exec(runc, args)


def cleanup_leftovers(state: NodeState, runc: str, inv: Invocation) -> None:
    """Remove runc's record of a half-restored container (``runc delete --force``)."""
    import subprocess

    if inv.cid:
        subprocess.run([runc, *inv.globals, "delete", "--force", inv.cid], check=False,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=60)
    shutil.rmtree(state.work(inv.global_value("--root", "/run/runc"), inv.cid),
                  ignore_errors=True)
