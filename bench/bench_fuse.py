"""Benchmark the lazy FUSE data plane against tmpfs (run once; bounded; cleans up after itself).

Through a lazy mount served by ``coldstart fuse-server`` from a local docker-registry:

1. a 1 GiB file of compressible, realistic data (random bytes mixed with text):
   cold sequential read (nothing cached), warm read (kernel page cache), and a re-mount read
   (chunk cache warm, page cache cold), vs the same file on tmpfs;
2. 20,000 small files: cold ``find`` and cold read-everything, vs the same tree on tmpfs;
3. registry bytes fetched ÷ bytes read.

Prints a table and writes JSON to ``bench/results/bench_fuse-<time>.json``.

    sudo .venv/bin/python bench/bench_fuse.py [--big-mib 1024] [--small-files 20000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
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
from tests.fixtures.registry import start_registry  # noqa: E402
from tests.integration.lazy.lazy_helpers import (  # noqa: E402
    fuse_server,
    push_layer,
    realistic_bytes,
)

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--big-mib", type=int, default=1024)
    ap.add_argument("--small-files", type=int, default=20_000)
    ap.add_argument("--read-ahead-kb", type=int, default=1024)
    args = ap.parse_args()
    big_size = args.big_mib * MiB
    work = Path(tempfile.mkdtemp(prefix="bench-fuse-", dir="/var/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="bench-fuse-", dir="/dev/shm"))
    results: dict[str, object] = {"big_bytes": big_size, "small_files": args.small_files,
                                  "cpus": os.cpu_count(), "load_avg": os.getloadavg()}
    reg_gen = start_registry(work / "registry")
    registry = next(reg_gen)
    try:
        print(f"building layers in {work} ...", flush=True)
        if big_size <= 0:
            raise SystemExit("--big-mib must be positive")
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
        print("layers pushed; starting the FUSE server", flush=True)
        srv_tmp = work / "srv"
        srv_tmp.mkdir()
        with fuse_server(srv_tmp, registry_host=registry.host,
                         cache_max=4 << 30) as (_, client, _root):
            rows: list[tuple[str, str, str]] = []
            mp_big = srv_tmp / "big"
            mp_big.mkdir()
            client.mount(str(mp_big), specs["big"])
            f = mp_big / "data/big.bin"
            t_cold, n = timed(read_file, f)
            assert n == big_size
            t_warm, _ = timed(read_file, f)
            cold_fetched = fetched(client, specs["big"].digest)
            client.unmount(str(mp_big))
            client.mount(str(mp_big), specs["big"])
            t_cache, _ = timed(read_file, f)
            t_tmpfs, _ = timed(read_file, shm / "data/big.bin")
            t_tmpfs2, _ = timed(read_file, shm / "data/big.bin")
            t_tmpfs = min(t_tmpfs, t_tmpfs2)
            mbs = {k: round(big_size / v / 1e6, 1) for k, v in
                   (("cold", t_cold), ("warm", t_warm), ("chunk_cache", t_cache),
                    ("tmpfs", t_tmpfs))}
            results["big_read_MBps"] = mbs
            results["big_fetched_over_read"] = round(cold_fetched / big_size, 3)
            results["big_fetched_over_compressed"] = round(
                cold_fetched / big.size, 3)
            rows += [("1 GiB seq read, cold (lazy fetch)", f"{mbs['cold']} MB/s", ""),
                     ("1 GiB seq read, page cache warm", f"{mbs['warm']} MB/s", ""),
                     ("1 GiB seq read, chunk cache warm", f"{mbs['chunk_cache']} MB/s", ""),
                     ("1 GiB seq read, tmpfs", f"{mbs['tmpfs']} MB/s", ""),
                     ("fetched / read (1 GiB)", f"{results['big_fetched_over_read']}",
                      f"compressed/uncompressed {big.size / big_size:.3f}")]
            client.unmount(str(mp_big))
            shutil.rmtree(shm / "data")

            mp_small = srv_tmp / "small"
            mp_small.mkdir()
            client.mount(str(mp_small), specs["small"])
            t_find, entries = timed(count_tree, mp_small)
            t_readall, (files, total) = timed(read_tree, mp_small)
            assert files == args.small_files and total == small_bytes, (files, total)
            small_fetched = fetched(client, specs["small"].digest)
            # again on a fresh mount: chunk cache warm, page cache cold (the FUSE cost alone)
            client.unmount(str(mp_small))
            client.mount(str(mp_small), specs["small"])
            t_readall_cached, _ = timed(read_tree, mp_small)
            t_find_tmpfs, _ = timed(count_tree, tmpfs_tree)
            t_read_tmpfs, _ = timed(read_tree, tmpfs_tree)
            results["small"] = {
                "find_s": round(t_find, 3), "read_all_s": round(t_readall, 3),
                "read_all_chunk_cache_warm_s": round(t_readall_cached, 3),
                "tmpfs_find_s": round(t_find_tmpfs, 3),
                "tmpfs_read_all_s": round(t_read_tmpfs, 3),
                "entries": entries, "bytes": total,
                "fetched_over_read": round(small_fetched / total, 3),
                "fetched_over_compressed": round(small_fetched / small.size, 3),
            }
            rows += [(f"find over {files} files, cold", f"{t_find:.3f} s",
                      f"tmpfs {t_find_tmpfs:.3f} s"),
                     (f"read all {files} files, cold", f"{t_readall:.2f} s",
                      f"tmpfs {t_read_tmpfs:.2f} s; anchor pyfuse3 in-memory 6.5 s"),
                     (f"read all {files} files, chunk cache warm", f"{t_readall_cached:.2f} s",
                      "fresh mount: FUSE cost without fetching"),
                     ("fetched / read (small files)", f"{small_fetched / total:.3f}",
                      f"of the blob: {small_fetched / small.size:.3f}")]
            results["status"] = client.status()
            client.unmount(str(mp_small))
        width = max(len(r[0]) for r in rows)
        print()
        for a, b, c in rows:
            print(f"{a:<{width}}  {b:>14}  {c}")
        out = REPO / "bench" / "results"
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"bench_fuse-{time.strftime('%Y%m%dT%H%M%S')}.json"
        path.write_text(json.dumps(results, indent=2, default=str))
        print(f"\nJSON: {path}")
    finally:
        with contextlib.suppress(StopIteration):
            next(reg_gen)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
