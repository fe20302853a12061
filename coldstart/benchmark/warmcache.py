"""The warm-cache modes of ``coldstart bench``: the app under ``coldstart warmup run``.

Before the runs, one start per warm-cache mode, on a fresh node, runs the app under
``coldstart warmup run --capture``: it restores the artifact matching the container's key if
the image has one (then nothing is pushed), else the app compiles and the caches are pushed
after READY. That is the artifact "made once beforehand", as the profile is; the key is the
container's own (its torch, its Python, this CPU), which the host cannot compute for it.
Each timed run then restores it before the app compiles, from the registry through the same
link as the image.

The floor it is put against is a warm start whose caches are already on the node: the same
artifact unpacked (verified) into a host directory once, bind-mounted where the app's cache
variables point.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from coldstart.benchmark.node import IO_MOUNT, WARMUP_REPORT, Node, Workload, cold_start
from coldstart.benchmark.ready import parse_ready
from coldstart.benchmark.results import Run
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient

__all__ = ["WarmPrep", "describe", "fresh_copies", "local_cache_mounts", "local_verdict",
           "prepare", "recording_mounts", "snapshot_mounts", "warm_command", "warm_workload"]

#: the log lines of `coldstart warmup run --capture` that end the preparing start
_PREP_DONE = r"log:coldstart warmup: warm-up cache (captured|not captured|hit)"


def warm_command(command: Sequence[str], ref: str, *, capture: bool = False) -> list[str]:
    """``command`` under ``coldstart warmup run``, restoring from ``ref``'s artifacts (the
    image's Python runs it: the image ships the coldstart package, as the built-in ``compile``
    image does)."""
    host = Reference.parse(ref).registry
    return ["python3", "-m", "coldstart.commands.warmup", "run", "--image", ref, "--insecure", host,
            "--report", f"{IO_MOUNT}/{WARMUP_REPORT}", *(["--capture"] if capture else []),
            "--", *command]


def warm_workload(work: Workload, ref: str, *, capture: bool = False) -> Workload:
    """``work`` for a warm-cache run of ``ref`` (the container reaches the loopback registry
    through the host's network)."""
    return replace(work, command=warm_command(work.command, ref, capture=capture),
                   host_network=True)


@dataclass
class WarmPrep:
    artifact: str | None          # the warm-up artifact the runs restore
    how: str                      # "captured" (this start compiled and pushed) or "found"
    run: Run
    error: str | None = None


def prepare(node: Node, ref: str, work: Workload, *, settle: float,
            on_phase: Callable[[str], None]) -> WarmPrep:
    """One start of ``ref`` on ``node`` under ``coldstart warmup run --capture``; the artifact
    the timed runs will restore (found, or captured by this start)."""
    prep = replace(warm_workload(work, ref, capture=True), ready=parse_ready(_PREP_DONE))
    run = cold_start(node, ref, prep, 2000, traffic=None, settle=settle, on_phase=on_phase)
    doc = run.warmup or {}
    captured = doc.get("capture") or {}
    restored = doc.get("restore") or {}
    if captured.get("artifact"):
        return WarmPrep(str(captured["artifact"]), "captured", run)
    if restored.get("status") == "restored" and restored.get("artifact"):
        return WarmPrep(str(restored["artifact"]), "found", run)
    why = (captured.get("error") or (run.error if not run.ok else None)
           or f"no artifact: restore said {restored.get('reason')!r}")
    return WarmPrep(None, "failed", run, error=str(why))


def local_cache_mounts(client: RegistryClient, ref: str, artifact: str, env: Sequence[str],
                       dst: Path) -> tuple[tuple[str, str], ...]:
    """Unpack ``artifact`` (of ``ref``) into ``dst/<role>`` and return the bind mounts that put
    each role's directory where the container's ``env`` (``KEY=VALUE`` lines) has it."""
    from coldstart.warmup import artifacts
    from coldstart.warmup.bundle import ROLES, cache_dirs, unpack

    image = Reference.parse(ref)
    found = artifacts.fetch(client, image, artifact)
    host = {role: dst / role for role in ROLES}
    unpack(artifacts.open_bundle(client, image, found, whole=True), host)
    inside = cache_dirs(_env_map(env))
    return tuple((str(host[r]), str(inside[r])) for r in sorted(host) if host[r].is_dir())


def recording_mounts(env: Sequence[str], dst: Path) -> tuple[tuple[str, str], ...]:
    """An empty host directory per cache role under ``dst``, bind-mounted where the
    container's ``env`` puts that cache: a first start fills them, a second finds them warm."""
    import shutil

    from coldstart.warmup.bundle import cache_dirs

    if dst.exists():
        shutil.rmtree(dst)
    inside = cache_dirs(_env_map(env))
    out = []
    for role in sorted(inside):
        (dst / role).mkdir(parents=True)
        out.append((str(dst / role), str(inside[role])))
    return tuple(out)


def _env_map(env: Sequence[str]) -> Mapping[str, str]:
    out: dict[str, str] = {"HOME": "/root", "USER": "root"}     # the container runs as root
    for line in env:
        k, sep, v = line.partition("=")
        if sep:
            out[k] = v
    return out


def describe(prep: WarmPrep) -> str:
    if prep.artifact is None:
        return f"no warm-up artifact: {prep.error}"
    took = f" ({prep.run.ready_s:.1f} s)" if prep.run.ready_s is not None else ""
    return f"warm-up artifact {prep.artifact[:19]}… {prep.how}{took}"


def fresh_copies(mounts: Sequence[tuple[str, str]], dst: Path) -> tuple[tuple[str, str], ...]:
    """A copy of each host directory of ``mounts`` under ``dst`` (one warm start's own: what
    an earlier one wrote is not in it), with the same container paths."""
    import shutil

    if dst.exists():
        shutil.rmtree(dst)
    out = []
    for host, inside in mounts:
        copy = dst / Path(host).name        # the role's name (local_cache_mounts names them)
        shutil.copytree(host, copy, symlinks=True)
        out.append((str(copy), inside))
    return tuple(out)


def local_verdict(before: Mapping[str, set[str]], mounts: Sequence[tuple[str, str]]
                  ) -> dict[str, object]:
    """What a warm start with the caches local compiled, read on the host side of its mounts
    (the same proof `coldstart warmup run` gives, for a start that ran without it)."""
    from coldstart.warmup.bundle import evidence
    from coldstart.warmup.runner import verdict

    return {"verdict": verdict(None, evidence(before, _roles(mounts)),
                               had_files=True).to_json()}


def snapshot_mounts(mounts: Sequence[tuple[str, str]]) -> dict[str, set[str]]:
    from coldstart.warmup.bundle import snapshot

    return snapshot(_roles(mounts))


def _roles(mounts: Sequence[tuple[str, str]]) -> dict[str, Path]:
    """Role → host directory of ``mounts`` (each host directory is named for its role)."""
    return {Path(host).name: Path(host) for host, _ in mounts}
