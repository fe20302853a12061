"""What ``coldstart bench`` measured: runs, their phases, per-mode summaries, the floor, and the
three ways they leave the process (a table, JSON, a PNG timeline).

A :class:`Run` is one cold start of one mode: an ordered list of :class:`Phase` (``resolve``,
``pull``, ``create``, ``start``, then the app's own phases as it reported them, up to READY),
``ready_s`` (seconds from the first phase's start to READY: the headline figure), the bytes and
requests the registry served, and the CPU seconds each daemon spent. :func:`summarise` turns the
runs of a mode into medians with min and max; :func:`to_json` writes the document whose schema is
``result_schema.json`` beside this module (``SCHEMA_ID``), :func:`render_table` the markdown table
the command prints, :func:`plot_timeline` the PNG (matplotlib, the ``plot`` extra).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from coldstart.errors import FailedPrecondition

__all__ = ["SCHEMA_ID", "SCHEMA_PATH", "BenchResult", "Floor", "Limit", "ModeResult", "Phase",
           "Run", "Stat", "describe_floor_cache", "describe_limit", "phase_medians",
           "plot_timeline", "render_table", "summarise", "to_json"]

SCHEMA_ID = "https://coldstart.dev/schemas/bench-result/v1"
SCHEMA_PATH = Path(__file__).with_name("result_schema.json")
# the phases every mode goes through before the app's own, in order
NODE_PHASES = ("resolve", "pull", "create", "start")


@dataclass(frozen=True)
class Phase:
    name: str
    start_s: float      # seconds after the run's t0
    end_s: float

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


@dataclass
class Run:
    mode: str
    index: int
    ok: bool = True
    error: str | None = None
    phases: list[Phase] = field(default_factory=list)
    ready_s: float | None = None
    exit_code: int | None = None
    registry_bytes: int | None = None
    registry_requests: int | None = None
    cpu_s: dict[str, float] = field(default_factory=dict)
    #: each daemon's peak resident memory (MB) at READY
    peak_rss_mb: dict[str, float] = field(default_factory=dict)
    error_kind: str = ""       # the failure's error class (not in the JSON: ``error`` says it)
    #: what `coldstart warmup run` said at READY (warm-cache modes): the restore (status,
    #: bytes fetched, seconds) and the verdict (hit | partial | miss, with the compile work)
    warmup: dict[str, Any] | None = None
    #: coldstart-runc's record of this start (snapshot modes): restored or fallback (its
    #: reason), the restore's phases, bytes fetched and chunks
    snapshot: dict[str, Any] | None = None

    def phase_seconds(self) -> dict[str, float]:
        """Seconds per phase name (a name that occurs twice is summed)."""
        out: dict[str, float] = {}
        for p in self.phases:
            out[p.name] = out.get(p.name, 0.0) + p.seconds
        return out


@dataclass(frozen=True)
class Stat:
    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Stat | None:
        vals = list(values)
        if not vals:
            return None
        return cls(statistics.median(vals), min(vals), max(vals), len(vals))


@dataclass
class ModeResult:
    mode: str
    status: str = "ok"                   # ok | skipped | failed
    reason: str | None = None            # why skipped / failed
    image_ref: str | None = None         # what this mode pulled
    compressed_bytes: int | None = None  # the layers' size in that format
    runs: list[Run] = field(default_factory=list)

    def ok_runs(self) -> list[Run]:
        return [r for r in self.runs if r.ok and r.ready_s is not None]


@dataclass(frozen=True)
class Floor:
    """The best a lazy pull can do on this link: the warm start plus the bytes the start-up
    needed sent at the link's rate."""

    warm_start_s: float          # the median of warm_runs_s
    startup_bytes: int | None
    link_s: float
    total_s: float
    #: each successful warm start's seconds, in the order they ran (one per round, alternated
    #: with the modes)
    warm_runs_s: list[float] = field(default_factory=list)
    #: the median seconds of each phase over those warm starts (create, start, the app's own)
    phases_s: dict[str, float] = field(default_factory=dict)


def phase_medians(runs: Sequence[Run]) -> dict[str, float]:
    """The median seconds of each phase over ``runs`` (the successful ones), in run order."""
    ok = [r for r in runs if r.ok and r.ready_s is not None]
    return {n: statistics.median(r.phase_seconds().get(n, 0.0) for r in ok)
            for n in _phase_order(ok)}


