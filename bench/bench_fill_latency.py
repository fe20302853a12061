"""Does the hybrid fill slow on-demand reads? p50/p99 of on-demand reads, fill off vs on.

One zstd:chunked layer (small files spread among big ones, ~300 MB) is served by a local
registry behind the bench's shaping proxy (default ``1gbit,2ms``). For each round and mode
(alternated) the page cache is dropped, a fresh FUSE server with an empty chunk cache mounts
the layer, and right away ``--reads`` small files are read one after the other, each timed from
``open`` to the last byte: files far apart in the blob (each one a miss: further apart than
the neighbour window), taken from the end of the blob, which the fill reaches last. With the
fill on (``fetch.background_rate`` at its default, the link's rate) a read either waits while
the fill streams the rest of the layer, or finds its file already filled; the bytes fetched on
demand say which. Reported: p50 and p99 per mode (medians over rounds), their ratios, and the
on-demand bytes; the goal is p99 within 1.5x. Needs root.

    .venv/bin/python bench/bench_fill_latency.py [--rounds 3] [--reads 150] [--link 1gbit,2ms]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

from coldstart.benchmark.node import drop_caches
from coldstart.benchmark.shaping import Link, shaping_proxy
from coldstart.format.writer import convert_layer
from coldstart.stack.images import realistic_bytes
from coldstart.stack.registry import push_layer, start_registry
from coldstart.stack.snapshotter import fuse_server

FILL_ON = 100 << 30          # the config's default: above any link
DEMAND_MB: dict[str, list[float]] = {}


def build_layer(small: int, big_mib: int) -> tuple[bytes, list[str]]:
    """A tar with ``small`` small files interleaved with four big ones."""
    buf = io.BytesIO()
    names = []
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for i in range(small):
            if i % (small // 4) == 0:
                data = realistic_bytes(big_mib << 20, 1000 + i)
                ti = tarfile.TarInfo(f"big/blob{i}.bin")
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
            data = realistic_bytes(8192 + (i * 7919) % 40000, i)
            name = f"pkg/mod{i // 100}/file{i}.py"
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
            names.append(name)
    return buf.getvalue(), names


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one_round(tmp: Path, host: str, spec: object, rate: int, wanted: list[str]) -> list[float]:
    with fuse_server(tmp, registry_host=host, background_rate=rate, read_deadline=60.0,
                     request_timeout=30.0, registry_timeout=30.0) as (_, client, _root):
        mp = tmp / "mnt"
        mp.mkdir()
        drop_caches(1.0)
        client.mount(str(mp), spec)  # type: ignore[arg-type]
        lat = []
        for name in wanted:
            t0 = time.perf_counter()
            (mp / name).read_bytes()
            lat.append(time.perf_counter() - t0)
        st = client.status()[0]
        print(f"  fill {'on ' if rate else 'off'}: p50 {pct(lat, .5) * 1e3:.2f} ms, "
              f"p99 {pct(lat, .99) * 1e3:.2f} ms; layer state {st['state']}, filled "
              f"{st['filled_bytes'] / 1e6:.0f} MB, on demand {st['on_demand_bytes'] / 1e6:.1f} MB",
              flush=True)
        client.unmount(str(mp))
        DEMAND_MB.setdefault("on" if rate else "off", []).append(st["on_demand_bytes"] / 1e6)
        return lat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reads", type=int, default=150)
    ap.add_argument("--link", default="1gbit,2ms")
    ap.add_argument("--json", type=Path, default=Path("bench/results/fill-latency.json"))
    args = ap.parse_args()
    tar, names = build_layer(4000, 64)
    out = io.BytesIO()
    res = convert_layer(io.BytesIO(tar), out, format="zstd:chunked")
    blob = out.getvalue()
    # the second half of the blob, far apart (past the neighbour window), last first: what
    # the fill reaches last
    later = names[len(names) // 2:]
    step = max(1, len(later) // args.reads)
    wanted = list(reversed(later[::step][:args.reads]))
    print(f"layer: {len(tar) / 1e6:.0f} MB tar, {len(blob) / 1e6:.0f} MB zstd:chunked; "
          f"{len(wanted)} on-demand reads, link {args.link}", flush=True)
    results: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="cs-fill-") as t:
        tmp = Path(t)
        with start_registry(tmp / "registry", log_level="error") as reg, \
                shaping_proxy(reg.host, Link.parse(args.link)) as proxy:
            spec = push_layer(reg.host, "fill/latency", blob, res, pull_host=proxy.host)
            for r in range(args.rounds):
                order = ["off", "on"] if r % 2 == 0 else ["on", "off"]
                for mode in order:
                    work = tmp / f"r{r}-{mode}"
                    work.mkdir()
                    lat = one_round(work, proxy.host, spec, FILL_ON if mode == "on" else 0,
                                    wanted)
                    results[mode].append((pct(lat, .5), pct(lat, .99)))
    summary = {m: {"p50_ms": statistics.median(x[0] for x in v) * 1e3,
                   "p99_ms": statistics.median(x[1] for x in v) * 1e3} for m, v in results.items()}
    for mode, mb in DEMAND_MB.items():
        summary[mode]["on_demand_mb"] = statistics.median(mb)
    summary["ratio"] = {"p50": summary["on"]["p50_ms"] / summary["off"]["p50_ms"],
                        "p99": summary["on"]["p99_ms"] / summary["off"]["p99_ms"]}
    for mode in ("off", "on"):
        m = summary[mode]
        print(f"fill {mode}: p50 {m['p50_ms']:.2f} ms, p99 {m['p99_ms']:.2f} ms, "
              f"{m['on_demand_mb']:.1f} MB fetched on demand")
    print(f"ratio on/off: p50 {summary['ratio']['p50']:.2f}x, p99 {summary['ratio']['p99']:.2f}x "
          f"(goal p99 <= 1.5x)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"link": args.link, "rounds": args.rounds,
                                     "reads": len(wanted), "summary": summary,
                                     "runs": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
