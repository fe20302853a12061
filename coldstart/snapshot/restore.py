"""One restore attempt of :mod:`coldstart.snapshot.runc`: find, fetch, put the rootfs changes
in, ``runc restore``, tell the app; or undo all of it and say why.

Every step is timed (``phases``) and its bytes counted; the attempt ends as one event in the
node's events log (:class:`~coldstart.snapshot.state.NodeState`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coldstart.errors import ColdstartError, DeadlineExceeded, FormatError, IntegrityError

if TYPE_CHECKING:
    from coldstart.cache.chunks import ChunkCache
    from coldstart.config import Config
    from coldstart.snapshot.runc import Invocation
    from coldstart.snapshot.state import NodeState

__all__ = ["Attempt", "Fallback", "after_restore_signal", "try_restore"]

log = logging.getLogger(__name__)


class Fallback(Exception):
    """The restore does not happen; ``kind`` names why (counted), the message says it."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class Attempt:
    cid: str
    image: str = ""
    snapshot: str | None = None
    phases: dict[str, float] = field(default_factory=dict)
    fetched_bytes: int = 0
    requests: int = 0
    chunks_cached: int = 0
    chunks_fetched: int = 0
    bytes: int = 0
    signalled: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"container": self.cid, "image": self.image, "snapshot": self.snapshot,
                "phases": {k: round(v, 4) for k, v in self.phases.items()},
                "fetched_bytes": self.fetched_bytes, "requests": self.requests,
                "chunks_cached": self.chunks_cached, "chunks_fetched": self.chunks_fetched,
                "bytes": self.bytes, "signalled": self.signalled}


def after_restore_signal(name: str) -> int | None:
    """``SIGUSR2``, ``SIGRTMIN+6``, ``40`` → the signal number; ``""`` → None."""
    name = name.strip().upper()
    if not name:
        return None
    if name.isdigit():
        return int(name)
    base, plus, off = name.partition("+")
    base = base if base.startswith("SIG") else "SIG" + base
    num = int(getattr(signal, base))
    return num + int(off) if plus else num


def _criu_ok(cfg: Config, state: NodeState) -> str:
    """CRIU's version when it can restore here; Fallback otherwise. ``criu check`` runs once
    per boot and CRIU binary (its answer is kept in the state directory)."""
    from coldstart.errors import FailedPrecondition
    from coldstart.snapshot.criu import find_criu

    try:
        quick = find_criu(cfg.snapshot.criu, check=False)
    except FailedPrecondition as exc:
        raise Fallback("criu", str(exc)) from None
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        st = os.stat(quick.path)
    except OSError:
        boot, st = "", None
    stamp = hashlib.sha256(f"{boot} {quick.path} {st and st.st_mtime_ns} {quick.version}"
                           .encode()).hexdigest()[:16]
    cached = state.root / f"criu-check-{stamp}"
    if cached.exists():
        problems = cached.read_text().strip()
    else:
        problems = "; ".join(find_criu(quick.path, check=True).problems)
        with contextlib.suppress(OSError):
            cached.write_text(problems)
    if problems:
        raise Fallback("criu", problems)
    return quick.version


def _image_ref(spec: Mapping[str, Any]) -> str:
    from coldstart.snapshot.runc import ANNOTATION, CRI_IMAGE

    ann = spec.get("annotations") or {}
    ref = str(ann.get(ANNOTATION, "")).strip()
    if ref == "auto":
        ref = str(ann.get(CRI_IMAGE, "")).strip()
        if not ref:
            raise Fallback("no-image", f"{ANNOTATION}=auto but the spec has no {CRI_IMAGE}")
    if not ref:
        raise Fallback("no-image", f"{ANNOTATION} names no image")
    return ref


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def _catches(pid: int, signum: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def _tell(pid: int, signum: int | None) -> list[int]:
    """Send ``signum`` to each process of ``pid``'s tree that handles it (others would die of
    it); the pids signalled."""
    if signum is None:
        return []
    told = []
    for p in _descendants(pid):
        if _catches(p, signum):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signum)
                told.append(p)
    return told