@dataclass(frozen=True)
class Limit:
    """The verified-bytes limit: how fast this machine fetches, decodes and verifies the
    image's checkpoint (its largest ``*.safetensors`` file) from the same registry, through
    the same link, with nothing else in the way
    (:func:`~coldstart.benchmark.limits.verified_bytes`; no cache, no page cache, no reader):
    the ceiling a lazy load of those bytes is put against."""

    file: str
    bytes: int                   # the file's bytes verified (holes not counted)
    gbps: float                  # the median of runs_gbps, in GB (1e9 bytes) per second
    #: each measurement's rate, in the order they ran (one per round, alternated with the
    #: modes, after the same page-cache drop and rest)
    runs_gbps: list[float] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        """The file's bytes at the limit's rate."""
        return self.bytes / (self.gbps * 1e9)


@dataclass
class BenchResult:
    image: dict[str, Any]
    node: str                    # "embedded" or "address:SOCK"
    ready: str
    link: dict[str, Any] | None
    runs_per_mode: int
    machine: dict[str, Any]
    started_at: str
    modes: dict[str, ModeResult] = field(default_factory=dict)
    floor: Floor | None = None
    limit: Limit | None = None
    baseline: str = "overlayfs"
    #: warm starts whose compile caches were already on the node (a directory bind-mounted
    #: where the app's cache variables point, filled before the run): what a warm-cache mode
    #: is put against (None unless a warm-cache mode ran)
    floor_cache: Floor | None = None


def summarise(mode: ModeResult) -> dict[str, Any]:
    """Medians (min, max) of a mode's successful runs: READY, each phase, bytes, CPU."""
    runs = mode.ok_runs()
    out: dict[str, Any] = {"ok_runs": len(runs), "failed_runs": len(mode.runs) - len(runs)}
    if not runs:
        return out
    out["ready_s"] = _stat(r.ready_s for r in runs)
    names = _phase_order(runs)
    out["phases"] = {n: _stat(r.phase_seconds().get(n, 0.0) for r in runs) for n in names}
    if all(r.registry_bytes is not None for r in runs):
        out["registry_bytes"] = _stat(float(r.registry_bytes or 0) for r in runs)
        out["registry_requests"] = _stat(float(r.registry_requests or 0) for r in runs)
    cpu_names = sorted({k for r in runs for k in r.cpu_s})
    out["cpu_s"] = {k: _stat(r.cpu_s.get(k, 0.0) for r in runs) for k in cpu_names}
    out["cpu_total_s"] = _stat(sum(r.cpu_s.values()) for r in runs)
    rss_names = sorted({k for r in runs for k in r.peak_rss_mb})
    out["peak_rss_mb"] = {k: _stat(r.peak_rss_mb.get(k) for r in runs) for k in rss_names}
    return out


def _stat(values: Iterable[float | None]) -> dict[str, float] | None:
    s = Stat.of(v for v in values if v is not None)
    return None if s is None else asdict(s)


def _phase_order(runs: Sequence[Run]) -> list[str]:
    names: list[str] = []
    for r in runs:
        for p in r.phases:
            if p.name not in names:
                names.append(p.name)
    return names


def to_json(result: BenchResult) -> dict[str, Any]:
    """The JSON document (``result_schema.json``)."""
    base = result.modes.get(result.baseline)
    base_s = _median_ready(base)
    modes: dict[str, Any] = {}
    for name, m in result.modes.items():
        summary = summarise(m)
        mine = _median_ready(m)
        summary["speedup_vs_baseline"] = (base_s / mine if base_s and mine else None)
        if result.floor is not None and mine:
            summary["over_floor"] = mine / result.floor.total_s
        if result.floor_cache is not None and mine:
            summary["over_floor_cache"] = mine / result.floor_cache.total_s
        verdicts = [str(((r.warmup or {}).get("verdict") or {}).get("verdict") or "unknown")
                    for r in m.ok_runs() if r.warmup]
        if verdicts:
            summary["warmup"] = {v: verdicts.count(v) for v in sorted(set(verdicts))}
            summary["warmup_fetched_bytes"] = _stat(
                float(((r.warmup or {}).get("restore") or {}).get("fetched_bytes") or 0)
                for r in m.ok_runs() if r.warmup)
        snaps = [r.snapshot for r in m.ok_runs() if r.snapshot]
        if snaps:
            outcomes = [str(e.get("outcome") if e.get("outcome") == "restored"
                            else f"fallback:{e.get('kind')}") for e in snaps]
            summary["snapshot"] = {o: outcomes.count(o) for o in sorted(set(outcomes))}
            restored = [e for e in snaps if e.get("outcome") == "restored"]
            if restored:
                summary["snapshot_fetched_bytes"] = _stat(
                    float(e.get("fetched_bytes") or 0) for e in restored)
                summary["snapshot_phases"] = {
                    k: _stat(float((e.get("phases") or {}).get(k) or 0) for e in restored)
                    for k in ("check", "find", "fetch", "rootfs", "restore", "total")}
        loading = (summary.get("phases") or {}).get("loading")
        if result.limit is not None and loading:
            summary["loading_over_limit"] = loading["median"] / result.limit.seconds
        modes[name] = {
            "status": m.status, "reason": m.reason, "image_ref": m.image_ref,
            "compressed_bytes": m.compressed_bytes,
            "runs": [_run_json(r) for r in m.runs], "summary": summary,
        }
    return {
        "$schema": SCHEMA_ID, "image": result.image, "node": result.node,
        "ready": result.ready,
        "link": result.link, "runs_per_mode": result.runs_per_mode, "machine": result.machine,
        "started_at": result.started_at, "baseline": result.baseline, "modes": modes,
        "floor": asdict(result.floor) if result.floor is not None else None,
        "floor_cache": (asdict(result.floor_cache) if result.floor_cache is not None
                        else None),
        "limit": ({**asdict(result.limit), "seconds": result.limit.seconds}
                  if result.limit is not None else None),
    }


