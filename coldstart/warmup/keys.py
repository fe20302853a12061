"""The warm-up cache's key: what compiled kernels depend on, and nothing incidental.

A component is one line of text; the key is the SHA-256 of the components as canonical JSON.
What each holds, and why:

* ``torch``: the version and the digest of the installed distribution's ``RECORD`` file, which
  lists the digest of every file torch installed: a rebuilt or patched torch changes it, as it
  changes Inductor's own ``torch_key()`` (a hash of every torch source file), but reading one
  file costs milliseconds where hashing torch's sources costs seconds and an ``import torch``.
* ``triton``: the same for Triton (Inductor keys on a hash of libtriton); ``none`` without it.
* ``python``: implementation, version, ABI flags and machine (bytecode and extension modules).
* ``isa``: the instruction-set extensions this CPU reports. Inductor builds its C++ kernels with
  ``-march=native`` but keys them on that literal text, not on the CPU: a cache built on a CPU
  with AVX-512 BF16 would be *hit*, and could fault, on one without. So the key names every
  extension ``-march=native`` may use; other ``/proc/cpuinfo`` flags (bugs, power, hypervisor)
  are left out.
* ``gpu``, ``driver``: the GPU's name and compute capability, and the NVIDIA driver version,
  from ``nvidia-smi`` (Inductor keys on the name; the driver's JIT cache on the driver);
  ``none`` without a GPU. ``cuda``: the CUDA version torch was built for (``none`` on CPU).
* ``model``: the model version the app was started for (``$COLDSTART_MODEL_VERSION``, or given).

Paths, host names, user names, pod IPs and times are never read.
"""

from __future__ import annotations

import csv
import hashlib
import importlib.metadata
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from coldstart.errors import FormatError

__all__ = ["COMPONENTS", "MODEL_ENV", "WarmupKey", "compute_key", "cpu_isa", "differences",
           "gpu_identity"]

KEY_VERSION = 1
COMPONENTS = ("torch", "triton", "python", "isa", "gpu", "driver", "cuda", "model")
MODEL_ENV = "COLDSTART_MODEL_VERSION"
NONE = "none"

# the x86 and Arm extensions a compiler may use under -march=native (gcc's own list, trimmed
# to what /proc/cpuinfo names): a flag matching this is part of the key, any other is not
_ISA_FLAG = re.compile(
    r"^(sse\w*|ssse3|avx\w*|amx\w*|fma4?|f16c|bmi[12]|adx|aes|vaes|pclmulqdq|vpclmulqdq|gfni|"
    r"popcnt|abm|lzcnt|movbe|sha_ni|rdrand|rdseed|xsave|xsavec|xsaveopt|xsaves|clflushopt|clwb|3dnowprefetch|cx16|"
    r"xop|tbm|movdiri|movdir64b|serialize|waitpkg|"
    r"fp|asimd\w*|sve\w*|sme\d?|smef\w+|smei\w+|bf16|i8mm|dotprod|fphp|fcma|jscvt|lrcpc|atomics|crc32|sha\d|"
    r"sm[34]|svei8mm|svebf16)$")


@dataclass(frozen=True)
class WarmupKey:
    """The components of a key and its digest (``sha256:…``)."""

    components: Mapping[str, str]
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        missing = [c for c in COMPONENTS if c not in self.components]
        extra = sorted(set(self.components) - set(COMPONENTS))
        if missing or extra:
            raise FormatError(f"warm-up key: components missing {missing}, unknown {extra}")
        for name, value in self.components.items():
            if not isinstance(value, str) or not value or "\n" in value:
                raise FormatError(f"warm-up key: component {name!r} is not one line of text")
        object.__setattr__(self, "digest", "sha256:" + hashlib.sha256(self.canonical()).hexdigest())

    def canonical(self) -> bytes:
        doc = {"version": KEY_VERSION, "components": {c: self.components[c] for c in COMPONENTS}}
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @property
    def short(self) -> str:
        """The digest's first 16 hex digits (tags, log lines)."""
        return self.digest.removeprefix("sha256:")[:16]

    @classmethod
    def parse(cls, data: bytes) -> WarmupKey:
        """A key from :meth:`canonical`'s bytes (an artifact's config); FormatError if bad."""
        try:
            doc = json.loads(data)
        except ValueError as exc:
            raise FormatError(f"warm-up key: not JSON: {exc}") from None
        version = doc.get("version") if isinstance(doc, dict) else None
        if version != KEY_VERSION:
            raise FormatError(f"warm-up key: version {version!r} is not {KEY_VERSION}")
        comps = doc.get("components")
        if not isinstance(comps, dict):
            raise FormatError("warm-up key: no components")
        return cls(comps)

    def to_json(self) -> dict[str, object]:
        return {"digest": self.digest, "components": dict(self.components)}


def _dist(*names: str) -> str:
    """``<version> record:<16 hex>`` of the first of ``names`` installed; ``none``.

    The digest covers the sorted lines of the distribution's ``RECORD`` that name a file of
    the package with its hash: not the console scripts (``../../bin/…``, or ``bin/…`` under
    ``pip install --target``: their shebang names the interpreter's path), the metadata
    (``*.dist-info/``: installer, direct URL) or the bytecode an installer may or may not
    have compiled: the same wheel installed anywhere, by any installer, has the same key."""
    for name in names:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        record = dist.read_text("RECORD")
        if record is None:      # an install without a RECORD: the version alone
            return f"{dist.version} record:none"
        rows = sorted(",".join(row) for row in csv.reader(io.StringIO(record))
                      if _package_file(row))
        digest = hashlib.sha256("\n".join(rows).encode()).hexdigest()[:16]
        return f"{dist.version} record:{digest}"
    return NONE


