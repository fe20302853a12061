"""Benchmark: an image nobody converted (plain gzip layers), pulled to exit three ways in one
run (issue 14): containerd's own full pull (``ctr image pull``, overlayfs, one gunzip thread),
coldstart lazily through a gzip index (``coldstart index --push``, pinned on the node), and
coldstart lazily on the same image converted to zstd:chunked (``coldstart convert``).

The image: busybox, and a layer of ``--mb`` MiB of library-like files (text and binary, about
2.5:1 under gzip -6) of which the workload reads ``--read-pct`` percent (a start-up that reads
a few percent of its image). Per run: a fresh containerd + snapshotter (fresh roots: nothing
cached), the page cache dropped, modes alternated; timed from the pull's start to the
workload's exit, pull and run apart; registry bytes and requests from its access log. Prints
a markdown table of medians (min-max) and ratios; ``--json FILE`` writes every run.

    sudo .venv/bin/python bench/bench_index.py [--runs 5] [--mb 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from coldstart.oci.registry import RegistryClient  # noqa: E402
from coldstart.stack.images import Entry, busybox_entries  # noqa: E402
from coldstart.stack.procs import coldstart_cli  # noqa: E402
from coldstart.stack.registry import AccessLog, start_registry  # noqa: E402
from coldstart.stack.snapshotter import temp_local_stack  # noqa: E402
from tests.integration.pull.pull_env import push_image  # noqa: E402

MODES = ("containerd-full", "coldstart-index", "coldstart-zstd")


def library(mb: int, seed: int = 14) -> list[Entry]:
    """Files of 4 KiB to 4 MiB: half text-like (compressible), half binary-like."""
    rnd = random.Random(seed)
    words = [rnd.randbytes(rnd.randrange(3, 12)).hex().encode() for _ in range(4000)]
    out = [Entry("lib", "dir", mode=0o755)]
    total, i = 0, 0
    while total < mb << 20:
        size = int(min(4 << 20, max(4096, rnd.lognormvariate(11, 1.4))))
        if i % 2:
            data = b" ".join(rnd.choice(words) for _ in range(size // 8))[:size]
        else:
            data = (rnd.randbytes(size // 3) + bytes(size - size // 3))
        out.append(Entry(f"lib/m{i:05d}.so", data=data))
        total += len(data)
        i += 1
    return out


def workload(entries: list[Entry], pct: float, seed: int = 15) -> str:
    files = [e.path for e in entries if e.kind == "file"]
    rnd = random.Random(seed)
    pick = sorted(rnd.sample(files, max(1, int(len(files) * pct / 100))))
    return "cat " + " ".join("/" + p for p in pick) + " | wc -c"


def drop_caches() -> None:
    subprocess.run(["sync"], check=False)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    time.sleep(1)


def one(mode: str, refs: dict[str, str], artifact: str, cmd: str, log_path: Path,
        host: str) -> dict[str, Any]:
    with temp_local_stack() as st:
        (st.snapshotter.root / "trusted-indexes").write_text(artifact + "\n")
        drop_caches()
        log = AccessLog(log_path)
        t0 = time.monotonic()
        if mode == "containerd-full":
            ref = refs["gzip"]
            st.ctd.ctr("images", "pull", "--plain-http", ref, namespace="b", timeout=900)
            snap = "overlayfs"
        else:
            ref = refs["gzip" if mode == "coldstart-index" else "zstd"]
            proc = coldstart_cli("pull", "--address", st.ctd.address, "--namespace", "b", ref)
            if proc.returncode != 0 or (mode == "coldstart-index" and " 0 downloaded" not in
                                        proc.stderr):
                raise RuntimeError(f"{mode}: {proc.stderr[-2000:]}")
            snap = "coldstart"
        t1 = time.monotonic()
        run = st.ctd.ctr("run", "--rm", "--snapshotter", snap, ref, "w", "/bin/sh", "-c", cmd,
                         namespace="b", timeout=900)
        t2 = time.monotonic()
        served = log.requests()
        blob = [r for r in served if "/blobs/" in r.path]
        return {"mode": mode, "pull_s": t1 - t0, "run_s": t2 - t1, "total_s": t2 - t0,
                "bytes": sum(r.bytes for r in blob), "requests": len(blob),
                "out": run.stdout.strip()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--mb", type=int, default=300)
    ap.add_argument("--read-pct", type=float, default=3.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    entries = library(args.mb)
    cmd = workload(entries, args.read_pct)
    with tempfile.TemporaryDirectory(prefix="bench-index-") as tmp, \
            start_registry(Path(tmp) / "reg") as reg:
        gz = f"{reg.host}/bench/index:gzip"
        with RegistryClient() as client:
            push_image(client, gz, [busybox_entries(), entries])
        t = time.monotonic()
        proc = coldstart_cli("index", gz, "--push", "-o", "json", timeout=1800)
        assert proc.returncode == 0, proc.stderr
        index_s = time.monotonic() - t
        doc = json.loads(proc.stdout)
        zs = f"{reg.host}/bench/index:zstd"
        t = time.monotonic()
        proc = coldstart_cli("convert", gz, zs, "--format", "zstd-chunked", timeout=1800)
        assert proc.returncode == 0, proc.stderr
        convert_s = time.monotonic() - t
        refs = {"gzip": gz, "zstd": zs}
        rows: list[dict[str, Any]] = []
        for i in range(args.runs):
            for mode in MODES:
                r = one(mode, refs, doc["artifact"], cmd, reg.access_log, reg.host)
                r["run"] = i
                rows.append(r)
                print(f"run {i} {mode}: pull {r['pull_s']:.2f} s, run {r['run_s']:.2f} s, "
                      f"{r['bytes'] / 1e6:.1f} MB in {r['requests']} requests", file=sys.stderr)
    outs = {r["out"] for r in rows}
    assert len(outs) == 1, f"the modes read different bytes: {outs}"
    gz_bytes = sum(la["size"] for la in doc["layers"])
    idx_bytes = sum(la["index_bytes"] for la in doc["layers"])
    print(f"image: {args.mb} MiB of files + busybox; {gz_bytes / 1e6:.1f} MB of gzip layers; "
          f"workload reads {args.read_pct}% of the files ({outs.pop()} bytes)")
    print(f"coldstart index: {index_s:.1f} s, {idx_bytes / 1e6:.2f} MB of index "
          f"({100 * idx_bytes / gz_bytes:.1f}% of the layers); coldstart convert: "
          f"{convert_s:.1f} s\n")
    print("| mode | pull → exit | pull | run | registry bytes | requests | vs full pull |")
    print("|---|---|---|---|---|---|---|")
    full = statistics.median(r["total_s"] for r in rows if r["mode"] == "containerd-full")
    for mode in MODES:
        rs = [r for r in rows if r["mode"] == mode]
        tot = [r["total_s"] for r in rs]
        med = statistics.median(tot)
        print(f"| {mode} | {med:.2f} s ({min(tot):.2f}-{max(tot):.2f}) | "
              f"{statistics.median(r['pull_s'] for r in rs):.2f} s | "
              f"{statistics.median(r['run_s'] for r in rs):.2f} s | "
              f"{statistics.median(r['bytes'] for r in rs) / 1e6:.1f} MB | "
              f"{statistics.median(r['requests'] for r in rs):.0f} | {full / med:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "index": doc, "index_s": index_s,
                                         "convert_s": convert_s}, indent=1))


if __name__ == "__main__":
    main()
