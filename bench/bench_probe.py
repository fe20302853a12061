"""How fast does "the app is ready" reach the router's store? And what does the prober cost?

Three processes, as in production: the app (a real HTTP server that turns ready on command and
records that instant), the prober host (runs one prober per trial), and this one (subscribes to
the store's change channel and records when READY arrives). Latency = arrival - ready instant,
both on CLOCK_MONOTONIC, which all processes of a machine share.

Modes, all in the same run against the same redis-server:
  notify    coldstart prober, the app pushes READY=1 through $NOTIFY_SOCKET (sd_notify)
  http      coldstart prober polling HTTP at its default start-up interval (5 ms)
  knative   baseline written here: poll every 50 ms (100 ms per try), as Knative's queue-proxy
  kubelet   baseline written here: poll every 1 s, as the kubelet's periodSeconds minimum
The baselines write the store the same way on their first success (HSET + PUBLISH), so they
measure only their polling delay: the real systems add endpoint propagation on top (1-7 s).
The 1 s poll runs fewer trials (40 by default): each one waits ~1 s (a random phase plus up to
one period), and its latency is uniform over the period by construction, so more trials would
only confirm p50 ~ 500 ms and p99 ~ 1 s at a cost of minutes.

Then the prober's CPU (utime+stime from /proc/<pid>/stat) as the real `coldstart probe` command
at its defaults: steady state (READY, 100 ms interval, 1 s heartbeat) and start-up (5 ms polls).

    .venv/bin/python bench/bench_probe.py                 # ~2-3 minutes
    .venv/bin/python bench/bench_probe.py --trials 50 --kubelet-trials 10 --cpu-seconds 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from coldstart.probe.router import channel, keys  # noqa: E402
from coldstart.stack.redis import start_redis  # noqa: E402

SERVICE = "bench"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- the app -------------------------------------------------------------------------------------

def app_main(conn: Connection, port: int) -> None:
    """HTTP app: /health is 503 until told 'ready'; answers with the instant it turned ready."""
    ready = [False]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            # one write per answer, as uvicorn or Go servers do (http.server's default of two
            # small writes would add Nagle/delayed-ACK stalls to the baselines)
            body = b'{"phase":"serving"}' if ready[0] else b'{"phase":"loading"}'
            status = b"200 OK" if ready[0] else b"503 Service Unavailable"
            self.wfile.write(b"HTTP/1.1 %s\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (status, len(body), body))

        def log_message(self, *a: Any) -> None:
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, request: Any, client_address: Any) -> None:
            pass  # a prober dropping its connection at the end of a trial is expected

    server = Server(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    from coldstart.probe.notify import notify

    conn.send("up")
    while True:
        cmd = conn.recv()
        if cmd[0] == "reset":
            ready[0] = False
            conn.send("ok")
        elif cmd[0] == "ready":
            t0 = time.monotonic_ns()
            ready[0] = True
            conn.send(t0)
        elif cmd[0] == "notify":
            t0 = time.monotonic_ns()
            notify(ready=True, socket_path=cmd[1])
            conn.send(t0)
        elif cmd[0] == "quit":
            return


# --- the prober host -----------------------------------------------------------------------------

async def baseline_poller(url: str, target: str, health: str, period: float) -> None:
    """What the baselines do: GET every ``period`` on a kept-alive connection (100 ms per try);
    on the first 200, write the store and publish, as the prober's sink does."""
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    k = keys(SERVICE)
    host, port = "127.0.0.1", int(health.split(":")[2].split("/")[0])
    request = f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None
    try:
        while True:
            ok = False
            try:
                async with asyncio.timeout(0.1):
                    if writer is None:
                        reader, writer = await asyncio.open_connection(host, port)
                    assert reader is not None
                    writer.write(request)
                    status = int((await reader.readline()).split()[1])
                    length = 0
                    while (line := await reader.readline()) not in (b"\r\n", b""):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":")[1])
                    await reader.readexactly(length)
                    ok = 200 <= status < 400
            except (OSError, TimeoutError, ValueError, IndexError, asyncio.IncompleteReadError):
                if writer is not None:
                    writer.close()
                reader = writer = None
            if ok:
                doc = json.dumps({"target": target, "state": "READY"})
                async with client.pipeline(transaction=True) as pipe:
                    pipe.hset(k[0], target, "READY")
                    pipe.publish(channel(SERVICE), doc)
                    await pipe.execute()
                return
            await asyncio.sleep(period)
    finally:
        if writer is not None:
            writer.close()
        await client.aclose()


