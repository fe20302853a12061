"""``coldstart node status``: what is installed on this node, and whether it works.

One dict (``-o json`` prints it as is): containerd's config (our keys there or which are
missing, changed since install), the install state and backup, the systemd unit, coldstart's
config, whether containerd lists the ``coldstart`` snapshotter (``ctr plugins ls``), whether
the snapshotter answers on its socket, and the FUSE
server's health with its lazily mounted layers. A part that cannot be read has an ``error``
string; nothing here raises for a broken node.

Example::

    doc = node_status(NodePaths(), address="/run/containerd/containerd.sock")
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

from coldstart import config as configmod
from coldstart.errors import ColdstartError
from coldstart.lazyfs.client import FuseServerClient
from coldstart.node.containerd_config import SNAPSHOTTER, Target, missing, parse, schema_version
from coldstart.node.files import read_optional, sha256
from coldstart.node.install import NodePaths
from coldstart.node.state import InstallState, load_state
from coldstart.node.systemd import Runner

__all__ = ["containerd_plugin", "node_status"]

SNAPSHOT_PLUGIN_TYPE = "io.containerd.snapshotter.v1"


def containerd_plugin(address: str, *, ctr: str = "ctr", timeout: float = 10.0,
                      run: Runner = subprocess.run) -> dict[str, Any]:
    """Whether containerd at ``address`` lists the ``coldstart`` snapshotter, and its status
    (``ok``, ``error``, ``skip``) as ``ctr plugins ls`` shows it."""
    out: dict[str, Any] = {"address": address, "listed": False, "status": None, "error": None}
    if not Path(address).is_socket():
        out["error"] = f"no socket at {address} (is containerd running? give --address)"
        return out
    exe = shutil.which(ctr) or ctr
    try:
        r = run([exe, "--address", address, "plugins", "ls"], capture_output=True, text=True,
                timeout=timeout, check=False)
    except OSError as exc:
        out["error"] = f"{ctr} plugins ls: {exc.strerror} (is containerd's ctr installed?)"
        return out
    except subprocess.TimeoutExpired:
        out["error"] = f"ctr plugins ls: no answer from {address} within {timeout:.0f} s"
        return out
    if r.returncode != 0:
        lines = (r.stderr or r.stdout).strip().splitlines()
        out["error"] = f"ctr plugins ls: {lines[-1] if lines else f'exit {r.returncode}'}"
        return out
    for line in r.stdout.splitlines():
        cols = line.split()
        if len(cols) >= 3 and cols[0] == SNAPSHOT_PLUGIN_TYPE and cols[1] == SNAPSHOTTER:
            out.update(listed=True, status=cols[-1])
    return out


def _snapshotter(path: str, timeout: float) -> dict[str, Any]:
    """Whether the snapshotter's gRPC socket accepts connections (containerd lists a proxy
    plugin as ``ok`` even when nothing listens on its socket)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(path)
        except OSError as exc:
            return {"socket": path, "answers": False, "error": f"{path}: {exc.strerror}"}
    return {"socket": path, "answers": True, "error": None}


def _fuse_server(path: str, timeout: float) -> dict[str, Any]:
    out: dict[str, Any] = {"socket": path, "answers": False, "lazy_layers": None,
                           "layers": [], "error": None}
    try:
        rows = FuseServerClient(path, timeout=timeout).status()
    except ColdstartError as exc:
        out["error"] = str(exc)
        return out
    out.update(answers=True, lazy_layers=len(rows), layers=rows)
    return out


def _config_part(paths: NodePaths, state: InstallState | None,
                 target: Target) -> dict[str, Any]:
    path = Path(state.containerd_config) if state else paths.containerd_config
    out: dict[str, Any] = {"path": str(path), "exists": False, "schema": None,
                           "installed": False, "missing": [], "changed_since_install": None,
                           "error": None}
    try:
        data = read_optional(path)
        if data is None:
            return out
        out["exists"] = True
        text = data.decode()
        out["schema"] = schema_version(parse(text, str(path)), str(path))
        out["missing"] = missing(text, target, str(path))
        out["installed"] = not out["missing"]
        if state is not None:
            out["changed_since_install"] = sha256(data) != state.installed_sha256
    except (ColdstartError, UnicodeDecodeError) as exc:
        out["error"] = str(exc)
    return out


def node_status(paths: NodePaths, *, address: str, ctr: str = "ctr",
                timeout: float = 10.0, run: Runner = subprocess.run) -> dict[str, Any]:
    """Everything ``coldstart node status`` reports (see the module docstring)."""
    doc: dict[str, Any] = {}
    try:
        state = load_state(paths.state_dir)
        state_error = None
    except ColdstartError as exc:
        state, state_error = None, str(exc)
    cfg_path = Path(state.coldstart_config) if state and state.coldstart_config \
        else paths.coldstart_config
    try:
        cfg = configmod.load(cfg_path if cfg_path.exists() else None)
        cfg_error = None
    except ColdstartError as exc:
        cfg, cfg_error = configmod.load(None), str(exc)
    target = state.target if state else Target(cfg.socket, cfg.root)
    doc["containerd_config"] = _config_part(paths, state, target)
    doc["install_state"] = {
        "path": str(paths.state_file), "installed": state is not None,
        "installed_at": state.installed_at if state else None,
        "runtime_handler": state.target.runtime_handler if state else None,
        "backup": str(paths.backup), "backup_exists": paths.backup.exists(),
        "error": state_error}
    unit = Path(state.unit_path) if state and state.unit_path else paths.unit
    unit_bytes = read_optional(unit)
    doc["unit"] = {"path": str(unit), "exists": unit_bytes is not None,
                   "as_installed": (sha256(unit_bytes) == state.unit_sha256
                                    if state and unit_bytes is not None else None)}
    doc["coldstart_config"] = {"path": str(cfg_path), "exists": cfg_path.exists(),
                               "socket": cfg.socket, "root": cfg.root, "error": cfg_error}
    doc["containerd"] = containerd_plugin(address, ctr=ctr, timeout=timeout, run=run)
    doc["snapshotter"] = _snapshotter(target.socket, timeout)
    doc["fuse_server"] = _fuse_server(cfg.fuse.socket, timeout)
    return doc
