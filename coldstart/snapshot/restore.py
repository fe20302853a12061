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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coldstart.errors import ColdstartError, DeadlineExceeded, FormatError, IntegrityError
from coldstart.snapshot.procs import descendants, kill_tree
from coldstart.snapshot.signals import signal_number

if TYPE_CHECKING:
    from coldstart.cache.chunks import ChunkCache
    from coldstart.config import Config
    from coldstart.snapshot.invocation import Invocation
    from coldstart.snapshot.state import NodeState
    from coldstart.snapshot.touched import Warmer

__all__ = ["Attempt", "Fallback", "check_privileges", "try_restore"]

log = logging.getLogger(__name__)

#: seconds ``runc restore`` may take past the find-and-fetch deadline (kubelet's CRI calls
#: have 2 minutes: the default deadline, 60 s, and this stay well within)
RESTORE_GRACE = 30.0
#: capability numbers (linux/capability.h), for the restored process's masks
CAPABILITIES = (
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID",
    "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW",
    "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE",
    "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE", "SYS_RESOURCE", "SYS_TIME",
    "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP",
    "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ",
    "PERFMON", "BPF", "CHECKPOINT_RESTORE",
)


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
    pages: str = "eager"
    warmer: Warmer | None = None        # reading what the process had read of its files
    uncached: list[tuple[str, str, int, int]] = field(default_factory=list)   # for the cache

    def to_json(self) -> dict[str, Any]:
        return {"container": self.cid, "image": self.image, "snapshot": self.snapshot,
                "phases": {k: round(v, 4) for k, v in self.phases.items()},
                "fetched_bytes": self.fetched_bytes, "requests": self.requests,
                "chunks_cached": self.chunks_cached, "chunks_fetched": self.chunks_fetched,
                "bytes": self.bytes, "signalled": self.signalled, "pages": self.pages,
                "warm": None if self.warmer is None else {
                    "files": self.warmer.files, "skipped": self.warmer.skipped,
                    "bytes": self.warmer.bytes, "seconds": round(self.warmer.seconds, 4),
                    "complete": self.warmer.complete}}


def _criu_ok(cfg: Config, state: NodeState) -> tuple[str, str, Callable[[], None]]:
    """CRIU's path and version, and a call that raises Fallback unless it can restore here
    (``criu check``, once per boot and CRIU binary: a pass is kept in the state directory;
    when it runs, it runs in the background meanwhile). Fallback at once for no CRIU, or one
    too old."""
    import threading

    from coldstart.errors import FailedPrecondition
    from coldstart.snapshot.criu import find_criu

    try:
        quick = find_criu(cfg.snapshot.criu, check=False)
    except FailedPrecondition as exc:
        raise Fallback("criu", str(exc)) from None
    if quick.problems:
        raise Fallback("criu", "; ".join(quick.problems))
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        st = os.stat(quick.path)
    except OSError:
        boot, st = "", None
    stamp = hashlib.sha256(f"{boot} {quick.path} {st and st.st_mtime_ns} {quick.version}"
                           .encode()).hexdigest()[:16]
    passed = state.root / f"criu-check-{stamp}"
    if passed.exists():
        return quick.path, quick.version, lambda: None
    problems: list[str] = []

    def check() -> None:
        try:
            problems.extend(find_criu(quick.path, check=True).problems)
        except Exception as exc:        # said as the reason
            problems.append(f"criu check: {exc}")
        if not problems:        # kept even when this attempt falls back for another reason
            with contextlib.suppress(OSError):
                passed.touch()

    thread = threading.Thread(target=check, name="criu-check", daemon=True)
    thread.start()

    def verdict() -> None:
        thread.join()
        if problems:            # only a pass is kept: a failure is checked again next time
            raise Fallback("criu", "; ".join(problems))

    return quick.path, quick.version, verdict


def _image_ref(spec: Mapping[str, Any]) -> str:
    from coldstart.snapshot.invocation import ANNOTATION, CRI_IMAGE

    ann = spec.get("annotations") or {}
    ref = str(ann.get(ANNOTATION, "")).strip()
    if ref == "auto":
        ref = str(ann.get(CRI_IMAGE, "")).strip()
        if not ref:
            raise Fallback("no-image", f"{ANNOTATION}=auto but the spec has no {CRI_IMAGE}")
    if not ref:
        raise Fallback("no-image", f"{ANNOTATION} names no image")
    return ref


