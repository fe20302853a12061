"""The router's store at fleet scale: picks per second, pick latency and the store's CPU per pick
with 100 to 50,000 READY targets, 64 concurrent pickers and every target's heartbeat on.

Both libraries run in the same run, against the same redis-server, through the same harness
and the same client path (``Router``'s): ``v2`` (this tree's :mod:`coldstart.probe.router`: a
pool of pickable targets, O(log n) per pick) and ``v1`` (the library before issue 52, kept in
``bench/baselines/router_v1.lua``: every pick reads the whole READY set). Rounds alternate which
library goes first. Per round, fleet size and library:

1. register N targets READY through the library's ``update`` (pipelined: the store sees what
   N probers' first updates would send);
2. start the heartbeats: every target's ``heartbeat`` call at the probers' default rate (one per
   target per second), from one process on pre-encoded, pipelined commands (so the load
   generator costs almost nothing; a real fleet sends the same calls over N connections, which
   adds the store's socket work per call: not measured here);
3. 64 pickers (threads over ``--procs`` processes, each with its own connection), each looping
   ``Router.pick()`` then ``Router.release()`` through the public API, for ``--seconds``;
   latency is the client's wall time of ``pick()``;
4. with the heartbeats stopped (and every target made alive again), the store's own time per
   call (``INFO commandstats``: usec of FCALL over calls) for 2,000 picks, then 2,000 releases,
   pipelined so the store runs them back to back: the time per pick free of client and network.

After the rounds, the store's time per call of heartbeat, pick and release, hot: Redis's own
``redis-benchmark`` sends each pipelined from 16 connections to random targets.

Before the rounds, 2,000 probers start at once against a store without the library: v2 through
``RedisSink``, v1 as its sink did (``FUNCTION LOAD REPLACE`` first): seconds, and the loads.

Server CPU per pick under load is the redis-server process's CPU time (utime + stime) over the
pickers' window divided by the picks in it: it includes the releases and the heartbeats, which
are part of what a pick costs the store.

    .venv/bin/python bench/bench_router.py                       # ~12 minutes
    .venv/bin/python bench/bench_router.py --sizes 100,10000 --seconds 5 --libraries v2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import select
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from coldstart.config import ProbeTimingConfig  # noqa: E402
from coldstart.errors import NotFound  # noqa: E402
from coldstart.probe.router import (  # noqa: E402
    LIBRARY,
    Router,
    channel,
    function,
    keys,
    resp_head,
)
from coldstart.stack.redis import start_redis  # noqa: E402

V1_LIBRARY = (ROOT / "bench" / "baselines" / "router_v1.lua").read_text()
CLK_TCK = os.sysconf("SC_CLK_TCK")
_T = ProbeTimingConfig()


class RouterV1(Router):
    """The same public API over the v1 library (function names without a version)."""

    def _call(self, name: str, *args: object) -> Any:
        return self._fcall(f"coldstart_{name}", args)  # the same client path as v2's

    def pick(self, *, policy: str | None = None, at_ms: int | None = None) -> str:
        target = self._call("pick")
        if not target:
            raise NotFound("no target")
        return str(target)


def make_router(library: str, url: str, service: str) -> Router:
    r = Router.connect(url, service, timeout=10.0)
    if library == "v1":
        return RouterV1(r.client, service, url)
    return r


def fn(library: str, name: str) -> str:
    return f"coldstart_{name}" if library == "v1" else function(name)


def target_names(n: int) -> list[str]:
    return [f"10.{i // 62500}.{i // 250 % 250}.{i % 250}:8000" for i in range(n)]


def register(url: str, library: str, service: str, names: list[str], ttl_ms: int) -> None:
    """Every target READY through the library's ``update``, pipelined 2,000 at a time."""
    client = redis.Redis.from_url(url, socket_timeout=60)
    k = keys(service)
    for start in range(0, len(names), 2000):
        pipe = client.pipeline(transaction=False)
        for t in names[start:start + 2000]:
            doc = json.dumps({"service": service, "target": t, "state": "READY", "epoch": 1})
            pipe.fcall(fn(library, "update"), len(k), *k, t, 1, "READY", doc, ttl_ms,
                       channel(service), 0)
        assert all(int(x) == 1 for x in pipe.execute())
    client.close()