async def host_async(conn: Connection, url: str) -> None:
    from coldstart.probe.checks import HttpCheck
    from coldstart.probe.prober import ProbeConfig, Prober
    from coldstart.probe.sinks import RedisSink

    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[Any] = asyncio.Queue()
    loop.add_reader(conn.fileno(), lambda: inbox.put_nowait(conn.recv()))
    task: asyncio.Task[Any] | None = None
    while True:
        cmd = await inbox.get()
        if cmd[0] == "start":
            _, mode, target, health, notify_path = cmd
            if mode in ("notify", "http"):
                config = ProbeConfig(service=SERVICE, target=target)  # the defaults
                check = HttpCheck(health) if mode == "http" else None
                prober = Prober(config, check, [RedisSink(url, SERVICE, target)],
                                notify_path=notify_path if mode == "notify" else None)
                task = asyncio.create_task(prober.run(signals=False))
                while not prober.history:
                    await asyncio.sleep(0.001)
                await prober.flush(5)  # STARTING is in the store
            else:
                period = 0.05 if mode == "knative" else 1.0
                task = asyncio.create_task(baseline_poller(url, target, health, period))
            conn.send("started")
        elif cmd[0] == "stop":
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            conn.send("stopped")
        elif cmd[0] == "quit":
            return


def host_main(conn: Connection, url: str) -> None:
    asyncio.run(host_async(conn, url))


# --- measurement ---------------------------------------------------------------------------------