def _status_of(path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    with open(path) as f:
        for line in f:
            name, _, value = line.partition(":")
            out[name] = value.strip()
    return out


def _mask(names: Any) -> int:
    """The capability bits of ``names`` (``CAP_NET_RAW``…; unknown names count for none)."""
    bits = 0
    for name in names or []:
        short = str(name).removeprefix("CAP_")
        if short in CAPABILITIES:
            bits |= 1 << CAPABILITIES.index(short)
    return bits


def check_privileges(pid: int, spec: Mapping[str, Any]) -> str:
    """Why the restored process tree of ``pid`` may do more than ``spec`` lets the container
    do; "" when it may not. CRIU restores the dumped credentials, capabilities, no_new_privs
    and seccomp mode of every thread, not the spec's: the init process's threads must have the
    spec's user and groups, and every thread of every process at most the spec's capability
    sets, no_new_privs and a seccomp filter when the spec sets them. (Which seccomp filter,
    and the LSM labels, are not read here: the key holds them.)"""
    proc = spec.get("process") or {}
    user = proc.get("user") or {}
    caps = proc.get("capabilities") or {}
    want_nnp = bool(proc.get("noNewPrivileges"))
    want_seccomp = bool((spec.get("linux") or {}).get("seccomp"))
    limits = {"CapEff": _mask(caps.get("effective")), "CapPrm": _mask(caps.get("permitted")),
              "CapBnd": _mask(caps.get("bounding")), "CapInh": _mask(caps.get("inheritable"))}
    uid, gid = int(user.get("uid", 0)), int(user.get("gid", 0))
    groups = {gid, *(int(g) for g in user.get("additionalGids") or [])}
    for p in descendants(pid):
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue            # gone since: nothing to check
        for tid in tids:
            try:
                st = _status_of(f"/proc/{p}/task/{tid}/status")
            except OSError:
                continue
            who = f"pid {p} (thread {tid})"
            if p == pid:
                uids, gids = st.get("Uid", "").split(), st.get("Gid", "").split()
                if {int(u) for u in uids} != {uid} or {int(g) for g in gids} != {gid}:
                    return f"{who} runs as uid {uids} gid {gids}, the spec says {uid}:{gid}"
                have_groups = {int(g) for g in st.get("Groups", "").split()}
                if have_groups - groups:
                    return f"{who} has groups {sorted(have_groups - groups)} the spec lacks"
            for field_, allowed in limits.items():
                have = int(st.get(field_, "0"), 16)
                if have & ~allowed:
                    extra = [f"CAP_{c}" for i, c in enumerate(CAPABILITIES)
                             if have & ~allowed & (1 << i)] or [hex(have & ~allowed)]
                    return f"{who} has {field_} beyond the spec's: {' '.join(extra[:4])}"
            if want_nnp and st.get("NoNewPrivs") != "1":
                return f"{who} lacks no_new_privs, which the spec sets"
            if want_seccomp and st.get("Seccomp") != "2":
                return f"{who} has no seccomp filter, which the spec sets"
    return ""


def _catches(pid: int, signum: int) -> bool:
    try:
        return bool(int(_status_of(f"/proc/{pid}/status").get("SigCgt", "0"), 16)
                    >> (signum - 1) & 1)
    except (OSError, ValueError):
        return False


def _tell(pid: int, signum: int | None) -> list[int]:
    """Send ``signum`` to each process of ``pid``'s tree that handles it (others would die of
    it); the pids signalled."""
    if signum is None:
        return []
    told = []
    for p in descendants(pid):
        if _catches(p, signum):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signum)
                told.append(p)
    return told