def _run_json(r: Run) -> dict[str, Any]:
    return {"index": r.index, "ok": r.ok, "error": r.error, "ready_s": r.ready_s,
            "exit_code": r.exit_code, "registry_bytes": r.registry_bytes,
            "registry_requests": r.registry_requests, "cpu_s": r.cpu_s,
            "peak_rss_mb": r.peak_rss_mb, "warmup": r.warmup, "snapshot": r.snapshot,
            "phases": [{"name": p.name, "start_s": p.start_s, "end_s": p.end_s}
                       for p in r.phases]}


def _median_ready(m: ModeResult | None) -> float | None:
    if m is None:
        return None
    s = Stat.of(r.ready_s for r in m.ok_runs() if r.ready_s is not None)
    return None if s is None else s.median


def _fmt(stat: dict[str, float] | None, unit: str = "s", scale: float = 1.0,
         digits: int = 2) -> str:
    if stat is None:
        return "-"
    med, lo, hi = (stat[k] / scale for k in ("median", "min", "max"))
    unit = f" {unit}" if unit else ""
    if stat.get("n", 1) == 1 or abs(hi - lo) < 10 ** -digits:
        return f"{med:.{digits}f}{unit}"
    return f"{med:.{digits}f}{unit} ({lo:.{digits}f}-{hi:.{digits}f})"


