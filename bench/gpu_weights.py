"""Host-to-device loading benchmark for a GPU machine (runs on CPU as a smoke check).

Measures, on one checkpoint (page cache warm), in one run, medians of ``--runs``:
  * peak: one pinned host buffer -> device copy of the same byte count (the PCIe ceiling);
  * file -> pinned: the file read into pinned buffers (the staging's cut, as many threads) and
    no device copy: the host's side of a staged load alone;
  * pageable copies: no staging at all, the file's map copied to the device in 16 MiB pieces
    by as many threads (the driver stages pageable memory itself);
  * coldstart.load: ``coldstart.weights.load(file, device=DEV)`` (pinned staging + async H2D);
  * coldstart.load_file: the safetensors drop-in, ``coldstart.weights.load_file(file, DEV)``;
  * safetensors.safe_open: ``safe_open(file, framework="pt", device=DEV)``, every tensor;
  * safetensors.load_file: ``safetensors.torch.load_file(file, device=DEV)``;
  * fastsafetensors: ``fastsafe_open([file], nogds=True, device=DEV)``, every tensor (the peer;
    the row says why when it is not installed or fails);
checks each loader's tensors for bit-identity with coldstart's, on the device; times pinning
128 and 512 MiB with cudaHostAlloc against touching pages on every core and cudaHostRegister
(in one call, or in slices by as many threads); and records coldstart's pinned staging: the
most pinned bytes in use at once during its load (torch's host allocator statistics) against
``--max-host-mb``.

``--sweep`` first loads the file in fresh processes (each timed after CUDA is up), the first
load of a process paying for its pinned staging as a model server's one load does, over
staging sizes (chunk MiB, staging MiB, threads); the fastest first load then gets its own row
in the rounds, beside the defaults'.

    python bench/gpu_weights.py --size-gb 4 --runs 5 --sweep    # on a GPU machine
    python bench/gpu_weights.py --device cpu --size-gb 0.2      # smoke check anywhere

With ``--device cpu`` the "peak" row is a plain host memcpy (no pinned memory without CUDA).
Results: ``--out`` (bench/results by default): gpu-weights-<time>.json and .md. A generated
file is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

# (chunk MiB, staging MiB, threads, buffers the staging is cut into at least; 0 = the loader's
# default) tried by --sweep. The loader cuts into at least 16 (loader._STAGING_BUFFERS): 16/128
# stages 16 buffers of 8 MiB, 16/128 with 8 buffers 8 of 16 MiB.
SWEEP = [(16, 128, 0, 0), (16, 128, 0, 8), (16, 512, 0, 0), (4, 128, 0, 0), (8, 256, 0, 0),
         (16, 128, 32, 0), (32, 1024, 0, 0), (16, 64, 0, 0)]


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def empty_caches(device: str) -> None:
    import torch

    if not device.startswith("cuda"):
        return
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # torch >= 2.9: torch.accelerator.empty_host_cache; before: torch._C._host_emptyCache
    fn = (getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
          or getattr(torch._C, "_host_emptyCache", None))
    if fn is not None:
        fn()


def host_stats(device: str) -> dict[str, Any]:
    import torch

    if not device.startswith("cuda"):
        return {}
    fn = getattr(torch.cuda, "host_memory_stats", None)
    return dict(fn()) if fn is not None else {}


def reset_host_peak(device: str) -> None:
    import torch

    fn = getattr(torch.cuda, "reset_peak_host_memory_stats", None)
    if device.startswith("cuda") and fn is not None:
        fn()


def peak_copy(nbytes: int, device: str) -> float:
    """Seconds for one pinned host -> device copy of ``nbytes`` (host memcpy on cpu)."""
    import torch

    cuda = device.startswith("cuda")
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=cuda)  # warm-up: first-touch and context costs out of the timing
    sync(device)
    start = time.perf_counter()
    dst.copy_(src, non_blocking=cuda)
    sync(device)
    secs = time.perf_counter() - start
    del src, dst
    empty_caches(device)
    return secs


Loaded = tuple[float, dict[str, Any]]


def coldstart_load(path: Path, device: str, max_host_mb: int,
                   info: dict[str, Any] | None = None, buffers: int = 0, **kw: Any) -> Loaded:
    """``load(path, device=...)``; ``buffers``: cut the staging into at least that many (0: the
    loader's own cut)."""
    from coldstart.weights import LoadStats, load, loader

    if buffers:
        default, loader._STAGING_BUFFERS = loader._STAGING_BUFFERS, buffers
        try:
            return coldstart_load(path, device, max_host_mb, info, **kw)
        finally:
            loader._STAGING_BUFFERS = default
    stats = LoadStats()
    sync(device)
    reset_host_peak(device)
    # torch counts a pinned block active until it has processed the block's events, which can
    # be after the tensor holding it is gone: what a load pins is the peak over the blocks
    # still counted when it starts
    held = host_stats(device).get("active_bytes.current", 0)
    start = time.perf_counter()
    out = load(path, device=device, max_host_bytes=max_host_mb << 20, stats=stats, **kw)
    sync(device)
    secs = time.perf_counter() - start
    if info is not None:
        host = host_stats(device)
        peak = host.get("active_bytes.peak")
        info.update(path=stats.path, staging_bytes=stats.staging_bytes,
                    pinned_active_peak=None if peak is None else peak - held,
                    pinned_blocks_made=host.get("num_host_alloc"),
                    pinned_alloc_us=host.get("host_alloc_time.total"))
    return secs, out


def coldstart_load_file(path: Path, device: str) -> Loaded:
    from coldstart.weights import load_file

    sync(device)
    start = time.perf_counter()
    out = load_file(path, device=device)
    sync(device)
    return time.perf_counter() - start, out


def safe_open_load(path: Path, device: str) -> Loaded:
    from safetensors import safe_open

    sync(device)
    start = time.perf_counter()
    out = {}
    with safe_open(str(path), framework="pt", device=device) as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            out[name] = f.get_tensor(name)
    sync(device)
    return time.perf_counter() - start, out


def safetensors_load_file(path: Path, device: str) -> Loaded:
    from safetensors.torch import load_file

    sync(device)
    start = time.perf_counter()
    out = load_file(str(path), device=device)
    sync(device)
    return time.perf_counter() - start, out


def pread_pinned(path: Path, device: str, max_host_mb: int) -> Loaded:
    """The host's side alone: the file read into pinned buffers (the loader's staging cut, as
    many threads), no device copy. What a staged load can deliver at most."""
    import torch

    from coldstart.weights.loader import local_concurrency, staging_chunk

    cuda = device.startswith("cuda")
    chunk = staging_chunk(16 << 20, max_host_mb << 20)
    threads = local_concurrency(False)
    size = path.stat().st_size
    start = time.perf_counter()
    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda) for _ in range(threads)]
    fd = os.open(path, os.O_RDONLY)
    try:
        def work(i: int) -> None:
            view = memoryview(bufs[i].numpy())
            for off in range(i * chunk, size, threads * chunk):
                os.preadv(fd, [view[: min(chunk, size - off)]], off)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(work, range(threads)))
    finally:
        os.close(fd)
    secs = time.perf_counter() - start
    bufs.clear()
    return secs, {}


