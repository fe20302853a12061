"""Benchmark ``coldstart pull`` (the lazy pull) of a layer of many small files against
containerd's full pull and unpack of the same image (bounded; cleans up after itself).

One layer of ``--files`` small files (default 200,000, in directories of 100; what CUDA and
PyTorch images look like at scale) is built once as a tar, pushed as a gzip image and, converted
to zstd:chunked, as a lazy one, into a private docker-registry. Each round starts a fresh
containerd + ``coldstart snapshotter`` (with its FUSE server) and times, through
:func:`coldstart.containerd.pull.pull_image` (what ``coldstart pull`` runs):

* ``lazy``: the zstd:chunked image through the coldstart snapshotter (resolve, content,
  Prepare -> the FUSE server fetches, verifies and parses the TOC -> bind mount);
* ``full``: the gzip image through containerd's overlayfs snapshotter (download + unpack).

Prints medians (min-max), the ratio, and µs per TOC entry of the lazy pull; writes JSON to
``bench/results/bench_pull-<time>.json``. ``--spy DIR`` records the FUSE server with py-spy
during each lazy pull (folded stacks, for flamegraph.pl or speedscope), to see where the time
goes. The torch image's pull next to stargz's ``ctr-remote image rpull`` is ``coldstart bench
builtin:torch --embedded --mode coldstart,stargz`` (its ``pull`` phase). Needs root; take the
bench lock when others measure::

    flock /tmp/cs-bench.lock .venv/bin/python bench/bench_pull.py [--files 200000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from coldstart.containerd.client import Containerd  # noqa: E402
from coldstart.containerd.pull import pull_image  # noqa: E402
from coldstart.format.layer import MEDIA_TYPE_GZIP  # noqa: E402
from coldstart.format.writer import LayerResult, convert_layer  # noqa: E402
from coldstart.oci.registry import RegistryClient  # noqa: E402
from coldstart.stack.registry import push_layer, start_registry  # noqa: E402
from coldstart.stack.snapshotter import temp_local_stack  # noqa: E402


def build_tar(path: Path, files: int, salt: str = "") -> None:
    """``files`` small files (distinct contents) in directories of 100, plus the directories
    (``salt``: in every file, so layers built with different salts differ)."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for d in range((files + 99) // 100):
            ti = tarfile.TarInfo(f"pkg/d{d:05d}")
            ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, 1_700_000_000
            tf.addfile(ti)
            for f in range(min(100, files - d * 100)):
                data = f"# module {d}.{f}{salt}\nVALUE = {d * 100 + f}\n".encode()
                ti = tarfile.TarInfo(f"pkg/d{d:05d}/m{f:03d}.py")
                ti.size, ti.mode, ti.mtime = len(data), 0o644, 1_700_000_000
                tf.addfile(ti, io.BytesIO(data))


