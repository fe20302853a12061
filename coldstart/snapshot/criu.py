"""CRIU on this node: where it is, which version, and whether it can restore here.

Debian 12's CRIU 3.17 fails ``criu check`` on current kernels (the vDSO's layout); 4.1 passes
on Linux 6.x, lazy pages (``uffd-noncoop``) included, but on Linux 6.18 it cannot dump a
process that holds an inet socket (it asks every socket for ``SO_PASSCRED``, which the kernel
now answers only for unix and netlink sockets; 4.2 asks those only). ``scripts/install.sh``
builds 4.2.1 from
Debian 13's source package into ``/usr/local/sbin`` when the node has nothing newer.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

from coldstart.errors import FailedPrecondition

__all__ = ["MIN_VERSION", "Criu", "find_criu", "version_of"]

MIN_VERSION = (4, 2)
#: where scripts/install.sh puts the CRIU it builds (checked when PATH has none)
INSTALLED = "/usr/local/sbin/criu"
#: features checked besides ``criu check``'s own required set
FEATURES = ("clone3_set_tid", "uffd-noncoop")


@dataclass(frozen=True)
class Criu:
    path: str
    version: str                     # "4.2.1"
    problems: tuple[str, ...] = ()   # why it cannot restore here; () when it can
    features: dict[str, bool] = field(default_factory=dict)

    @property
    def usable(self) -> bool:
        return not self.problems


def version_of(path: str, timeout: float = 10.0) -> str:
    """CRIU's version (``4.2.1``) as ``criu --version`` prints it; FailedPrecondition if it
    does not run."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True,
                             timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FailedPrecondition(f"CRIU at {path} does not run: {exc}") from None
    m = re.search(r"Version:\s*(\d+(?:\.\d+)+)", out.stdout)
    if out.returncode != 0 or not m:
        raise FailedPrecondition(f"CRIU at {path}: --version exited {out.returncode}: "
                                 f"{(out.stdout + out.stderr).strip()[:200]}")
    return m.group(1)


def _tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def find_criu(path: str = "", *, check: bool = True, timeout: float = 30.0) -> Criu:
    """The CRIU at ``path`` (else ``criu`` on PATH, else :data:`INSTALLED`), its version and,
    with ``check``, what ``criu check`` and the :data:`FEATURES` say (as root only: CRIU
    needs it). FailedPrecondition when there is none or it does not run."""
    found = path or shutil.which("criu") or (INSTALLED if os.access(INSTALLED, os.X_OK) else "")
    if not found:
        raise FailedPrecondition("CRIU is not installed (scripts/install.sh builds CRIU 4.2.1; "
                                 f"version {'.'.join(map(str, MIN_VERSION))} or newer is needed)")
    version = version_of(found)
    problems: list[str] = []
    if _tuple(version) < MIN_VERSION:
        problems.append(f"CRIU {version} is older than "
                        f"{'.'.join(map(str, MIN_VERSION))} (Debian 12's 3.17 fails on this "
                        "kernel; scripts/install.sh builds 4.2.1)")
    features: dict[str, bool] = {}
    if check and not problems:
        if os.geteuid() != 0:
            problems.append("criu check needs root")
        else:
            try:
                out = subprocess.run([found, "check"], capture_output=True, text=True,
                                     timeout=timeout, check=False)
                if out.returncode != 0:
                    text = (out.stdout + out.stderr).strip().splitlines()
                    problems.append(f"criu check failed: {' | '.join(text[-3:])[:300]}")
                for feat in FEATURES:
                    f = subprocess.run([found, "check", "--feature", feat], capture_output=True,
                                       text=True, timeout=timeout, check=False)
                    features[feat] = f.returncode == 0
            except (OSError, subprocess.TimeoutExpired) as exc:
                problems.append(f"criu check did not finish: {exc}")
            if features and not features.get("clone3_set_tid", False):
                problems.append("the kernel lacks clone3 with set_tid (Linux 5.5+)")
    return Criu(found, version, tuple(problems), features)
