"""Benchmark lazy reads under registry faults: what each fault mix costs, and that it never
costs a wrong byte (issue 15, item 2).

A local docker-registry, the fault-injecting proxy of the lazy tests in front of it
(``tests/integration/lazy/lazy_proxy.py``: 5xx answers, connection resets, stalls, truncated
bodies, flipped bytes, each at its own rate, seeded), and ``coldstart fuse-server`` reading
through the proxy with retries (``registry.retries``; each attempt cut off after
``registry.timeout``). Per mix, a fresh layer (a few hundred small files and several
multi-chunk files; zstd:chunked by default) is mounted while the proxy is healthy, then every
file is read whole through the mount, 8 readers at a time, under the mix, and compared with its
source bytes. Then, healthy again, the files that failed are read once more, and every chunk
the node's chunk cache holds is compared with its source bytes.

Reported per mix: the blob range requests the proxy saw and the faults it injected (per kind),
the reads (files) attempted, those that failed with EIO, any other failure, the wrong bytes
delivered (must be 0), the chunks fetched again after failing verification, the slowest single
``pread``, the wall time of the pass, and the wrong chunks in the cache (must be 0).

    sudo .venv/bin/python bench/bench_faults.py [--json FILE] [--mix 5xx=0.2 --mix all=0.05]

With ``--container``, each mix also starts a container: a fresh containerd and ``coldstart
snapshotter`` (its FUSE server with the same ``registry.retries``, ``registry.timeout`` and
``fetch.neighbor_bytes``, no background fill, the other settings its defaults), ``coldstart
pull`` of a converted busybox image through the proxy, then ``ctr run`` of a script that prints
the SHA-256 of every file of a data layer (a few hundred files); reported: whether the pull and
the run succeeded, how the layers were pulled, and the files whose sums came out right, wrong
(must be none) or not at all.

Exits 1 if a wrong byte was delivered or cached, or a read failed otherwise than with EIO.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from coldstart.lazyfs.client import FuseServerClient  # noqa: E402
from coldstart.stack.containerd import start_containerd  # noqa: E402
from coldstart.stack.images import Entry  # noqa: E402
from coldstart.stack.mounts import unmount_under  # noqa: E402
from coldstart.stack.procs import coldstart_cli  # noqa: E402
from coldstart.stack.registry import push_layer, start_registry  # noqa: E402
from coldstart.stack.snapshotter import missing_tools, start_snapshotter  # noqa: E402
from tests.integration.lazy.lazy_faults import (  # noqa: E402
    ServerTimes,
    check_cache,
    fault_server,
    fault_tree,
    read_tree,
)
from tests.integration.lazy.lazy_helpers import convert, tar_of  # noqa: E402
from tests.integration.lazy.lazy_proxy import FAULT_KINDS, FaultMix, Proxy, proxy_for  # noqa: E402
from tests.integration.pull.pull_env import push_converted_app  # noqa: E402

DEFAULT_MIXES = ("none", "5xx=0.1", "reset=0.1", "stall=0.02", "truncate=0.1", "corrupt=0.1",
                 "all=0.03")
COLUMNS = (("mix", 13), ("requests", 8), *((k, 7) for k in FAULT_KINDS), ("reads", 6),
           ("EIO", 5), ("other", 5), ("wrong B", 7), ("refetch", 7), ("slowest", 8),
           ("wall s", 7), ("bad cache", 9))


def run_mix(i: int, spec: str, args: argparse.Namespace, proxy: Proxy,
            client: FuseServerClient, tmp: Path, registry_host: str) -> dict[str, Any]:
    """One pass of the workload under ``spec``; its row."""
    files = fault_tree(args.seed + 1000 * i, small=args.small, big=args.big,
                       big_size=args.big_kib << 10)
    blob, res = convert(tar_of(files), args.format)
    repo = f"bench-faults/m{i}"
    layer = push_layer(registry_host, repo, blob, res, pull_host=proxy.host)
    mp = tmp / f"m{i}"
    mp.mkdir()
    client.mount(str(mp), layer)
    mix = FaultMix.parse(spec, seed=args.seed + i, stall_seconds=args.stall_seconds)
    try:
        with proxy.faults(mix):
            report = read_tree(mp, files, threads=args.threads, seed=args.seed + i)
            counts = proxy.fault_counts()
        again = read_tree(mp, files, names=report.failed, threads=args.threads)
        status = next(s for s in client.status() if s["digest"] == layer.digest)
        # every chunk was read: wait (a while) for the background cache writes to land
        give_up = time.monotonic() + 30
        while True:
            cache = check_cache(tmp / "root/cache", blob, layer.annotations, files)
            if cache.cached == cache.chunks or cache.bad or time.monotonic() > give_up:
                break
            time.sleep(0.2)
    finally:
        client.unmount(str(mp))
    return {
        "mix": spec, "requests": counts["requests"],
        "faults": {k: counts[k] for k in FAULT_KINDS},
        "reads": report.reads, "preads": report.preads, "ok": report.ok, "eio": report.eio,
        "other_errors": report.other_errors, "wrong_reads": report.wrong_reads,
        "wrong_bytes": report.wrong_bytes, "refetched_chunks": status.get("refetched_chunks", 0),
        "slowest_pread_s": round(report.slowest, 3), "wall_s": round(report.seconds, 3),
        "recovered": again.ok, "recovery_failed": again.reads - again.ok,
        "cache_chunks": cache.chunks, "cache_cached": cache.cached, "cache_bad": len(cache.bad),
        "server_requests": status.get("requests", 0), "server_errors": status.get("errors", 0),
    }


# -- a container start under faults (--container) ----------------------------------------------

CONTAINER_COLUMNS = (("mix", 13), ("requests", 8), ("faults", 6), ("pull", 4), ("layers", 16),
                     ("run", 4), ("right", 5), ("wrong", 5), ("missing", 7), ("wall s", 7))
#: what the container runs: one ``sha256sum`` per file of /data, every file whatever fails
SCRIPT = (b"#!/bin/sh\ncd /data && find . -type f | while read -r f; do sha256sum \"$f\"; "
          b"done\n")


def push_container_image(registry_host: str, args: argparse.Namespace
                         ) -> tuple[str, dict[str, str]]:
    """Push a busybox image with a data layer (gzip), convert it with ``coldstart convert``;
    the converted image's repository:tag and the SHA-256 of each data file (``./path``)."""
    files = fault_tree(args.seed + 77, small=args.small, big=2, big_size=args.big_kib << 10)
    push_converted_app(registry_host, "bench-faults/app", files,
                       [Entry("run.sh", data=SCRIPT, mode=0o755)])
    return "bench-faults/app:zstd", {f"./{n}": hashlib.sha256(b).hexdigest()
                                     for n, b in files.items()}


