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

After each lazy pull (and ``SETTLE`` seconds), the FUSE server's memory, then ``find -ls``
over the mounted layer (every entry listed and stat'ed, as a user's check does): its time, the
FUSE server's CPU during it and ``find``'s own (the kernel's work of making each dentry and inode
is done in find's context), and the memory after it. Each round also times ``find -ls`` over the
same tree unpacked on the local disk with the kernel's caches dropped: this machine's floor for
a first walk of that many entries, to read the lazy figure against. ``--fill on,off`` (default
both): with the product's background fill (``fetch.background_rate`` left at its default, as a
user runs it) and without it.
``--before DIR``: the same rounds with the code of checkout DIR too (``git worktree add DIR
<commit>``; copy ``coldstart/_proto`` into it), each arm in a child process of its own, arms
alternated, so before and after are measured in one run. Prints medians (min-max) per arm;
writes JSON to ``bench/results/bench_pull-<time>.json``. ``--spy DIR`` records the FUSE server
with py-spy during each lazy pull and each find (folded stacks, for flamegraph.pl or
speedscope), to see where the time goes. The torch image's pull next to stargz's
``ctr-remote image rpull`` is ``coldstart bench builtin:torch --embedded --mode
coldstart,stargz`` (its ``pull`` phase).
Needs root; take the bench lock when others measure::

    flock /tmp/cs-bench.lock .venv/bin/python bench/bench_pull.py [--files 200000] [--rounds 3]
        [--fill on,off] [--before /tmp/cs-before] [--lazy-only]
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import io
import json
import os
import resource
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
# --before runs each round of that arm in a child process with this set to that checkout: its
# coldstart (and the daemons the stack starts from it) is measured, with this script's rounds
sys.path.insert(0, os.environ.get("COLDSTART_BENCH_CODE", str(REPO)))

from coldstart.benchmark.node import drop_caches  # noqa: E402
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


def _fs_type(path: Path) -> str:
    """The file system type ``path`` is on (its mount's)."""
    proc = subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True,
                          check=False, timeout=30)
    return proc.stdout.strip() or "?"


def _cpu(pid: int | None) -> tuple[float, float]:
    """CPU seconds (user, system) ``pid`` has used so far (0, 0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


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


def _find(root: Path) -> int:
    """``find ROOT -ls`` (every entry looked up and stat'ed, as a user's check does); the
    number of entries."""
    proc = subprocess.run(["find", str(root), "-mindepth", "1", "-ls"], capture_output=True,
                          check=True, timeout=600)
    return proc.stdout.count(b"\n")


def unpacked(work: Path, files: int) -> Path:
    """The layer's tree unpacked on the local disk (cached in ``work``): the floor a ``find``
    over the same entries has on this machine."""
    tree = work / f"tree-{files}"
    if not (tree / ".complete").exists():
        shutil.rmtree(tree, ignore_errors=True)
        tree.mkdir(parents=True)
        with tarfile.open(work / f"layer-{files}.tar.gz") as tf:
            tf.extractall(tree, filter="tar")
        (tree / ".complete").touch()
    return tree


def floor_round(tree: Path) -> float:
    """``find -ls`` over ``tree`` on the local disk with the kernel's caches dropped (dentries,
    inodes, pages) and ``SETTLE`` seconds after, as the lazy rounds wait after their pull:
    seconds."""
    drop_caches(SETTLE)
    t0 = time.monotonic()
    _find(tree)
    return time.monotonic() - t0


def one_round(host: str, refs: dict[str, str], spy_dir: Path | None, i: int,
              fill: bool = True) -> dict[str, float]:
    """One lazy pull of the big layer on a fresh node, with the product's background fill
    (``fill``: ``fetch.background_rate`` left at its default) or without it (0)."""
    out: dict[str, float] = {}
    with temp_local_stack(log_level="warning", background_rate=None if fill else 0) as stack, \
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
        spy = _spy(fuse_pid, spy_dir / f"find-{i}.folded.txt" if spy_dir else None)
        cpu0, kids0 = _cpu(fuse_pid), resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        out["walked"] = float(sum(_find(m) for m in mounts))
        out["find"] = time.monotonic() - t0
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = _cpu(fuse_pid)
        out["find_server_cpu"] = cpu[0] - cpu0[0] + cpu[1] - cpu0[1]
        out["find_server_sys"] = cpu[1] - cpu0[1]
        out["find_own_cpu"] = (kids.ru_utime - kids0.ru_utime) + (kids.ru_stime - kids0.ru_stime)
        if spy is not None:
            spy.wait(timeout=120)
        out["fuse_rss_walk_mb"], out["fuse_peak_walk_mb"] = _memory(fuse_pid)
    return out


def full_round(host: str, refs: dict[str, str]) -> float:
    """containerd's full pull and unpack of the gzip image, on a fresh node: seconds."""
    with temp_local_stack(log_level="warning") as stack, \
            RegistryClient(insecure_hosts=[host]) as reg, \
            Containerd(stack.address, "default", timeout=600) as ctd:
        t0 = time.monotonic()
        pull_image(ctd, reg, refs["full"], snapshotter="overlayfs", timeout=600)
        return time.monotonic() - t0


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


