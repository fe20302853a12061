"""Benchmark the lazy FUSE data plane against tmpfs (bounded; cleans up after itself).

Through a lazy mount served by ``coldstart fuse-server`` from a local docker-registry:

1. a 1 GiB file of compressible, realistic data (random bytes mixed with text):
   cold sequential read (nothing cached), warm read (kernel page cache), and a re-mount read
   (chunk cache warm, page cache cold), vs the same file on tmpfs;
2. 20,000 small files: cold ``find`` and cold read-everything, vs the same tree on tmpfs;
3. registry bytes fetched ÷ bytes read.

Each FUSE server's CPU time (``/proc/<pid>/stat``) and the number of FUSE reads it served
(its ``coldstart_fuse_read_seconds`` count, from ``--metrics-address``) are taken per phase, so
the table also shows the server's CPU per read.

``--tree DIR`` (repeatable) runs the FUSE server from another coldstart checkout (the same
layers, registry and client; the control protocol is stable), so a change can be measured
against the commit before it in one run, rounds alternated, medians reported::

    git archive OLD --prefix=old/ | tar -x -C /tmp   # then copy coldstart/_proto/*_pb2*.py in
    sudo .venv/bin/python bench/bench_fuse.py --tree /tmp/old --tree . --rounds 3

Prints a table and writes JSON to ``bench/results/bench_fuse-<time>.json``.

    sudo .venv/bin/python bench/bench_fuse.py [--big-mib 1024] [--small-files 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from coldstart.format.writer import LayerResult, convert_layer  # noqa: E402
from coldstart.lazyfs.client import FuseServerClient  # noqa: E402
from coldstart.lazyfs.spec import LayerSpec  # noqa: E402
from coldstart.stack.images import realistic_bytes  # noqa: E402
from coldstart.stack.procs import free_port  # noqa: E402
from coldstart.stack.registry import push_layer, start_registry  # noqa: E402
from coldstart.stack.snapshotter import fuse_server  # noqa: E402

MiB = 1 << 20
T = TypeVar("T")


def big_data(total: int, seed: int = 7) -> Iterator[bytes]:
    """``total`` bytes in 1 MiB blocks, each unique (no chunk dedup) but text-like."""
    rng = random.Random(seed)
    base = realistic_bytes(32 * MiB, seed)
    done = 0
    while done < total:
        n = min(MiB, total - done)
        off = rng.randrange(0, len(base) - MiB)
        block = rng.randbytes(64) + base[off:off + n - 64]
        yield block[:n]
        done += n


class _GenReader:
    """A file-like ``read(n)`` over a generator of blocks (what tarfile.addfile needs)."""

    def __init__(self, it: Iterator[bytes]) -> None:
        self.it = it
        self.buf = b""

    def read(self, n: int = -1) -> bytes:
        while not self.buf:
            try:
                self.buf = next(self.it)
            except StopIteration:
                return b""
        if n < 0:
            n = len(self.buf)
        out, self.buf = self.buf[:n], self.buf[n:]
        return out


def big_tar(path: Path, size: int) -> None:
    with tarfile.open(path, "w") as tf:
        ti = tarfile.TarInfo("data/big.bin")
        ti.size = size
        ti.mode = 0o644
        tf.addfile(ti, _GenReader(big_data(size)))


def small_tree(root: Path, count: int) -> int:
    rng = random.Random(11)
    total = 0
    for i in range(count):
        d = root / f"pkg{i // 200:03d}" / f"mod{(i // 20) % 10}"
        if i % 20 == 0:
            d.mkdir(parents=True, exist_ok=True)
        n = rng.randint(200, 6000)
        (d / f"f{i:05d}.py").write_bytes(realistic_bytes(n, 1000 + i))
        total += n
    return total


def tar_dir(src: Path, dst: Path) -> None:
    with tarfile.open(dst, "w") as tf:
        tf.add(src, arcname=".")


def convert(src: Path, dst: Path) -> LayerResult:
    with open(src, "rb") as s, open(dst, "wb") as d:
        return convert_layer(s, d, format="zstd:chunked")


def read_file(path: Path, bufsize: int = MiB) -> int:
    buf = bytearray(bufsize)
    n = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            got = f.readinto(buf)
            if not got:
                return n
            n += got


def read_tree(root: Path) -> tuple[int, int]:
    files = 0
    total = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as f:
                total += len(f.read())
            files += 1
    return files, total


def count_tree(root: Path) -> int:
    return sum(len(d) + len(f) for _, d, f in os.walk(root))


def timed(fn: Callable[..., T], *args: Any) -> tuple[float, T]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def fetched(client: FuseServerClient, digest: str) -> int:
    return sum(int(s["fetched_bytes"]) for s in client.status() if s["digest"] == digest)


def server_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def reads_served(metrics_port: int) -> int:
    """FUSE reads the server answered so far (its read-latency histogram's count)."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10.0).text
    for line in text.splitlines():
        if line.startswith("coldstart_fuse_read_seconds_count"):
            return int(float(line.split()[-1]))
    return 0


def drop_page_cache(settle: float) -> None:
    """Drop the page cache, then let free page reporting settle (see bench_weights.py)."""
    subprocess.run(["sync"], check=False)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    time.sleep(settle)


class Phase:
    """Wall time, server CPU and reads of one measured step."""

    def __init__(self, pid: int, port: int) -> None:
        self.pid, self.port = pid, port

    def run(self, fn: Callable[..., T], *args: Any) -> tuple[dict[str, float], T]:
        c0, r0 = server_cpu(self.pid), reads_served(self.port)
        t, out = timed(fn, *args)
        cpu, reads = server_cpu(self.pid) - c0, reads_served(self.port) - r0
        return {"s": t, "server_cpu_s": cpu, "reads": reads,
                "cpu_us_per_read": cpu / reads * 1e6 if reads else 0.0}, out


def one_round(tree: Path, srv_tmp: Path, registry_host: str, specs: dict[str, LayerSpec],
              big_size: int, small_files: int, small_bytes: int,
              settle: float) -> dict[str, Any]:
    """Every phase once against a fresh FUSE server run from ``tree`` (fresh chunk cache)."""
    port = free_port()
    res: dict[str, Any] = {}
    drop_page_cache(settle)
    with fuse_server(srv_tmp, registry_host=registry_host, cache_max=4 << 30,
                     source_root=tree,
                     extra_args=("--metrics-address", f"127.0.0.1:{port}")) as (proc, client, _):
        ph = Phase(proc.pid, port)
        mp_big = srv_tmp / "big"
        mp_big.mkdir(exist_ok=True)
        client.mount(str(mp_big), specs["big"])
        f = mp_big / "data/big.bin"
        res["big_cold"], n = ph.run(read_file, f)
        assert n == big_size
        res["big_page_cache"], _ = ph.run(read_file, f)
        res["big_fetched"] = fetched(client, specs["big"].digest)
        client.unmount(str(mp_big))
        client.mount(str(mp_big), specs["big"])   # new inodes: page cache cold, chunks local
        res["big_chunk_cache"], _ = ph.run(read_file, f)
        client.unmount(str(mp_big))

        mp_small = srv_tmp / "small"
        mp_small.mkdir(exist_ok=True)
        client.mount(str(mp_small), specs["small"])
        res["small_find_cold"], entries = ph.run(count_tree, mp_small)
        res["small_read_cold"], (files, total) = ph.run(read_tree, mp_small)
        assert files == small_files and total == small_bytes, (files, total)
        res["small_fetched"] = fetched(client, specs["small"].digest)
        res["small_entries"] = entries
        client.unmount(str(mp_small))
        client.mount(str(mp_small), specs["small"])
        res["small_read_chunk_cache"], _ = ph.run(read_tree, mp_small)
        client.unmount(str(mp_small))
    shutil.rmtree(srv_tmp, ignore_errors=True)
    srv_tmp.mkdir()
    return res


PHASES = ["big_cold", "big_page_cache", "big_chunk_cache", "small_find_cold",
          "small_read_cold", "small_read_chunk_cache"]


def median_of(rounds: list[dict[str, Any]], phase: str, key: str) -> float:
    return statistics.median(r[phase][key] for r in rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big-mib", type=int, default=1024)
    ap.add_argument("--small-files", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=1, help="rounds per tree (alternated)")
    ap.add_argument("--tree", action="append", type=Path, default=None,
                    help="coldstart checkout to run the FUSE server from (repeatable; "
                         "default: this one)")
    ap.add_argument("--settle", type=float, default=6.0,
                    help="seconds to wait after dropping the page cache before each round")
    args = ap.parse_args()
    trees = [t.resolve() for t in (args.tree or [REPO])]
    for t in trees:
        if not (t / "coldstart" / "cli.py").is_file():
            raise SystemExit(f"--tree {t}: not a coldstart checkout")
    big_size = args.big_mib * MiB
    if big_size <= 0 or args.rounds <= 0:
        raise SystemExit("--big-mib and --rounds must be positive")
    work = Path(tempfile.mkdtemp(prefix="bench-fuse-", dir="/var/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="bench-fuse-", dir="/dev/shm"))
    results: dict[str, Any] = {"big_bytes": big_size, "small_files": args.small_files,
                               "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
                               "trees": [str(t) for t in trees], "rounds": args.rounds}
    try:
        with start_registry(work / "registry") as registry:
            print(f"building layers in {work} ...", flush=True)
            big_tar(work / "big.tar", big_size)
            tmpfs_tree = shm / "tree"
            tmpfs_tree.mkdir()
            small_bytes = small_tree(tmpfs_tree, args.small_files)
            tar_dir(tmpfs_tree, work / "small.tar")
            with tarfile.open(work / "big.tar") as tf:
                tf.extract("data/big.bin", shm, filter="data")
            t_conv, big = timed(convert, work / "big.tar", work / "big.zst")
            small = convert(work / "small.tar", work / "small.zst")
            (work / "big.tar").unlink()
            results["convert_1gib_s"] = round(t_conv, 2)
            results["big_compressed_bytes"] = big.size
            specs: dict[str, LayerSpec] = {}
            for name, info, path in (("big", big, work / "big.zst"),
                                     ("small", small, work / "small.zst")):
                blob = path.read_bytes()
                specs[name] = push_layer(registry.host, f"bench/{name}", blob, info)
                del blob
                path.unlink()
            t_tmpfs = min(timed(read_file, shm / "data/big.bin")[0] for _ in range(2))
            t_find_tmpfs, _ = timed(count_tree, tmpfs_tree)
            t_read_tmpfs, _ = timed(read_tree, tmpfs_tree)
            results["tmpfs"] = {"big_MBps": round(big_size / t_tmpfs / 1e6, 1),
                                "small_find_s": round(t_find_tmpfs, 3),
                                "small_read_s": round(t_read_tmpfs, 3)}
            shutil.rmtree(shm / "data")
            per_tree: dict[str, list[dict[str, Any]]] = {str(t): [] for t in trees}
            srv_tmp = work / "srv"
            srv_tmp.mkdir()
            for rnd in range(args.rounds):
                order = trees if rnd % 2 == 0 else list(reversed(trees))
                for t in order:
                    print(f"round {rnd + 1}/{args.rounds}: FUSE server from {t}", flush=True)
                    per_tree[str(t)].append(one_round(
                        t, srv_tmp, registry.host, specs, big_size, args.small_files,
                        small_bytes, args.settle))
            results["runs"] = per_tree
            summary: dict[str, Any] = {}
            for t, rounds in per_tree.items():
                row: dict[str, Any] = {}
                for ph in PHASES:
                    row[ph] = {k: round(median_of(rounds, ph, k), 4)
                               for k in ("s", "server_cpu_s", "reads", "cpu_us_per_read")}
                    if ph.startswith("big_"):
                        row[ph]["MBps"] = round(big_size / row[ph]["s"] / 1e6, 1)
                row["big_fetched_over_compressed"] = round(
                    statistics.median(r["big_fetched"] for r in rounds) / big.size, 3)
                row["small_fetched_over_read"] = round(
                    statistics.median(r["small_fetched"] for r in rounds) / small_bytes, 3)
                summary[t] = row
            results["median"] = summary
        print()
        names = [Path(t).name or t for t in summary]
        hdr = f"{'phase (median of ' + str(args.rounds) + ')':<34}" + "".join(
            f"{n[:30]:>32}" for n in names)
        print(hdr)
        for ph in PHASES:
            cells = []
            for t in summary:
                m = summary[t][ph]
                speed = f"{m['MBps']} MB/s" if "MBps" in m else f"{m['s']:.2f} s"
                cells.append(f"{speed}, {m['cpu_us_per_read']:.0f} us/read ({m['reads']:.0f})")
            print(f"{ph:<34}" + "".join(f"{c:>32}" for c in cells))
        print(f"{'tmpfs':<34}{results['tmpfs']}")
        out = REPO / "bench" / "results"
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"bench_fuse-{time.strftime('%Y%m%dT%H%M%S')}.json"
        path.write_text(json.dumps(results, indent=2, default=str))
        print(f"\nJSON: {path}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