def pageable_copies(path: Path, device: str) -> Loaded:
    """No staging at all: the file's private map (page cache warm) copied to the device in
    16 MiB pieces by as many threads as a staged load has, each on its own stream; the driver
    stages pageable memory itself. Raw bytes into one buffer: no tensors, nothing verified."""
    import mmap

    import torch

    from coldstart.weights.loader import local_concurrency

    chunk = 16 << 20
    threads = local_concurrency(False)
    cuda = device.startswith("cuda")
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        src = torch.frombuffer(mapping, dtype=torch.uint8)
        size = src.numel()
        sync(device)
        start = time.perf_counter()
        dst = torch.empty(size, dtype=torch.uint8, device=device)

        def work(i: int) -> None:
            stream = (torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
                      if cuda else None)
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                for off in range(i * chunk, size, threads * chunk):
                    dst[off : off + chunk].copy_(src[off : off + chunk])
            if stream is not None:
                stream.synchronize()

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(work, range(threads)))
        sync(device)
        secs = time.perf_counter() - start
        # the tensor views the map: drop both before the map closes
        src = dst = torch.empty(0)
    finally:
        mapping.close()
    return secs, {}


def pinning(device: str, mb: int) -> dict[str, Any]:
    """Milliseconds to pin ``mb`` MiB: torch's pinned allocator (cudaHostAlloc, what the loader
    uses) against anonymous pages touched first on every core (``fill_``), then registered
    (cudaHostRegister) in one call, or in page-aligned slices by as many threads. Run in a child
    process (``--pinning``): a failed CUDA call leaves nothing behind for the timed rounds."""
    import mmap

    import torch

    from coldstart.weights.loader import local_concurrency

    if not device.startswith("cuda"):
        return {}
    nbytes = mb << 20
    out: dict[str, Any] = {}
    torch.zeros(1, device=device)
    start = time.perf_counter()
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out["cudaHostAlloc_ms"] = (time.perf_counter() - start) * 1e3
    del pinned
    rt = torch.cuda.cudart()
    threads = local_concurrency(False)
    step = nbytes // threads // mmap.PAGESIZE * mmap.PAGESIZE
    for how in ("one call", "threads"):
        pages = mmap.mmap(-1, nbytes)
        view = torch.frombuffer(pages, dtype=torch.uint8)
        base = view.data_ptr()
        start = time.perf_counter()
        view.fill_(0)
        touched = time.perf_counter()
        if how == "one call":
            spans = [(base, nbytes)]
        else:
            spans = [(base + i * step, step if i < threads - 1 else nbytes - i * step)
                     for i in range(threads)]
        with ThreadPoolExecutor(len(spans)) as pool:
            errs = list(pool.map(lambda span: int(rt.cudaHostRegister(span[0], span[1], 0)),
                                 spans))
        done = time.perf_counter()
        for (ptr, _), err in zip(spans, errs, strict=True):
            if err == 0:
                rt.cudaHostUnregister(ptr)
        out[f"touch_ms ({how})"] = (touched - start) * 1e3
        out[f"cudaHostRegister_ms ({how})"] = (done - touched) * 1e3
        out[f"errors ({how})"] = sorted({e for e in errs if e})
        del view
        pages.close()
    return out


