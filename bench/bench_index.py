"""Benchmark: an image nobody converted (plain gzip layers), pulled and run to exit four ways in
one run (issue 14):

* ``containerd``: containerd's own pull (``ctr image pull``: one download stream, one gunzip
  thread, overlayfs), then ``ctr run``;
* ``cs-full``: coldstart's parallel full pull (``pull.mode = "auto"``, no index: parallel range
  requests, rapidgzip on every core, containerd's applier semantics);
* ``cs-index``: coldstart lazily through a gzip index (``coldstart index --push``, pinned on
  the node);
* ``cs-index+profile``: the same with an index that also names the start-up's spans
  (``coldstart index --profile``, from a ``coldstart optimize`` recording of this image): they
  are prefetched at mount, as for an image ``coldstart optimize`` wrote, while the image itself
  stays unconverted;
* ``cs-zstd``: coldstart lazily on the same image converted to zstd:chunked
  (``coldstart convert``);
* ``cs-zstd+profile``: the same converted with the same profile (``coldstart convert
  --profile``: the start-up's files first, prefetched at mount), the best a converted image
  gives and what ``cs-index+profile`` compares with.

The image is a built-in benchmark image (``coldstart bench-image``; default ``torch``: Debian
12 + python3 + torch 2.13.0 CPU, its start-up imports torch). Per run: a fresh containerd and
snapshotter (fresh roots, nothing cached), the page cache dropped, modes alternated; pull and
run timed apart; registry bytes and requests from its access log. Prints a markdown table of
medians (min-max) and ratios to ``containerd``; ``--json FILE`` writes every run.

    sudo .venv/bin/python bench/bench_index.py [--image torch] [--runs 5] [--json out.json]
        [--profile FILE]     # a saved recording (else one is recorded: ~1 min)
"""

from __future__ import annotations

import argparse
import json
import shutil
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

MODES = ("containerd", "cs-full", "cs-index", "cs-index+profile", "cs-zstd", "cs-zstd+profile")
#: the image each mode pulls
IMAGE_OF = {"cs-zstd": "zstd", "cs-zstd+profile": "zstd-profile"}


def drop_caches() -> None:
    subprocess.run(["sync"], check=False)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    time.sleep(1)


def one(mode: str, refs: dict[str, str], artifacts: dict[str, str], cmd: list[str],
        log_path: Path, keep: Path | None = None) -> dict[str, Any]:
    with temp_local_stack(pull_mode=None) as st:
        if mode in artifacts:
            (st.snapshotter.root / "trusted-indexes").write_text(artifacts[mode] + "\n")
        drop_caches()
        log = AccessLog(log_path)
        ref = refs[IMAGE_OF.get(mode, "gzip")]
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
        if keep is not None and mode != "containerd":
            keep.mkdir(parents=True, exist_ok=True)
            n = len(list(keep.glob(f"{mode}-*.fuse.log")))
            shutil.copy(st.fuse_log, keep / f"{mode}-{n}.fuse.log")
            shutil.copy(st.snapshotter.log, keep / f"{mode}-{n}.snapshotter.log")
            (keep / f"{mode}-{n}.pull.log").write_text(
                f"pull {time.strftime('%H:%M:%S', time.localtime(time.time() - (t2 - t0)))}"
                f" +{t1 - t0:.3f} s, run +{t2 - t1:.3f} s\n")
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
                    help="Only these modes (repeatable; default: all)")
    ap.add_argument("--keep-logs", type=Path, metavar="DIR",
                    help="Copy each coldstart run's FUSE server and snapshotter logs, and "
                         "its pull and run times, here")
    ap.add_argument("--profile", type=Path,
                    help="The start-up profile of cs-index+profile and cs-zstd+profile "
                         "(default: recorded now with coldstart optimize)")
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
        artifacts = {"cs-index": doc["artifact"]}
        profiled: dict[str, Any] = {}
        profile = args.profile
        if {"cs-index+profile", "cs-zstd+profile"} & set(modes):
            if profile is None:
                profile = Path(tmp) / "profile.json"
                proc = coldstart_cli("optimize", gz, f"oci:{tmp}/optimized", "--profile-out",
                                     str(profile), "--", *image.command, timeout=3600)
                assert proc.returncode == 0, proc.stderr
            proc = coldstart_cli("index", gz, "--push", "--profile", str(profile), "-o",
                                 "json", timeout=3600)
            assert proc.returncode == 0, proc.stderr
            profiled = json.loads(proc.stdout)
            artifacts["cs-index+profile"] = profiled["artifact"]
            print("index with the profile: " + ", ".join(
                f"{la['prefetch_files']} files, {la['prefetch_bytes'] / 1e6:.1f} MB of spans"
                for la in profiled["layers"]), file=sys.stderr)
        refs = {"gzip": gz}
        convert_s = 0.0
        for mode, tag in IMAGE_OF.items():
            if mode not in modes:
                continue
            refs[tag] = f"{reg.host}/bench/{args.image}:{tag}"
            t = time.monotonic()
            proc = coldstart_cli("convert", gz, refs[tag], "--format", "zstd-chunked",
                                 *(["--profile", str(profile)] if "profile" in tag else []),
                                 timeout=3600)
            assert proc.returncode == 0, proc.stderr
            if tag == "zstd":
                convert_s = time.monotonic() - t
        rows: list[dict[str, Any]] = []
        for i in range(args.runs):
            for mode in modes:
                r = one(mode, refs, artifacts, image.command, reg.access_log,
                        args.keep_logs)
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
                                         "index_with_profile": profiled,
                                         "index_s": index_s, "convert_s": convert_s},
                                        indent=1))


if __name__ == "__main__":
    main()