def try_restore(inv: Invocation, bundle: Path, spec: Mapping[str, Any], cfg: Config,
                runc: str, state: NodeState) -> bool:
    """Restore container ``inv.cid`` in place of its ``create``; True when its process runs.
    False after a fallback, with nothing left of the attempt (the caller runs ``create``)."""
    from coldstart.snapshot.invocation import cleanup_leftovers, runc_log

    t0 = time.monotonic()
    attempt = Attempt(inv.cid)
    attempt.phases["exec"] = _since_exec()
    root = inv.global_value("--root", "/run/runc")
    applied = None
    cache: ChunkCache | None = None
    pager: subprocess.Popen[bytes] | None = None
    restored = False
    try:
        state.ensure()
        attempt.phases["check"] = 0.0
        if inv.flags.get("--console-socket") or (spec.get("process") or {}).get("terminal"):
            raise Fallback("terminal", "the container has a terminal (CRIU restores no tty "
                           "here)")
        if str(inv.flags.get("--preserve-fds", "0")) not in ("0", "", "False"):
            raise Fallback("preserve-fds", "the container is given extra file descriptors")
        criu_path, criu_version, criu_verdict = _criu_ok(cfg, state)
        lazy = cfg.snapshot.pages == "lazy"
        attempt.pages = cfg.snapshot.pages
        ref = _image_ref(spec)
        attempt.phases["check"] = time.monotonic() - t0
        from coldstart.cache.chunks import ChunkCache

        cache = ChunkCache(cfg.snapshot_chunk_dir, max_bytes=cfg.snapshot.chunk_max_bytes)
        applied = _fetch_and_place(inv, bundle, spec, cfg, state, attempt, ref, criu_version,
                                   t0, cache, lazy=lazy)
        t = time.monotonic()
        criu_verdict()
        attempt.phases["criu-check"] = time.monotonic() - t
        t = time.monotonic()
        work = state.work(root, inv.cid)
        images = work / "bundle" / "criu" if lazy else work / "images"
        restore_argv = [runc, *inv.globals, "restore", "--detach", "--bundle", str(bundle),
                        "--image-path", str(images), "--work-path", str(work / "criu")]
        if not inv.global_value("--criu"):      # the CRIU that passed the check, not PATH's
            restore_argv[1:1] = ["--criu", criu_path]
        if inv.flags.get("--pid-file"):
            restore_argv += ["--pid-file", str(inv.flags["--pid-file"])]
        if inv.flags.get("--no-pivot"):
            restore_argv.append("--no-pivot")
        restore_argv.append(inv.cid)
        (work / "criu").mkdir(mode=0o700, exist_ok=True)
        if lazy:
            from coldstart.snapshot.lazy import start_pager

            restore_argv.insert(-1, "--lazy-pages")
            pager = start_pager(criu_path, images, work / "criu", mountpoint=work / "bundle",
                                fuse_socket=cfg.fuse.socket,
                                pid_file=str(inv.flags.get("--pid-file") or ""),
                                state_dir=state.root, cid=inv.cid,
                                cgroup=str((spec.get("linux") or {}).get("cgroupsPath") or ""),
                                log=state.log(root, inv.cid).with_suffix(".pager.log"))
            _wait_socket(work / "criu" / "lazy-pages.socket", pager, 10.0)
        # standard I/O is the shim's: runc gives it to the restored process. Its own session:
        # past the deadline runc and the CRIU it runs are killed together
        proc = subprocess.Popen(restore_argv, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(10.0, t0 + cfg.snapshot.timeout - time.monotonic())
                           + RESTORE_GRACE)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = -1
        attempt.phases["restore"] = time.monotonic() - t
        log_path = work / "criu" / "restore.log"
        with contextlib.suppress(OSError):
            os.replace(log_path, state.log(root, inv.cid))
        if rc != 0:
            tail = _tail(state.log(root, inv.cid))
            raise Fallback("restore-failed", f"runc restore exited {rc}: {tail}")
        pid = _pid(inv)
        wrong = check_privileges(pid, spec) if pid else "runc wrote no pid"
        if wrong:
            # a snapshot whose process may do more than this container's spec allows (a
            # forged key): it ran for as long as this check took; it is killed, and the
            # container starts normally
            if pid:
                kill_tree(pid)
            raise Fallback("privileges", wrong)
        # the marker that makes `start` a no-op: a failure to write it is a fallback too
        state.mark_restored(root, inv.cid, {"snapshot": attempt.snapshot, "pid": pid,
                                            "image": attempt.image})
        restored = True
    except Exception as exc:   # any failure is a fallback, never a failed start
        kind = exc.kind if isinstance(exc, Fallback) else (
            "timeout" if isinstance(exc, DeadlineExceeded) else
            "integrity" if isinstance(exc, IntegrityError | FormatError) else
            "registry" if isinstance(exc, ColdstartError) else "internal")
        reason = f"{type(exc).__name__}: {exc}" if not isinstance(exc, Fallback) else str(exc)
        # the restored processes first (while a lazy pager still serves their pages), then
        # the pager, the rootfs changes, the mount; each step on its own
        if attempt.warmer is not None:
            with contextlib.suppress(Exception):
                attempt.warmer.stop()
        with contextlib.suppress(Exception):
            cleanup_leftovers(state, runc, inv)
        if pager is not None and pager.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pager.pid, signal.SIGKILL)     # the pager and its criu lazy-pages
            pager.wait()
        if applied is not None:
            try:
                left = applied.undo()
            except Exception as undo_exc:      # said in the reason
                left = [f"undo failed: {undo_exc}"]
            if left:
                reason += f" (rootfs: {len(left)} changes could not be undone: {left[:3]})"
        if kind == "timeout" and cache is not None and attempt.uncached:
            # what came before the deadline stays on the node: the next attempt fetches less
            from coldstart.snapshot.bundle import cache_later

            with contextlib.suppress(Exception):
                cache_later(state.work(root, inv.cid) / "images", attempt.uncached, cache)
        with contextlib.suppress(Exception):
            _unmount(cfg, state.work(root, inv.cid) / "bundle")
            import shutil

            shutil.rmtree(state.work(root, inv.cid), ignore_errors=True)   # the mount point
        attempt.phases["total"] = time.monotonic() - t0
        with contextlib.suppress(Exception):
            state.record({"outcome": "fallback", "kind": kind, "reason": reason[:2000],
                          **attempt.to_json()})
        runc_log(inv, "warning", f"not restored from a snapshot ({kind}), starting normally: "
                 f"{reason[:500]}")
        return False
    finally:
        if cache is not None and not restored:
            with contextlib.suppress(Exception):
                cache.close()
    # restored: from here on nothing falls back (the process runs); what fails is logged.
    # The app is told first; then what the cache's writer holds is written
    with contextlib.suppress(Exception):
        attempt.signalled = _tell(pid, signal_number(cfg.snapshot.signal)) if pid else []
    attempt.phases["total"] = time.monotonic() - t0     # to the restored app told
    t = time.monotonic()
    if attempt.warmer is not None:
        # the app runs: from now on its own faults go first (what it had read and is not read
        # yet comes on demand)
        with contextlib.suppress(Exception):
            attempt.warmer.stop()
    if cache is not None:
        # the fetched chunks into the node's cache now that nothing waits on them (the next
        # restore of a snapshot sharing them fetches them no more), hashed again as they go
        from coldstart.snapshot.bundle import cache_later

        with contextlib.suppress(Exception):
            cache_later(work / "images", attempt.uncached, cache)
        with contextlib.suppress(Exception):
            cache.close()
    with contextlib.suppress(Exception):
        applied.drop()
    if not lazy:     # the pages are in the process now (lazy: the pager cleans up)
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    # what the wrapper did after the app was told, before runc's create returns
    attempt.phases["after"] = time.monotonic() - t
    with contextlib.suppress(Exception):
        state.record({"outcome": "restored", **attempt.to_json()})
    return True