def fastsafetensors_load(path: Path, device: str) -> Loaded:
    import torch
    from fastsafetensors import fastsafe_open

    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # it wants the index: "cuda" is refused
        device = f"cuda:{torch.cuda.current_device()}"
    sync(device)
    start = time.perf_counter()
    with fastsafe_open(filenames=[str(path)], nogds=True, device=device) as f:
        out = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    sync(device)
    return time.perf_counter() - start, out


def identical(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    if sorted(a) != sorted(b):
        return False
    for name, x in a.items():
        y = b[name]
        if x.dtype != y.dtype or tuple(x.shape) != tuple(y.shape):
            return False
        if x.device != y.device:
            y = y.to(x.device)
        if x.numel() and not torch.equal(x.reshape(-1).view(torch.uint8),
                                         y.reshape(-1).view(torch.uint8)):
            return False
    return True


def time_calls(acc: dict[str, list[float]]) -> None:
    """Sum the seconds (over every thread) spent in the staged pipeline's steps, into ``acc``:
    the read into the staging buffer, queuing its device copy, waiting for a buffer's last copy
    to land, and handing a finished tensor out."""
    import threading

    from coldstart.remote.local import LocalFileBlob
    from coldstart.weights import loader

    lock = threading.Lock()

    def wrap(owner: Any, name: str, label: str) -> None:
        orig = getattr(owner, name)

        def timed(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                took = time.perf_counter() - start
                with lock:
                    calls = acc.setdefault(label, [0.0, 0])
                    calls[0] += took
                    calls[1] += 1

        setattr(owner, name, timed)

    wrap(LocalFileBlob, "read_into", "read_into")
    wrap(loader._CudaCopies, "copy_async", "copy_async")
    wrap(loader._CudaCopies, "host_wait", "host_wait")
    wrap(loader._Staging, "get", "waiting for a free buffer (host_wait within)")
    wrap(loader, "_finish", "finish (main thread)")


def child(path: Path, device: str, spec: str) -> None:
    """One fresh process: CUDA up first, then two loads; prints one JSON line."""
    import torch

    chunk_mb, host_mb, threads, buffers = (int(x) for x in spec.split(","))
    t0 = time.perf_counter()
    if device.startswith("cuda"):
        torch.zeros(1, device=device)
        sync(device)
    up = time.perf_counter() - t0
    kw: dict[str, Any] = {"chunk_bytes": chunk_mb << 20, "buffers": buffers}
    if threads:
        kw["concurrency"] = threads
    runs = []
    acc: dict[str, list[float]] = {}
    time_calls(acc)
    for _ in range(2):
        info: dict[str, Any] = {}
        acc.clear()
        secs, out = coldstart_load(path, device, host_mb, info, **kw)
        runs.append({"seconds": secs, **info,
                     "thread_seconds": {k: [round(v[0], 4), int(v[1])] for k, v in acc.items()}})
        del out
        torch.cuda.empty_cache() if device.startswith("cuda") else None
    print(json.dumps({"spec": [chunk_mb, host_mb, threads, buffers], "cuda_up_s": up,
                      "loads": runs}))


def sweep(path: Path, device: str, size: int) -> list[dict[str, Any]]:
    rows = []
    for chunk_mb, host_mb, threads, buffers in SWEEP:
        spec = f"{chunk_mb},{host_mb},{threads},{buffers}"
        try:
            proc = subprocess.run([sys.executable, __file__, "--file", str(path), "--device",
                                   device, "--child", spec], capture_output=True, text=True,
                                  timeout=120)
        except subprocess.TimeoutExpired:
            rows.append({"spec": spec, "error": "no answer within 120 s"})
            print(f"sweep {spec}: no answer within 120 s", flush=True)
            continue
        if proc.returncode != 0:
            rows.append({"spec": spec, "error": proc.stderr.strip()[-2000:]})
            print(f"sweep {spec}: failed: {proc.stderr.strip()[-300:]}", flush=True)
            continue
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        first, second = row["loads"]
        row["first_gb_per_s"] = size / first["seconds"] / 1e9
        row["second_gb_per_s"] = size / second["seconds"] / 1e9
        rows.append(row)
        print(f"sweep chunk {chunk_mb} MiB, staging {host_mb} MiB, threads {threads or 'auto'}, "
              f"buffers >= {buffers or 'default'}: "
              f"first load {row['first_gb_per_s']:.2f} GB/s, second "
              f"{row['second_gb_per_s']:.2f} GB/s; pinned peak "
              f"{(first.get('pinned_active_peak') or 0) / 2**20:.0f} MiB, pinning "
              f"{(first.get('pinned_alloc_us') or 0) / 1e3:.0f} ms; second load's thread-seconds "
              f"[s, calls]: {second.get('thread_seconds')}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--file", type=Path, help="existing .safetensors file (default: generate one)")
    p.add_argument("--dir", type=Path, default=Path("/var/tmp/coldstart-gpu-weights"))
    p.add_argument("--size-gb", type=float, default=4.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-host-mb", type=int, default=128, choices=range(1, 1 << 20),
                   metavar="MB", help="coldstart's pinned staging budget (its default)")
    p.add_argument("--sweep", action="store_true", help="also time fresh-process loads over "
                   "staging sizes (see SWEEP)")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--pinning", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --device cpu for a smoke check")
    if args.child:
        child(args.file, args.device, args.child)
        return
    if args.pinning:
        print(json.dumps(pinning(args.device, args.pinning)))
        return
    from bench_weights import write_model

    generated = args.file is None
    path: Path = args.file or args.dir / "model.safetensors"
    if generated:
        args.dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        write_model(path, int(args.size_gb * 1e9))
        print(f"wrote {path} in {time.perf_counter() - t0:.1f} s", flush=True)
    size = path.stat().st_size
    loaders: dict[str, Callable[[], Loaded]] = {
        "file -> pinned (no device copy)": lambda: pread_pinned(path, args.device,
                                                                args.max_host_mb),
        "pageable copies, no staging (16 MiB, threads)": lambda: pageable_copies(path,
                                                                               args.device),
        "coldstart.load": lambda: coldstart_load(path, args.device, args.max_host_mb, info),
        "coldstart.load_file": lambda: coldstart_load_file(path, args.device),
        "safetensors.safe_open": lambda: safe_open_load(path, args.device),
        "safetensors.load_file": lambda: safetensors_load_file(path, args.device),
        "fastsafetensors": lambda: fastsafetensors_load(path, args.device),
    }
    rows: dict[str, list[float]] = {"peak": []}
    failed: dict[str, str] = {}
    same: dict[str, bool] = {}
    info: dict[str, Any] = {}
    staging: list[dict[str, Any]] = []
    swept: list[dict[str, Any]] = []
    try:
        subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)  # warm cache
        pinned_ms: dict[str, Any] = {}
        if args.device.startswith("cuda"):
            for mb in (128, 512):
                try:
                    proc = subprocess.run([sys.executable, __file__, "--device", args.device,
                                           "--pinning", str(mb)], capture_output=True,
                                          text=True, timeout=120)
                    pinned_ms[f"{mb} MiB"] = (json.loads(proc.stdout.strip().splitlines()[-1])
                                              if proc.returncode == 0 else
                                              {"error": proc.stderr.strip()[-500:]})
                except (subprocess.TimeoutExpired, ValueError, IndexError) as exc:
                    pinned_ms[f"{mb} MiB"] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"pinning: {pinned_ms}", flush=True)
        if args.sweep:
            swept = sweep(path, args.device, size)
            done = [s for s in swept if "loads" in s]
            if done:
                best = max(done, key=lambda s: s["first_gb_per_s"])
                chunk_mb, host_mb, threads, buffers = best["spec"]
                kw: dict[str, Any] = {"chunk_bytes": chunk_mb << 20}
                if threads:
                    kw["concurrency"] = threads
                if buffers:  # the cut the sweep found best, for this row only
                    kw["buffers"] = buffers
                loaders[f"coldstart.load ({chunk_mb}/{host_mb} MiB, threads "
                        f"{threads or 'auto'}, buffers >= {buffers or 'default'}: the sweep's "
                        "best)"] = (
                    lambda: coldstart_load(path, args.device, host_mb, None, **kw))
        for r in range(args.runs):
            rows["peak"].append(peak_copy(size, args.device))
            ref: dict[str, Any] | None = None
            for name, fn in loaders.items():
                rows.setdefault(name, [])
                if name in failed:
                    continue
                try:
                    secs, out = fn()
                except Exception as exc:  # a peer that is missing or fails here: say why
                    failed[name] = f"{type(exc).__name__}: {exc}"
                    print(f"{name}: {failed[name]}", flush=True)
                    continue
                rows[name].append(secs)
                # every loader pins its own staging, as a process's first load does
                empty_caches(args.device)
                if not out:
                    continue
                if name == "coldstart.load":
                    staging.append(dict(info))
                    if r == 0:
                        ref = out
                        continue
                elif r == 0 and ref is not None:
                    same[name] = identical(ref, out)
                del out
                empty_caches(args.device)
            del ref
            empty_caches(args.device)
            print(f"round {r + 1}: " + "  ".join(f"{k} {size / v[-1] / 1e9:.2f} GB/s"
                                                 for k, v in rows.items() if len(v) > r),
                  flush=True)
    finally:
        if generated:
            path.unlink(missing_ok=True)
    med = {k: size / statistics.median(v) / 1e9 for k, v in rows.items() if v}
    peak_pinned = max((s.get("pinned_active_peak") or 0 for s in staging), default=0)
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "cpus": os.cpu_count(),
        "bytes": size, "runs": args.runs, "max_host_mb": args.max_host_mb,
        "coldstart_path": info.get("path", ""),
        "seconds": rows, "median_gb_per_s": med, "failed": failed,
        "bit_identical_to_coldstart": same,
        "coldstart_staging": staging,
        "coldstart_pinned_peak_bytes": peak_pinned,
        "pinned_peak_within_max_host": peak_pinned <= args.max_host_mb << 20,
        "ratio_coldstart_vs_peak": med.get("coldstart.load", 0) / med["peak"],
        "sweep": swept,
        "pinning_ms": pinned_ms,
    }
    for peer in ("safetensors.safe_open", "safetensors.load_file", "fastsafetensors"):
        if peer in med and "coldstart.load" in med:
            result[f"ratio_coldstart_vs_{peer}"] = med["coldstart.load"] / med[peer]
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    (args.out / f"gpu-weights-{stamp}.json").write_text(json.dumps(result, indent=2))
    table = "\n".join([
        f"# H2D weights benchmark {result['date']} on {result['device_name']} "
        f"({size / 1e9:.2f} GB, page cache warm, medians of {args.runs})", "",
        "| loader | GB/s | x peak | bit-identical to coldstart.load |", "|---|---|---|---|",
        *(f"| {k} | {v:.2f} | {v / med['peak']:.2f} | "
          f"{same.get(k, '-')} |"
          for k, v in med.items()),
        *(f"| {k} | failed: {why[:160]} | | |" for k, why in failed.items()),
        "", f"coldstart path: {info.get('path', '')}; pinned staging in use at once: "
        f"{peak_pinned / 2**20:.0f} MiB (max_host {args.max_host_mb} MiB)", ""])
    if swept:
        table += "\n".join([
            "", "Fresh processes (CUDA up first; the first load pays for its pinned staging):",
            "", "| chunk MiB | staging MiB | threads | buffers >= | first GB/s | second GB/s "
            "| pinning ms |", "|---|---|---|---|---|---|---|",
            *(f"| {s['spec'][0]} | {s['spec'][1]} | {s['spec'][2] or 'auto'} | "
              f"{s['spec'][3] or 16} | "
              f"{s['first_gb_per_s']:.2f} | {s['second_gb_per_s']:.2f} | "
              f"{(s['loads'][0].get('pinned_alloc_us') or 0) / 1e3:.0f} |"
              for s in swept if "loads" in s), ""])
    (args.out / f"gpu-weights-{stamp}.md").write_text(table)
    print(table)
    bad = [k for k, ok in same.items() if not ok]
    if bad:
        raise SystemExit(f"tensors differ from coldstart.load's: {', '.join(bad)}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(HERE.parent))
    main()
