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

import contextlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from coldstart.snapshot.invocation import (
    ANNOTATION,
    CONFIG_ENV,
    CRI_CONTAINER_TYPE,
    DEFAULT_CONFIG,
    real_runc,
    runc_log,
    spec_of,
)

if TYPE_CHECKING:
    from coldstart.config import Config

__all__ = ["main"]


def _load_config() -> Config:
    from coldstart.config import load

    path = os.environ.get(CONFIG_ENV) or (DEFAULT_CONFIG if os.path.exists(DEFAULT_CONFIG)
                                          else None)
    return load(path)


def _configured_runc() -> str:
    """``snapshot.runc`` of the node's config, read without the config module (a bad file
    counts as none: the full read on a restore says what is wrong), else $COLDSTART_RUNC."""
    path = os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG
    try:
        import tomllib

        with open(path, "rb") as f:
            table = tomllib.load(f).get("snapshot") or {}
        runc = table.get("runc") if isinstance(table, dict) else None
        if isinstance(runc, str) and runc:
            return runc
    except (OSError, ValueError):
        pass
    return os.environ.get("COLDSTART_RUNC", "")


def _exec(runc: str, argv: Sequence[str]) -> NoReturn:
    os.execv(runc, [runc, *argv])


def main(argv: Sequence[str] | None = None) -> NoReturn:
    args = list(sys.argv[1:] if argv is None else argv)
    from coldstart.snapshot.invocation import parse_argv

    inv = parse_argv(args)
    spec = spec_of(inv) if inv.command == "create" else None
    ann = spec[1].get("annotations") if spec is not None else None
    # a pod's sandbox (its pause container) gets the pod's annotations too: never restored
    wants = isinstance(ann, dict) and ANNOTATION in ann and \
        ann.get(CRI_CONTAINER_TYPE) != "sandbox"
    if not wants and inv.command not in ("start", "delete"):
        # the common case, kept fast: only snapshot.runc read from the config (a node whose
        # handler ran nvidia-container-runtime names it there)
        _exec(real_runc(_configured_runc()), args)
    try:
        cfg = _load_config()
    except Exception as exc:     # a broken config must not stop containers
        runc_log(inv, "warning", f"config unreadable, no restore: {exc}")
        _exec(real_runc(_configured_runc()), args)
    runc = real_runc(cfg.snapshot.runc or os.environ.get("COLDSTART_RUNC", ""))
    _quiet_logging(cfg)
    from coldstart.snapshot.state import NodeState

    state = NodeState(Path(cfg.snapshot.state_dir), Path(cfg.snapshot_work_dir))
    root = inv.global_value("--root", "/run/runc")
    try:
        started = inv.command == "start" and bool(inv.cid) and state.take_start(root, inv.cid)
    except Exception:       # the state directory unreadable: runc decides
        started = False
    if started:
        sys.exit(0)         # restored by create: the process already runs
    if inv.command == "delete":
        import subprocess

        rc = subprocess.run([runc, *args], check=False).returncode
        if inv.cid and (rc == 0 or "--force" in inv.flags):
            with contextlib.suppress(Exception):
                state.forget(root, inv.cid)
        sys.exit(rc)
    if wants and spec is not None:
        try:
            from coldstart.snapshot.restore import try_restore

            restored = try_restore(inv, spec[0], spec[1], cfg, runc, state)
        except Exception as exc:    # try_restore falls back itself; this is a last guard
            runc_log(inv, "warning", f"restore attempt failed ({exc!r}); starting normally")
            restored = False
        if restored:
            sys.exit(0)
    _exec(runc, args)


def _quiet_logging(cfg: Config) -> None:
    """Log lines go to ``<state_dir>/wrapper.log``, never to standard error: a container's
    standard output and error are the wrapper's (they are the container's log)."""
    import logging

    logging.lastResort = None
    root = logging.getLogger()
    root.handlers.clear()
    try:
        Path(cfg.snapshot.state_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
        handler: logging.Handler = logging.FileHandler(
            Path(cfg.snapshot.state_dir) / "wrapper.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: "
                                               "%(message)s"))
    except OSError:
        handler = logging.NullHandler()
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