def _fetch_and_place(inv: Invocation, bundle: Path, spec: Mapping[str, Any], cfg: Config,
                     state: NodeState, attempt: Attempt, ref: str, criu_version: str,
                     t0: float, cache: ChunkCache, *, lazy: bool = False) -> Any:
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
    # the node's registry settings, and kubelet's pull credentials as the CRI proxy keeps
    # them (the FUSE server reads the same)
    with RegistryClient.from_config(r, keychain_dir=cfg.cri_keychain_dir,
                                    timeout=min(r.timeout, left())) as client:
        resolved = client.resolve(image)
        attempt.image = resolved.digest
        key = compute_key(resolved.digest, spec, criu_version)
        found = artifacts.find(client, image, key)
        attempt.phases["find"] = time.monotonic() - t
        if found.digest is None:
            raise Fallback("no-snapshot", "; ".join(found.reasons) or "no snapshot")
        attempt.snapshot = found.digest
        _hold_background(cfg)           # a restore follows: the node's fill waits for it
        t = time.monotonic()
        layer = open_bundle(client, image, found, timeout=min(r.timeout, left()))
        if sbundle.TOUCHED in layer.toc.entries:
            # read ahead, through the container's rootfs, what the process had read of its
            # mapped files, while its pages come and CRIU restores
            from coldstart.snapshot.touched import MAX_JSON, Warmer, parse

            entry = layer.toc.entries[sbundle.TOUCHED]
            try:
                if entry.size > MAX_JSON:
                    raise FormatError(f"{sbundle.TOUCHED} holds {entry.size} bytes")
                # verified: a bad chunk falls back (IntegrityError is not caught here)
                files = parse(layer.read_file(sbundle.TOUCHED))
                mounts = [str(m.get("destination", "")) for m in spec.get("mounts") or []
                          if isinstance(m, Mapping)]
                attempt.warmer = Warmer(_rootfs(bundle, spec), files, deadline=deadline,
                                        skip=mounts)
            except IntegrityError:
                raise
            except Exception as exc:        # a hint only: the restore goes on without it
                log.warning("no read-ahead of the mapped files: %s", exc)
        work = state.work(inv.global_value("--root", "/run/runc"), inv.cid)
        import shutil

        shutil.rmtree(work, ignore_errors=True)
        done = sbundle.Unpacked()
        try:
            if lazy:
                # CRIU reads its files through the FUSE server, which fetches, verifies and
                # caches each chunk as it is read; only the rootfs changes are read now
                from coldstart.snapshot.lazy import mount_bundle

                mount_bundle(cfg.fuse.socket, ref, found.layer, work / "bundle")
                if sbundle.ROOTFS in layer.toc.entries:
                    done.rootfs = layer.read_file(sbundle.ROOTFS)
            else:
                sbundle.materialize(layer, work / "images", cache, into=done,
                                    deadline=deadline, defer_cache=True)
        finally:
            attempt.fetched_bytes = int(getattr(layer.blob, "bytes", 0))
            attempt.requests = int(getattr(layer.blob, "requests", 0))
            attempt.chunks_cached, attempt.chunks_fetched = done.chunks_cached, \
                done.chunks_fetched
            attempt.uncached = done.uncached
        left()
        attempt.bytes = done.size
        attempt.phases["fetch"] = time.monotonic() - t
    t = time.monotonic()
    rootfs = _rootfs(bundle, spec)
    applied = rootdiff.apply(done.rootfs, rootfs) if done.rootfs else rootdiff.Applied(rootfs)
    attempt.phases["rootfs"] = time.monotonic() - t
    return applied


