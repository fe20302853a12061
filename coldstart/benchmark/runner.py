"""``coldstart bench``: the whole cold start of an image, to READY, in each mode, side by side.

:func:`run_bench` prepares the image once (built-in images are built and cached; an OCI layout
or a built-in image is served by a local registry whose storage is cached beside the images, so
conversions are reused), converts it for each mode (zstd:chunked with ``coldstart convert``,
eStargz with ``ctr-remote``), optionally puts a shaping proxy in front of the registry, then
runs ``runs`` cold starts per mode, the modes alternated (each round starts one mode later),
each on a fresh :class:`~coldstart.benchmark.node.Node` with the page cache dropped. Modes that
cannot run here (stargz without Go) are skipped with the reason. The floor takes its turn in
each round like a mode: a fresh node pulls the image in full (not timed), then the warm start
(image already unpacked, page cache dropped) is timed; the floor is the median warm start plus
the bytes the lazy start-up fetched sent at the link's rate. Measured in the same rounds as the
modes, the floor drifts with the host as they do.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from coldstart.benchmark import SETTLE_S, warmcache
from coldstart.benchmark.node import (
    MODES,
    ModeSpec,
    Node,
    Traffic,
    Workload,
    cold_start,
    drop_caches,
    existing_node,
    start_node,
)
from coldstart.benchmark.ready import parse_ready
from coldstart.benchmark.results import (
    BenchResult,
    Floor,
    Limit,
    ModeResult,
    Run,
    phase_medians,
)
from coldstart.benchmark.shaping import Link
from coldstart.benchmark.warmcache import WarmPrep, warm_workload
from coldstart.errors import ColdstartError, FailedPrecondition, InvalidArgument, NotFound
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from coldstart.prefetch.ranges import CUT_ALIGN, CUT_GAP, OVERFETCH
from coldstart.stack.registry import push_layout

__all__ = ["BenchOptions", "Reporter", "Silent", "check_modes", "parse_modes", "run_bench"]

DEFAULT_MODES = ("overlayfs", "coldstart", "stargz")


class Reporter(Protocol):
    """What the runner tells the user as it goes; the CLI draws it."""

    def stage(self, text: str) -> None:
        """A setup step (building, pushing, converting, skipping a mode)."""

    def phase(self, mode: str, index: int, phase: str) -> None:
        """Run ``index`` of ``mode`` entered ``phase``."""

    def run_done(self, run: Run, done: int, total: int) -> None:
        """A run finished (successfully or not)."""


class Silent:
    """A :class:`Reporter` that says nothing."""

    def stage(self, text: str) -> None:
        pass

    def phase(self, mode: str, index: int, phase: str) -> None:
        pass

    def run_done(self, run: Run, done: int, total: int) -> None:
        pass


@dataclass
class BenchOptions:
    ref: str
    modes: Sequence[str] = DEFAULT_MODES
    runs: int = 5
    ready: str | None = None               # default: the built-in image's, else "exit"
    command: Sequence[str] = ()            # default: the built-in image's, else the image's own
    env: Sequence[str] = ()
    link: Link | None = None
    address: str | None = None             # an existing containerd instead of embedded ones
    workdir: Path | None = None
    cache_dir: Path | None = None
    images: dict[str, str] = field(default_factory=dict)   # mode -> ref override
    insecure: Sequence[str] = ()
    timeout: float = 900.0
    settle: float = SETTLE_S
    heat: int = 0                          # bytes written and freed after each rest (hot)
    floor: bool = True
    # the verified-bytes limit of the image's checkpoint, once per round (images with a
    # *.safetensors file, benched in a zstd:chunked mode)
    limit: bool = True
    prepare_only: bool = False             # build, push and convert; no runs
    estargz_level: int | None = None       # ctr-remote's gzip level (None: its default, 9)


def parse_modes(text: str | Sequence[str]) -> list[str]:
    """``overlayfs,coldstart`` -> the modes, checked (order kept, duplicates dropped)."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[str] = []
    for raw in items:
        name = raw.strip()
        if not name:
            continue
        if name not in MODES:
            users = ", ".join(n for n, m in MODES.items() if not m.ablation)
            raise InvalidArgument(f"unknown mode {name!r}; modes: {users}")
        if name not in out:
            out.append(name)
    if not out:
        raise InvalidArgument("--mode needs at least one mode")
    return out