def render_table(doc: dict[str, Any]) -> str:
    """A markdown table of the medians (min-max): one row per mode, READY first; CPU is the
    daemons' and the pulling client's seconds, from t0 to READY; peak RSS each daemon's
    (median) at READY."""
    modes: dict[str, Any] = doc["modes"]
    phase_names: list[str] = []
    for m in modes.values():
        for n in m["summary"].get("phases", {}):
            if n not in phase_names:
                phase_names.append(n)
    cache_col = any("warmup" in m["summary"] for m in modes.values())
    snap_col = any("snapshot" in m["summary"] for m in modes.values())
    head = ["mode", "READY", "speed-up", *phase_names, "registry", "requests", "CPU",
            "peak RSS", *(["warm-up cache"] if cache_col else []),
            *(["snapshot"] if snap_col else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, m in modes.items():
        s = m["summary"]
        if m["status"] != "ok" or "ready_s" not in s:
            why = m["reason"] or f"{s.get('failed_runs', 0)} runs failed"
            lines.append(f"| {name} | {m['status']}: {why} |" + " |" * (len(head) - 2))
            continue
        speed = s.get("speedup_vs_baseline")
        row = [name, f"**{_fmt(s['ready_s'])}**",
               f"{speed:.2f}x" if speed else "-",
               *(_fmt(s["phases"].get(n)) for n in phase_names),
               _fmt(s.get("registry_bytes"), "MB", 1e6, 1),
               _fmt(s.get("registry_requests"), "", 1.0, 0),
               _fmt(s.get("cpu_total_s"), "s", 1.0, 1),
               ", ".join(f"{k} {v['median']:.0f} MB"
                         for k, v in s.get("peak_rss_mb", {}).items() if v) or "-"]
        if cache_col:
            row.append(", ".join(f"{n} {v}" for v, n in s.get("warmup", {}).items()) or "-")
        if snap_col:
            sp = s.get("snapshot_phases") or {}
            row.append(", ".join(f"{n} {v}" for v, n in s.get("snapshot", {}).items())
                       + (f"; fetched {_fmt(s.get('snapshot_fetched_bytes'), 'MB', 1e6, 1)}, "
                          f"restore {_fmt(sp.get('restore'))}" if sp else "") or "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _spread(runs: Sequence[float], digits: int) -> str:
    """`` (median of N, min-max)`` for more than one measurement, else nothing."""
    if len(runs) < 2:
        return ""
    return f" (median of {len(runs)}, {min(runs):.{digits}f}-{max(runs):.{digits}f})"


def describe_floor(doc: dict[str, Any]) -> str | None:
    """One line on the floor (None when it was not measured)."""
    floor = doc.get("floor")
    if not floor:
        return None
    text = f"floor: warm start {floor['warm_start_s']:.2f} s"
    text += _spread(floor.get("warm_runs_s") or [], 2)
    if floor["startup_bytes"] is not None and doc.get("link"):
        text += (f" + {floor['startup_bytes'] / 1e6:.1f} MB at {doc['link']['text']} "
                 f"({floor['link_s']:.2f} s)")
    text += f" = {floor['total_s']:.2f} s"
    return text


def describe_floor_cache(doc: dict[str, Any]) -> str | None:
    """One line on the warm start with the compile caches already local (None: not run)."""
    floor = doc.get("floor_cache")
    if not floor:
        return None
    spread = _spread(floor.get("warm_runs_s") or [], 2)
    return f"floor with the compile caches local: warm start {floor['total_s']:.2f} s{spread}"


def describe_limit(doc: dict[str, Any]) -> str | None:
    """One line on the verified-bytes limit (None when it was not measured)."""
    limit = doc.get("limit")
    if not limit:
        return None
    spread = _spread(limit.get("runs_gbps") or [], 3)
    return (f"verified-bytes limit: {limit['gbps']:.3f} GB/s{spread}, {limit['file']} "
            f"({limit['bytes'] / 1e9:.2f} GB: {limit['seconds']:.2f} s at that rate)")


def median_run(mode: dict[str, Any]) -> dict[str, Any] | None:
    """The successful run whose READY is the median (the lower middle one for an even count):
    its phases add up to a real start, which stacked per-phase medians do not."""
    runs = sorted((r for r in mode["runs"] if r["ok"] and r["ready_s"] is not None),
                  key=lambda r: r["ready_s"])
    return runs[(len(runs) - 1) // 2] if runs else None


def plot_timeline(doc: dict[str, Any], path: Path) -> None:
    """A PNG timeline: one bar per mode, the phases of its median run (by READY) in order,
    READY written at the end, the floor as a dashed line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise FailedPrecondition(
            "--plot needs matplotlib (pip install 'coldstart[plot]')") from exc
    rows = [(n, r) for n, m in doc["modes"].items() if (r := median_run(m)) is not None]
    if not rows:
        raise FailedPrecondition("nothing to plot: no mode has a successful run")
    names: list[str] = []
    for _, run in rows:
        names += [p["name"] for p in run["phases"] if p["name"] not in names]
    cmap = plt.get_cmap("tab20")
    colours = {n: cmap(i % 20) for i, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(10, 1.8 + 0.6 * len(rows)))
    labelled: set[str] = set()
    for y, (_, run) in enumerate(rows):
        for p in run["phases"]:
            width = p["end_s"] - p["start_s"]
            if width <= 0:
                continue
            ax.barh(y, width, left=p["start_s"], color=colours[p["name"]],
                    label=None if p["name"] in labelled else p["name"])
            labelled.add(p["name"])
        ax.text(run["ready_s"], y, f"  {run['ready_s']:.2f} s", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [n for n, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the start (resolve) to READY: the median run of each mode")
    link = doc.get("link")
    ax.set_title(f"{doc['image']['ref']}" + (f" at {link['text']}" if link else "")
                 + f", N={doc['runs_per_mode']}, ready: {doc['ready']}")
    floor = doc.get("floor")
    if floor:
        ax.axvline(floor["total_s"], color="black", linestyle="--", linewidth=1)
        ax.text(floor["total_s"], -0.6, " floor", fontsize=8)
    cached = doc.get("floor_cache")
    if cached:
        ax.axvline(cached["total_s"], color="grey", linestyle=":", linewidth=1)
        ax.text(cached["total_s"], -0.3, " floor, caches local", fontsize=8)
    right = max(run["ready_s"] for _, run in rows)
    ax.set_xlim(0, right * 1.12)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), fontsize=7,
              ncol=min(len(names), 8), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json(doc: dict[str, Any], path: Path) -> None:
    """Write ``doc`` atomically (a temp file renamed into place)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)
