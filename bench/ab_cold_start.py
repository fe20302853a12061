"""A/B of two checkouts on one cold start: single `coldstart bench` runs, alternated.

A code change to the start-up path moves READY by tens of milliseconds, while five-run matrices
of the same code differ by hundreds (the host's state drifts). Alternating single runs of the
two checkouts pairs each A with a B from the same minute::

    git worktree add /tmp/b HEAD~1            # B: the code before the change (or after)
    python3 bench/ab_cold_start.py /work/main /tmp/b --pairs 6 \\
        -- builtin:torch --embedded --mode coldstart+profile --cache-dir $PWD/bench/images

Everything after ``--`` goes to ``coldstart bench`` (with ``--runs 1``); the pairs alternate
which arm goes first (A B, B A, ...). Each arm runs in its checkout's directory with it on
``PYTHONPATH``, so give paths absolute (a worktree needs its ``coldstart/_proto`` built: copy
it). Prints each run (READY, phases, the FUSE server's CPU up to READY and peak RSS) and the
medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def run_once(checkout: Path, bench_args: list[str], out: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    cmd = [sys.executable, "-m", "coldstart.cli", "bench", *bench_args, "--runs", "1",
           "--json", str(out)]
    out.unlink(missing_ok=True)
    # run from the checkout: ``python -m`` puts the working directory first on sys.path; a
    # failed run exits 1 and says why in its result
    proc = subprocess.run(cmd, env=env, cwd=checkout, stdout=subprocess.DEVNULL)
    if not out.exists():
        return {"ok": False, "error": f"coldstart bench exited {proc.returncode}, no result"}
    result = json.loads(out.read_text())
    (mode,) = [m for m in result["modes"].values() if m.get("runs")]
    run: dict[str, Any] = mode["runs"][0]
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="checkout A")
    ap.add_argument("b", type=Path, help="checkout B")
    ap.add_argument("--pairs", type=int, default=6, help="runs of each arm (default 6)")
    ap.usage = "%(prog)s [-h] [--pairs N] A B -- BENCH_ARGS (one mode)"
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    bench_args = argv[cut + 1:]
    ready: dict[str, list[float]] = {"A": [], "B": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(1, args.pairs + 1):
            arms = [("A", args.a), ("B", args.b)]
            for arm, checkout in arms if i % 2 else arms[::-1]:    # A B, B A, A B, ...
                run = run_once(checkout.resolve(), bench_args, Path(tmp) / "run.json")
                if not run["ok"]:
                    print(f"{arm} {i} failed: {run['error']}", flush=True)
                    continue
                phases = {p["name"]: p["end_s"] - p["start_s"] for p in run["phases"]}
                secs = float(run["ready_s"])
                ready[arm].append(secs)
                cpu = run.get("cpu_s") or {}
                rss = run.get("peak_rss_mb") or {}
                print(f"{arm} {i} READY {secs:.3f} s ("
                      + " ".join(f"{k} {v:.3f}" for k, v in phases.items())
                      + f") fuse-server CPU {cpu.get('fuse-server', '-')} s, "
                      f"peak RSS {rss.get('fuse-server', 0):.0f} MB", flush=True)
    for arm, values in ready.items():
        if values:
            print(f"{arm}: median READY {statistics.median(values):.3f} s of {len(values)} "
                  f"({min(values):.3f}-{max(values):.3f})")


if __name__ == "__main__":
    main()