def run_container(i: int, spec: str, args: argparse.Namespace, proxy: Proxy, repo_tag: str,
                  sums: dict[str, str]) -> dict[str, Any]:
    """A fresh containerd + snapshotter: pull through the proxy and run, under ``spec``."""
    base = Path(tempfile.mkdtemp(prefix="cs-fc-", dir="/tmp"))
    # the snapshotter's defaults but these (and no background fill: what is read is fetched)
    extra = (f"[registry]\ntimeout = {args.registry_timeout}\nretries = {args.retries}\n"
             f"[fetch]\nneighbor_bytes = {args.neighbor_bytes}\nbackground_rate = 0\n")
    mix = FaultMix.parse(spec, seed=args.seed + 500 + i, stall_seconds=args.stall_seconds)
    ref = f"{proxy.host}/{repo_tag}"
    try:
        with start_snapshotter(base / "sn", metrics=False, log_level="info", extra=extra,
                               background_rate=None) as sn, \
                start_containerd(base / "ctrd", proxy_socket=sn.socket) as ctd:
            ctd.namespace = "default"
            t0 = time.monotonic()
            with proxy.faults(mix):
                pull = coldstart_cli("pull", "--address", ctd.address, "-o", "json", "--quiet",
                                     ref, timeout=600)
                run = ctd.ctr("run", "--rm", "--snapshotter", "coldstart", ref, f"faults-{i}",
                              "/run.sh", check=False, timeout=600) if pull.returncode == 0 \
                    else None
                counts = proxy.fault_counts()
            wall = time.monotonic() - t0
    finally:
        unmount_under(base, abort_fuse=True)
        shutil.rmtree(base, ignore_errors=True)
    hows: dict[str, int] = {}
    if pull.returncode == 0:
        for layer in json.loads(pull.stdout)["layers"]:
            hows[layer["how"]] = hows.get(layer["how"], 0) + 1
    got: dict[str, str] = {}
    for line in (run.stdout if run is not None else "").splitlines():
        digest, _, path = line.partition("  ")
        got[path] = digest
    right = sum(1 for p, d in got.items() if sums.get(p) == d)
    return {"mix": spec, "requests": counts["requests"],
            "faults": {k: counts[k] for k in FAULT_KINDS},
            "pull_ok": pull.returncode == 0, "pull_error": pull.stderr[-500:].strip()
            if pull.returncode else "", "layers": hows,
            "run_rc": run.returncode if run is not None else None,
            "run_error": (run.stderr[-500:].strip() if run is not None and run.returncode
                          else ""),
            "files": len(sums), "right": right, "wrong": len(got) - right,
            "missing": len(sums) - len(got), "wall_s": round(wall, 3)}


def container_cells(r: dict[str, Any]) -> list[str]:
    layers = ",".join(f"{k}:{v}" for k, v in sorted(r["layers"].items())) or "-"
    return [r["mix"], str(r["requests"]), str(sum(r["faults"].values())),
            "ok" if r["pull_ok"] else "FAIL", layers,
            "-" if r["run_rc"] is None else str(r["run_rc"]), str(r["right"]), str(r["wrong"]),
            str(r["missing"]), f"{r['wall_s']:.1f}"]


# -- the table -----------------------------------------------------------------------------------