class Subscriber:
    """Records the monotonic instant each target's READY document arrives."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=None)
        self.pubsub = self.client.pubsub()  # type: ignore[no-untyped-call]
        self.pubsub.subscribe(channel(SERVICE))
        self.arrived: dict[str, int] = {}
        self.cond = threading.Condition()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        with contextlib.suppress(redis.RedisError):  # the server goes away at the end
            for msg in self.pubsub.listen():
                if msg["type"] != "message":
                    continue
                now = time.monotonic_ns()
                doc = json.loads(msg["data"])
                if doc.get("state") == "READY":
                    with self.cond:
                        self.arrived.setdefault(doc["target"], now)
                        self.cond.notify_all()

    def wait(self, target: str, timeout: float) -> int:
        with self.cond:
            if not self.cond.wait_for(lambda: target in self.arrived, timeout):
                raise TimeoutError(f"{target} never READY in the store")
            return self.arrived[target]


def run_mode(mode: str, trials: int, app: Connection, host: Connection, sub: Subscriber,
             health: str, tmp: str) -> list[float]:
    latencies = []
    jitter = {"notify": 0.02, "http": 0.02, "knative": 0.05, "kubelet": 1.0}[mode]
    for i in range(trials):
        target = f"{mode}-{i}-{os.getpid()}"
        notify_path = os.path.join(tmp, f"n{i}.sock")
        app.send(("reset",))
        app.recv()
        host.send(("start", mode, target, health, notify_path))
        host.recv()
        time.sleep(random.uniform(0, jitter))  # a random phase against the poll ticks
        app.send(("notify", notify_path) if mode == "notify" else ("ready",))
        t0 = app.recv()
        t1 = sub.wait(target, timeout=10)
        latencies.append((t1 - t0) / 1e6)
        host.send(("stop",))
        host.recv()
    return latencies


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(utime+stime from /proc/PID/stat, in clock ticks of 10 ms; the sum of every thread's
    on-CPU time from /proc/PID/task/*/schedstat, in ns: the same thing, finer)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = (int(fields[11]) + int(fields[12])) / CLK_TCK
    ns = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            ns += int((task / "schedstat").read_text().split()[0])
    return ticks, ns / 1e9


def measure_cpu(url: str, port: int, seconds: float, app: Connection, *,
                ready: bool) -> tuple[float, float]:
    """% of one core used by the real `coldstart probe` command over ``seconds``."""
    app.send(("reset",))
    app.recv()
    if ready:
        app.send(("ready",))
        app.recv()
    argv = [sys.executable, "-m", "coldstart.cli", "probe", "--target",
            f"http://127.0.0.1:{port}/health", "--sink", url, "--service", SERVICE,
            "--advertise", f"cpu-{'ready' if ready else 'starting'}"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(2.0)  # imports and connection set-up are not steady state
        c0, w0 = cpu_seconds(proc.pid), time.monotonic()
        time.sleep(seconds)
        c1, w1 = cpu_seconds(proc.pid), time.monotonic()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    wall = w1 - w0
    return 100 * (c1[0] - c0[0]) / wall, 100 * (c1[1] - c0[1]) / wall


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A private redis-server (coldstart.stack's, the tests' too) in a temp dir."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-redis-"))
    try:
        with start_redis(tmp) as url:
            yield url
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=200, help="trials per mode (notify/http/knative)")
    p.add_argument("--kubelet-trials", type=int, default=40,
                   help="trials of the 1 s poll (each costs ~1 s; see above)")
    p.add_argument("--cpu-seconds", type=float, default=10.0)
    p.add_argument("--redis", help="use this Valkey/Redis instead of starting redis-server")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--modes", default="notify,http,knative,kubelet",
                   help="comma-separated subset of the modes (ratios need all four)")
    p.add_argument("--no-cpu", action="store_true", help="skip the CPU measurement")
    args = p.parse_args()

    ctx = mp.get_context("spawn")
    with contextlib.ExitStack() as stack:
        url = args.redis or stack.enter_context(redis_server())
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        health = f"http://127.0.0.1:{port}/health"
        app_conn, app_end = ctx.Pipe()
        host_conn, host_end = ctx.Pipe()
        app = ctx.Process(target=app_main, args=(app_end, port), daemon=True)
        host = ctx.Process(target=host_main, args=(host_end, url), daemon=True)
        app.start()
        host.start()
        stack.callback(app.terminate)
        stack.callback(host.terminate)
        assert app_conn.recv() == "up"
        sub = Subscriber(url)
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-probe-"))
        wanted = set(args.modes.split(","))
        plan = [(m, args.kubelet_trials if m == "kubelet" else args.trials)
                for m in ("notify", "http", "knative", "kubelet") if m in wanted]
        results: dict[str, Any] = {"load_before": os.getloadavg(), "modes": {}}
        print(f"{'mode':<9} {'trials':>6} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} "
              f"{'max ms':>9}", flush=True)
        for mode, n in plan:
            lat = run_mode(mode, n, app_conn, host_conn, sub, health, tmp)
            row = {"trials": n, "p50": statistics.median(lat), "p90": pct(lat, 90),
                   "p99": pct(lat, 99), "max": max(lat)}
            results["modes"][mode] = row
            print(f"{mode:<9} {n:>6} {row['p50']:>9.2f} {row['p90']:>9.2f} {row['p99']:>9.2f} "
                  f"{row['max']:>9.2f}", flush=True)
        m = results["modes"]
        for name in ("notify", "http") if {"knative", "kubelet"} <= wanted else ():
            print(f"{name}: p50 {m['knative']['p50'] / m[name]['p50']:.0f}x faster than the 50 ms "
                  f"poll, {m['kubelet']['p50'] / m[name]['p50']:.0f}x than the 1 s poll")
        host_conn.send(("quit",))
        app_conn.send(("reset",))
        app_conn.recv()
        if args.no_cpu:
            app_conn.send(("quit",))
            return
        steady = measure_cpu(url, port, args.cpu_seconds, app_conn, ready=True)
        starting = measure_cpu(url, port, args.cpu_seconds, app_conn, ready=False)
        results["cpu_percent_of_one_core"] = {
            "steady_ready": {"proc_stat": steady[0], "schedstat": steady[1]},
            "startup_polling": {"proc_stat": starting[0], "schedstat": starting[1]}}
        results["load_after"] = os.getloadavg()
        print(f"prober CPU, % of one core over {args.cpu_seconds:g} s (/proc/PID/stat | "
              f"schedstat): steady (READY, defaults) {steady[0]:.2f} | {steady[1]:.3f}; "
              f"while starting (5 ms polls) {starting[0]:.2f} | {starting[1]:.3f}")
        print(f"load average before/after: {results['load_before'][0]:.2f} / "
              f"{results['load_after'][0]:.2f} ({os.cpu_count()} CPUs)")
        app_conn.send(("quit",))
        client = redis.Redis.from_url(url, socket_timeout=2)
        client.delete(*keys(SERVICE))
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