def _package_file(row: list[str]) -> bool:
    """A ``RECORD`` row (CSV: path, hash, size) that names a file of the package itself."""
    if len(row) < 2 or not row[1]:
        return False
    path = row[0]
    first = path.split("/", 1)[0]
    return not path.startswith(("../", "/")) and first not in ("bin", "Scripts") and \
        not first.endswith((".dist-info", ".data")) and not path.endswith(".pyc") and \
        "__pycache__/" not in path


def _python() -> str:
    impl = sys.implementation
    return (f"{impl.name}-{sys.version_info.major}.{sys.version_info.minor}{sys.abiflags}-"
            f"{platform.machine()}")


def cpu_isa(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The ISA extensions of this CPU (those of its first processor): ``<machine>:`` then the
    sorted flags, or ``<machine>:unknown`` where cpuinfo is unreadable."""
    machine = platform.machine()
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return f"{machine}:unknown"
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in ("flags", "Features"):
            flags = sorted({f for f in value.split() if _ISA_FLAG.match(f)})
            return f"{machine}:{' '.join(flags) or 'none'}"
    return f"{machine}:unknown"


def gpu_identity(timeout: float = 5.0) -> tuple[str, str]:
    """(``name cc X.Y``, driver version) of GPU 0 from nvidia-smi; (none, none) without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return NONE, NONE
    try:
        out = subprocess.run([smi, "--query-gpu=name,compute_cap,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return NONE, NONE
    first = out.stdout.strip().splitlines()[:1]
    if out.returncode != 0 or not first:
        return NONE, NONE
    parts = [p.strip() for p in first[0].split(",")]
    if len(parts) != 3:
        return NONE, NONE
    return f"{parts[0]} cc {parts[1]}", parts[2]


def _cuda(torch_version: str) -> str:
    """The CUDA version torch was built for: its local version (``2.5.1+cu124`` → 12.4), else
    (PyPI's default CUDA wheels carry none) the CUDA runtime wheel it installed beside it."""
    local = torch_version.split(" ", 1)[0].partition("+")[2]
    m = re.fullmatch(r"cu(\d+)(\d)", local)
    if m:
        return f"{m.group(1)}.{m.group(2)}"
    try:        # the runtime torch itself requires, not any other package's
        wanted = [re.split(r"[\s;<>=!~\[]", r, maxsplit=1)[0].lower()
                  for r in importlib.metadata.requires("torch") or []]
    except importlib.metadata.PackageNotFoundError:
        return NONE
    for runtime in wanted:
        if runtime.startswith("nvidia-cuda-runtime"):
            try:
                return ".".join(importlib.metadata.version(runtime).split(".")[:2])
            except importlib.metadata.PackageNotFoundError:
                continue
    return NONE


def compute_key(model_version: str | None = None, *,
                overrides: Mapping[str, str] | None = None) -> WarmupKey:
    """The key of this interpreter, CPU and GPU. ``model_version``: else
    ``$COLDSTART_MODEL_VERSION``, else ``none``; ``overrides``: components given instead of
    read (tests, cross-builds)."""
    torch = _dist("torch")
    gpu, driver = gpu_identity()
    comps = {
        "torch": torch,
        # torch's own Triton builds go by other names
        "triton": _dist("triton", "pytorch-triton", "pytorch-triton-rocm",
                        "pytorch-triton-xpu"),
        "python": _python(),
        "isa": cpu_isa(),
        "gpu": gpu,
        "driver": driver,
        "cuda": _cuda(torch),
        "model": model_version or os.environ.get(MODEL_ENV) or NONE,
    }
    comps.update(overrides or {})
    return WarmupKey(comps)


def _some(flags: list[str], most: int = 6) -> str:
    more = f" (+{len(flags) - most} more)" if len(flags) > most else ""
    return " ".join(flags[:most]) + more


def differences(want: WarmupKey, have: WarmupKey) -> list[str]:
    """Why ``have`` (an artifact's key) is not ``want`` (this node's): one phrase per component
    that differs, e.g. ``isa: this CPU lacks avx512_bf16``."""
    out: list[str] = []
    for c in COMPONENTS:
        a, b = want.components[c], have.components[c]
        if a == b:
            continue
        if c == "isa" and a.partition(":")[0] != b.partition(":")[0]:
            out.append(f"isa: the artifact is for {b.partition(':')[0]}, this machine is "
                       f"{a.partition(':')[0]}")
        elif c == "isa":
            mine, theirs = set(a.partition(":")[2].split()), set(b.partition(":")[2].split())
            lacks, extra = sorted(theirs - mine), sorted(mine - theirs)
            what = []
            if lacks:
                what.append(f"this CPU lacks {_some(lacks)}")
            if extra:
                what.append(f"the artifact's CPU lacked {_some(extra)}")
            out.append(f"isa: {'; '.join(what) or f'{b} vs {a}'}")
        else:
            out.append(f"{c}: artifact {b!r}, here {a!r}")
    return out
