"""Benchmark: coldstart.weights.load against its peers, on the same file, in the same run.

coldstart runs twice: ``coldstart`` (its default for local CPU loads, cpu_mode=auto = mmap +
parallel MADV_POPULATE_READ) and ``coldstart_read`` (preadv into freshly allocated tensors);
``coldstart_direct`` (O_DIRECT) only cold.
Peers: ``safetensors.torch.load_file`` (+ touching every page, since it maps lazily), Run:ai Model
Streamer (``SafetensorsStreamer``), and the floor, a raw read of the same bytes (``dd bs=16M``).
``fresh_memory`` reads nothing: it allocates as many bytes and writes them once (``torch.empty`` +
``fill_``), the ceiling of any loader that copies into new memory (``dd`` reuses one 16 MiB
buffer, so it never pays for that).
S3: coldstart ``load("s3://...")`` against raw parallel ranged boto3 GETs and Run:ai's S3 backend
(``runai-model-streamer-s3``), all on a moto_server started here (moto is slow and memory
hungry, so that object is smaller).
Lazy (``--only lazy``): the same file inside a zstd:chunked layer in a local docker-registry,
lazily mounted by a fresh ``coldstart fuse-server`` (empty node cache) for every run, loaded
(a) ``lazy_safetensors``: ``safetensors.torch.load_file`` through the mount (+ every page
touched), (b) ``lazy_coldstart``: ``coldstart.weights.load`` of the same path, which takes the
files socket (the run fails if it did not), (c) ``registry_coldstart``: the same bytes pushed as
a plain blob, ``load("registry://…@sha256:…")`` (digest verified), (d) ``coldstart``: the local
file, page cache dropped; and ``verified_limit``, the machine's ceiling for that layer: its
chunks fetched with parallel range GETs, decoded and verified, then dropped. Goals: (b) >=
0.9x (c) and >= 3x (a).

Each loader runs in its own subprocess (peak RSS = its ``VmHWM``; ``ru_maxrss`` would count the
parent's peak, which Linux carries over fork and exec); rounds interleave the
loaders (each round starts one loader later, so no loader always follows the same one); medians
of ``--runs``. A child imports what it needs, says it is ready, and waits; then the parent
prepares the cache and lets it go. Cold runs drop the page cache (``/proc/sys/vm/drop_caches``,
falling back to ``posix_fadvise(DONTNEED)``), then set the guest's free memory to one state,
``--memory``, the same for every loader:

* ``settled`` (default): wait 6 s. On a VM with free page reporting (virtio-balloon: Firecracker,
  many clouds), pages the guest frees go back to the host about two seconds later; the disk's
  DMA into such a page then waits for a host page fault in the VMM's I/O thread. That is a node
  that has not read the model yet; here it caps buffered reads at ~0.6-0.7 GB/s.
* ``hot``: write and free 1.5x the file's size of anonymous memory just before the load, so the
  free pages it gets are still backed by the host.

Without this, whether a run lands on backed pages depends on what ran just before it (``dd``
swung between 0.9 and 3.3 GB/s from one run to the next).

    python bench/bench_weights.py --size-gb 2.2 --runs 3 --s3-mb 384
    python bench/bench_weights.py --only warm --runs 1 --size-gb 0.2   # quick smoke

Results: bench/results/weights-<time>.json and .md. The big file is deleted at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MiB = 1 << 20


# ---------------------------------------------------------------------------------------------
# child side: one loader, one run, one JSON line


def _rss_now(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _child(args: argparse.Namespace) -> None:
    import torch  # before the baseline RSS, so every loader pays it alike

    name, path = args.child, args.file
    concurrency, chunk = args.concurrency, args.chunk_mb * MiB
    nbytes = 0
    if "runai" in name:
        from runai_model_streamer import SafetensorsStreamer
    if name.startswith(("safetensors", "lazy_safetensors")):
        from safetensors.torch import load_file
    if name.startswith(("coldstart", "s3", "lazy_coldstart", "registry")):
        import coldstart.weights  # noqa: F401
    before = _rss_now()
    # Imports done: wait for the parent to drop the page cache, so every loader starts from the
    # same memory state however long its imports took.
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.perf_counter()
    if name == "verified_limit":
        nbytes = _verified_limit(path, max(4, 2 * (os.cpu_count() or 1)))
    elif name == "lazy_coldstart":
        from coldstart.weights import LoadStats, load

        stats = LoadStats()
        out = load(path, chunk_bytes=chunk, stats=stats)
        if "files socket" not in stats.path:
            raise SystemExit(f"lazy_coldstart did not take the files socket: {stats.path}")
        nbytes = sum(t.numel() * t.element_size() for t in out.values())
    elif name == "registry_coldstart":
        from coldstart.weights import load

        out = load(path, concurrency=concurrency, chunk_bytes=chunk,
                   registry={"insecure_hosts": [os.environ["BENCH_REGISTRY_HOST"]]})
        nbytes = sum(t.numel() * t.element_size() for t in out.values())
    elif name in ("coldstart", "coldstart_read", "coldstart_direct", "s3_coldstart"):
        from coldstart.weights import load

        local = None if args.local_concurrency == 0 else args.local_concurrency
        out = load(path, concurrency=concurrency if name.startswith("s3") else local,
                   chunk_bytes=chunk, direct=name == "coldstart_direct",
                   cpu_mode="read" if name == "coldstart_read" else "auto")
        nbytes = sum(t.numel() * t.element_size() for t in out.values())
    elif name in ("safetensors", "lazy_safetensors"):
        import torch
        from safetensors.torch import load_file

        out = load_file(path)
        # load_file maps the file lazily: read one byte of every page so the data is really in.
        for t in out.values():
            flat = t.reshape(-1).view(torch.uint8)
            if flat.numel():
                int(flat[::4096].sum())
            nbytes += flat.numel()
    elif name in ("runai", "s3_runai"):
        from runai_model_streamer import SafetensorsStreamer

        out = {}
        with SafetensorsStreamer() as streamer:
            streamer.stream_file(path)
            for tname, t in streamer.get_tensors():
                out[tname] = t
                nbytes += t.numel() * t.element_size()
    elif name == "fresh_memory":
        size = os.path.getsize(path)
        out = torch.empty(size, dtype=torch.uint8)
        out.fill_(0)  # page faults + zeroing, on every core torch uses
        nbytes = size
    elif name == "s3_raw":
        nbytes = _s3_raw(path, concurrency, chunk)
    else:
        raise SystemExit(f"unknown loader {name}")
    seconds = time.perf_counter() - start
    peak = _rss_now("VmHWM")
    print(json.dumps({"loader": name, "seconds": seconds, "bytes": nbytes,
                      "rss_before": before, "rss_peak": peak}))


def _verified_limit(url: str, threads: int) -> int:
    """What this machine can do with the lazy layer, as the fast path's ceiling
    (:func:`coldstart.benchmark.limits.verified_bytes` of its ``model.safetensors``)."""
    from coldstart.benchmark.limits import verified_bytes
    from coldstart.format.layer import open_layer
    from coldstart.oci.reference import Reference
    from coldstart.oci.registry import RegistryClient
    from coldstart.remote import RegistryBlob

    ref_text, digest = url.split("@", 1)
    ref = Reference.parse(ref_text)
    client = RegistryClient(insecure_hosts=[ref.registry])
    try:
        blob = RegistryBlob(client, ref, digest, None)
        layer = open_layer(blob, annotations=json.loads(os.environ["BENCH_LAYER_ANNOTATIONS"]))
        return verified_bytes(blob, layer, "model.safetensors", threads)
    finally:
        client.close()


def _s3_raw(url: str, concurrency: int, chunk: int) -> int:
    """The S3 floor: parallel ranged GETs of the whole object into one preallocated buffer."""
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    from botocore.config import Config

    bucket, key = url[len("s3://"):].split("/", 1)
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"],
                          config=Config(max_pool_connections=concurrency))
    size = int(client.head_object(Bucket=bucket, Key=key)["ContentLength"])
    buf = bytearray(size)
    view = memoryview(buf)

    def get(off: int) -> None:
        end = min(off + chunk, size)
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={off}-{end - 1}")["Body"]
        pos = off
        while piece := body.read(MiB):
            view[pos : pos + len(piece)] = piece
            pos += len(piece)
        assert pos == end

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(get, range(0, size, chunk)))
    return size


# ---------------------------------------------------------------------------------------------
# parent side


def write_model(path: Path, total_bytes: int) -> int:
    """A bf16 checkpoint of 4096x4096 matrices plus small norms, written tensor by tensor."""
    import torch

    big = 4096 * 4096 * 2
    count = max(1, -(-total_bytes // big))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    names = []
    for i in range(count):
        for kind, shape in (("weight", [4096, 4096]), ("norm", [4096])):
            n = shape[0] * (shape[1] if len(shape) > 1 else 1) * 2
            name = f"layers.{i}.{kind}"
            header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
            names.append((name, shape))
            offset += n
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    gen = torch.Generator().manual_seed(0)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body)
        for _, shape in names:
            t = torch.randn(shape, generator=gen).to(torch.bfloat16)
            f.write(t.view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    return path.stat().st_size


def drop_cache(path: Path) -> str:
    """Evict ``path`` from the page cache; say how."""
    how = "posix_fadvise(DONTNEED)"
    try:
        subprocess.run(["sync"], check=True, timeout=120)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        how = "drop_caches"
    except OSError:
        pass
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return how


def resident_bytes(path: Path) -> int | None:
    """Bytes of ``path`` in the page cache (``fincore``), or None if it cannot tell."""
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True, timeout=60)
    try:
        return int(out.stdout.split()[0])
    except (IndexError, ValueError):
        return None


def run_child(name: str, target: str, args: argparse.Namespace,
              env: dict[str, str] | None = None,
              prepare: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Run one loader once; ``prepare`` (drop or warm the cache) runs just before it starts."""
    if name == "dd":
        prepare()
        start = time.perf_counter()
        subprocess.run(["dd", f"if={target}", "of=/dev/null", "bs=16M", "status=none"],
                       check=True, timeout=600)
        seconds = time.perf_counter() - start
        return {"loader": "dd", "seconds": seconds, "bytes": os.path.getsize(target),
                "rss_before": 0, "rss_peak": 0}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--file", target,
           "--concurrency", str(args.concurrency), "--chunk-mb", str(args.chunk_mb),
           "--local-concurrency", str(args.local_concurrency)]
    with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        if proc.stdout.readline().strip() == "ready":
            prepare()
            proc.stdin.write("go\n")
            proc.stdin.flush()
        try:
            stdout, stderr = proc.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{stderr[-3000:]}")
    result: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    return result


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per loader: medians, peak RSS, every run's GB/s."""
    return {name: {"median_gb_per_s": statistics.median(x["gb_per_s"] for x in rs),
                   "median_seconds": statistics.median(x["seconds"] for x in rs),
                   "peak_rss_bytes": max(x["rss_peak"] for x in rs),
                   "rss_before_bytes": max(x["rss_before"] for x in rs),
                   "runs_gb_per_s": [x["gb_per_s"] for x in rs]}
            for name, rs in runs.items()}