@dataclasses.dataclass(frozen=True)
class Arm:
    """One configuration measured each round: whose code, with or without the fill."""

    code: str           # "after" (this checkout) or "before" (--before DIR)
    fill: bool

    @property
    def name(self) -> str:
        return f"{self.code}, fill {'on' if self.fill else 'off'}"


def run_arm(arm: Arm, before: Path | None, host: str, refs: dict[str, str], i: int,
            spy: Path | None) -> dict[str, float]:
    """One lazy round of ``arm`` in a child process (a fresh interpreter: no memory of the
    other arms), with the code the arm names."""
    env = dict(os.environ, COLDSTART_BENCH_CODE=str(before if arm.code == "before" else REPO))
    job = json.dumps({"host": host, "refs": refs, "i": i, "fill": arm.fill,
                      "spy": str(spy) if spy else None})
    proc = subprocess.run([sys.executable, __file__, "--child", job], env=env, check=False,
                          stdout=subprocess.PIPE, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{arm.name}: round {i + 1} failed (exit {proc.returncode})")
    return dict(json.loads(proc.stdout.decode().strip().splitlines()[-1]))


def child(job: str) -> None:
    j = json.loads(job)
    r = one_round(j["host"], j["refs"], Path(j["spy"]) if j["spy"] else None, j["i"],
                  fill=j["fill"])
    print(json.dumps(r))


def _stat(xs: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None


#: what each arm reports: (key, label, unit)
FIGURES = (("lazy", "lazy pull", "s"), ("fuse_rss_mb", "FUSE server RSS, layer mounted", "MB"),
           ("fuse_peak_mb", "FUSE server peak RSS (the TOC's parse)", "MB"),
           ("find", "find -ls over the layer", "s"),
           ("find_server_cpu", "FUSE server CPU during the find", "s"),
           ("find_server_sys", "of which in the kernel (system)", "s"),
           ("find_own_cpu", "find's own CPU (user + system, the kernel's work for it)", "s"),
           ("fuse_rss_walk_mb", "FUSE server RSS after the find", "MB"),
           ("fuse_peak_walk_mb", "FUSE server peak RSS by then", "MB"),
           ("grpc_rss_mb", "gRPC snapshotter RSS", "MB"))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/cs-bench-pull"),
                    help="where the built layers are cached (default %(default)s)")
    ap.add_argument("--spy", type=Path, default=None, metavar="DIR",
                    help="record the FUSE server with py-spy during each lazy pull and each find")
    ap.add_argument("--lazy-only", action="store_true", help="skip containerd's full pull")
    ap.add_argument("--fill", default="on,off", metavar="on,off",
                    help="the lazy rounds with the product's background fill (on), without it "
                         "(off), or both (default %(default)s)")
    ap.add_argument("--before", type=Path, default=None, metavar="DIR",
                    help="also measure the code of this checkout (each arm alternated in the "
                         "same rounds)")
    ap.add_argument("--idle-layers", type=int, default=0, metavar="N",
                    help="also: the FUSE server's memory with N layers mounted (default: skip)")
    ap.add_argument("--idle-files", type=int, default=10_000, metavar="K",
                    help="files in each of those layers (default %(default)s)")
    args = ap.parse_args()
    fills = [f.strip() for f in args.fill.split(",") if f.strip()]
    if not fills or any(f not in ("on", "off") for f in fills):
        ap.error("--fill: on, off or on,off")
    if args.before is not None and not (args.before / "coldstart" / "_proto").is_dir():
        ap.error(f"--before {args.before}: no coldstart/_proto there (copy this checkout's)")
    arms = [Arm(code, f == "on") for code in (["before"] if args.before else []) + ["after"]
            for f in fills]
    meta = prepare(args.work, args.files)
    g = meta["gzip"]
    if args.spy:
        args.spy.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, float]]] = {a.name: [] for a in arms}
    full_s: list[float] = []
    floor_s: list[float] = []
    floor_tree = unpacked(args.work, args.files)
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
            for arm in arms if i % 2 == 0 else arms[::-1]:      # alternated
                r = run_arm(arm, args.before, host, refs, i, args.spy)
                results[arm.name].append(r)
                print(f"round {i + 1}/{args.rounds}, {arm.name}: lazy {r['lazy']:.2f} s; FUSE "
                      f"server {r['fuse_rss_mb']:.0f} MB mounted (peak "
                      f"{r['fuse_peak_mb']:.0f}), find -ls of {r['walked']:,.0f} entries "
                      f"{r['find']:.2f} s (server CPU {r.get('find_server_cpu', 0):.2f} s, system "
                      f"{r.get('find_server_sys', 0):.2f} s; "
                      f"find's {r.get('find_own_cpu', 0):.2f} s), then "
                      f"{r['fuse_rss_walk_mb']:.0f} MB (peak "
                      f"{r['fuse_peak_walk_mb']:.0f})", file=sys.stderr)
            floor_s.append(floor_round(floor_tree))
            print(f"round {i + 1}/{args.rounds}: find -ls over the same tree on the local disk "
                  f"{floor_s[-1]:.2f} s", file=sys.stderr)
            if not args.lazy_only:
                full_s.append(full_round(host, refs))
                print(f"round {i + 1}/{args.rounds}: full pull {full_s[-1]:.2f} s",
                      file=sys.stderr)

    table = {name: {k: _stat([r[k] for r in rs if k in r]) for k, _, _ in FIGURES}
             for name, rs in results.items()}
    full = _stat(full_s)
    floor = _stat(floor_s)
    print(f"| {args.files:,} files, median (min-max) of {args.rounds} | "
          + " | ".join(a.name for a in arms) + " |")
    print("|---|" + "---|" * len(arms))
    for key, label, unit in FIGURES:
        cells = []
        for a in arms:
            st = table[a.name][key]
            fmt = ".2f" if unit == "s" else ".0f"
            cells.append("-" if st is None else
                         f"{st['median']:{fmt}} {unit} ({st['min']:{fmt}}-{st['max']:{fmt}})")
        print(f"| {label} | " + " | ".join(cells) + " |")
    if floor is not None:
        print(f"find -ls over the same tree on the local disk ({_fs_type(floor_tree)}, caches "
              f"dropped): {floor['median']:.2f} s ({floor['min']:.2f}-{floor['max']:.2f}), the "
              f"machine's floor")
    if full is not None:
        print(f"containerd full pull + unpack: {full['median']:.2f} s "
              f"({full['min']:.2f}-{full['max']:.2f})")
    if idle_refs:
        print(f"| FUSE server, {args.idle_layers} layers of {args.idle_files:,} files mounted "
              f"| {idle['rss_mb']:.0f} | {idle['peak_mb']:.0f} |")
    summary = {"files": args.files, "rounds": results, "arms": table, "full": full,
               "find_floor": floor, "idle": idle if idle_refs else None,
               "before": str(args.before or ""),
               "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
    results_dir = REPO / "bench" / "results"
    results_dir.mkdir(exist_ok=True)
    path = results_dir / f"bench_pull-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(summary, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
