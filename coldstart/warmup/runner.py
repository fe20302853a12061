"""Restore, prove, capture: the warm-up cache around one start of an app.

:func:`restore` puts the artifact matching this node's key in the compilers' cache
directories, before the app starts; any problem (no artifact, another key, a chunk that fails
its digest, a registry that does not answer) is a *miss with its reason*, never a failure:
the app then compiles as it would have. :func:`verdict` says, from what compile work the app
left in those directories (:func:`~coldstart.warmup.bundle.evidence`), whether the restore
was a ``hit`` (no compile), ``partial`` or a ``miss``. :func:`run_app` wraps an unmodified app:
restore, start it, relay its sd_notify messages (adding ``X_WARMUP=<verdict>`` to the one that
says ``READY=1``, so probes and the bench see it), and optionally capture after READY.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coldstart.errors import ColdstartError, InvalidArgument
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from coldstart.probe.notify import MAX_DATAGRAM, notify, parse_notice
from coldstart.warmup import artifacts
from coldstart.warmup.bundle import (
    OFF_IN_CONTAINERS,
    Evidence,
    Unpacked,
    cache_dirs,
    evidence,
    pack,
    snapshot,
    unpack,
    watched_dirs,
)
from coldstart.warmup.keys import WarmupKey, compute_key

if TYPE_CHECKING:
    from coldstart.cache.chunks import ChunkCache

__all__ = ["Captured", "Restored", "Verdict", "capture", "restore", "run_app", "verdict"]

log = logging.getLogger(__name__)

VERDICT_ENV = "X_WARMUP"
#: the X_PHASE `run` reports while it restores (before the app's own phases)
RESTORE_PHASE = "warmcache-restore"
#: the chunk cache a restore uses unless told (a node directory mounted into pods shares it)
CHUNK_CACHE_ENV = "COLDSTART_WARMUP_CHUNKS"
CHUNK_CACHE_BYTES = 8 << 30


@dataclass
class Restored:
    """What a restore did: ``status`` is ``restored``, ``miss`` or ``refused`` (an artifact
    matched but could not be used: a digest mismatch, a registry error …)."""

    status: str
    reason: str
    key: WarmupKey
    image: str = ""                 # the image manifest digest
    artifact: str | None = None
    files: int = 0
    kept: int = 0
    bytes: int = 0                  # uncompressed, written
    fetched_bytes: int = 0          # compressed, from the registry (the bundle's part)
    requests: int = 0
    chunks_cached: int = 0
    chunks_fetched: int = 0
    seconds: float = 0.0
    compiles_at_capture: int | None = None
    dirs: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "reason": self.reason, "key": self.key.digest,
                "image": self.image, "artifact": self.artifact, "files": self.files,
                "kept": self.kept, "bytes": self.bytes, "fetched_bytes": self.fetched_bytes,
                "requests": self.requests, "chunks_cached": self.chunks_cached,
                "chunks_fetched": self.chunks_fetched, "seconds": round(self.seconds, 4),
                "compiles_at_capture": self.compiles_at_capture, "dirs": self.dirs}


def _chunk_cache(path: str | os.PathLike[str] | None) -> ChunkCache | None:
    path = path if path is not None else os.environ.get(CHUNK_CACHE_ENV) or None
    if not path:
        return None
    from coldstart.cache.chunks import ChunkCache

    return ChunkCache(path, max_bytes=CHUNK_CACHE_BYTES)


def restore(client: RegistryClient, image: str | Reference, *, key: WarmupKey | None = None,
            dirs: Mapping[str, Path] | None = None,
            chunk_cache: str | os.PathLike[str] | None = None) -> Restored:
    """Restore the artifact of ``image`` matching ``key`` (default: this node's) into ``dirs``
    (default: where this process's environment puts the caches). Never raises for what a
    registry or an artifact does wrong: that is a ``miss``/``refused`` with its reason."""
    t0 = time.monotonic()
    key = key or compute_key()
    dirs = dict(dirs) if dirs is not None else cache_dirs()
    out = Restored("miss", "", key, dirs={r: str(p) for r, p in dirs.items()})
    try:
        ref = image if isinstance(image, Reference) else Reference.parse(image)
        found = artifacts.find(client, ref, key)
        out.image = found.image
        if found.digest is None:
            out.reason = "; ".join(found.reasons) or "no artifact"
            return out
        out.artifact, out.compiles_at_capture = found.digest, found.compiles
        cache = _chunk_cache(chunk_cache)
        try:
            # into empty directories, with no chunk cache to serve some of its chunks, every
            # file is read: the bundle is fetched whole (else the TOC, then what is missing)
            whole = cache is None and not any(_not_empty(p) for p in dirs.values())
            layer = artifacts.open_bundle(client, ref, found, whole=whole)
            stats = artifacts.Fetched()
            done = Unpacked()
            try:
                unpack(layer, dirs, read=artifacts.cached_reader(cache, stats), into=done)
            finally:        # what was written before a failure is counted too
                blob = layer.blob
                out.fetched_bytes = int(getattr(blob, "bytes", 0))
                out.requests = int(getattr(blob, "requests", 0))
                out.files, out.kept, out.bytes = done.files, done.kept, done.bytes
                out.chunks_cached, out.chunks_fetched = stats.chunks_cached, stats.chunks_fetched
        finally:
            if cache is not None:
                cache.close()
        out.status = "restored"
        out.reason = (f"{done.files} files ({done.bytes} bytes) from {found.digest[:19]}, "
                      f"{done.kept} already here")
    except Exception as exc:    # a cache may make a start faster, never make it fail
        out.status = "refused" if out.artifact else "miss"
        out.reason = f"{type(exc).__name__}: {exc}"
        log.warning("warm-up cache not restored (the app compiles): %s", out.reason)
    finally:
        out.seconds = time.monotonic() - t0
    return out


def _not_empty(path: Path) -> bool:
    try:
        with os.scandir(path) as it:
            return any(True for _ in it)
    except OSError:         # not there (yet): nothing to keep
        return False


@dataclass
class Verdict:
    verdict: str          # hit | partial | miss
    reason: str
    evidence: Evidence

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "reason": self.reason,
                "evidence": self.evidence.to_json()}


def verdict(restored: Restored | None, ev: Evidence, *, had_files: bool = False) -> Verdict:
    """hit: restored (or, with no restore asked, caches already there: ``had_files``) and no
    compile work since; partial: some compiled; miss: nothing restored, or as much compile work
    as the capturing start did (the cache was not used)."""
    work = f"{ev.compiled} compiles, {ev.graphs} new graph entries"
    if restored is None or restored.status != "restored":
        why = ("no restore asked" if restored is None
               else f"{restored.status}: {restored.reason}")
        if (had_files or (restored is not None and restored.files)) and \
                ev.compiled == 0 and ev.graphs == 0:
            return Verdict("hit", f"{why}; the caches here were enough: nothing compiled", ev)
        if had_files:
            return Verdict("partial", f"{why}; {work} beside the caches here", ev)
        return Verdict("miss", f"{why}; {work}", ev)
    if ev.compiled == 0 and ev.graphs == 0:
        return Verdict("hit", f"no compile after restoring {restored.files + restored.kept} "
                       "files", ev)
    at_capture = restored.compiles_at_capture
    if at_capture and ev.compiled >= at_capture:
        return Verdict("miss", f"{work}, as many as the capturing start did: the restored "
                       "entries were not used (the compilers' own key differs)", ev)
    return Verdict("partial", f"{work} after the restore", ev)


@dataclass
class Captured:
    artifact: str
    files: int
    bytes: int
    compressed_bytes: int
    key: WarmupKey
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"artifact": self.artifact, "files": self.files, "bytes": self.bytes,
                "compressed_bytes": self.compressed_bytes, "key": self.key.to_json(),
                "seconds": round(self.seconds, 4)}


def capture(client: RegistryClient, image: str | Reference, *, key: WarmupKey | None = None,
            dirs: Mapping[str, Path] | None = None, compiles: int = 0,
            max_bytes: int = 4 << 30) -> Captured:
    """Pack the caches in ``dirs`` and push them as ``image``'s artifact for ``key``."""
    t0 = time.monotonic()
    key = key or compute_key()
    dirs = dict(dirs) if dirs is not None else cache_dirs()
    ref = image if isinstance(image, Reference) else Reference.parse(image)
    with tempfile.TemporaryDirectory(prefix="coldstart-warmup-") as tmp:
        blob = Path(tmp) / "bundle"
        with open(blob, "wb") as f:
            packed = pack(dirs, f, max_bytes=max_bytes)
        if compiles <= 0:   # not told: what the caches hold is what that start compiled
            compiles = evidence({}, dirs).compiled
        if packed.files == 0:
            raise InvalidArgument("the compile caches are empty ("
                                  + ", ".join(f"{r}: {p}" for r, p in sorted(dirs.items()))
                                  + "): nothing to capture; did the app compile?")
        digest = artifacts.push(client, ref, key, packed, blob, dirs=dirs, compiles=compiles)
    return Captured(digest, packed.files, packed.bytes, packed.layer.size, key,
                    time.monotonic() - t0)


# -- wrapping an app --------------------------------------------------------------------------

class _NotifyRelay:
    """Our own sd_notify socket for the app: each datagram is passed on to ``upstream``; the
    first that says READY=1 first runs ``on_ready`` and carries what it returns."""

    def __init__(self, upstream: str | None, on_ready: Callable[[], list[str]]) -> None:
        self.upstream = upstream
        self.on_ready = on_ready
        self.ready = threading.Event()
        self._dir = tempfile.mkdtemp(prefix="coldstart-warmup-notify-")
        self.path = os.path.join(self._dir, "notify.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.path)
        os.chmod(self._dir, 0o711)      # the app may drop privileges: it must reach the socket
        os.chmod(self.path, 0o777)
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="warmup-notify", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(MAX_DATAGRAM)
            except TimeoutError:
                continue
            except OSError:
                return
            lines = data.decode("utf-8", errors="replace").split("\n")
            if parse_notice(data).ready and not self.ready.is_set():
                try:
                    lines += self.on_ready()
                except Exception:   # the relay must pass READY on whatever happens
                    log.exception("warm-up verdict failed")
                self.ready.set()
            self._send("\n".join(lines).encode())

    def _send(self, data: bytes) -> None:
        if not self.upstream:
            return
        addr = "\0" + self.upstream[1:] if self.upstream.startswith("@") else self.upstream
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.settimeout(1.0)
            with contextlib.suppress(OSError):
                s.sendto(data, addr)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()     # a verdict being judged (and its capture's start) finishes
        self._sock.setblocking(False)
        while True:             # what the app sent last (STOPPING=1 as it exits) goes on too
            try:
                data = self._sock.recv(MAX_DATAGRAM)
            except OSError:
                break
            self._send(data)
        self._sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.rmdir(self._dir)


@dataclass
class RunOptions:
    argv: Sequence[str]
    image: str | None                  # None: no restore, no capture (proof only)
    capture: bool = False              # capture after READY when the start was not a hit
    report: Path | None = None         # JSON written at READY (and at exit)
    chunk_cache: str | None = None
    model_version: str | None = None


def run_app(client: RegistryClient | None, opts: RunOptions,
            say: Callable[[str], None] = lambda s: None) -> int:
    """Run ``opts.argv`` with its warm-up cache restored first; its exit code (128 + N when a
    signal N ended it, as a shell says)."""
    if not opts.argv:
        raise InvalidArgument("say what to run after --")
    # a SIGTERM before the app runs (the restore) ends us at once, as it would the app; one
    # while it starts is passed on once it runs; one after it exited (a capture still being
    # pushed) ends us too
    child: list[subprocess.Popen[bytes]] = []
    state = {"starting": False, "done": False}
    pending: list[int] = []

    def on_signal(n: int, _frame: object) -> None:
        if child and not state["done"]:
            child[0].send_signal(n)
        elif state["starting"] and not state["done"]:
            pending.append(n)
        else:
            raise SystemExit(128 + n)

    previous = {s: signal.signal(s, on_signal)
                for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        return _run(client, opts, say, child, state, pending)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _run(client: RegistryClient | None, opts: RunOptions, say: Callable[[str], None],
         child: list[subprocess.Popen[bytes]], state: dict[str, bool],
         pending: list[int]) -> int:
    key = compute_key(opts.model_version)
    if key.components["torch"] == "none":
        say("torch is not installed for this Python (" + sys.executable + "): the key names "
            "no torch build; run coldstart with the app's own interpreter")
    dirs = cache_dirs()
    restored: Restored | None = None
    upstream = os.environ.get("NOTIFY_SOCKET") or None
    if opts.image and client is not None:
        if upstream:        # the restore is a phase of the start-up, as the app's are
            with contextlib.suppress(ColdstartError):
                notify(phase=RESTORE_PHASE, status="restoring the warm-up cache",
                       socket_path=upstream)
        restored = restore(client, opts.image, key=key, dirs=dirs, chunk_cache=opts.chunk_cache)
        say(f"warm-up cache: {restored.status}: {restored.reason} ({restored.seconds:.2f} s)")
    watched = watched_dirs()
    before = snapshot(watched)
    had_files = any(before[r] for r in dirs)
    report: dict[str, Any] = {"key": key.to_json(),
                              "restore": restored.to_json() if restored else None}
    lock = threading.Lock()
    judged: list[Verdict] = []
    captures: list[threading.Thread] = []

    def judge(at: str) -> Verdict:
        with lock:
            if not judged:
                v = verdict(restored, evidence(before, watched), had_files=had_files)
                judged.append(v)
                report.update(verdict=v.to_json(), judged_at=at)
                _write_report(opts.report, report)
                say(f"warm-up cache {v.verdict}: {v.reason}")
            return judged[0]

    def on_ready() -> list[str]:
        v = judge("ready")
        if opts.capture and v.verdict != "hit" and opts.image and client is not None:
            t = threading.Thread(target=_capture_after, name="warmup-capture", daemon=True,
                                 args=(client, opts, key, dirs, v, report, say))
            captures.append(t)
            t.start()
        return [f"{VERDICT_ENV}={v.verdict}"]

    relay = _NotifyRelay(upstream, on_ready)
    env = {**OFF_IN_CONTAINERS, **os.environ, "NOTIFY_SOCKET": relay.path}
    try:
        state["starting"] = True
        try:
            child.append(subprocess.Popen(list(opts.argv), env=env))
        except OSError as exc:
            raise InvalidArgument(f"cannot run {opts.argv[0]!r}: {exc}") from None
        for n in pending:           # signals that came while it started
            child[0].send_signal(n)
        code = child[0].wait()
        state["done"] = True
    finally:
        relay.close()
    judge("exit")
    for t in captures:      # a capture that began at READY finishes before we exit
        t.join()
    code = 128 - code if code < 0 else code
    report["exit_code"] = code
    _write_report(opts.report, report)
    return code


def _capture_after(client: RegistryClient, opts: RunOptions, key: WarmupKey,
                   dirs: Mapping[str, Path], v: Verdict, report: dict[str, Any],
                   say: Callable[[str], None]) -> None:
    assert opts.image is not None
    try:
        # (compiles=0: all the caches hold, not only what this start added)
        got = capture(client, opts.image, key=key, dirs=dirs, compiles=0)
        report["capture"] = got.to_json()
        _write_report(opts.report, report)     # before the line: a watcher may stop at it
        say(f"warm-up cache captured: {got.files} files, {got.compressed_bytes} bytes "
            f"compressed, artifact {got.artifact}")
    except Exception as exc:    # the app runs on; the bench waits for one of these lines
        report["capture"] = {"error": f"{type(exc).__name__}: {exc}"}
        _write_report(opts.report, report)
        say(f"warm-up cache not captured: {type(exc).__name__}: {exc}")


def _write_report(path: Path | None, doc: Mapping[str, Any]) -> None:
    if path is None:
        return
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as exc:      # the report is for whoever watches; the app runs on
        log.warning("cannot write the warm-up report %s: %s", path, exc)
