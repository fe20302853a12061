"""A snapshot's key: where a checkpoint of a ready container may be restored.

A component is one line of text; the key is the SHA-256 of the components as canonical JSON.
What each holds, and why:

* ``image``: the image manifest's digest. CRIU reopens every open and mapped file by path and
  refuses one whose size (or ELF build-id) differs, so the rootfs must be the same bytes.
* ``process``: the digest of what the container was started to run and may do (the OCI
  spec's ``args``, ``cwd``, user and groups, terminal, capabilities, no_new_privs, AppArmor and
  SELinux labels, seccomp profile, and ``env`` less the variables a node or pod sets on its
  own: ``HOSTNAME``, ``KUBERNETES_*`` and Kubernetes' service links). Another command or
  setting is another start-up, whose state this is not; and CRIU restores the dumped
  process's privileges, not the new spec's, so a snapshot of a privileged container must never
  match a restricted one.
* ``isa``: the CPU's instruction-set extensions (as the warm-up key reads them): torch and
  oneDNN pick their kernels when they are imported, so a process dumped on a CPU with AVX-512
  faults on one without (CRIU's own ``--cpu-cap`` check stops some of these, not all).
* ``kernel``: the kernel release (``uname -r``): CRIU restores vDSO, seccomp and namespace
  state whose layout follows the kernel.
* ``criu``: CRIU's version; its image format changes between releases.
* ``gpu``, ``driver``: GPU model and NVIDIA driver, ``none`` without one (a CUDA process is
  restored through ``cuda-checkpoint`` onto the same kind of GPU only).

Host names, pod IPs, paths on the node and times are never part of it.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from coldstart.errors import FormatError
from coldstart.warmup.keys import cpu_isa, gpu_identity

__all__ = ["COMPONENTS", "SnapshotKey", "compute_key", "differences", "process_digest"]

KEY_VERSION = 1
COMPONENTS = ("image", "process", "isa", "kernel", "criu", "gpu", "driver")

#: environment variables a node, a pod or Kubernetes' service links set on their own: left out
#: of the key (a pod's restore on another node has another HOSTNAME and other service IPs)
_NODE_ENV = re.compile(r"^(HOSTNAME|KUBERNETES_\w*|[A-Z0-9_]+_SERVICE_(HOST|PORT(_[A-Z0-9_]+)?)|"
                       r"[A-Z0-9_]+_PORT_\d+_(TCP|UDP|SCTP)(_(ADDR|PORT|PROTO))?)$")
#: a service link's ``<NAME>_PORT=tcp://10.0.0.1:80`` (an app's own ``APP_PORT=8080`` stays)
_LINK_PORT = re.compile(r"^[A-Z0-9_]+_PORT=(tcp|udp|sctp)://")


def _node_set(entry: str) -> bool:
    return bool(_NODE_ENV.match(entry.partition("=")[0]) or _LINK_PORT.match(entry))


@dataclass(frozen=True)
class SnapshotKey:
    """The components of a key and its digest (``sha256:…``)."""

    components: Mapping[str, str]
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        missing = [c for c in COMPONENTS if c not in self.components]
        extra = sorted(set(self.components) - set(COMPONENTS))
        if missing or extra:
            raise FormatError(f"snapshot key: components missing {missing}, unknown {extra}")
        for name, value in self.components.items():
            if not isinstance(value, str) or not value or "\n" in value:
                raise FormatError(f"snapshot key: component {name!r} is not one line of text")
        object.__setattr__(self, "digest",
                           "sha256:" + hashlib.sha256(self.canonical()).hexdigest())

    def canonical(self) -> bytes:
        doc = {"version": KEY_VERSION, "components": {c: self.components[c] for c in COMPONENTS}}
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, data: bytes) -> SnapshotKey:
        """A key from :meth:`canonical`'s bytes (an artifact's config); FormatError if bad."""
        try:
            doc = json.loads(data)
        except ValueError as exc:
            raise FormatError(f"snapshot key: not JSON: {exc}") from None
        version = doc.get("version") if isinstance(doc, dict) else None
        if version != KEY_VERSION:
            raise FormatError(f"snapshot key: version {version!r} is not {KEY_VERSION}")
        comps = doc.get("components")
        if not isinstance(comps, dict):
            raise FormatError("snapshot key: no components")
        return cls(comps)

    def to_json(self) -> dict[str, object]:
        return {"digest": self.digest, "components": dict(self.components)}


def process_digest(spec: Mapping[str, Any]) -> str:
    """``sha256:…`` of what the OCI runtime spec ``spec`` starts (see the module's text)."""
    proc = spec.get("process")
    if not isinstance(proc, Mapping):
        raise FormatError("OCI spec: no process")
    env = proc.get("env") or []
    if not isinstance(env, list) or not all(isinstance(e, str) for e in env):
        raise FormatError("OCI spec: process.env is not a list of strings")
    user = proc.get("user")
    user = user if isinstance(user, Mapping) else {}
    doc = {
        "args": proc.get("args") or [],
        "cwd": proc.get("cwd") or "/",
        "env": sorted(e for e in env if not _node_set(e)),
        "user": [user.get("uid", 0), user.get("gid", 0)],
        "terminal": bool(proc.get("terminal")),
        # what the process may do: CRIU restores the dumped credentials, capabilities,
        # no_new_privs and seccomp filters, not the new spec's (restore.check_privileges
        # checks the restored process against the spec as well)
        "groups": user.get("additionalGids") or [],
        "capabilities": proc.get("capabilities") or {},
        "no_new_privileges": bool(proc.get("noNewPrivileges")),
        "apparmor": proc.get("apparmorProfile") or "",
        "selinux": proc.get("selinuxLabel") or "",
        "seccomp": _seccomp(spec),
    }
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def _seccomp(spec: Mapping[str, Any]) -> str:
    linux = spec.get("linux")
    profile = linux.get("seccomp") if isinstance(linux, Mapping) else None
    if not profile:
        return ""
    raw = json.dumps(profile, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def compute_key(image_digest: str, spec: Mapping[str, Any], criu_version: str, *,
                overrides: Mapping[str, str] | None = None) -> SnapshotKey:
    """The key of a container of ``image_digest`` started as ``spec`` says, on this node with
    CRIU ``criu_version``; ``overrides``: components given instead of read (tests)."""
    gpu, driver = gpu_identity()
    comps = {
        "image": image_digest,
        "process": process_digest(spec),
        "isa": cpu_isa(),
        "kernel": platform.release() or "unknown",
        "criu": criu_version,
        "gpu": gpu,
        "driver": driver,
    }
    comps.update(overrides or {})
    return SnapshotKey(comps)


def differences(want: SnapshotKey, have: SnapshotKey) -> list[str]:
    """Why ``have`` (an artifact's key) is not ``want`` (this container's, on this node): one
    phrase per component that differs."""
    out = []
    for c in COMPONENTS:
        a, b = want.components[c], have.components[c]
        if a == b:
            continue
        if c == "isa":
            mine, theirs = set(a.partition(":")[2].split()), set(b.partition(":")[2].split())
            lacks = sorted(theirs - mine)
            out.append(f"isa: this CPU lacks {' '.join(lacks[:6])}" if lacks else
                       f"isa: the snapshot's CPU differs ({len(mine ^ theirs)} flags)")
        elif c == "process":
            out.append("process: another command, working directory, user or environment")
        else:
            out.append(f"{c}: snapshot {b!r}, here {a!r}")
    return out