def row_cells(r: dict[str, Any]) -> list[str]:
    return [r["mix"], str(r["requests"]), *(str(r["faults"][k]) for k in FAULT_KINDS),
            str(r["reads"]), str(r["eio"]), str(len(r["other_errors"])), str(r["wrong_bytes"]),
            str(r["refetched_chunks"]), f"{r['slowest_pread_s']:.2f}", f"{r['wall_s']:.1f}",
            str(r["cache_bad"])]


def print_table(rows: list[dict[str, Any]], columns: tuple[tuple[str, int], ...] = COLUMNS,
                cells: Any = row_cells) -> None:
    print("  ".join(f"{name:>{w}}" for name, w in columns))
    for r in rows:
        print("  ".join(f"{c:>{w}}" for c, (_, w) in zip(cells(r), columns, strict=True)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mix", action="append", default=None,
                    help="a fault mix, 'kind=rate,...' (kinds: " + ", ".join(FAULT_KINDS)
                         + "; 'all=rate': each kind at that rate; 'none'); repeatable "
                         f"(default: {' '.join(DEFAULT_MIXES)})")
    ap.add_argument("--format", default="zstd:chunked", choices=("zstd:chunked", "estargz"))
    ap.add_argument("--small", type=int, default=300, help="small files per layer")
    ap.add_argument("--big", type=int, default=4, help="multi-chunk files per layer")
    ap.add_argument("--big-kib", type=int, default=640, help="size of each multi-chunk file")
    ap.add_argument("--threads", type=int, default=8, help="files read at once")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--retries", type=int, default=3, help="registry.retries")
    ap.add_argument("--registry-timeout", type=float, default=1.0,
                    help="registry.timeout: one attempt's wait for the registry, seconds")
    ap.add_argument("--request-timeout", type=float, default=5.0,
                    help="fetch.request_timeout: one range request with its retries")
    ap.add_argument("--read-deadline", type=float, default=6.0, help="fetch.read_deadline")
    ap.add_argument("--stall-seconds", type=float, default=2.5,
                    help="how long the proxy holds a stalled request")
    ap.add_argument("--neighbor-bytes", type=int, default=0,
                    help="fetch.neighbor_bytes (0: each small file is a request of its own)")
    ap.add_argument("--container", action="store_true",
                    help="also start a container under each mix (containerd, ctr, runc)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (FUSE mounts)", file=sys.stderr)
        return 2
    if args.container and missing_tools():
        print(f"--container: missing {', '.join(missing_tools())}", file=sys.stderr)
        return 2
    mixes = args.mix or list(DEFAULT_MIXES)
    for spec in mixes:
        FaultMix.parse(spec)            # a typo fails here, before anything starts
    times = ServerTimes(retries=args.retries, registry_timeout=args.registry_timeout,
                        request_timeout=args.request_timeout, read_deadline=args.read_deadline)
    work = Path(tempfile.mkdtemp(prefix="cs-faults-", dir="/tmp"))
    rows: list[dict[str, Any]] = []
    containers: list[dict[str, Any]] = []
    t_all = time.monotonic()
    try:
        with start_registry(work / "registry", access_log=False) as reg, \
                proxy_for(f"http://{reg.host}") as proxy, \
                fault_server(work / "fs", registry_host=proxy.host, times=times,
                             neighbor_bytes=args.neighbor_bytes) as (_proc, client, _root):
            for i, spec in enumerate(mixes):
                row = run_mix(i, spec, args, proxy, client, work / "fs", reg.host)
                rows.append(row)
                print("  ".join(f"{n}={v}" for n, v in zip(
                    (c for c, _ in COLUMNS), row_cells(row), strict=True)), flush=True)
            if args.container:
                repo_tag, sums = push_container_image(reg.host, args)
                for i, spec in enumerate(mixes):
                    crow = run_container(i, spec, args, proxy, repo_tag, sums)
                    containers.append(crow)
                    print("container " + "  ".join(f"{n}={v}" for n, v in zip(
                        (c for c, _ in CONTAINER_COLUMNS), container_cells(crow),
                        strict=True)), flush=True)
    finally:
        unmount_under(work)
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(f"{args.format}, {args.small} small + {args.big} x {args.big_kib} KiB files per "
          f"layer; retries {times.retries}, registry.timeout {times.registry_timeout:g} s, "
          f"request_timeout {times.request_timeout:g} s, read_deadline "
          f"{times.read_deadline:g} s; stall {args.stall_seconds:g} s; "
          f"{time.monotonic() - t_all:.0f} s in all")
    print_table(rows)
    if containers:
        print()
        print(f"container start (/run.sh: sha256sum of {containers[0]['files']} files) under "
              "each mix, a fresh containerd + snapshotter each")
        print_table(containers, CONTAINER_COLUMNS, container_cells)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"config": {k: (str(v) if isinstance(v, Path) else v)
                                                    for k, v in vars(args).items()},
                                         "mixes": rows, "containers": containers},
                                        indent=2) + "\n")
        print(f"results: {args.json}")
    bad = [r["mix"] for r in rows if r["wrong_bytes"] or r["other_errors"] or r["cache_bad"]]
    bad += [f"{r['mix']} (container)" for r in containers if r["wrong"]]
    if bad:
        print(f"WRONG BYTES, OTHER ERRORS OR BAD CACHE under: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
