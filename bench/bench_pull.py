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


def build_tar(path: Path, files: int) -> None:
    """``files`` small files (distinct contents) in directories of 100, plus the directories."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for d in range((files + 99) // 100):
            ti = tarfile.TarInfo(f"pkg/d{d:05d}")
            ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, 1_700_000_000
            tf.addfile(ti)
            for f in range(min(100, files - d * 100)):
                data = f"# module {d}.{f}\nVALUE = {d * 100 + f}\n".encode()
                ti = tarfile.TarInfo(f"pkg/d{d:05d}/m{f:03d}.py")
                ti.size, ti.mode, ti.mtime = len(data), 0o644, 1_700_000_000
                tf.addfile(ti, io.BytesIO(data))


def prepare(work: Path, files: int) -> dict[str, Any]:
    """The tar, its gzip blob and its zstd:chunked conversion, cached in ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    meta_path = work / f"meta-{files}.json"
    if meta_path.exists():
        return json.loads(meta_path.read_text())  # type: ignore[no-any-return]
    tar = work / f"layer-{files}.tar"
    t0 = time.monotonic()
    build_tar(tar, files)
    raw = tar.read_bytes()
    gz = gzip.compress(raw, compresslevel=1, mtime=0)
    (work / f"layer-{files}.tar.gz").write_bytes(gz)
    with open(tar, "rb") as src, open(work / f"layer-{files}.zst", "wb") as dst:
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


def one_round(host: str, refs: dict[str, str], spy_dir: Path | None, i: int,
              full: bool = True) -> dict[str, float]:
    out: dict[str, float] = {}
    with temp_local_stack(log_level="warning") as stack, \
            RegistryClient(insecure_hosts=[host]) as reg, \
            Containerd(stack.address, "default", timeout=600) as ctd:
        spy = _spy(stack.snapshotter.fuse_pid,
                   spy_dir / f"lazy-{i}.folded.txt" if spy_dir else None)
        t0 = time.monotonic()
        lazy = pull_image(ctd, reg, refs["lazy"], snapshotter="coldstart", timeout=300)
        out["lazy"] = time.monotonic() - t0
        if spy is not None:
            spy.wait(timeout=120)
        if lazy.lazy_layers != 1:
            raise SystemExit(f"the lazy pull downloaded instead: {lazy}")
        if not full:
            return out
        t0 = time.monotonic()
        pull_image(ctd, reg, refs["full"], snapshotter="overlayfs", timeout=600)
        out["full"] = time.monotonic() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/cs-bench-pull"),
                    help="where the built layers are cached (default %(default)s)")
    ap.add_argument("--spy", type=Path, default=None, metavar="DIR",
                    help="record the FUSE server with py-spy during each lazy pull")
    ap.add_argument("--lazy-only", action="store_true", help="skip containerd's full pull")
    args = ap.parse_args()
    meta = prepare(args.work, args.files)
    z = meta["zstd"]
    g = meta["gzip"]
    if args.spy:
        args.spy.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="cs-bp-", dir="/tmp") as tmp, \
            start_registry(Path(tmp) / "registry", access_log=False) as registry:
        host = registry.host
        zblob = (args.work / f"layer-{args.files}.zst").read_bytes()
        push_layer(host, "bench/many-zstd", zblob, LayerResult(
            digest=z["digest"], size=z["size"], diff_id=z["diff_id"],
            toc_digest=z["toc_digest"], media_type=z["media_type"],
            annotations=z["annotations"]))
        gblob = (args.work / f"layer-{args.files}.tar.gz").read_bytes()
        push_layer(host, "bench/many-gzip", gblob, LayerResult(
            digest=g["digest"], size=g["size"], diff_id=meta["diff_id"], toc_digest="",
            media_type=MEDIA_TYPE_GZIP, annotations={}))
        refs = {"lazy": f"{host}/bench/many-zstd:v1", "full": f"{host}/bench/many-gzip:v1"}
        for i in range(args.rounds):
            r = one_round(host, refs, args.spy, i, full=not args.lazy_only)
            full_s = f", full {r['full']:.2f} s" if "full" in r else ""
            print(f"round {i + 1}/{args.rounds}: lazy {r['lazy']:.2f} s{full_s}",
                  file=sys.stderr)
            results.append(r)

    def stat(key: str) -> dict[str, float] | None:
        xs = [r[key] for r in results if key in r]
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None

    lazy, full = stat("lazy"), stat("full")
    assert lazy is not None
    summary = {"files": args.files, "rounds": results, "lazy": lazy, "full": full,
               "ratio_full_over_lazy": full["median"] / lazy["median"] if full else None,
               "us_per_entry_lazy": lazy["median"] / args.files * 1e6,
               "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print(f"| pull of 1 layer, {args.files:,} files | median | min-max |\n|---|---|---|")
    for name, st in (("coldstart lazy pull", lazy), ("containerd full pull + unpack", full)):
        if st is not None:
            print(f"| {name} | {st['median']:.2f} s | {st['min']:.2f}-{st['max']:.2f} s |")
    ratio = f"; full/lazy {summary['ratio_full_over_lazy']:.1f}x" if full else ""
    print(f"lazy: {summary['us_per_entry_lazy']:.1f} µs per TOC entry{ratio}")
    results_dir = REPO / "bench" / "results"
    results_dir.mkdir(exist_ok=True)
    path = results_dir / f"bench_pull-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(summary, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
