"""Host-to-device loading benchmark, prepared for when a GPU is lent (runs on CPU as a smoke check).

Measures, on one checkpoint, in one run (medians of ``--runs``):
  * peak: pinned host buffer -> device copy of the same byte count (the PCIe ceiling);
  * coldstart: ``coldstart.weights.load(file, device=DEV)`` (pinned staging + async H2D);
  * safe_open: ``safetensors.safe_open(file, framework="pt", device=DEV)`` reading every tensor;
and checks that coldstart's tensors are bit-identical to safe_open's, on the device.

    python bench/gpu_weights.py --size-gb 4 --runs 3            # on a GPU machine
    python bench/gpu_weights.py --device cpu --size-gb 0.2      # smoke check anywhere

With ``--device cpu`` the "peak" row is a plain host memcpy (no pinned memory without CUDA).
Results: bench/results/gpu-weights-<time>.json and .md. A generated file is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


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
    return time.perf_counter() - start


def coldstart_load(path: Path, device: str, max_host_mb: int) -> tuple[float, dict[str, Any], str]:
    from coldstart.weights import LoadStats, load

    stats = LoadStats()
    sync(device)
    start = time.perf_counter()
    out = load(path, device=device, max_host_bytes=max_host_mb << 20, stats=stats)
    sync(device)
    return time.perf_counter() - start, out, stats.path


def safe_open_load(path: Path, device: str) -> tuple[float, dict[str, Any]]:
    from safetensors import safe_open

    sync(device)
    start = time.perf_counter()
    out = {}
    with safe_open(str(path), framework="pt", device=device) as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            out[name] = f.get_tensor(name)
    sync(device)
    return time.perf_counter() - start, out


def identical(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    if sorted(a) != sorted(b):
        return False
    for name, x in a.items():
        y = b[name]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.numel() and not torch.equal(x.reshape(-1).view(torch.uint8),
                                         y.reshape(-1).view(torch.uint8)):
            return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--file", type=Path, help="existing .safetensors file (default: generate one)")
    p.add_argument("--dir", type=Path, default=Path("/var/tmp/coldstart-gpu-weights"))
    p.add_argument("--size-gb", type=float, default=4.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-host-mb", type=int, default=512)
    args = p.parse_args()

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --device cpu for a smoke check")
    from bench_weights import write_model

    generated = args.file is None
    path: Path = args.file or args.dir / "model.safetensors"
    if generated:
        args.dir.mkdir(parents=True, exist_ok=True)
        write_model(path, int(args.size_gb * 1e9))
    size = path.stat().st_size
    try:
        subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)  # warm cache
        rows: dict[str, list[float]] = {"peak": [], "coldstart": [], "safe_open": []}
        path_used = ""
        ok = True
        for r in range(args.runs):
            rows["peak"].append(peak_copy(size, args.device))
            secs, ours, path_used = coldstart_load(path, args.device, args.max_host_mb)
            rows["coldstart"].append(secs)
            secs, theirs = safe_open_load(path, args.device)
            rows["safe_open"].append(secs)
            if r == 0:
                ok = identical(ours, theirs)
            del ours, theirs
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            print(f"round {r + 1}: " + "  ".join(f"{k} {size / v[-1] / 1e9:.2f} GB/s"
                                                 for k, v in rows.items()), flush=True)
    finally:
        if generated:
            path.unlink(missing_ok=True)
    med = {k: size / statistics.median(v) / 1e9 for k, v in rows.items()}
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "bytes": size, "runs": args.runs, "max_host_mb": args.max_host_mb,
        "coldstart_path": path_used, "bit_identical_to_safe_open": ok,
        "median_gb_per_s": med,
        "ratio_coldstart_vs_peak": med["coldstart"] / med["peak"],
        "ratio_coldstart_vs_safe_open": med["coldstart"] / med["safe_open"],
    }
    out_dir = HERE / "results"
    out_dir.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    (out_dir / f"gpu-weights-{stamp}.json").write_text(json.dumps(result, indent=2))
    table = "\n".join([
        f"# H2D weights benchmark {result['date']} on {result['device_name']} "
        f"({size / 1e9:.2f} GB, medians of {args.runs})", "",
        "| loader | GB/s |", "|---|---|",
        *(f"| {k} | {v:.2f} |" for k, v in med.items()),
        f"| coldstart / peak | {result['ratio_coldstart_vs_peak']:.2f} |",
        f"| coldstart / safe_open | {result['ratio_coldstart_vs_safe_open']:.2f} |",
        "", f"coldstart path: {path_used}; bit-identical to safe_open: {ok}", ""])
    (out_dir / f"gpu-weights-{stamp}.md").write_text(table)
    print(table)
    if not ok:
        raise SystemExit("coldstart tensors differ from safe_open's")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(HERE.parent))
    main()
