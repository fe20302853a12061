"""Benchmark: cold start of a container, ``coldstart pull`` (lazy) against containerd's full pull.

Side by side in one run, on the same generated image:

* **baseline**: ``ctr image pull`` (download + unpack into overlayfs) then ``ctr run``;
* **coldstart**: ``coldstart pull`` of the converted image (zstd:chunked by default) through the
  coldstart snapshotter, then ``ctr run --snapshotter coldstart``.

Each run starts a fresh containerd (own root/state/socket) and, for coldstart, a fresh snapshotter
root (and FUSE server), then drops the page cache (``sync; echo 3 > /proc/sys/vm/drop_caches``);
daemon start-up is not timed. The modes alternate (baseline, coldstart, baseline, ...) so drift
hits both. Reported: medians of pull, run and total time, bytes and requests the registry served
(its access log), bytes fetched ÷ bytes the workload reads, and bytes fetched ÷ compressed
bytes of the chunks holding what it reads (the floor for a lazy pull, from the TOCs).

The image is a python-ish tree: many small text-like files (a "stdlib") and a few big
half-compressible ".so" files; the workload (busybox sh) reads ~10% of the small files and a
slice of two of the big ones, like an ``import`` does.

    .venv/bin/python bench/bench_coldstart_e2e.py                       # ~300 MB, N=3
    .venv/bin/python bench/bench_coldstart_e2e.py --size-mb 40 --runs 1  # smoke

Results: a table on stdout and bench/results/coldstart-e2e-<time>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from coldstart.oci.manifest import OCI_CONFIG, OCI_LAYER_GZIP, OCI_MANIFEST, digest_of
from coldstart.oci.reference import Reference
from coldstart.oci.registry import RegistryClient
from coldstart.stack.containerd import temp_containerd
from coldstart.stack.images import APPLETS, busybox_entries, layer_tar
from coldstart.stack.procs import coldstart_cli
from coldstart.stack.registry import AccessLog, Registry, start_registry
from coldstart.stack.snapshotter import temp_local_stack

MB = 1_000_000
MiB = 1 << 20
RESULTS = Path(__file__).resolve().parent / "results"


# -- the image ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    script: str
    bytes_read: int
    files_read: int
    reads: tuple[tuple[str, int, int], ...]     # (path, offset, length) the workload reads


def _text_pool(rng: random.Random, size: int) -> bytes:
    words = [bytes(rng.choice(b"abcdefghijklmnopqrstuvwxyz_") for _ in range(rng.randint(2, 10)))
             for _ in range(4000)]
    out = bytearray()
    while len(out) < size:
        out += b" ".join(rng.choices(words, k=10)) + (b":\n" if rng.random() < 0.5 else b"()\n")
    return bytes(out[:size])


def _write_gzip_layer(path: Path, members: Iterator[tuple[tarfile.TarInfo, bytes | None]]
                      ) -> tuple[str, str, int]:
    """Stream a tar into ``path`` gzip-compressed; return (blob digest, diff id, blob size)."""
    import hashlib

    raw_hash = hashlib.sha256()

    class _Tee(io.RawIOBase):
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def writable(self) -> bool:
            return True

        def write(self, b: Any) -> int:
            raw_hash.update(b)
            self.inner.write(b)
            return len(b)

    with open(path, "wb") as out, \
            gzip.GzipFile(fileobj=out, mode="wb", compresslevel=6, mtime=0) as gz, \
            tarfile.open(fileobj=_Tee(gz), mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for ti, data in members:
            tar.addfile(ti, io.BytesIO(data) if data is not None else None)
    blob_hash = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(MiB):
            blob_hash.update(block)
    return f"sha256:{blob_hash.hexdigest()}", f"sha256:{raw_hash.hexdigest()}", \
        path.stat().st_size


def _file(name: str, data: bytes, mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.mtime = len(data), mode, 1_700_000_000
    return ti, data


def _dir(name: str) -> tuple[tarfile.TarInfo, None]:
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, 1_700_000_000
    return ti, None


def build_image(registry: Registry, ref: str, size_mb: int, work: Path,
                seed: int = 1) -> Workload:
    """Generate and push the image; return the workload that runs in it."""
    rng = random.Random(seed)
    pool = _text_pool(rng, 4 * MiB)
    small_total = size_mb * MB * 2 // 5
    big_count = 3
    big_size = (size_mb * MB - small_total) // big_count
    small: list[tuple[str, int]] = []
    total = 0
    i = 0
    while total < small_total:
        n = min(int(rng.lognormvariate(8.6, 1.0)) + 200, 1 << 20)   # median ~5.6 kB
        small.append((f"usr/lib/python3/pkg{i // 200:03d}/mod{i:05d}.py", n))
        total += n
        i += 1
    chosen = rng.sample(small, max(1, len(small) // 10))
    slice_mb = max(1, big_size // MiB // 4)
    script = ["#!/bin/sh", "cat \\"]
    script += [f"  /{name} \\" for name, _ in chosen]
    script += ["  > /dev/null",
               f"dd if=/usr/lib/torch/lib0.so of=/dev/null bs=1M count={slice_mb} skip=1"
               " 2>/dev/null",
               "dd if=/usr/lib/torch/lib1.so of=/dev/null bs=1M count=2 skip=3 2>/dev/null",
               "echo ok"]
    script_bytes = ("\n".join(script) + "\n").encode()
    bytes_read = sum(n for _, n in chosen) + (slice_mb + 2) * MiB + len(script_bytes)

    def base() -> Iterator[tuple[tarfile.TarInfo, bytes | None]]:
        raw = layer_tar([*busybox_entries((*APPLETS, "dd"))])
        with tarfile.open(fileobj=io.BytesIO(raw)) as t:
            for m in t.getmembers():
                f = t.extractfile(m)
                yield m, (f.read() if f is not None else None)
        yield _file("run.sh", script_bytes, 0o755)

    def stdlib() -> Iterator[tuple[tarfile.TarInfo, bytes | None]]:
        yield _dir("usr")
        yield _dir("usr/lib")
        yield _dir("usr/lib/python3")
        last = ""
        for name, n in small:
            parent = name.rsplit("/", 1)[0]
            if parent != last:
                yield _dir(parent)
                last = parent
            off = rng.randrange(0, len(pool) - n)
            yield _file(name, pool[off:off + n])

    def torch() -> Iterator[tuple[tarfile.TarInfo, bytes | None]]:
        yield _dir("usr")
        yield _dir("usr/lib")
        yield _dir("usr/lib/torch")
        for k in range(big_count):
            out = bytearray()
            while len(out) < big_size:           # half text-like, half random: ~2x compressible
                off = rng.randrange(0, len(pool) - 64 * 1024)
                out += pool[off:off + 64 * 1024]
                out += rng.randbytes(64 * 1024)
            yield _file(f"usr/lib/torch/lib{k}.so", bytes(out[:big_size]), 0o755)

    reference = Reference.parse(ref)
    layers, diff_ids = [], []
    with RegistryClient() as client:
        for k, gen in enumerate((base(), stdlib(), torch())):
            path = work / f"layer{k}.tar.gz"
            digest, diff_id, size = _write_gzip_layer(path, gen)
            client.push_blob(reference, path, digest)
            path.unlink()
            layers.append({"mediaType": OCI_LAYER_GZIP, "digest": digest, "size": size})
            diff_ids.append(diff_id)
        config = json.dumps({"architecture": "amd64", "os": "linux",
                             "config": {"Env": ["PATH=/bin"], "Cmd": ["/run.sh"]},
                             "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
        cdigest = client.push_blob(reference, config)
        manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                    "config": {"mediaType": OCI_CONFIG, "digest": cdigest, "size": len(config)},
                    "layers": layers}
        client.push_manifest(reference, json.dumps(manifest).encode(), OCI_MANIFEST)
        assert digest_of(config) == cdigest
    reads = ((*((name, 0, n) for name, n in chosen),
              ("usr/lib/torch/lib0.so", MiB, slice_mb * MiB),
              ("usr/lib/torch/lib1.so", 3 * MiB, 2 * MiB),
              ("run.sh", 0, len(script_bytes)), ("bin/busybox", 0, 1 << 30)))
    return Workload(script="/run.sh", bytes_read=bytes_read, files_read=len(chosen) + 3,
                    reads=reads)


def touched_compressed(ref: str, workload: Workload) -> int:
    """Compressed bytes of the chunks holding what the workload reads (the floor a lazy pull
    can fetch, TOCs aside), from the converted layers' TOCs."""
    from coldstart.format import BytesReadAt, open_layer

    wanted: dict[str, list[tuple[int, int]]] = {}
    for path, off, length in workload.reads:
        wanted.setdefault(path, []).append((off, length))
    total = 0
    with RegistryClient() as client:
        resolved = client.resolve(Reference.parse(ref))
        for desc in resolved.manifest.layers:
            blob = client.get_blob(resolved.ref, desc.digest, max_size=4 << 30)
            layer = open_layer(BytesReadAt(blob), annotations=desc.annotations)
            for path, ranges in wanted.items():
                entry = layer.toc.entries.get(path)
                if entry is None or entry.type != "reg":
                    continue
                chunks = {c for off, n in ranges for c in layer.chunks_for(entry, off, n)}
                total += sum(c.compressed_size for c in chunks)
    return total


