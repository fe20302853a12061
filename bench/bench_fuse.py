"""Benchmark the lazy FUSE data plane against tmpfs (bounded; cleans up after itself).

Through a lazy mount served by ``coldstart fuse-server`` from a local docker-registry:

1. a 1 GiB file of compressible, realistic data (random bytes mixed with text):
   cold sequential read (nothing cached; ``read(2)`` of 1 MiB, as ``cat`` does), cold
   ``mmap`` page-fault read (a fresh server: how safetensors and ``torch.load(mmap=True)``
   read), warm read (kernel page cache), and a re-mount read (chunk cache warm, page cache
   cold), vs the same file on tmpfs and against **the verified-bytes limit** of this machine
   for that blob, measured in the same round: its chunks fetched with parallel range GETs
   (8 MiB each), decompressed and checked against their digests in a thread pool, then
   dropped: what any lazy reader of that blob could deliver here; and that limit again with
   each verified chunk written into a tmpfs file (``big_limit_page_cache``, "+pc" in the
   table): the bytes landing in the page cache by a CPU copy, as a FUSE read's answer lands
   them, which on a VM with free page reporting costs as much as the fetch itself (see
   ``--memory``);
2. 20,000 small files: cold ``find`` and cold read-everything, vs the same tree on tmpfs;
   and one ``getxattr`` of ``trusted.overlay.metacopy`` per file (what overlayfs asks of
   every file it looks up in a lower layer; the kernel caches no answer, so each is a round
   trip to the server): the FUSE request's cost, in µs per call;
3. registry bytes fetched ÷ bytes read, and the bytes the server pushed into the page cache
   during the cold ``cat`` (``big_warmed`` in the JSON: ``NOTIFY_STORE``);
4. with ``--link 1gbit,2ms``: the cold ``cat`` again with the registry behind the bench's
   shaping proxy (``coldstart.benchmark.shaping``), its compressed bytes per second against
   the link's rate, and against the verified-bytes limit through the same link, measured
   after it in a process of its own (``big_limit_link``: the proxy runs on this machine's
   cores too, so on a small machine the limit may itself fall short of the link).

Each FUSE server's CPU time (``/proc/<pid>/stat``) and the number of FUSE reads it served
(its ``coldstart_fuse_read_seconds`` count, from ``--metrics-address``) are taken per phase
(and, in the JSON, ``cache_hits``: its ``coldstart_fuse_cache_hits`` count, chunk look-ups
answered from the node's chunk cache, pending or on disk, rather than by a fetch: once per read
the FUSE loop answers from the cache, once per chunk piece otherwise), so the table also
shows the server's CPU per read, and the whole machine's busy CPU seconds (``/proc/stat``:
registry, kernel and reader included; on a small machine the limit and the lazy reads are
CPU-bound, and this says where they differ).

``--tree DIR`` (repeatable) runs the FUSE server from another coldstart checkout (the same
layers, registry and client; the control protocol is stable), so a change can be measured
against the commit before it in one run, rounds alternated, medians reported::

    git archive OLD --prefix=old/ | tar -x -C /tmp   # then copy coldstart/_proto/*_pb2*.py in
    sudo .venv/bin/python bench/bench_fuse.py --tree /tmp/old --tree . --rounds 3

Prints a table and writes JSON to ``bench/results/bench_fuse-<time>.json``.

    sudo .venv/bin/python bench/bench_fuse.py [--big-mib 1024] [--small-files 20000]
        [--only big] [--link 1gbit,2ms] [--rounds 3] [--memory settled|hot]

``--memory`` sets the guest's free memory before each cold phase, the same for the limit and
every read: ``settled`` (default) waits ``--settle`` seconds, so on a VM with free page reporting
the page cache the read fills lands in pages the host backs again one by one on first touch
(here the limit with its bytes written into tmpfs fell from 661 to 389 MB/s settled, from 704
to 577 MB/s hot: ``bench/published/fuse-2026-12-04/``); ``hot`` then writes and frees twice
the big file's size first.

The FUSE server runs with the product's ``fetch.concurrency`` (``--concurrency`` sets another)
and read-ahead, and otherwise the test fixture's config (``coldstart.stack.snapshotter``): no
background fill of the rest of the layer, no retries, shorter deadlines. The limit fetches with
as many threads by default (``--limit-threads``). Earlier results of this script are not
comparable: they used 4 fetch threads, and their "chunk cache" phase fetched again (a layer's
last unmount reclaims its chunks).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import mmap
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from coldstart.benchmark.node import drop_caches  # noqa: E402
from coldstart.benchmark.shaping import Link, shaping_proxy  # noqa: E402
from coldstart.config import FetchConfig  # noqa: E402
from coldstart.errors import ColdstartError  # noqa: E402
from coldstart.format.layer import open_layer  # noqa: E402
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


def mmap_read(path: Path, step: int = MiB) -> int:
    """Read ``path`` through a shared read-only mapping, front to back, ``step`` bytes copied
    at a time: every page arrives by a page fault (the kernel's mmap read-ahead decides how
    many pages each fault asks the file system for)."""
    buf = bytearray(step)
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            view = memoryview(m)
            try:
                for off in range(0, size, step):
                    n = min(step, size - off)
                    buf[:n] = view[off:off + n]
            finally:
                view.release()
    return size


def link_arg(text: str) -> Link:
    """``--link``: a finite rate and a round-trip time (argparse's error otherwise)."""
    try:
        link = Link.parse(text)
    except ColdstartError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if link.unlimited:
        raise argparse.ArgumentTypeError("--link needs a finite rate, e.g. 1gbit,2ms")
    return link


def verified_limit(registry_host: str, spec: LayerSpec, name: str, threads: int,
                   into: int | None = None) -> int:
    """Bytes of file ``name`` in ``spec``'s layer, fetched, decoded and verified the fastest
    plain way (:func:`coldstart.benchmark.limits.verified_bytes`; ``into``: written into that
    file too)."""
    from coldstart.benchmark.limits import verified_bytes
    from coldstart.oci.reference import Reference
    from coldstart.oci.registry import RegistryClient
    from coldstart.remote import RegistryBlob

    client = RegistryClient(insecure_hosts=[registry_host])
    try:
        blob = RegistryBlob(client, Reference.parse(spec.reference), spec.digest, None)
        return verified_bytes(blob, open_layer(blob, annotations=spec.annotations), name,
                              threads, into=into)
    finally:
        client.close()


def in_child(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a forked process of its own (its result pickled back; a child that
    dies raises BrokenProcessPool rather than hanging)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        return pool.submit(fn, *args).result()


def read_tree(root: Path) -> tuple[int, int]:
    files = 0
    total = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as f:
                total += len(f.read())
            files += 1
    return files, total


def getxattr_tree(root: Path) -> int:
    """One ``getxattr`` that finds nothing per file (as overlayfs's lookup does); the count."""
    calls = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                os.getxattr(os.path.join(dirpath, name), "trusted.overlay.metacopy",
                            follow_symlinks=False)
            except OSError as exc:
                if exc.errno != errno.ENODATA:
                    raise
            calls += 1
    return calls


def count_tree(root: Path) -> int:
    return sum(len(d) + len(f) for _, d, f in os.walk(root))


def timed(fn: Callable[..., T], *args: Any) -> tuple[float, T]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def layer_stat(client: FuseServerClient, digest: str, key: str) -> int:
    """A count from the server's status of layer ``digest`` (summed over its mounts):
    ``fetched_bytes``, ``page_cache_bytes`` (pushed with FUSE ``NOTIFY_STORE``), ..."""
    return sum(int(s[key]) for s in client.status() if s["digest"] == digest)


def server_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> float:
    """CPU seconds the whole machine spent busy so far (every core; ``/proc/stat``): what a
    phase cost, the registry, kernel and reader included."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    # user nice system idle iowait irq softirq (steal: time the host took, not ours)
    idle = fields[3] + fields[4]
    return (sum(fields[:7]) - idle) / os.sysconf("SC_CLK_TCK")


def reads_served(metrics_port: int) -> tuple[int, int]:
    """FUSE reads the server answered so far (its read-latency histogram's count), and its
    chunk look-ups answered from the node's chunk cache (``coldstart_fuse_cache_hits``; 0 for
    a server without that metric)."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10.0).text
    reads = hits = 0
    for line in text.splitlines():
        if line.startswith("coldstart_fuse_read_seconds_count"):
            reads = int(float(line.split()[-1]))
        elif line.startswith("coldstart_fuse_cache_hits_total"):
            hits = int(float(line.split()[-1]))
    return reads, hits


class Phase:
    """Wall time, server CPU and reads of one measured step."""

    def __init__(self, pid: int, port: int) -> None:
        self.pid, self.port = pid, port

    def run(self, fn: Callable[..., T], *args: Any) -> tuple[dict[str, float], T]:
        c0, (r0, h0), b0 = server_cpu(self.pid), reads_served(self.port), machine_busy()
        t, out = timed(fn, *args)
        busy = machine_busy() - b0
        cpu = server_cpu(self.pid) - c0
        r1, h1 = reads_served(self.port)
        reads = r1 - r0
        return {"s": t, "server_cpu_s": cpu, "reads": reads, "cache_hits": h1 - h0,
                "machine_cpu_s": busy,
                "cpu_us_per_read": cpu / reads * 1e6 if reads else 0.0}, out


def one_round(tree: Path, srv_tmp: Path, registry_host: str, specs: dict[str, LayerSpec],
              big_size: int, small_files: int, small_bytes: int, settle: float, heat: int,
              concurrency: int, limit_threads: int, link: Link | None) -> dict[str, Any]:
    """Every phase once, each cold one against a fresh FUSE server run from ``tree`` (fresh
    chunk cache), and the verified-bytes limit of the big blob."""
    res: dict[str, Any] = {}

    @contextlib.contextmanager
    def served(host: str = registry_host) -> Iterator[tuple[Phase, FuseServerClient]]:
        """A fresh FUSE server reading from ``host``, the page cache dropped before it starts;
        its temp directory emptied after."""
        drop_caches(settle, heat)
        port = free_port()
        with fuse_server(srv_tmp, registry_host=host, cache_max=4 << 30, source_root=tree,
                         concurrency=concurrency,
                         extra_args=("--metrics-address", f"127.0.0.1:{port}")
                         ) as (proc, client, _):
            yield Phase(proc.pid, port), client
        shutil.rmtree(srv_tmp, ignore_errors=True)
        srv_tmp.mkdir()

    def mount(client: FuseServerClient, name: str, spec: LayerSpec) -> Path:
        mp = srv_tmp / name
        mp.mkdir(exist_ok=True)
        client.mount(str(mp), spec)
        return mp

    if "big" in specs:
        drop_caches(settle, heat)
        b0 = machine_busy()
        t, n = timed(verified_limit, registry_host, specs["big"], "data/big.bin", limit_threads)
        assert n == big_size, (n, big_size)
        res["big_limit"] = {"s": t, "server_cpu_s": 0.0, "reads": 0, "cpu_us_per_read": 0.0,
                            "machine_cpu_s": machine_busy() - b0}
        # the same, each verified chunk written into a tmpfs file: the limit with the bytes
        # landing in the page cache by a CPU copy (as a FUSE read's answer lands them)
        drop_caches(settle, heat)
        fd, shm_file = tempfile.mkstemp(prefix="bench-fuse-limit-", dir="/dev/shm")
        try:
            b0 = machine_busy()
            t, n = timed(verified_limit, registry_host, specs["big"], "data/big.bin",
                         limit_threads, fd)
            assert n == big_size and os.fstat(fd).st_size == big_size, n
            res["big_limit_page_cache"] = {"s": t, "server_cpu_s": 0.0, "reads": 0,
                                           "cpu_us_per_read": 0.0,
                                           "machine_cpu_s": machine_busy() - b0}
        finally:
            os.close(fd)
            os.unlink(shm_file)

        with served() as (ph, client):
            mp_big = mount(client, "big", specs["big"])
            f = mp_big / "data/big.bin"
            res["big_cold"], n = ph.run(read_file, f)
            assert n == big_size
            res["big_warmed"] = layer_stat(client, specs["big"].digest, "page_cache_bytes")
            res["big_page_cache"], _ = ph.run(read_file, f)
            res["big_fetched"] = layer_stat(client, specs["big"].digest, "fetched_bytes")
            # chunks local, page cache dropped: read through a second mount of the layer (a
            # node's next container; the first stays mounted: a layer's last unmount reclaims
            # its chunks)
            mp_again = mount(client, "big-again", specs["big"])
            drop_caches(settle, heat)
            res["big_chunk_cache"], _ = ph.run(read_file, mp_again / "data/big.bin")
            client.unmount(str(mp_again))
            client.unmount(str(mp_big))

        with served() as (ph, client):
            mp_big = mount(client, "big", specs["big"])
            res["big_mmap_cold"], n = ph.run(mmap_read, mp_big / "data/big.bin")
            assert n == big_size
            client.unmount(str(mp_big))

        if link is not None:
            with shaping_proxy(registry_host, link) as proxy:
                ref = specs["big"].reference        # "host/repo:tag", from push_layer
                assert ref.startswith(registry_host + "/"), ref
                shaped = dataclasses.replace(
                    specs["big"], reference=proxy.host + ref[len(registry_host):])
                with served(proxy.host) as (ph, client):
                    mp_big = mount(client, "big", shaped)
                    down0 = proxy.bytes_down
                    res["big_cold_link"], n = ph.run(read_file, mp_big / "data/big.bin")
                    assert n == big_size
                    res["big_cold_link"]["link_bytes"] = proxy.bytes_down - down0
                    client.unmount(str(mp_big))
                # then the verified-bytes limit through the same link, in a process of its
                # own (the proxy is a thread of this one: the limit's threads would share its
                # GIL); its time includes opening the layer through the link (the footer and
                # TOC, ~0.5 MB, a few round trips), which the mount did before the cat's
                # clock started: the ratio favours the cat by well under 1 %
                drop_caches(settle, heat)
                down0, b0 = proxy.bytes_down, machine_busy()
                t, n = in_child(timed, verified_limit, proxy.host, shaped, "data/big.bin",
                                limit_threads)
                assert n == big_size, (n, big_size)
                res["big_limit_link"] = {"s": t, "server_cpu_s": 0.0, "reads": 0,
                                         "cpu_us_per_read": 0.0,
                                         "machine_cpu_s": machine_busy() - b0,
                                         "link_bytes": proxy.bytes_down - down0}

    if "small" in specs:
        with served() as (ph, client):
            mp_small = mount(client, "small", specs["small"])
            res["small_find_cold"], entries = ph.run(count_tree, mp_small)
            res["small_read_cold"], (files, total) = ph.run(read_tree, mp_small)
            assert files == small_files and total == small_bytes, (files, total)
            res["small_fetched"] = layer_stat(client, specs["small"].digest, "fetched_bytes")
            res["small_entries"] = entries
            res["small_getxattr"], calls = ph.run(getxattr_tree, mp_small)
            assert calls == small_files, (calls, small_files)
            res["small_getxattr"]["us_per_call"] = res["small_getxattr"]["s"] / calls * 1e6
            mp_again = mount(client, "small-again", specs["small"])
            drop_caches(settle, heat)
            res["small_read_chunk_cache"], _ = ph.run(read_tree, mp_again)
            client.unmount(str(mp_again))
            client.unmount(str(mp_small))
    return res


BIG_PHASES = ["big_limit", "big_limit_page_cache", "big_cold", "big_mmap_cold", "big_page_cache",
              "big_chunk_cache", "big_limit_link", "big_cold_link"]
SMALL_PHASES = ["small_find_cold", "small_read_cold", "small_read_chunk_cache",
                "small_getxattr"]
PHASES = BIG_PHASES + SMALL_PHASES


def median_of(rounds: list[dict[str, Any]], phase: str, key: str) -> float:
    return float(statistics.median(r[phase][key] for r in rounds))


def summarize(rounds: list[dict[str, Any]], big_size: int, big_compressed: int,
              small_bytes: int, link: Link | None) -> dict[str, Any]:
    """Medians per phase, MB/s of the big file's phases, and the ratios the goals name: each
    cold read against the verified-bytes limit of the same round (median of the per-round
    ratios) and the shaped read's link bytes per second against the link's rate."""
    row: dict[str, Any] = {}
    for ph in PHASES:
        if ph not in rounds[0]:
            continue
        row[ph] = {k: round(median_of(rounds, ph, k), 4)
                   for k in ("s", "server_cpu_s", "reads", "cpu_us_per_read",
                             "machine_cpu_s")}
        if ph.startswith("big_"):
            row[ph]["MBps"] = round(big_size / row[ph]["s"] / 1e6, 1)
        if ph == "small_getxattr":
            row[ph]["us_per_call"] = round(median_of(rounds, ph, "us_per_call"), 1)
    if "big_limit" in rounds[0]:
        for ph in ("big_cold", "big_mmap_cold"):
            row[ph]["vs_limit"] = round(statistics.median(
                r["big_limit"]["s"] / r[ph]["s"] for r in rounds), 3)
            if "big_limit_page_cache" in rounds[0]:
                row[ph]["vs_limit_page_cache"] = round(statistics.median(
                    r["big_limit_page_cache"]["s"] / r[ph]["s"] for r in rounds), 3)
        row["big_fetched_over_compressed"] = round(
            statistics.median(r["big_fetched"] for r in rounds) / big_compressed, 3)
    for ph in ("big_limit_link", "big_cold_link"):
        if ph in rounds[0] and link is not None:
            rates = [r[ph]["link_bytes"] / r[ph]["s"] for r in rounds]
            row[ph]["link_MBps"] = round(statistics.median(rates) / 1e6, 1)
            row[ph]["vs_link"] = round(statistics.median(rates) / link.rate_bytes_per_s, 3)
    if "big_limit_link" in rounds[0] and "big_cold_link" in rounds[0]:
        row["big_cold_link"]["vs_limit_link"] = round(statistics.median(
            r["big_limit_link"]["s"] / r["big_cold_link"]["s"] for r in rounds), 3)
    if "small_fetched" in rounds[0]:
        row["small_fetched_over_read"] = round(
            statistics.median(r["small_fetched"] for r in rounds) / small_bytes, 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big-mib", type=int, default=1024)
    ap.add_argument("--small-files", type=int, default=20_000)
    ap.add_argument("--only", choices=("big", "small"), default=None,
                    help="run only the big-file or only the small-files phases")
    ap.add_argument("--link", type=link_arg, default=None,
                    help="also read the big file cold through a shaped link, e.g. 1gbit,2ms")
    ap.add_argument("--concurrency", type=int, default=FetchConfig().concurrency,
                    help="the FUSE server's fetch.concurrency (default: the product's, "
                         "%(default)s)")
    ap.add_argument("--limit-threads", type=int, default=None,
                    help="threads of the verified-bytes limit (default: --concurrency)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds per tree (alternated)")
    ap.add_argument("--tree", action="append", type=Path, default=None,
                    help="coldstart checkout to run the FUSE server from (repeatable; "
                         "default: this one)")
    ap.add_argument("--settle", type=float, default=6.0,
                    help="seconds to wait after dropping the page cache before each cold phase")
    ap.add_argument("--memory", choices=["settled", "hot"], default="settled",
                    help="the guest's free memory before each cold phase: settled (the "
                         "--settle wait: on a VM with free page reporting, pages freed "
                         "before are the host's again, as on a node that has not read the "
                         "file yet) or hot (then twice the big file's size written and freed: "
                         "the page cache and the server get pages the host still backs)")
    args = ap.parse_args()
    if args.link is not None and args.only == "small":
        ap.error("--link reads the big file: not with --only small")
    if args.limit_threads is None:
        args.limit_threads = args.concurrency
    trees = [t.resolve() for t in (args.tree or [REPO])]
    for t in trees:
        if not (t / "coldstart" / "cli.py").is_file():
            raise SystemExit(f"--tree {t}: not a coldstart checkout")
    big_size = args.big_mib * MiB
    if big_size <= 0 or args.rounds <= 0 or args.concurrency <= 0 or args.limit_threads <= 0:
        raise SystemExit("--big-mib, --rounds, --concurrency and --limit-threads must be "
                         "positive")
    want_big, want_small = args.only in (None, "big"), args.only in (None, "small")
    work = Path(tempfile.mkdtemp(prefix="bench-fuse-", dir="/var/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="bench-fuse-", dir="/dev/shm"))
    results: dict[str, Any] = {"big_bytes": big_size, "small_files": args.small_files,
                               "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
                               "trees": [str(t) for t in trees], "rounds": args.rounds,
                               "concurrency": args.concurrency,
                               "limit_threads": args.limit_threads,
                               "link": str(args.link) if args.link else None,
                               "memory": args.memory, "settle_s": args.settle}
    try:
        with start_registry(work / "registry") as registry:
            print(f"building layers in {work} ...", flush=True)
            specs: dict[str, LayerSpec] = {}
            results["tmpfs"] = {}
            big_compressed = small_bytes = 0
            if want_big:
                big_tar(work / "big.tar", big_size)
                with tarfile.open(work / "big.tar") as tf:
                    tf.extract("data/big.bin", shm, filter="data")
                t_conv, big = timed(convert, work / "big.tar", work / "big.zst")
                (work / "big.tar").unlink()
                results["convert_1gib_s"] = round(t_conv, 2)
                results["big_compressed_bytes"] = big_compressed = big.size
                specs["big"] = push_layer(registry.host, "bench/big", work / "big.zst", big)
                (work / "big.zst").unlink()
                t_tmpfs = min(timed(read_file, shm / "data/big.bin")[0] for _ in range(2))
                t_tmpfs_mmap = min(timed(mmap_read, shm / "data/big.bin")[0] for _ in range(2))
                results["tmpfs"].update(big_MBps=round(big_size / t_tmpfs / 1e6, 1),
                                        big_mmap_MBps=round(big_size / t_tmpfs_mmap / 1e6, 1))
                shutil.rmtree(shm / "data")
            if want_small:
                tmpfs_tree = shm / "tree"
                tmpfs_tree.mkdir()
                small_bytes = small_tree(tmpfs_tree, args.small_files)
                tar_dir(tmpfs_tree, work / "small.tar")
                small = convert(work / "small.tar", work / "small.zst")
                specs["small"] = push_layer(registry.host, "bench/small", work / "small.zst",
                                            small)
                (work / "small.zst").unlink()
                t_find_tmpfs, _ = timed(count_tree, tmpfs_tree)
                t_read_tmpfs, _ = timed(read_tree, tmpfs_tree)
                results["tmpfs"].update(small_find_s=round(t_find_tmpfs, 3),
                                        small_read_s=round(t_read_tmpfs, 3))
                shutil.rmtree(tmpfs_tree)
            per_tree: dict[str, list[dict[str, Any]]] = {str(t): [] for t in trees}
            srv_tmp = work / "srv"
            srv_tmp.mkdir()
            for rnd in range(args.rounds):
                order = trees if rnd % 2 == 0 else list(reversed(trees))
                for t in order:
                    print(f"round {rnd + 1}/{args.rounds}: FUSE server from {t}", flush=True)
                    per_tree[str(t)].append(one_round(
                        t, srv_tmp, registry.host, specs, big_size, args.small_files,
                        small_bytes, args.settle,
                        2 * big_size if args.memory == "hot" else 0, args.concurrency,
                        args.limit_threads,
                        args.link))
            results["runs"] = per_tree
            summary = {t: summarize(rounds, big_size, big_compressed, small_bytes, args.link)
                       for t, rounds in per_tree.items()}
            results["median"] = summary
        print()
        names = [Path(t).name or t for t in summary]
        print(f"free memory before each cold phase: {args.memory}")
        hdr = f"{'phase (median of ' + str(args.rounds) + ')':<22}" + "".join(
            f"{n[:68]:>70}" for n in names)
        print(hdr)
        for ph in PHASES:
            cells = []
            for t in summary:
                m = summary[t].get(ph)
                if m is None:
                    continue
                speed = f"{m['MBps']} MB/s" if "MBps" in m else f"{m['s']:.2f} s"
                if "vs_limit" in m:
                    speed += f" ({m['vs_limit']}x limit"
                    if "vs_limit_page_cache" in m:
                        speed += f", {m['vs_limit_page_cache']}x +pc"
                    speed += ")"
                if "us_per_call" in m:
                    speed += f" ({m['us_per_call']} us/call)"
                if "vs_link" in m:
                    speed += f" (link {m['link_MBps']} MB/s, {m['vs_link']}x)"
                if "vs_limit_link" in m:
                    speed += f" ({m['vs_limit_link']}x limit_link)"
                if m["reads"]:
                    speed += f", {m['cpu_us_per_read']:.0f} us/read ({m['reads']:.0f})"
                speed += f", {m['machine_cpu_s']:.1f} cpu-s"
                cells.append(speed)
            if cells:
                print(f"{ph:<22}" + "".join(f"{c:>70}" for c in cells))
        print(f"{'tmpfs':<22}{results['tmpfs']}")
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