def prepare(work: Path, files: int, salt: str = "") -> dict[str, Any]:
    """The tar, its gzip blob and its zstd:chunked conversion, cached in ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    key = f"{files}{salt}"
    meta_path = work / f"meta-{key}.json"
    if meta_path.exists():
        return json.loads(meta_path.read_text())  # type: ignore[no-any-return]
    tar = work / f"layer-{key}.tar"
    t0 = time.monotonic()
    build_tar(tar, files, salt)
    raw = tar.read_bytes()
    gz = gzip.compress(raw, compresslevel=1, mtime=0)
    (work / f"layer-{key}.tar.gz").write_bytes(gz)
    with open(tar, "rb") as src, open(work / f"layer-{key}.zst", "wb") as dst:
        res = convert_layer(src, dst, format="zstd:chunked")
    meta = {"files": files, "diff_id": "sha256:" + hashlib.sha256(raw).hexdigest(),
            "gzip": {"digest": "sha256:" + hashlib.sha256(gz).hexdigest(), "size": len(gz)},
            "zstd": {"digest": res.digest, "size": res.size, "diff_id": res.diff_id,
                     "toc_digest": res.toc_digest, "media_type": res.media_type,
                     "annotations": res.annotations},
            "build_seconds": time.monotonic() - t0}
    tar.unlink()
    meta_path.write_text(json.dumps(meta))
    return meta


def _spy(pid: int | None, out: Path | None) -> subprocess.Popen[bytes] | None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if pid is None or out is None or not Path(spy).exists():
        return None
    # a fixed duration, and never pausing the server: paused, it cannot answer the FUSE
    # requests that py-spy itself (or the pull) may cause
    proc = subprocess.Popen([spy, "record", "--pid", str(pid), "-r", "250", "--duration", "10",
                             "--nonblocking",
                             "-f", "raw", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # py-spy attaches
    return proc


#: files in the layer pulled first (the memory baseline)
SMALL_FILES = 100
#: seconds between the pull and the memory figures (the layer's index is built meanwhile, and
#: its TOC compacted 2 s after the mount once the reads pause)
SETTLE = 8.0


def _memory(pid: int | None) -> tuple[float, float]:
    """(VmRSS, VmHWM) of ``pid`` in MB (0, 0 when it is gone)."""
    got = {"VmRSS": 0.0, "VmHWM": 0.0}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in got:
                got[key] = int(value.split()[0]) * 1024 / 1e6
    except (FileNotFoundError, ProcessLookupError, TypeError):
        pass
    return got["VmRSS"], got["VmHWM"]


def _fuse_mounts(base: Path) -> list[Path]:
    """The FUSE mount points under ``base`` that show one layer each: the snapshots' binds,
    not the FUSE server's own mounts (``<root>/fuse`` and ``<root>/fuse-plain`` show every
    layer)."""
    out: list[Path] = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if fields[2].startswith("fuse") and fields[1].startswith(str(base)):
            path = Path(fields[1].replace("\\040", " "))
            if path.name not in ("fuse", "fuse-plain") and path not in out:
                out.append(path)
    return out


def _walk(root: Path) -> int:
    """lstat every entry under ``root`` (what ``find -ls`` does); the number of entries."""
    n = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lstat(os.path.join(dirpath, name))
            n += 1
    return n


def one_round(host: str, refs: dict[str, str], spy_dir: Path | None, i: int,
              full: bool = True) -> dict[str, float]:
    out: dict[str, float] = {}
    with temp_local_stack(log_level="warning") as stack, \
            RegistryClient(insecure_hosts=[host]) as reg, \
            Containerd(stack.address, "default", timeout=600) as ctd:
        spy = _spy(stack.snapshotter.fuse_pid,
                   spy_dir / f"lazy-{i}.folded.txt" if spy_dir else None)
        out["fuse_idle_mb"] = _memory(stack.snapshotter.fuse_pid)[0]
        # a layer of a few files first: what the server loads for any mount (the registry
        # client, TLS, the decoders) is then in the baseline, not in the big layer's figure
        pull_image(ctd, reg, refs["small"], snapshotter="coldstart", timeout=300)
        time.sleep(SETTLE)
        out["fuse_small_mb"] = _memory(stack.snapshotter.fuse_pid)[0]
        t0 = time.monotonic()
        lazy = pull_image(ctd, reg, refs["lazy"], snapshotter="coldstart", timeout=300)
        out["lazy"] = time.monotonic() - t0
        if spy is not None:
            spy.wait(timeout=120)
        if lazy.lazy_layers != 1:
            raise SystemExit(f"the lazy pull downloaded instead: {lazy}")
        # the daemons' memory with the layer mounted, then after every entry was looked up
        fuse_pid, grpc_pid = stack.snapshotter.fuse_pid, stack.snapshotter.proc.pid \
            if stack.snapshotter.proc else None
        time.sleep(SETTLE)  # the server indexes the layer in a thread after the mount
        out["fuse_rss_mb"], out["fuse_peak_mb"] = _memory(fuse_pid)
        out["grpc_rss_mb"], out["grpc_peak_mb"] = _memory(grpc_pid)
        mounts = _fuse_mounts(stack.snapshotter.base)
        out["walked"] = float(sum(_walk(m) for m in mounts))
        out["fuse_rss_walk_mb"], out["fuse_peak_walk_mb"] = _memory(fuse_pid)
        if not full:
            return out
        t0 = time.monotonic()
        pull_image(ctd, reg, refs["full"], snapshotter="overlayfs", timeout=600)
        out["full"] = time.monotonic() - t0
    return out


def _push_zstd(host: str, repo: str, work: Path, meta: dict[str, Any], key: str) -> str:
    z = meta["zstd"]
    push_layer(host, repo, (work / f"layer-{key}.zst").read_bytes(), LayerResult(
        digest=z["digest"], size=z["size"], diff_id=z["diff_id"], toc_digest=z["toc_digest"],
        media_type=z["media_type"], annotations=z["annotations"]))
    return f"{host}/{repo}:v1"


def idle_round(host: str, refs: list[str]) -> dict[str, float]:
    """The FUSE server's memory with every image of ``refs`` (one layer each) mounted lazily,
    once it has settled, and its peak while they were mounted."""
    with temp_local_stack(log_level="warning") as stack, \
            RegistryClient(insecure_hosts=[host]) as reg, \
            Containerd(stack.address, "default", timeout=600) as ctd:
        fuse_pid = stack.snapshotter.fuse_pid
        idle = _memory(fuse_pid)[0]
        for ref in refs:
            if pull_image(ctd, reg, ref, snapshotter="coldstart", timeout=300).lazy_layers != 1:
                raise SystemExit(f"{ref}: the lazy pull downloaded instead")
        time.sleep(SETTLE)
        rss, peak = _memory(fuse_pid)
        grpc = _memory(stack.snapshotter.proc.pid if stack.snapshotter.proc else None)
    return {"layers": float(len(refs)), "idle_mb": idle, "rss_mb": rss, "peak_mb": peak,
            "grpc_rss_mb": grpc[0], "grpc_peak_mb": grpc[1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/cs-bench-pull"),
                    help="where the built layers are cached (default %(default)s)")
    ap.add_argument("--spy", type=Path, default=None, metavar="DIR",
                    help="record the FUSE server with py-spy during each lazy pull")
    ap.add_argument("--lazy-only", action="store_true", help="skip containerd's full pull")
    ap.add_argument("--idle-layers", type=int, default=0, metavar="N",
                    help="also: the FUSE server's memory with N layers mounted (default: skip)")
    ap.add_argument("--idle-files", type=int, default=10_000, metavar="K",
                    help="files in each of those layers (default %(default)s)")
    args = ap.parse_args()
    meta = prepare(args.work, args.files)
    g = meta["gzip"]
    if args.spy:
        args.spy.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="cs-bp-", dir="/tmp") as tmp, \
            start_registry(Path(tmp) / "registry", access_log=False) as registry:
        host = registry.host
        _push_zstd(host, "bench/many-zstd", args.work, meta, str(args.files))
        gblob = (args.work / f"layer-{args.files}.tar.gz").read_bytes()
        push_layer(host, "bench/many-gzip", gblob, LayerResult(
            digest=g["digest"], size=g["size"], diff_id=meta["diff_id"], toc_digest="",
            media_type=MEDIA_TYPE_GZIP, annotations={}))
        refs = {"lazy": f"{host}/bench/many-zstd:v1", "full": f"{host}/bench/many-gzip:v1",
                "small": _push_zstd(host, "bench/few-zstd", args.work,
                                    prepare(args.work, SMALL_FILES), str(SMALL_FILES))}
        idle_refs = [_push_zstd(host, f"bench/layer-{n}", args.work,
                                prepare(args.work, args.idle_files, f"-{n}"),
                                f"{args.idle_files}-{n}") for n in range(args.idle_layers)]
        idle: dict[str, float] = {}
        if idle_refs:
            idle = idle_round(host, idle_refs)
            print(f"{args.idle_layers} layers of {args.idle_files:,} files mounted: FUSE server "
                  f"{idle['idle_mb']:.0f} MB before, {idle['rss_mb']:.0f} MB after "
                  f"(peak {idle['peak_mb']:.0f}); gRPC daemon {idle['grpc_rss_mb']:.0f} MB",
                  file=sys.stderr)
        for i in range(args.rounds):
            r = one_round(host, refs, args.spy, i, full=not args.lazy_only)
            full_s = f", full {r['full']:.2f} s" if "full" in r else ""
            print(f"round {i + 1}/{args.rounds}: lazy {r['lazy']:.2f} s{full_s}; FUSE server "
                  f"{r['fuse_idle_mb']:.0f} MB before, {r['fuse_small_mb']:.0f} MB with "
                  f"{SMALL_FILES} files, {r['fuse_rss_mb']:.0f} MB mounted "
                  f"(peak {r['fuse_peak_mb']:.0f}), "
                  f"{r['fuse_rss_walk_mb']:.0f} MB after lstat of {r['walked']:,.0f} entries "
                  f"(peak {r['fuse_peak_walk_mb']:.0f}); gRPC daemon {r['grpc_rss_mb']:.0f} MB "
                  f"(peak {r['grpc_peak_mb']:.0f})", file=sys.stderr)
            results.append(r)

    def stat(key: str) -> dict[str, float] | None:
        xs = [r[key] for r in results if key in r]
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None

    lazy, full = stat("lazy"), stat("full")
    assert lazy is not None
    memory = {k: stat(k) for k in ("fuse_idle_mb", "fuse_small_mb", "fuse_rss_mb", "fuse_peak_mb",
                                   "fuse_rss_walk_mb",
                                   "fuse_peak_walk_mb", "grpc_rss_mb", "grpc_peak_mb")}
    summary = {"files": args.files, "rounds": results, "lazy": lazy, "full": full,
               "memory_mb": memory, "idle": idle if idle_refs else None,
               "ratio_full_over_lazy": full["median"] / lazy["median"] if full else None,
               "us_per_entry_lazy": lazy["median"] / args.files * 1e6,
               "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print(f"| pull of 1 layer, {args.files:,} files | median | min-max |\n|---|---|---|")
    for name, st in (("coldstart lazy pull", lazy), ("containerd full pull + unpack", full)):
        if st is not None:
            print(f"| {name} | {st['median']:.2f} s | {st['min']:.2f}-{st['max']:.2f} s |")
    ratio = f"; full/lazy {summary['ratio_full_over_lazy']:.1f}x" if full else ""
    print(f"lazy: {summary['us_per_entry_lazy']:.1f} µs per TOC entry{ratio}")
    print("| daemon memory (MB, median of rounds) | RSS | peak |\n|---|---|---|")
    for name, rss, peak in (("FUSE server, before the pull", "fuse_idle_mb", "fuse_idle_mb"),
                            (f"FUSE server, a layer of {SMALL_FILES} files mounted",
                             "fuse_small_mb", "fuse_small_mb"),
                            ("FUSE server, layer mounted", "fuse_rss_mb", "fuse_peak_mb"),
                            ("FUSE server, after lstat of every entry", "fuse_rss_walk_mb",
                             "fuse_peak_walk_mb"),
                            ("gRPC snapshotter", "grpc_rss_mb", "grpc_peak_mb")):
        now, top = memory[rss], memory[peak]
        assert now is not None and top is not None
        print(f"| {name} | {now['median']:.0f} | {top['median']:.0f} |")
    if idle_refs:
        print(f"| FUSE server, {args.idle_layers} layers of {args.idle_files:,} files mounted "
              f"| {idle['rss_mb']:.0f} | {idle['peak_mb']:.0f} |")
    results_dir = REPO / "bench" / "results"
    results_dir.mkdir(exist_ok=True)
    path = results_dir / f"bench_pull-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(summary, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