def check_modes(names: Sequence[str], images: Mapping[str, str]) -> None:
    """InvalidArgument for modes that cannot run together as given: the grid ablation writes
    the profile that coldstart+profile records in the same run (not one named by --image)."""
    formats = {MODES[n].image_format for n in names if n not in images}
    if "zstd:chunked-profile-grid" in formats and "zstd:chunked-profile" not in formats:
        raise InvalidArgument("mode coldstart+profile-grid writes the profile that "
                              "coldstart+profile records: bench both in one run (and "
                              "without --image for coldstart+profile)")


# -- the image ---------------------------------------------------------------------------------

@dataclass
class Prepared:
    """The image, ready in every format the modes need."""

    display: str
    refs: dict[str, str]               # mode -> reference (on the registry, not the proxy)
    sizes: dict[str, int]              # mode -> compressed bytes of its layers
    command: list[str]
    env: list[str]
    ready: str
    info: dict[str, Any]


def _layers_size(client: RegistryClient, ref: str) -> int:
    return sum(d.size for d in client.resolve(Reference.parse(ref)).manifest.layers)


class _Conversions:
    """Which conversions the cached registry already holds (source digest + format ->
    destination digest), so a second bench of the same image converts nothing."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.done: dict[str, str] = {}
        if path is not None and path.exists():
            with contextlib.suppress(ValueError, OSError):
                self.done = json.loads(path.read_text())

    def get(self, client: RegistryClient, key: str, dst: str) -> bool:
        want = self.done.get(key)
        if want is None:
            return False
        try:
            return client.resolve(Reference.parse(dst)).digest == want
        except NotFound:
            return False

    def put(self, client: RegistryClient, key: str, dst: str) -> None:
        self.done[key] = client.resolve(Reference.parse(dst)).digest
        if self.path is not None:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.done, indent=1))
            tmp.replace(self.path)


def _prepare(opts: BenchOptions, modes: list[ModeSpec], stack: contextlib.ExitStack,
             report: Reporter, skipped: dict[str, str], work: Path
             ) -> tuple[Prepared, Callable[[], tuple[int, int]] | None]:
    """Build/push/convert what the modes need; returns the image and the registry's traffic
    counter (None when the registry is not ours)."""
    from coldstart.oci.convert import convert_image

    ref = opts.ref
    command, env, ready = list(opts.command), list(opts.env), opts.ready
    info: dict[str, Any] = {"ref": ref}
    layout: Path | None = None
    tag = "latest"
    if ref.startswith("builtin:"):
        from coldstart.benchmark import images

        name = ref.removeprefix("builtin:")
        img = images.load_image(name, opts.cache_dir)
        if img is None:
            report.stage(f"building the built-in image {name!r} (once; cached)")
            img = images.build_image(name, opts.cache_dir, progress=report.stage)
        layout = img.layout
        command = command or list(img.command)
        env = [*img.env, *env]
        ready = ready or img.ready
        info.update(name=name, uncompressed_bytes=img.uncompressed_bytes,
                    description=img.description)
        repo = f"bench/{name}"
    elif ref.startswith("oci:"):
        from coldstart.oci.layout import parse_layout_spec

        layout, given = parse_layout_spec(ref)
        tag = given or "latest"
        repo = "bench/" + (layout.name.lower() or "image")
    ready = ready or "exit"
    parse_ready(ready)
    traffic: Callable[[], tuple[int, int]] | None = None
    conv: _Conversions
    if layout is not None:
        from coldstart.stack.registry import AccessLog, start_registry

        if opts.cache_dir is None:
            from coldstart.benchmark.images import default_cache_dir

            opts.cache_dir = default_cache_dir()
        cache = opts.cache_dir / "registry"
        cache.mkdir(parents=True, exist_ok=True)
        log = cache / "registry.log"
        if log.exists() and log.stat().st_size > 64 << 20:   # its storage is kept, not its log
            log.unlink()
        reg = stack.enter_context(start_registry(cache, log_level="error"))
        storage = reg.root
        served = AccessLog(reg.access_log)

        def traffic() -> tuple[int, int]:
            reqs = served.requests()
            return sum(r.bytes for r in reqs), len(reqs)

        base = f"{reg.host}/{repo}"
        conv = _Conversions(cache / "conversions.json")
        src = f"oci:{layout}:{tag}"
        gzip_ref = f"{base}:gzip"
    else:
        parsed = Reference.parse(ref)
        base = f"{parsed.registry}/{parsed.repository}"
        suffix = parsed.tag or "latest"
        conv = _Conversions(None)
        src = gzip_ref = ref
        storage = None
    insecure = [Reference.parse(gzip_ref).registry, *opts.insecure]
    client = stack.enter_context(RegistryClient(insecure_hosts=insecure))
    refs: dict[str, str] = {}
    sizes: dict[str, int] = {}
    kept = (opts.cache_dir or work) / "profiles"
    # the grid ablation is written from the profile the profiled image recorded: after it
    for mode in sorted(modes, key=lambda m: m.image_format == "zstd:chunked-profile-grid"):
        if mode.name in opts.images:
            refs[mode.name] = opts.images[mode.name]
            continue
        fmt = mode.image_format
        if fmt == "gzip":
            if layout is not None:
                report.stage(f"pushing {ref} to the local registry as {gzip_ref}")
                push_layout(layout, tag, gzip_ref, client, storage=storage)
            refs[mode.name] = gzip_ref
            continue
        dst = (f"{base}:{fmt.replace(':', '-')}" if layout is not None
               else f"{base}:{suffix}-{fmt.replace(':', '-')}")
        key = f"{src if layout is None else _layout_digest(layout, tag)} {fmt}"
        saved = kept / (f"{Reference.parse(dst).repository.replace('/', '-')}"
                        f"{'-warmcache' if fmt == WARM_PROFILE else ''}.json")
        # the warm-cache profile is recorded with the app under `coldstart warmup run`, so
        # that the wrapper's own start-up is in it too
        recorded = (warmcache.warm_command(command, gzip_ref) if fmt == WARM_PROFILE
                    else command)
        if fmt in ("estargz-optimized", *PROFILED):
            # what the optimizer ran decides what it recorded (the registry's port, which
            # changes from run to run, left out)
            key += " " + json.dumps([command if fmt != WARM_PROFILE else
                                     warmcache.warm_command(command, "registry/image"), env])
        if fmt in PROFILED:
            key += f" cuts={CUT_GAP}/{CUT_ALIGN}"    # how its files' chunks are cut
        if fmt == WARM_PROFILE:
            key += " caches=warm"       # recorded from a start whose caches were warm
        if fmt.startswith("zstd:chunked-profile"):
            key += f" overfetch={OVERFETCH}"           # what its prefetch ranges hold
        if fmt == "zstd:chunked-profile-grid":
            # (check_modes: coldstart+profile is prepared in this run, before this one)
            key += " " + hashlib.sha256(saved.read_bytes()).hexdigest()
        if fmt.startswith("estargz") and opts.estargz_level is not None:
            key += f" level={opts.estargz_level}"
            dst += f"-l{opts.estargz_level}"
        if conv.get(client, key, dst) and (fmt not in PROFILED or saved.exists()):
            refs[mode.name] = dst
            continue
        if fmt == "zstd:chunked":
            report.stage(f"converting to zstd:chunked: {dst}")
            convert_image(src, dst, format="zstd:chunked", client=client, workdir=work)
        elif fmt == "zstd:chunked-profile-grid":
            from coldstart.prefetch.profile import load_profile

            report.stage(f"writing {saved} first, in fixed-size chunks only: {dst}")
            convert_image(src, dst, format="zstd:chunked", client=client, workdir=work,
                          profile=load_profile(saved), cut_chunks=False)
        elif fmt in PROFILED:
            from coldstart.benchmark.optimize import (
                OptimizeOptions,
                optimize_image,
                record_profile,
            )

            mounts: tuple[tuple[str, str], ...] = ()
            if fmt == WARM_PROFILE:
                # what a start with its caches restored reads (the wrapper, tracing, loading
                # the kernels), not what a compiling one does (g++, headers): the caches are
                # filled by a first start on the recording node, and the recorded one finds
                # them (the recording container has no network to restore from)
                filled = work / "warm-profile-caches"
                mounts = warmcache.recording_mounts(env, filled)
                report.stage("filling the compile caches for the warm-cache recording "
                             "(coldstart optimize's node, the same command, not recorded)")
                record_profile(src, OptimizeOptions(
                    command=recorded, env=env, ready=ready, timeout=opts.timeout,
                    insecure=tuple(insecure), workdir=work, mounts=mounts),
                    progress=report.stage)
                if not any(p.is_file() for p in filled.rglob("*")):
                    report.stage("warning: the first start left the compile caches empty: "
                                 "the warm-cache profile is that of a compiling start")
            report.stage(f"recording the start-up and writing it first (coldstart optimize): "
                         f"{dst}")
            result = optimize_image(src, dst, OptimizeOptions(
                command=recorded, env=env, ready=ready, timeout=opts.timeout,
                insecure=tuple(insecure), workdir=work, mounts=mounts), progress=report.stage)
            kept.mkdir(parents=True, exist_ok=True)
            saved.write_text(result.profile.dumps())
            report.stage(f"profile: {saved} ({result.profile.files} files)")
            for w in result.warnings:
                report.stage(f"coldstart optimize: warning: {w}")
        else:
            from coldstart.stack.stargz import make_estargz_images, stargz_missing

            why = stargz_missing()
            if why:
                skipped[mode.name] = why
                continue
            if layout is not None:
                push_layout(layout, tag, gzip_ref, client, storage=storage)
            report.stage(f"converting with ctr-remote ({fmt}): {dst}")
            optimized = fmt == "estargz-optimized"
            make_estargz_images(gzip_ref, None if optimized else dst, dst if optimized else None,
                                command or [], work / "ctr-remote", env=env,
                                compression_level=opts.estargz_level)
        conv.put(client, key, dst)
        refs[mode.name] = dst
    for mode_name, r in refs.items():
        sizes[mode_name] = _layers_size(client, r)
    return Prepared(display=ref, refs=refs, sizes=sizes, command=command, env=env,
                    ready=ready, info=info), traffic


#: the formats `coldstart optimize` records a profile for: the plain one, and the one recorded
#: under `coldstart warmup run` (coldstart+profile+warmcache)
WARM_PROFILE = "zstd:chunked-profile-warmcache"
PROFILED = ("zstd:chunked-profile", WARM_PROFILE)


def _layout_digest(layout: Path, tag: str) -> str:
    from coldstart.oci.layout import OciLayout

    return OciLayout(layout).resolve(tag).digest


def _via(ref: str, host: str | None) -> str:
    """``ref`` with its registry replaced by ``host`` (the shaping proxy)."""
    if host is None:
        return ref
    parsed = Reference.parse(ref)
    rest = str(parsed).removeprefix(parsed.registry)
    return host + rest


# -- the runs ----------------------------------------------------------------------------------

def run_bench(opts: BenchOptions, report: Reporter | None = None) -> BenchResult:
    """Run the benchmark; everything it started is stopped, and its temp files removed, when it
    returns or raises (Ctrl-C included)."""
    from coldstart.benchmark.node import require_root
    from coldstart.stack.snapshotter import missing_tools

    report = report or Silent()
    if opts.runs < 1:
        raise InvalidArgument("--runs must be >= 1")
    if not opts.command and not opts.ref.startswith("builtin:"):
        raise InvalidArgument("say what to start: --command (the image's own entrypoint is "
                              "not read yet) or use a built-in image")
    require_root()
    missing = [] if opts.address else missing_tools()
    if missing:
        raise FailedPrecondition(f"cannot run containerd here: missing {', '.join(missing)}")
    names = parse_modes(opts.modes)
    check_modes(names, opts.images)
    specs = [MODES[m] for m in names]
    started_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    with contextlib.ExitStack() as stack:
        work = _workdir(opts, stack)
        skipped: dict[str, str] = {}
        stargz_binary = None if opts.address else _stargz_binary(specs, skipped, report)
        if opts.address:
            report.stage(f"using containerd at {opts.address} (namespace coldstart-bench): "
                         "images are removed between runs, but the snapshotters' chunk "
                         "caches are not cleared; --embedded measures a truly cold node")
        prepared, traffic = _prepare(opts, [s for s in specs if s.name not in skipped],
                                     stack, report, skipped, work)
        cond = parse_ready(prepared.ready)
        proxy_host = None
        if opts.link is not None:
            from coldstart.benchmark.shaping import shaping_proxy

            hosts = {Reference.parse(r).registry for r in prepared.refs.values()}
            if len(hosts) != 1 or not next(iter(hosts)).startswith(("127.", "localhost")):
                raise InvalidArgument(
                    f"--link shapes a plain-HTTP registry on this machine (an oci: layout or a "
                    f"built-in image); these images are on {', '.join(sorted(hosts))}")
            upstream = next(iter(hosts))
            proxy = stack.enter_context(shaping_proxy(upstream, opts.link))
            proxy_host = proxy.host
            if traffic is None:
                def traffic() -> tuple[int, int]:
                    return proxy.bytes_down, proxy.connections
        result = BenchResult(
            image={**prepared.info, "formats": {m: {"ref": r, "compressed_bytes":
                                                    prepared.sizes.get(m)}
                                                for m, r in prepared.refs.items()}},
            node=("embedded" if opts.address is None else f"address:{opts.address}"),
            ready=str(cond), link=(None if opts.link is None else
                                   {"text": str(opts.link),
                                    "rate_bps": (None if opts.link.unlimited
                                                 else opts.link.rate_bps),
                                    "rtt_s": opts.link.rtt_s}),
            runs_per_mode=opts.runs, machine=_machine(), started_at=started_at)
        for spec in specs:
            result.modes[spec.name] = ModeResult(
                spec.name, image_ref=prepared.refs.get(spec.name),
                compressed_bytes=prepared.sizes.get(spec.name))
            if spec.name in skipped:
                result.modes[spec.name].status = "skipped"
                result.modes[spec.name].reason = skipped[spec.name]
                report.stage(f"skipping {spec.name}: {skipped[spec.name]}")
        active = [] if opts.prepare_only else [s for s in specs if s.name not in skipped]
        workload = Workload(prepared.command, prepared.env, cond, opts.timeout)
        # the registry itself, not the shaping proxy: the floor's pull is not timed (its
        # bytes at the link's rate are the floor's link term)
        floor_ref = (prepared.refs["overlayfs"]
                     if opts.floor and "overlayfs" in prepared.refs and active else None)
        if opts.floor and active and floor_ref is None:
            # said, not left for the table to show by omission
            report.stage("no floor: its warm starts pull the image mode overlayfs pulls; "
                         "add overlayfs to --mode for a floor (or --no-floor to silence this)")
        insecure = tuple({Reference.parse(r).registry for r in prepared.refs.values()}
                         | ({proxy_host} if proxy_host else set()) | set(opts.insecure))
        checkpoint = (_checkpoint(opts, active, prepared.refs, proxy_host, insecure, report)
                      if opts.limit and active else None)
        # the floor's warm starts (None) and the limit (LIMIT) take a turn in each round,
        # alternated with the modes
        preps = _warm_preps(opts, active, prepared.refs, workload, work / "n", insecure,
                            stargz_binary, result, report)
        active = [s for s in active if not s.warm_cache or preps[s.name].artifact]
        snaps = _snapshot_preps(opts, active, prepared.refs, workload, work / "n", insecure,
                                stargz_binary, result, report)
        active = [s for s in active if not s.snapshot or s.name in snaps]
        cache_mounts = (_local_cache(opts, preps, prepared, insecure, work, report)
                        if floor_ref else None)
        turns: list[ModeSpec | str | None] = [*active, *([None] if floor_ref else []),
                                              *([FLOOR_CACHE] if cache_mounts else []),
                                              *([LIMIT] if checkpoint else [])]
        total, done = len(turns) * opts.runs, 0
        warm: list[Run] = []
        warm_cached: list[Run] = []
        rates: list[float] = []
        for i in range(opts.runs):
            order = turns[i % len(turns):] + turns[:i % len(turns)] if turns else []
            for turn in order:
                if turn == LIMIT:
                    assert checkpoint is not None
                    done += 1
                    rate = _limit_run(opts, checkpoint, i, f"[{done}/{total}]", report)
                    if rate is not None:
                        rates.append(rate)
                    continue
                if turn is None:
                    assert floor_ref is not None
                    run = _warm_start(opts, floor_ref, workload, i, work / "n", insecure, report)
                    warm.append(run)
                elif turn == FLOOR_CACHE:
                    assert floor_ref is not None and cache_mounts
                    # each warm start its own copy of the caches, its compile work proven
                    mounts = warmcache.fresh_copies(cache_mounts, work / "floor-cache")
                    before = warmcache.snapshot_mounts(mounts)
                    run = _warm_start(opts, floor_ref, replace(
                        workload, mounts=(*workload.mounts, *mounts)), i, work / "n",
                        insecure, report, name=FLOOR_CACHE)
                    if run.ok:
                        run.warmup = warmcache.local_verdict(before, mounts)
                    warm_cached.append(run)
                else:
                    assert isinstance(turn, ModeSpec)
                    run = _mode_run(opts, turn, _via(prepared.refs[turn.name], proxy_host),
                                    workload, i, work / "n", insecure, stargz_binary, traffic,
                                    report)
                    result.modes[turn.name].runs.append(run)
                done += 1
                report.run_done(run, done, total)
        for m in result.modes.values():
            if m.status == "ok" and m.runs and not m.ok_runs():
                m.status, m.reason = "failed", m.runs[-1].error
        if floor_ref is not None:
            result.floor = _floor(opts, warm, result, report)
        if warm_cached:     # what each warm start with the caches local compiled, if any
            result.image.setdefault("warmup", {})[FLOOR_CACHE] = {"runs": [
                {"ok": r.ok, "ready_s": r.ready_s, "error": r.error,
                 "verdict": (r.warmup or {}).get("verdict")} for r in warm_cached]}
        cached = [r.ready_s for r in warm_cached if r.ok and r.ready_s is not None]
        if cached:
            med = statistics.median(cached)
            result.floor_cache = Floor(warm_start_s=med, startup_bytes=None, link_s=0.0,
                                       total_s=med, warm_runs_s=cached,
                                       phases_s=phase_medians(warm_cached))
        if checkpoint is not None and rates:
            result.limit = Limit(file=checkpoint[2], bytes=checkpoint[3],
                                 gbps=statistics.median(rates), runs_gbps=rates)
        return result


LIMIT = "limit"     # the verified-bytes limit's turn in a round (progress lines say so too)
#: fetch threads of the limit's measurement (what the FUSE server's pool has: 8 by default)
LIMIT_THREADS = 8

Checkpoint = tuple[Any, Any, str, int]   # (blob, layer, file name, bytes), limits.largest_weights


def _checkpoint(opts: BenchOptions, active: Sequence[ModeSpec], refs: Mapping[str, str],
                proxy_host: str | None, insecure: tuple[str, ...],
                report: Reporter) -> Checkpoint | None:
    """The image's checkpoint (its largest ``*.safetensors`` file) in the zstd:chunked copy
    the coldstart modes pull, read through the link's proxy as theirs are; None when no such
    mode runs or the image holds none."""
    from coldstart.benchmark.limits import largest_weights

    ref = next((refs[s.name] for s in active if s.image_format == "zstd:chunked"
                and s.name in refs), None)
    if ref is None:
        return None
    client = RegistryClient(insecure_hosts=list(insecure))
    try:
        found = largest_weights(client, Reference.parse(_via(ref, proxy_host)))
    except ColdstartError as exc:
        client.close()
        report.stage(f"no verified-bytes limit: {exc}")
        return None
    if found is None:
        client.close()
        return None
    blob, layer, name = found
    size = layer.resolve(name).size
    report.stage(f"verified-bytes limit: {name} ({size / 1e9:.2f} GB), once per round")
    return blob, layer, name, size       # (the client lives as long as the bench process)


def _limit_run(opts: BenchOptions, checkpoint: Checkpoint, index: int, count: str,
               report: Reporter) -> float | None:
    """One measurement of the verified-bytes limit (:func:`~coldstart.benchmark.limits
    .verified_bytes`), after the page-cache drop and rest every run gets: GB/s, or None when
    it failed (reported)."""
    from coldstart.benchmark.limits import image_limit

    blob, layer, name, _ = checkpoint
    try:
        drop_caches(opts.settle, opts.heat)
        n, secs = image_limit((blob, layer, name), LIMIT_THREADS)
    except (ColdstartError, OSError) as exc:
        report.stage(f"{count} {LIMIT} run {index + 1} failed: {exc}")
        return None
    rate = n / max(secs, 1e-9) / 1e9
    report.stage(f"{count} {LIMIT} run {index + 1}: {n / 1e9:.2f} GB verified in {secs:.2f} s "
                 f"({rate:.3f} GB/s)")
    return rate


def _node(opts: BenchOptions, spec: ModeSpec, base: Path, ref: str, insecure: tuple[str, ...],
          stargz_binary: Path | None) -> contextlib.AbstractContextManager[Node]:
    if opts.address is not None:
        return existing_node(spec, base, opts.address, ref, insecure=insecure)
    return start_node(spec, base, insecure=insecure, stargz_binary=stargz_binary)


def _workdir(opts: BenchOptions, stack: contextlib.ExitStack) -> Path:
    if opts.workdir is not None:
        opts.workdir.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix="cs-b-", dir=opts.workdir))
    else:
        path = Path(tempfile.mkdtemp(prefix="cs-b-", dir="/tmp"))
    stack.callback(shutil.rmtree, path, True)
    return path


def _stargz_binary(specs: list[ModeSpec], skipped: dict[str, str],
                   report: Reporter) -> Path | None:
    wants = [s for s in specs if s.snapshotter == "stargz"]
    if not wants:
        return None
    from coldstart.errors import ColdstartError
    from coldstart.stack.stargz import build_stargz_daemon, stargz_missing

    why = stargz_missing()
    if why is None:
        try:
            report.stage("building the stargz-snapshotter peer (once; cached)")
            return build_stargz_daemon()
        except ColdstartError as exc:
            why = f"the stargz peer did not build: {exc}"
    for s in wants:
        skipped[s.name] = why
    return None


def _mode_run(opts: BenchOptions, spec: ModeSpec, ref: str, workload: Workload, index: int,
              base: Path, insecure: tuple[str, ...], stargz_binary: Path | None,
              traffic: Traffic | None, report: Reporter) -> Run:
    """One cold start of ``spec`` on a node of its own (a node that does not start is a
    failed run)."""
    if spec.warm_cache:
        workload = warm_workload(workload, ref)
    try:
        with _node(opts, spec, base, ref, insecure, stargz_binary) as node:
            return cold_start(node, ref, workload, index, traffic=traffic, settle=opts.settle,
                              heat=opts.heat,
                              on_phase=functools.partial(report.phase, spec.name, index))
    except ColdstartError as exc:   # the node did not start: this run failed
        return Run(spec.name, index, ok=False, error=f"the node did not start: {exc}")


FLOOR = "floor"     # the name the floor's warm starts go by in progress lines
#: the warm starts with the compile caches local (a warm-cache mode's own floor)
FLOOR_CACHE = "floor+cache"


def _warm_preps(opts: BenchOptions, active: Sequence[ModeSpec], refs: Mapping[str, str],
                workload: Workload, base: Path, insecure: tuple[str, ...],
                stargz_binary: Path | None, result: BenchResult,
                report: Reporter) -> dict[str, WarmPrep]:
    """For each warm-cache mode, its artifact: found, or captured by one untimed start (see
    :mod:`coldstart.benchmark.warmcache`); a mode without one fails with the reason."""
    out: dict[str, WarmPrep] = {}
    for spec in active:
        if not spec.warm_cache:
            continue
        report.stage(f"{spec.name}: its warm-up artifact (one untimed start under coldstart "
                     "warmup run --capture; it compiles unless the artifact exists)")
        ref = refs[spec.name]
        try:
            with _node(opts, spec, base, ref, insecure, stargz_binary) as node:
                prep = warmcache.prepare(node, ref, workload, settle=opts.settle,
                                         on_phase=functools.partial(report.phase, spec.name,
                                                                    -1))
        except Exception as exc:    # this mode fails, with the reason; the others run
            prep = WarmPrep(None, "failed", Run(spec.name, -1, ok=False, error=str(exc)),
                            error=f"the node did not start: {type(exc).__name__}: {exc}")
        out[spec.name] = prep
        report.stage(f"{spec.name}: {warmcache.describe(prep)}")
        result.image.setdefault("warmup", {})[spec.name] = {
            "artifact": prep.artifact, "how": prep.how, "error": prep.error,
            "prepare_s": prep.run.ready_s, "report": prep.run.warmup}
        if prep.artifact is None:
            m = result.modes[spec.name]
            m.status, m.reason = "failed", f"no warm-up artifact: {prep.error}"
    return out


def _snapshot_preps(opts: BenchOptions, active: Sequence[ModeSpec], refs: Mapping[str, str],
                    workload: Workload, base: Path, insecure: tuple[str, ...],
                    stargz_binary: Path | None, result: BenchResult,
                    report: Reporter) -> dict[str, str]:
    """For each snapshot mode, its snapshot: one untimed start of the mode's image on a node
    of its own (plain runc), checkpointed once ready and pushed to the image's repository
    (:func:`coldstart.snapshot.create.checkpoint`). A mode without one fails with the
    reason; the others run."""
    out: dict[str, str] = {}
    for spec in active:
        if not spec.snapshot:
            continue
        m = result.modes[spec.name]
        if workload.ready.kind == "exit":
            m.status, m.reason = "failed", ("READY is the command's exit here: a start-up "
                                            "that exits leaves no ready process to snapshot")
            continue
        report.stage(f"{spec.name}: its snapshot (one untimed start, checkpointed at READY "
                     "and pushed)")
        ref = refs[spec.name]
        info: dict[str, Any] = {}

        def take(node: Node, cid: str, ref: str = ref, info: dict[str, Any] = info) -> None:
            from coldstart.snapshot.create import checkpoint, push
            from coldstart.snapshot.criu import find_criu

            criu = find_criu(check=True)
            if not criu.usable:
                raise FailedPrecondition("; ".join(criu.problems))
            with RegistryClient(insecure_hosts=list(insecure), timeout=60) as client:
                ckpt = checkpoint(node.ctd.address, node.ctd.namespace, cid, client,
                                  node.base / "snapshot", criu_version=criu.version,
                                  image=ref)
                t = time.monotonic()
                pushed = push(client, ckpt, image=ref)
                info.update(pushed.to_json())
                info["seconds"] = {**{k: round(v, 3) for k, v in ckpt.seconds.items()},
                                   "push": round(time.monotonic() - t, 3)}

        try:
            with _node(opts, replace(spec, snapshot=False), base, ref, insecure,
                       stargz_binary) as node:
                # a container name apart from the runs' (runc's state is per host)
                run = cold_start(node, ref, workload, 2000, traffic=None, settle=opts.settle,
                                 on_phase=functools.partial(report.phase, spec.name, -1),
                                 after_ready=take)
        except Exception as exc:
            run = Run(spec.name, -1, ok=False, error=f"the node did not start: {exc}")
        result.image.setdefault("snapshot", {})[spec.name] = {
            **info, "prepare_ready_s": run.ready_s, "error": run.error}
        if run.ok and info.get("digest"):
            out[spec.name] = str(info["digest"])
            report.stage(f"{spec.name}: snapshot {str(info['digest'])[:19]}…: "
                         f"{int(info.get('pages_bytes', 0)) / 1e6:.1f} MB of pages, "
                         f"{int(info.get('rootfs_bytes', 0)) / 1e6:.1f} MB of rootfs changes, "
                         f"{int(info.get('blob_bytes', 0)) / 1e6:.1f} MB stored")
        else:
            m.status, m.reason = "failed", f"no snapshot: {run.error}"
    return out


def _local_cache(opts: BenchOptions, preps: Mapping[str, WarmPrep], prepared: Prepared,
                 insecure: tuple[str, ...], work: Path,
                 report: Reporter) -> tuple[tuple[str, str], ...] | None:
    """Bind mounts that put a warm-up artifact's caches where the app looks, on the node
    (for the floor with the caches local); None without an artifact."""
    for name, prep in preps.items():
        if prep.artifact is None:
            continue
        report.stage(f"{FLOOR_CACHE}: unpacking {prep.artifact[:19]}… onto the node (once)")
        with RegistryClient(insecure_hosts=list(insecure), timeout=60) as client:
            try:
                return warmcache.local_cache_mounts(client, prepared.refs[name], prep.artifact,
                                                    prepared.env, work / "local-cache")
            except Exception as exc:    # no floor+cache; the modes still run
                report.stage(f"{FLOOR_CACHE}: skipped: {type(exc).__name__}: {exc}")
                return None
    return None


def _warm_start(opts: BenchOptions, ref: str, workload: Workload, index: int, base: Path,
                insecure: tuple[str, ...], report: Reporter, *, name: str = FLOOR) -> Run:
    """One warm start of the floor: a fresh node pulls ``ref`` in full (not timed), then the
    container is created and started from the unpacked image with the page cache dropped."""
    try:
        with _node(opts, MODES["overlayfs"], base, ref, insecure, None) as node:
            report.phase(name, index, "pull (not timed)")
            node.pull(ref, timeout=opts.timeout)
            # a container name apart from the modes' (runc's state is per host)
            run = cold_start(node, ref, workload, 1000 + index, traffic=None,
                             settle=opts.settle, heat=opts.heat, prepared=True,
                             on_phase=functools.partial(report.phase, name, index))
    except Exception as exc:   # the node did not start or the pull failed (or timed out)
        run = Run(name, index, ok=False, error=f"the floor's node did not get ready: {exc}")
    run.mode, run.index = name, index
    return run


def _floor(opts: BenchOptions, warm_runs: list[Run], result: BenchResult,
           report: Reporter) -> Floor | None:
    """The floor from its warm starts (median) and the bytes term (None: none succeeded)."""
    warm = [r.ready_s for r in warm_runs if r.ok and r.ready_s is not None]
    if not warm:
        why = warm_runs[-1].error if warm_runs else "none ran"
        report.stage(f"no floor: no warm start succeeded ({why})")
        return None
    lazy = result.modes.get("coldstart")
    startup: int | None = None
    if lazy is not None and lazy.ok_runs():
        got = [r.registry_bytes for r in lazy.ok_runs() if r.registry_bytes is not None]
        startup = int(statistics.median(got)) if got else None
    link_s = (startup * 8 / opts.link.rate_bps
              if startup is not None and opts.link is not None and not opts.link.unlimited
              else 0.0)
    warm_s = statistics.median(warm)
    return Floor(warm_start_s=warm_s, startup_bytes=startup, link_s=link_s,
                 phases_s=phase_medians(warm_runs),
                 total_s=warm_s + link_s, warm_runs_s=warm)


def _machine() -> dict[str, Any]:
    total = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
    return {"cpus": os.cpu_count(), "kernel": os.uname().release, "memory_bytes": total,
            "hostname": os.uname().nodename}