def try_restore(inv: Invocation, bundle: Path, spec: Mapping[str, Any], cfg: Config,
                runc: str, state: NodeState) -> bool:
    """Restore container ``inv.cid`` in place of its ``create``; True when its process runs.
    False after a fallback, with nothing left of the attempt (the caller runs ``create``)."""
    from coldstart.snapshot.runc import _runc_log, cleanup_leftovers

    t0 = time.monotonic()
    attempt = Attempt(inv.cid)
    root = inv.global_value("--root", "/run/runc")
    applied = None
    cache: ChunkCache | None = None
    try:
        state.ensure()
        attempt.phases["check"] = 0.0
        if inv.flags.get("--console-socket") or (spec.get("process") or {}).get("terminal"):
            raise Fallback("terminal", "the container has a terminal (CRIU restores no tty "
                           "here)")
        if str(inv.flags.get("--preserve-fds", "0")) not in ("0", "", "False"):
            raise Fallback("preserve-fds", "the container is given extra file descriptors")
        criu_version = _criu_ok(cfg, state)
        ref = _image_ref(spec)
        attempt.phases["check"] = time.monotonic() - t0
        from coldstart.cache.chunks import ChunkCache

        cache = ChunkCache(cfg.snapshot_chunk_dir, max_bytes=cfg.snapshot.chunk_max_bytes)
        applied = _fetch_and_place(inv, bundle, spec, cfg, state, attempt, ref, criu_version,
                                   t0, cache)
        t = time.monotonic()
        work = state.work(root, inv.cid)
        restore_argv = [runc, *inv.globals, "restore", "--detach", "--bundle", str(bundle),
                        "--image-path", str(work / "images"), "--work-path", str(work / "criu")]
        if inv.flags.get("--pid-file"):
            restore_argv += ["--pid-file", str(inv.flags["--pid-file"])]
        if inv.flags.get("--no-pivot"):
            restore_argv.append("--no-pivot")
        restore_argv.append(inv.cid)
        (work / "criu").mkdir(mode=0o700, exist_ok=True)
        try:
            # standard I/O is the shim's: runc gives it to the restored process
            rc = subprocess.run(restore_argv, check=False, timeout=max(60.0, cfg.snapshot.timeout)
                                ).returncode
        except subprocess.TimeoutExpired:
            rc = -1
        attempt.phases["restore"] = time.monotonic() - t
        log_path = work / "criu" / "restore.log"
        with contextlib.suppress(OSError):
            os.replace(log_path, state.log(root, inv.cid))
        if rc != 0:
            tail = _tail(state.log(root, inv.cid))
            raise Fallback("restore-failed", f"runc restore exited {rc}: {tail}")
        pid = _pid(inv)
        attempt.signalled = _tell(pid, after_restore_signal(cfg.snapshot.signal)) if pid else []
        applied.drop()
        import shutil

        shutil.rmtree(work, ignore_errors=True)      # the pages are in the process now
        state.mark_restored(root, inv.cid, {"snapshot": attempt.snapshot, "pid": pid,
                                            "image": attempt.image})
        attempt.phases["total"] = time.monotonic() - t0
        state.record({"outcome": "restored", **attempt.to_json()})
        return True
    except Exception as exc:   # any failure is a fallback, never a failed start
        kind = exc.kind if isinstance(exc, Fallback) else (
            "timeout" if isinstance(exc, DeadlineExceeded) else
            "integrity" if isinstance(exc, IntegrityError | FormatError) else
            "registry" if isinstance(exc, ColdstartError) else "internal")
        reason = f"{type(exc).__name__}: {exc}" if not isinstance(exc, Fallback) else str(exc)
        cleanup_leftovers(state, runc, inv)
        if applied is not None:
            left = applied.undo()
            if left:
                reason += f" (rootfs: {len(left)} changes could not be undone: {left[:3]})"
        attempt.phases["total"] = time.monotonic() - t0
        with contextlib.suppress(Exception):
            state.record({"outcome": "fallback", "kind": kind, "reason": reason[:2000],
                          **attempt.to_json()})
        _runc_log(inv, "warning", f"not restored from a snapshot ({kind}), starting normally: "
                  f"{reason[:500]}")
        return False
    finally:
        if cache is not None:       # what its writer holds is written, after the restore
            with contextlib.suppress(Exception):
                cache.close()