def measure(mode: str, loaders: list[str], target: str, file_bytes: int,
            args: argparse.Namespace, env: dict[str, str] | None = None,
            cold_path: Path | None = None) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in loaders}
    evictions: list[dict[str, Any]] = []
    for r in range(args.runs):
        for name in loaders[r % len(loaders):] + loaders[: r % len(loaders)]:
            def prepare() -> None:
                if cold_path is not None:
                    how = drop_cache(cold_path)
                    evictions.append({"how": how, "resident_after": resident_bytes(cold_path)})
                    if args.memory == "settled":
                        time.sleep(6.0)
                    else:
                        sys.path.insert(0, str(ROOT))
                        from coldstart.benchmark.node import heat_memory
                        heat_memory(int(file_bytes * 1.5))
                elif mode == "warm":
                    subprocess.run(["cat", target], stdout=subprocess.DEVNULL, check=True)

            res = run_child(name, target, args, env, prepare)
            res["gb_per_s"] = file_bytes / res["seconds"] / 1e9
            runs[name].append(res)
            print(f"  [{mode}] round {r + 1} {name:17s} {res['gb_per_s']:6.2f} GB/s  "
                  f"peak RSS {res['rss_peak'] / 1e9:5.2f} GB", flush=True)
    summary = summarize(runs)
    return {"file_bytes": file_bytes, "loaders": summary, "evictions": evictions}