# --- heartbeats ----------------------------------------------------------------------------------

def heartbeat_main(url: str, library: str, service: str, n: int, stop: Any,
                   out: Any) -> None:
    """Every target's heartbeat once per ``_T.heartbeat`` s, spread evenly in 10 ms ticks."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    k = keys(service)
    call = ("FCALL", fn(library, "heartbeat"), len(k), *k)
    ttl_ms = int(_T.ttl * 1000)
    commands = [resp_head(len(call) + 3, *call, t, 1, ttl_ms) for t in target_names(n)]
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sent, answers = 0, {"ok": 0, "other": 0}
    done = threading.Event()

    def reader() -> None:
        buf = b""
        while not (done.is_set() and answers["ok"] + answers["other"] >= sent):
            if not select.select([sock], [], [], 0.2)[0]:
                continue  # look up at least this often: done, and every answer in?
            chunk = sock.recv(1 << 16)
            if not chunk:
                return
            buf += chunk
            lines = buf.split(b"\r\n")
            buf = lines.pop()
            for line in lines:
                if line == b":1":
                    answers["ok"] += 1
                elif line:
                    answers["other"] += 1

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    tick = 0.01
    per_tick = n * tick / _T.heartbeat
    owed, i, t0 = 0.0, 0, time.monotonic()
    next_tick = t0
    while not stop.is_set():
        owed += per_tick
        batch = int(owed)
        owed -= batch
        if batch:
            chunk = [commands[(i + j) % n] for j in range(batch)]
            i = (i + batch) % n
            sock.sendall(b"".join(chunk))
            sent += batch
        next_tick += tick
        time.sleep(max(0.0, next_tick - time.monotonic()))
    elapsed = time.monotonic() - t0
    done.set()
    th.join(10)
    out.put({"sent": sent, "ok": answers["ok"], "other": answers["other"],
             "per_s": sent / elapsed})
    sock.close()


# --- pickers -------------------------------------------------------------------------------------

def picker_proc(url: str, library: str, service: str, threads: int, start_at: float,
                seconds: float, out: Any) -> None:
    results: list[tuple[list[float], int]] = []
    lock = threading.Lock()

    def one() -> None:
        r = make_router(library, url, service)
        r.client.ping()
        lat: list[float] = []
        refused = 0
        time.sleep(max(0.0, start_at - time.time()))
        end = start_at + seconds
        while time.time() < end:
            t0 = time.perf_counter()
            try:
                target = r.pick()
            except NotFound:
                refused += 1
                continue
            lat.append(time.perf_counter() - t0)
            r.release(target)
        with lock:
            results.append((lat, refused))
        r.client.close()

    ths = [threading.Thread(target=one) for _ in range(threads)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    out.put(([x for lat, _ in results for x in lat], sum(r for _, r in results)))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def server_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def fcall_usec(client: redis.Redis) -> tuple[int, int]:
    stats = client.info("commandstats").get("cmdstat_fcall", {})
    return int(stats.get("calls", 0)), int(stats.get("usec", 0))


def unloaded_usec(url: str, library: str, service: str, calls: int = 2000) -> dict[str, float]:
    """The store's own time per pick and per release (``INFO commandstats``), nothing else
    running: ``calls`` picks, then as many releases, sent in pipelined batches of 100 so the
    store runs them back to back, as it does under load."""
    client = redis.Redis.from_url(url, socket_timeout=60, decode_responses=True)
    k = keys(service)
    names = target_names(int(client.hlen(k[0])))
    for start in range(0, len(names), 2000):  # every target alive again (and for long enough)
        pipe = client.pipeline(transaction=False)
        for t in names[start:start + 2000]:
            pipe.fcall(fn(library, "heartbeat"), len(k), *k, t, 1, 600_000)
        pipe.execute()
    pick = [fn(library, "pick")] + ([] if library == "v1" else ["spread"])
    out, picked = {}, []
    c0 = fcall_usec(client)
    for _ in range(calls // 100):
        pipe = client.pipeline(transaction=False)
        for _ in range(100):
            pipe.fcall(pick[0], len(k), *k, *pick[1:])
        picked += pipe.execute()
    c1 = fcall_usec(client)
    assert all(picked), "a pick found no target"
    for start in range(0, len(picked), 100):
        pipe = client.pipeline(transaction=False)
        for t in picked[start:start + 100]:
            pipe.fcall(fn(library, "release"), len(k), *k, t, 1)
        pipe.execute()
    c2 = fcall_usec(client)
    out["pick_us"] = (c1[1] - c0[1]) / max(1, c1[0] - c0[0])
    out["release_us"] = (c2[1] - c1[1]) / max(1, c2[0] - c1[0])
    client.close()
    return out


def measure(url: str, pid: int, library: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    service = f"bench-{library}-{n}"
    client = redis.Redis.from_url(url, socket_timeout=60, decode_responses=True)
    client.delete(*keys(service))
    t0 = time.monotonic()
    register(url, library, service, target_names(n), int(_T.ttl * 1000))
    registered_s = time.monotonic() - t0
    stop, hb_out = ctx.Event(), ctx.Queue()
    hb = ctx.Process(target=heartbeat_main, args=(url, library, service, n, stop, hb_out))
    hb.start()
    time.sleep(1.0)  # heartbeats at their rate before the pickers start
    queue = ctx.Queue()
    start_at = time.time() + 2.0 + 0.2 * args.procs  # the processes import and connect first
    per = [args.pickers // args.procs + (1 if i < args.pickers % args.procs else 0)
           for i in range(args.procs)]
    procs = [ctx.Process(target=picker_proc,
                         args=(url, library, service, k, start_at, args.seconds, queue))
             for k in per]
    for p in procs:
        p.start()
    # the store's CPU over the pickers' own window, [start_at, start_at + seconds]
    time.sleep(max(0.0, start_at - time.time()))
    cpu0, w0 = server_cpu(pid), time.monotonic()
    calls0 = fcall_usec(client)
    time.sleep(max(0.0, start_at + args.seconds - time.time()))
    cpu1, w1 = server_cpu(pid), time.monotonic()
    calls1 = fcall_usec(client)
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    stop.set()
    beats = hb_out.get(timeout=60)
    hb.join(30)
    lat = [x * 1000 for lats, _ in results for x in lats]
    picks = len(lat)
    wall = args.seconds  # the pickers' own window (each stops its loop at its end)
    row: dict[str, Any] = {
        "library": library, "pods": n, "pickers": args.pickers, "procs": args.procs,
        "seconds": args.seconds, "picks": picks, "refused": sum(r for _, r in results),
        "picks_per_s": picks / wall,
        "p50_ms": statistics.median(lat) if lat else None,
        "p99_ms": pct(lat, 99) if lat else None,
        "server_cpu_s": cpu1 - cpu0,
        "server_cpu_us_per_pick": (cpu1 - cpu0) / max(1, picks) * 1e6,
        "server_busy_percent": 100 * (cpu1 - cpu0) / (w1 - w0),
        "fcalls_in_window": calls1[0] - calls0[0],
        "heartbeats": beats, "register_s": registered_s,
    }
    row.update(unloaded_usec(url, library, service))
    client.delete(*keys(service))
    client.close()
    return row


@contextlib.contextmanager
def redis_server() -> Iterator[tuple[str, int]]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-router-"))
    try:
        with start_redis(tmp) as url:
            client = redis.Redis.from_url(url)
            pid = int(client.info("server")["process_id"])
            client.close()
            yield url, pid
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def registration(url: str, library: str, n: int) -> dict[str, Any]:
    """``n`` probers start at once (64 at a time), each with its own connection, and write
    READY: v2 through :class:`RedisSink`; v1 as its sink did (``FUNCTION LOAD REPLACE`` on its
    first call, then the update). Seconds, and ``FUNCTION LOAD`` calls that loaded."""
    import asyncio

    import redis.asyncio

    from coldstart.probe.sinks import RedisSink
    from coldstart.probe.states import State, Status

    service = f"register-{library}-{n}"
    k = keys(service)
    names = target_names(n)

    async def one(i: int, gate: asyncio.Semaphore) -> None:
        target = names[i]
        async with gate:
            if library == "v2":
                sink = RedisSink(url, service, target)
                await sink.publish(Status(State.READY, epoch=1))
                await sink.close()
                return
            client = redis.asyncio.Redis.from_url(url, socket_timeout=60)
            await client.function_load(V1_LIBRARY, replace=True)
            await client.fcall("coldstart_update", len(k), *k, target, 1, "READY", "{}",
                               int(_T.ttl * 1000), channel(service), 0)
            await client.aclose()

    async def run() -> None:
        gate = asyncio.Semaphore(64)
        await asyncio.gather(*(one(i, gate) for i in range(n)))

    client = redis.Redis.from_url(url, socket_timeout=60, decode_responses=True)
    client.config_resetstat()
    t0 = time.monotonic()
    asyncio.run(run())
    seconds = time.monotonic() - t0
    stats = client.info("commandstats").get("cmdstat_function|load", {})
    loads = int(stats.get("calls", 0)) - int(stats.get("failed_calls", 0))
    registered = client.hlen(k[0])
    client.delete(*k)
    client.close()
    return {"library": library, "probers": n, "seconds": seconds, "library_loads": loads,
            "load_store_ms": int(stats.get("usec", 0)) / 1000, "registered": registered}


def per_call(url: str, library: str, n: int) -> dict[str, float] | None:
    """The store's time per call of heartbeat, pick and release with n targets, hot: Redis's
    own ``redis-benchmark`` (C) sends them pipelined from 16 connections, random targets."""
    bench = shutil.which("redis-benchmark")
    if bench is None:
        return None
    client = redis.Redis.from_url(url, socket_timeout=60, decode_responses=True)
    service = f"percall-{library}-{n}"
    k = keys(service)
    client.delete(*k)
    # the names redis-benchmark's -r makes of t:__rand_int__
    register(url, library, service, [f"t:{i:012d}" for i in range(n)], 600_000)
    host, port = url.split("//")[1].split("/")[0].split(":")
    out = {}
    pick = ["spread"] if library == "v2" else []
    for name, args in (("heartbeat", ["t:__rand_int__", 1, 600_000]), ("pick", pick),
                       ("release", ["t:__rand_int__", 1])):
        client.config_resetstat()
        subprocess.run([bench, "-h", host, "-p", port, "-n", "50000", "-c", "16", "-P", "16",
                        "-q", "-r", str(n), "FCALL", fn(library, name), str(len(k)), *k,
                        *map(str, args)], capture_output=True, check=True, timeout=600)
        out[f"{name}_us"] = float(client.info("commandstats")["cmdstat_fcall"]["usec_per_call"])
    client.delete(*k)
    client.close()
    return out


SUMMED = ("picks_per_s", "p50_ms", "p99_ms", "pick_us", "release_us", "server_cpu_us_per_pick",
          "server_busy_percent")


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over the rounds, per library and fleet size."""
    out = []
    for lib, n in sorted({(r["library"], r["pods"]) for r in rows}):
        runs = [r for r in rows if (r["library"], r["pods"]) == (lib, n)]
        row: dict[str, Any] = {"library": lib, "pods": n, "runs": len(runs)}
        for field in SUMMED:
            row[field] = statistics.median(r[field] for r in runs)
        row["heartbeats_per_s"] = statistics.median(r["heartbeats"]["per_s"] for r in runs)
        row["heartbeats_refused"] = sum(r["heartbeats"]["other"] for r in runs)
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="100,1000,10000,50000", help="READY targets per run")
    p.add_argument("--libraries", default="v1,v2", help="v1 (before issue 52), v2 (this tree)")
    p.add_argument("--rounds", type=int, default=3,
                   help="runs of each size and library; the table shows their medians")
    p.add_argument("--pickers", type=int, default=64)
    p.add_argument("--procs", type=int, default=2, help="processes the pickers run in")
    p.add_argument("--seconds", type=float, default=10.0, help="loaded window per run")
    p.add_argument("--v1-max", type=int, default=10000,
                   help="largest fleet the v1 library is run at (it is O(n) per pick)")
    p.add_argument("--probers", type=int, default=2000,
                   help="probers starting at once, for the registration figure (0: skip)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    libraries = args.libraries.split(",")
    rows = []
    head = (f"{'lib':<4} {'pods':>6} {'picks/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'pick us':>8} "
            f"{'rel us':>7} {'cpu us/pick':>11} {'busy %':>6} {'beats/s':>8}")
    with redis_server() as (url, pid):
        print(f"{os.cpu_count()} CPUs; {args.pickers} pickers in {args.procs} processes; "
              f"{args.seconds:g} s per run; heartbeat every {_T.heartbeat:g} s per target",
              flush=True)
        registrations = []
        client = redis.Redis.from_url(url)
        for library in libraries if args.probers else ():
            client.function_flush()  # a fresh store: the first probers find no library
            reg = registration(url, library, args.probers)
            registrations.append(reg)
            print(f"{library}: {reg['probers']} probers starting at once registered in "
                  f"{reg['seconds']:.2f} s, {reg['library_loads']} library loads "
                  f"(the store spent {reg['load_store_ms']:.0f} ms in FUNCTION LOAD) "
                  f"({reg['registered']} targets in the store)", flush=True)
        client.function_flush()
        client.function_load(LIBRARY)
        client.function_load(V1_LIBRARY)
        client.close()
        print(head, flush=True)
        for rnd in range(args.rounds):
            order = libraries if rnd % 2 == 0 else libraries[::-1]  # alternate who goes first
            for n in sizes:
                for library in order:
                    if library == "v1" and n > args.v1_max:
                        continue
                    row = measure(url, pid, library, n, args)
                    row["round"] = rnd
                    rows.append(row)
                    hb = row["heartbeats"]
                    print(f"{library:<4} {n:>6} {row['picks_per_s']:>8.0f} "
                          f"{row['p50_ms']:>7.2f} {row['p99_ms']:>7.2f} {row['pick_us']:>8.1f} "
                          f"{row['release_us']:>7.1f} {row['server_cpu_us_per_pick']:>11.1f} "
                          f"{row['server_busy_percent']:>6.0f} {hb['per_s']:>8.0f}"
                          + ("" if hb["other"] == 0 else f"  ({hb['other']} beats refused)"),
                          flush=True)
        calls = []
        for n in sizes:
            for library in libraries:
                if library == "v1" and n > args.v1_max:
                    continue
                got = per_call(url, library, n)
                if got is not None:
                    calls.append({"library": library, "pods": n} | got)
    summary = summarize(rows)
    print(f"\nmedians of {args.rounds} rounds\n{head}")
    for r in summary:
        print(f"{r['library']:<4} {r['pods']:>6} {r['picks_per_s']:>8.0f} {r['p50_ms']:>7.2f} "
              f"{r['p99_ms']:>7.2f} {r['pick_us']:>8.1f} {r['release_us']:>7.1f} "
              f"{r['server_cpu_us_per_pick']:>11.1f} {r['server_busy_percent']:>6.0f} "
              f"{r['heartbeats_per_s']:>8.0f}")
    if calls:
        print("\nthe store's time per call, hot (redis-benchmark, 16 connections, pipelined)")
        for c in calls:
            print(f"{c['library']:<4} {c['pods']:>6}: heartbeat {c['heartbeat_us']:.1f} us, "
                  f"pick {c['pick_us']:.1f} us, release {c['release_us']:.1f} us")
    by = {(r["library"], r["pods"]): r for r in summary}
    print()
    for lib in libraries:
        base = by.get((lib, min(sizes)))
        for n in sizes:
            at = by.get((lib, n))
            if not base or not at or n == base["pods"]:
                continue
            print(f"{lib} {n:>6} pods vs {base['pods']}: store time per pick "
                  f"{at['pick_us'] / base['pick_us']:.2f}x, client p99 "
                  f"{at['p99_ms'] / base['p99_ms']:.2f}x, {at['picks_per_s']:.0f} picks/s")
    for n in sizes:
        old, new = by.get(("v1", n)), by.get(("v2", n))
        if old and new:
            print(f"v2 vs v1 at {n:>6} pods: {new['picks_per_s'] / old['picks_per_s']:.1f}x "
                  f"picks/s, store time per pick {old['pick_us'] / new['pick_us']:.1f}x less")
    if args.json:
        args.json.write_text(json.dumps({"cpus": os.cpu_count(), "args": vars(args) | {
            "json": str(args.json)}, "summary": summary, "rows": rows,
            "registration": registrations, "per_call": calls}, indent=2))


if __name__ == "__main__":
    main()