def _fetch_and_place(inv: Invocation, bundle: Path, spec: Mapping[str, Any], cfg: Config,
                     state: NodeState, attempt: Attempt, ref: str, criu_version: str,
                     t0: float, cache: ChunkCache) -> Any:
    """Find the snapshot, fetch its CRIU images (verified, through the chunk cache) into the
    work directory and put its rootfs changes into the container's root; the
    :class:`~coldstart.snapshot.rootdiff.Applied` journal."""
    from coldstart.oci.reference import Reference
    from coldstart.oci.registry import RegistryClient
    from coldstart.snapshot import artifacts, rootdiff
    from coldstart.snapshot import bundle as sbundle
    from coldstart.snapshot.keys import compute_key
    from coldstart.warmup.artifacts import open_bundle

    deadline = t0 + cfg.snapshot.timeout

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceeded(f"finding and fetching the snapshot took more than "
                                   f"{cfg.snapshot.timeout:g} s")
        return remaining

    r = cfg.registry
    t = time.monotonic()
    image = Reference.parse(ref)
    with RegistryClient(insecure_hosts=r.insecure_hosts,
                        docker_config=Path(r.docker_config) if r.docker_config else None,
                        hosts_dir=Path(r.hosts_dir) if r.hosts_dir else None,
                        timeout=min(r.timeout, left()), retries=r.retries) as client:
        resolved = client.resolve(image)
        attempt.image = resolved.digest
        key = compute_key(resolved.digest, spec, criu_version)
        found = artifacts.find(client, image, key)
        attempt.phases["find"] = time.monotonic() - t
        if found.digest is None:
            raise Fallback("no-snapshot", "; ".join(found.reasons) or "no snapshot")
        attempt.snapshot = found.digest
        t = time.monotonic()
        layer = open_bundle(client, image, found, timeout=min(r.timeout, left()))
        work = state.work(inv.global_value("--root", "/run/runc"), inv.cid)
        import shutil

        shutil.rmtree(work, ignore_errors=True)
        done = sbundle.Unpacked()
        try:
            sbundle.materialize(layer, work / "images", cache, into=done)
        finally:
            attempt.fetched_bytes = int(getattr(layer.blob, "bytes", 0))
            attempt.requests = int(getattr(layer.blob, "requests", 0))
            attempt.chunks_cached, attempt.chunks_fetched = done.chunks_cached, \
                done.chunks_fetched
        left()
        attempt.bytes = done.size
        attempt.phases["fetch"] = time.monotonic() - t
    t = time.monotonic()
    root_path = Path(str((spec.get("root") or {}).get("path") or "rootfs"))
    rootfs = root_path if root_path.is_absolute() else bundle / root_path
    applied = rootdiff.apply(done.rootfs, rootfs) if done.rootfs else rootdiff.Applied(rootfs)
    attempt.phases["rootfs"] = time.monotonic() - t
    return applied


def _pid(inv: Invocation) -> int | None:
    path = inv.flags.get("--pid-file")
    if not path:
        return None
    try:
        return int(Path(str(path)).read_text().strip())
    except (OSError, ValueError):
        return None


def _tail(path: Path, lines: int = 4) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no restore log)"
    errs = [ln for ln in text if "Error" in ln or "error" in ln][-lines:]
    return " | ".join(e.strip() for e in (errs or text[-lines:]))[:800]