# -- one run -----------------------------------------------------------------------------------

def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _timed(argv: list[str], timeout: float = 900) -> float:
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])}… failed:\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-2000:]}")
    return time.monotonic() - t0


def _blob_stats(log: AccessLog) -> tuple[int, int]:
    reqs = [r for r in log.requests() if "/blobs/" in r.path and r.method == "GET"]
    return sum(r.bytes for r in reqs), len(reqs)


def run_baseline(registry: Registry, ref: str, workload: Workload, i: int) -> dict[str, Any]:
    with temp_containerd() as ctd:
        drop_caches()
        log = AccessLog(registry.access_log)
        pull = _timed(["ctr", "-a", ctd.address, "image", "pull", "--plain-http", ref])
        run = _timed(["ctr", "-a", ctd.address, "run", "--rm", "--snapshotter", "overlayfs",
                      ref, f"bench-base-{i}", workload.script])
        served, requests = _blob_stats(log)
    return {"mode": "baseline", "pull_s": pull, "run_s": run, "total_s": pull + run,
            "registry_bytes": served, "requests": requests}


def run_coldstart(registry: Registry, ref: str, workload: Workload, i: int,
                  background_rate: int | None = None) -> dict[str, Any]:
    with temp_local_stack(background_rate=background_rate) as st:
        drop_caches()
        log = AccessLog(registry.access_log)
        t0 = time.monotonic()
        proc = coldstart_cli("pull", "--address", st.ctd.address, ref)
        pull = time.monotonic() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"coldstart pull failed:\n{proc.stderr}")
        lazy = proc.stderr.count(": lazy")
        run = _timed(["ctr", "-a", st.ctd.address, "run", "--rm", "--snapshotter", "coldstart",
                      ref, f"bench-cs-{i}", workload.script])
        served, requests = _blob_stats(log)
    return {"mode": "coldstart", "pull_s": pull, "run_s": run, "total_s": pull + run,
            "registry_bytes": served, "requests": requests, "lazy_layers": lazy}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=300, help="uncompressed image size")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--format", default="zstd-chunked", choices=("zstd-chunked", "estargz"))
    ap.add_argument("--background-rate", type=int, default=256 << 20,
                    help="fetch.background_rate of the 'coldstart+bg' mode, bytes/s "
                         "(the 'coldstart' mode fetches on demand only)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (containerd, mounts, drop_caches)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="cs-bench-", dir="/tmp"))
    daemons = contextlib.ExitStack()
    registry = daemons.enter_context(start_registry(work / "registry"))
    try:
        src = f"{registry.host}/bench/app:gzip"
        t0 = time.monotonic()
        workload = build_image(registry, src, args.size_mb, work)
        print(f"image built and pushed in {time.monotonic() - t0:.1f} s; workload reads "
              f"{workload.bytes_read / MB:.1f} MB in {workload.files_read} files", flush=True)
        dst = f"{registry.host}/bench/app:{args.format}"
        t0 = time.monotonic()
        proc = coldstart_cli("convert", src, dst, "--format", args.format, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"convert failed:\n{proc.stderr}")
        print(f"converted to {args.format} in {time.monotonic() - t0:.1f} s", flush=True)
        with RegistryClient() as client:
            sizes = {r: sum(la.size for la in client.resolve(Reference.parse(r)).manifest.layers)
                     for r in (src, dst)}
        floor = touched_compressed(dst, workload)
        print(f"the workload touches chunks holding {floor / MB:.1f} MB compressed", flush=True)
        rows: list[dict[str, Any]] = []
        modes = {"baseline": None, "coldstart": 0, "coldstart+bg": args.background_rate}
        for i in range(args.runs):
            for mode, rate in modes.items():
                row = (run_baseline(registry, src, workload, i) if rate is None
                       else run_coldstart(registry, dst, workload, i, rate))
                row["mode"] = mode
                row["run"] = i
                rows.append(row)
                print(f"  run {i} {mode:9s} pull {row['pull_s']:6.2f} s  run {row['run_s']:6.2f}"
                      f" s  total {row['total_s']:6.2f} s  registry "
                      f"{row['registry_bytes'] / MB:7.1f} MB in {row['requests']} requests",
                      flush=True)
        summary: dict[str, Any] = {}
        for mode in modes:
            mine = [r for r in rows if r["mode"] == mode]
            summary[mode] = {k: statistics.median(r[k] for r in mine)
                             for k in ("pull_s", "run_s", "total_s", "registry_bytes",
                                       "requests")}
            summary[mode]["fetched_over_read"] = summary[mode]["registry_bytes"] / \
                workload.bytes_read
            summary[mode]["fetched_over_touched"] = summary[mode]["registry_bytes"] / floor
        print()
        print(f"image: {args.size_mb} MB uncompressed; gzip {sizes[src] / MB:.1f} MB, "
              f"{args.format} {sizes[dst] / MB:.1f} MB; workload reads "
              f"{workload.bytes_read / MB:.1f} MB; N={args.runs}, medians")
        print(f"touched chunks: {floor / MB:.1f} MB compressed")
        print("| mode | pull | run | total | registry bytes | requests | fetched/read "
              "| fetched/touched |")
        print("|---|---|---|---|---|---|---|---|")
        for mode, s in summary.items():
            print(f"| {mode} | {s['pull_s']:.2f} s | {s['run_s']:.2f} s | "
                  f"**{s['total_s']:.2f} s** | {s['registry_bytes'] / MB:.1f} MB | "
                  f"{s['requests']:.0f} | {s['fetched_over_read']:.2f} | "
                  f"{s['fetched_over_touched']:.2f} |")
        for mode in modes:
            if mode != "baseline":
                ratio = summary["baseline"]["total_s"] / summary[mode]["total_s"]
                print(f"{mode}: total is {ratio:.2f}x the full pull's speed "
                      f"(>1 is faster)")
        RESULTS.mkdir(exist_ok=True)
        out = RESULTS / f"coldstart-e2e-{time.strftime('%Y%m%dT%H%M%S')}.json"
        out.write_text(json.dumps({"args": vars(args), "bytes_read": workload.bytes_read,
                                   "touched_compressed": floor,
                                   "compressed": sizes, "rows": rows, "summary": summary},
                                  indent=2))
        print(f"results: {out}")
    finally:
        daemons.close()
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