#: seconds the node's FUSE server holds its background work (the hybrid fill) when a restore
#: starts: a restore decodes pages and runs CRIU without reading through FUSE, so the fill
#: would not see it busy; after it, the app's own reads keep the fill waiting
HOLD_SECONDS = 20.0


def _hold_background(cfg: Config) -> None:
    """Ask the node's FUSE server to hold its background work (a hint: a server that is not
    there, or older, is ignored)."""
    with contextlib.suppress(Exception):
        from coldstart.lazyfs.client import FuseServerClient

        FuseServerClient(cfg.fuse.socket, timeout=2.0).hold(min(HOLD_SECONDS,
                                                                  cfg.snapshot.timeout))


def _since_exec() -> float:
    """Seconds since this process was started (the wrapper's own start: Python, imports,
    the config), by the kernel's clock ticks; 0.0 when /proc does not say."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def _rootfs(bundle: Path, spec: Mapping[str, Any]) -> Path:
    root_path = Path(str((spec.get("root") or {}).get("path") or "rootfs"))
    return root_path if root_path.is_absolute() else bundle / root_path


def _wait_socket(path: Path, pager: subprocess.Popen[bytes], timeout: float) -> None:
    """Until the pager's ``criu lazy-pages`` listens at ``path``; Fallback if it exits."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if pager.poll() is not None:
            raise Fallback("criu", f"criu lazy-pages exited {pager.returncode} before it "
                           "listened")
        if time.monotonic() > deadline:
            raise Fallback("criu", f"criu lazy-pages did not listen within {timeout:g} s")
        time.sleep(0.005)


def _unmount(cfg: Config, mountpoint: Path) -> None:
    if os.path.ismount(mountpoint):
        from coldstart.snapshot.lazy import unmount_bundle

        unmount_bundle(cfg.fuse.socket, mountpoint)


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