def _layer_of(model: Path, work: Path) -> tuple[Path, Any]:
    """``model`` as ``model.safetensors`` in a zstd:chunked layer (a file), and its result."""
    import tarfile

    from coldstart.format.writer import convert_layer

    tar = work / "layer.tar"
    with tarfile.open(tar, "w") as tf:
        tf.add(model, arcname="model.safetensors")
    blob = work / "layer.zst"
    with open(tar, "rb") as src, open(blob, "wb") as dst:
        result = convert_layer(src, dst, format="zstd:chunked")
    tar.unlink()
    return blob, result


def measure_lazy(model: Path, work: Path, file_bytes: int,
                 args: argparse.Namespace) -> dict[str, Any]:
    """Rows (a)-(d) of the lazy mode (see the module docstring), rounds rotated, medians."""
    import hashlib

    sys.path.insert(0, str(ROOT))
    from coldstart.lazyfs.filewire import SOCKET_ENV
    from coldstart.oci.reference import Reference
    from coldstart.oci.registry import RegistryClient
    from coldstart.stack.registry import push_layer, start_registry
    from coldstart.stack.snapshotter import fuse_server

    loaders = ["lazy_coldstart", "registry_coldstart", "lazy_safetensors", "coldstart",
               "verified_limit"]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in loaders}
    fetched: dict[str, list[int]] = {"lazy_coldstart": [], "lazy_safetensors": []}
    with start_registry(work / "registry", access_log=False) as registry:
        t0 = time.perf_counter()
        blob_path, result = _layer_of(model, work)
        print(f"  layer: {result.size / 1e9:.2f} GB zstd:chunked, converted in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        spec = push_layer(registry.host, "bench/lazy-weights", blob_path, result)
        blob_path.unlink()
        h = hashlib.sha256()
        with open(model, "rb") as f:
            while piece := f.read(16 * MiB):
                h.update(piece)
        digest = "sha256:" + h.hexdigest()
        with RegistryClient(insecure_hosts=[registry.host]) as client:
            client.push_blob(Reference.parse(f"{registry.host}/bench/raw-weights:v1"), model,
                             digest)
        blob_url = f"registry://{registry.host}/bench/raw-weights@{digest}"
        env = {"BENCH_REGISTRY_HOST": registry.host,
               "BENCH_LAYER_ANNOTATIONS": json.dumps(dict(result.annotations))}
        layer_url = f"{registry.host}/bench/lazy-weights@{spec.digest}"
        for r in range(args.runs):
            for name in loaders[r % len(loaders):] + loaders[: r % len(loaders)]:
                def prepare() -> None:
                    drop_cache(model)
                    time.sleep(6.0)     # settled free memory, as every cold run here

                if name.startswith("lazy"):
                    node = work / f"node-{r}-{name}"
                    node.mkdir()
                    with fuse_server(node, registry_host=registry.host,
                                     cache_max=int(file_bytes * 2)) as (_, fuse, root):
                        mp = node / "mnt"
                        mp.mkdir()
                        fuse.mount(str(mp), spec)
                        child_env = {**env, SOCKET_ENV: str(root / "files" / "files.sock")}
                        res = run_child(name, str(mp / "model.safetensors"), args, child_env,
                                        prepare)
                        layer = next(x for x in fuse.status() if x["digest"] == spec.digest)
                        fetched[name].append(int(layer.get("fetched_bytes", 0)))
                        fuse.unmount(str(mp))
                    shutil.rmtree(node, ignore_errors=True)
                else:
                    target = {"registry_coldstart": blob_url,
                              "verified_limit": layer_url}.get(name, str(model))
                    res = run_child(name, target, args, env, prepare)
                res["gb_per_s"] = file_bytes / res["seconds"] / 1e9
                runs[name].append(res)
                print(f"  [lazy] round {r + 1} {name:19s} {res['gb_per_s']:6.2f} GB/s  "
                      f"{res['seconds']:6.2f} s  peak RSS {res['rss_peak'] / 1e9:5.2f} GB",
                      flush=True)
    summary = summarize(runs)
    out: dict[str, Any] = {"file_bytes": file_bytes, "layer_bytes": result.size,
                           "loaders": summary, "registry_bytes_fetched": fetched}
    out["ratio_lazy_coldstart_vs_registry"] = ratio(out, "lazy_coldstart", "registry_coldstart")
    out["ratio_lazy_coldstart_vs_lazy_safetensors"] = ratio(out, "lazy_coldstart",
                                                            "lazy_safetensors")
    out["ratio_lazy_coldstart_vs_local_cold"] = ratio(out, "lazy_coldstart", "coldstart")
    out["ratio_lazy_coldstart_vs_verified_limit"] = ratio(out, "lazy_coldstart",
                                                          "verified_limit")
    out["ratio_lazy_safetensors_vs_verified_limit"] = ratio(out, "lazy_safetensors",
                                                            "verified_limit")
    return out


def moto(tmp: Path) -> contextlib.AbstractContextManager[str]:
    """moto's S3 server (coldstart.stack's, the tests' too), log in ``tmp``."""
    sys.path.insert(0, str(ROOT))
    from coldstart.stack.s3 import start_s3

    return start_s3(tmp)


def ratio(summary: dict[str, Any], a: str, b: str) -> float:
    loaders = summary["loaders"]
    return float(loaders[a]["median_gb_per_s"] / loaders[b]["median_gb_per_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--child")
    p.add_argument("--file")
    p.add_argument("--dir", default="/var/tmp/coldstart-bench-weights")
    p.add_argument("--size-gb", type=float, default=2.2)
    p.add_argument("--s3-mb", type=int, default=384)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=16, help="S3 requests in flight")
    p.add_argument("--local-concurrency", type=int, default=0,
                   help="coldstart threads for local files (0: its default, 2 per core)")
    p.add_argument("--chunk-mb", type=int, default=16)
    p.add_argument("--memory", choices=["settled", "hot"], default="settled",
                   help="free memory state for cold runs (see above)")
    p.add_argument("--only", default="cold,warm,s3",
                   help="comma list of cold, warm, s3, lazy (lazy needs root and FUSE)")
    p.add_argument("--keep", action="store_true", help="keep the generated files")
    args = p.parse_args()
    if args.child:
        _child(args)
        return

    modes = set(args.only.split(","))
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "host_cpus": os.cpu_count(), "runs": args.runs,
                               "concurrency": args.concurrency, "chunk_mb": args.chunk_mb,
                               "memory": args.memory}
    s3_peers = ["s3_coldstart", "s3_raw"]
    try:
        import runai_model_streamer_s3  # noqa: F401

        s3_peers.append("s3_runai")
    except ImportError:
        print("runai-model-streamer-s3 is not installed: no Run:ai row for S3", flush=True)
    model = work / "model.safetensors"
    try:
        if modes & {"cold", "warm"}:
            size = write_model(model, int(args.size_gb * 1e9))
            print(f"model: {model} {size / 1e9:.2f} GB", flush=True)
            peers = ["coldstart", "coldstart_read", "safetensors", "runai", "dd", "fresh_memory"]
            if "cold" in modes:
                results["cold"] = measure("cold", [*peers, "coldstart_direct"], str(model), size,
                                          args, cold_path=model)
                results["cold"]["ratio_coldstart_read_vs_dd"] = ratio(
                    results["cold"], "coldstart_read", "dd")
                results["cold"]["ratio_coldstart_vs_dd"] = ratio(results["cold"], "coldstart",
                                                                 "dd")
                results["cold"]["ratio_coldstart_vs_safetensors"] = ratio(
                    results["cold"], "coldstart", "safetensors")
            if "warm" in modes:
                results["warm"] = measure("warm", peers, str(model), size, args)
                results["warm"]["ratio_coldstart_vs_dd"] = ratio(results["warm"], "coldstart",
                                                                 "dd")
                results["warm"]["ratio_coldstart_read_vs_dd"] = ratio(
                    results["warm"], "coldstart_read", "dd")
                results["warm"]["ratio_coldstart_vs_safetensors"] = ratio(
                    results["warm"], "coldstart", "safetensors")
            model.unlink()
        if "lazy" in modes:
            size = write_model(model, int(args.size_gb * 1e9))
            print(f"model: {model} {size / 1e9:.2f} GB", flush=True)
            results["lazy"] = measure_lazy(model, work, size, args)
            model.unlink()
        if "s3" in modes:
            s3_file = work / "s3.safetensors"
            size = write_model(s3_file, args.s3_mb * MiB)
            with moto(work) as endpoint:
                import boto3

                env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                       # Run:ai's S3 client: path-style requests, no instance metadata lookups;
                       # its defaults (1 s request timeout, a minimum throughput, a 190 MB window
                       # in flight) abort against moto_server's ~40 MB/s, so give it slack.
                       "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
                       "AWS_EC2_METADATA_DISABLED": "true",
                       "RUNAI_STREAMER_S3_LOW_SPEED_LIMIT": "1",
                       "RUNAI_STREAMER_S3_REQUEST_TIMEOUT_MS": "120000",
                       "RUNAI_STREAMER_S3_MAX_INFLIGHT_MIB": "64"}
                os.environ.update(env)
                client = boto3.client("s3", endpoint_url=endpoint)
                client.create_bucket(Bucket="bench")
                client.upload_file(str(s3_file), "bench", "model.safetensors")
                s3_file.unlink()
                saved, args.chunk_mb = args.chunk_mb, 8  # both sides: 8 MiB ranges
                results["s3"] = measure("s3", s3_peers,
                                        "s3://bench/model.safetensors", size, args, env)
                args.chunk_mb = saved
                results["s3"]["ratio_coldstart_vs_raw"] = ratio(results["s3"], "s3_coldstart",
                                                                "s3_raw")
                if "s3_runai" in s3_peers:
                    results["s3"]["ratio_coldstart_vs_runai"] = ratio(
                        results["s3"], "s3_coldstart", "s3_runai")
    finally:
        if not args.keep:
            for f in work.glob("*.safetensors"):
                f.unlink()
    out_dir = HERE / "results"
    out_dir.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    (out_dir / f"weights-{stamp}.json").write_text(json.dumps(results, indent=2))
    table = [f"# weights benchmark {results['date']} (medians of {args.runs}, cold runs with "
             f"{args.memory} free memory)", "",
             "| mode | loader | GB/s | peak RSS GB | RSS before load GB |", "|---|---|---|---|---|"]
    for mode in ("cold", "warm", "s3", "lazy"):
        if mode not in results:
            continue
        for name, s in results[mode]["loaders"].items():
            table.append(f"| {mode} | {name} | {s['median_gb_per_s']:.3f} | "
                         f"{s['peak_rss_bytes'] / 1e9:.2f} | {s['rss_before_bytes'] / 1e9:.2f} |")
        for key, value in results[mode].items():
            if key.startswith("ratio"):
                table.append(f"| {mode} | **{key}** | **{value:.2f}** | | |")
    text = "\n".join(table) + "\n"
    (out_dir / f"weights-{stamp}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
