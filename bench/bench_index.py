"""Benchmark: an image nobody converted (plain gzip layers), pulled and run to exit four ways in
one run (issue 14):

* ``containerd``: containerd's own pull (``ctr image pull``: one download stream, one gunzip
  thread, overlayfs), then ``ctr run``;
* ``cs-full``: coldstart's parallel full pull (``pull.mode = "auto"``, no index: parallel range
  requests, rapidgzip on every core, containerd's applier semantics);
* ``cs-index``: coldstart lazily through a gzip index (``coldstart index --push``, pinned on
  the node);
* ``cs-zstd``: coldstart lazily on the same image converted to zstd:chunked
  (``coldstart convert``), the best a converted image gives.

The image is a built-in benchmark image (``coldstart bench-image``; default ``torch``: Debian
12 + python3 + torch 2.13.0 CPU, its start-up imports torch). Per run: a fresh containerd and
snapshotter (fresh roots, nothing cached), the page cache dropped, modes alternated; pull and
run timed apart; registry bytes and requests from its access log. Prints a markdown table of
medians (min-max) and ratios to ``containerd``; ``--json FILE`` writes every run.

    sudo .venv/bin/python bench/bench_index.py [--image torch] [--runs 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from coldstart.benchmark.images import build_image  # noqa: E402
from coldstart.oci.registry import RegistryClient  # noqa: E402
from coldstart.stack.procs import coldstart_cli  # noqa: E402
from coldstart.stack.registry import AccessLog, push_layout, start_registry  # noqa: E402
from coldstart.stack.snapshotter import temp_local_stack  # noqa: E402

MODES = ("containerd", "cs-full", "cs-index", "cs-zstd")


def drop_caches() -> None:
    subprocess.run(["sync"], check=False)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    time.sleep(1)


def one(mode: str, refs: dict[str, str], artifact: str, cmd: list[str],
        log_path: Path) -> dict[str, Any]:
    with temp_local_stack(pull_mode=None) as st:
        if mode == "cs-index":
            (st.snapshotter.root / "trusted-indexes").write_text(artifact + "\n")
        drop_caches()
        log = AccessLog(log_path)
        ref = refs["zstd" if mode == "cs-zstd" else "gzip"]
        t0 = time.monotonic()
        if mode == "containerd":
            st.ctd.ctr("images", "pull", "--plain-http", ref, namespace="b", timeout=1800)
            snap = "overlayfs"
            how = ""
        else:
            proc = coldstart_cli("pull", "--address", st.ctd.address, "--namespace", "b", ref,
                                 timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(f"{mode}: {proc.stderr[-2000:]}")
            how = proc.stderr.strip().splitlines()[-1]
            want = "pulled in full" if mode == "cs-full" else " 0 downloaded"
            if want not in how or (mode != "cs-full" and "pulled in full" in how):
                raise RuntimeError(f"{mode}: not the pull this mode measures: {how}")
            snap = "coldstart"
        t1 = time.monotonic()
        run = st.ctd.ctr("run", "--rm", "--snapshotter", snap, ref, "w", *cmd, namespace="b",
                         timeout=1800)
        t2 = time.monotonic()
        blob = [r for r in log.requests() if "/blobs/" in r.path]
        return {"mode": mode, "pull_s": t1 - t0, "run_s": t2 - t1, "total_s": t2 - t0,
                "bytes": sum(r.bytes for r in blob), "requests": len(blob),
                "out": run.stdout.strip(), "pull": how}


def _med(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image", default="torch")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--mode", action="append", choices=MODES,
                    help="Only these modes (repeatable; default: all four)")
    args = ap.parse_args()
    modes = tuple(args.mode or MODES)
    image = build_image(args.image, progress=lambda s: print(s, file=sys.stderr))
    with tempfile.TemporaryDirectory(prefix="bench-index-") as tmp, \
            start_registry(Path(tmp) / "reg") as reg:
        gz = f"{reg.host}/bench/{args.image}:gzip"
        with RegistryClient() as client:
            push_layout(image.layout, "latest", gz, client, storage=reg.root)
        t = time.monotonic()
        proc = coldstart_cli("index", gz, "--push", "-o", "json", timeout=3600)
        assert proc.returncode == 0, proc.stderr
        index_s = time.monotonic() - t
        doc = json.loads(proc.stdout)
        zs = f"{reg.host}/bench/{args.image}:zstd"
        t = time.monotonic()
        proc = coldstart_cli("convert", gz, zs, "--format", "zstd-chunked", timeout=3600)
        assert proc.returncode == 0, proc.stderr
        convert_s = time.monotonic() - t
        refs = {"gzip": gz, "zstd": zs}
        rows: list[dict[str, Any]] = []
        for i in range(args.runs):
            for mode in modes:
                r = one(mode, refs, doc["artifact"], image.command, reg.access_log)
                r["run"] = i
                rows.append(r)
                print(f"run {i} {mode}: pull {r['pull_s']:.2f} s, run {r['run_s']:.2f} s, "
                      f"{r['bytes'] / 1e6:.1f} MB in {r['requests']} requests, out "
                      f"{r['out'][-40:]!r}", file=sys.stderr)
    outs = {r["out"] for r in rows}
    if len(outs) != 1:
        raise SystemExit(f"the modes printed different things: {outs}")
    gz_bytes = sum(la["size"] for la in doc["layers"])
    idx_bytes = sum(la["index_bytes"] for la in doc["layers"])
    print(f"image {args.image}: {len(doc['layers'])} layers, {gz_bytes / 1e6:.1f} MB of gzip; "
          f"start-up: {' '.join(image.command)}; N = {args.runs} per mode, alternated, fresh "
          "node and dropped page cache per run; medians (min-max)")
    print(f"coldstart index: {index_s:.1f} s, {idx_bytes / 1e6:.2f} MB of index "
          f"({100 * idx_bytes / gz_bytes:.1f} % of the layers); coldstart convert (zstd:chunked)"
          f": {convert_s:.1f} s\n")
    ref_mode = "containerd" if "containerd" in modes else modes[0]
    print(f"| mode | pull → exit | pull | run | registry bytes | requests | vs {ref_mode} |")
    print("|---|---|---|---|---|---|---|")
    base = _med([r for r in rows if r["mode"] == ref_mode], "total_s")
    base_pull = _med([r for r in rows if r["mode"] == ref_mode], "pull_s")
    for mode in modes:
        rs = [r for r in rows if r["mode"] == mode]
        tot = [r["total_s"] for r in rs]
        med = statistics.median(tot)
        pull = _med(rs, "pull_s")
        print(f"| {mode} | {med:.2f} s ({min(tot):.2f}-{max(tot):.2f}) | {pull:.2f} s "
              f"({base_pull / pull:.2f}x) | {_med(rs, 'run_s'):.2f} s | "
              f"{_med(rs, 'bytes') / 1e6:.1f} MB | {_med(rs, 'requests'):.0f} | "
              f"{base / med:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"image": args.image, "rows": rows, "index": doc,
                                         "index_s": index_s, "convert_s": convert_s},
                                        indent=1))


if __name__ == "__main__":
    main()
