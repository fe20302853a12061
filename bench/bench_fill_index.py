"""Benchmark: the hybrid fill of a plain gzip layer read through its index (issue 14's lazy
path), in process: registry bytes, requests and seconds to fetch every piece into the chunk
cache, for one or more coldstart checkouts, alternated.

The layer is the largest of a built-in benchmark image (default ``torch``: its 257 MB layer of
Python and torch); its index is built once with ``coldstart index``'s defaults (2 MiB spans)
and kept in ``--work``. The source is the blob in memory, read through the fetcher as from a
registry; ``--link RATE`` throttles it (e.g. ``1gbit``: each request takes at least its bytes
at that rate; no added latency). The whole blob is the floor of what a fill should fetch.

    .venv/bin/python bench/bench_fill_index.py [--tree DIR ...] [--rounds 2] [--link 1gbit]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# one fill, in a fresh interpreter on the tree's own code: prints a JSON line
_ONE = textwrap.dedent('''
    import json, sys, tempfile, time
    from pathlib import Path
    blob_path, index_path, rate = sys.argv[1], sys.argv[2], float(sys.argv[3])
    from coldstart.cache import ChunkCache
    from coldstart.format.gzindex import open_indexed_layer
    from coldstart.format.readat import BytesReadAt, CountingReadAt
    from coldstart.lazyfs.fetcher import ChunkFetcher
    from coldstart.lazyfs.reader import LayerReader
    from coldstart.remote.source import ReadAtSource

    class Throttled(ReadAtSource):
        def read_at(self, offset, length, *, timeout=None):
            t0 = time.monotonic()
            data = self.inner.read_at(offset, length)
            left = length / rate - (time.monotonic() - t0) if rate else 0.0
            if left > 0:
                time.sleep(left)
            return data

    blob = Path(blob_path).read_bytes()
    digest = "sha256:" + Path(blob_path).name
    counting = CountingReadAt(BytesReadAt(blob))
    src = Throttled(counting)
    layer = open_indexed_layer(src, Path(index_path).read_bytes(), layer=digest)
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        cache = ChunkCache(Path(tmp) / "cache", max_bytes=8 << 30)
        fetcher = ChunkFetcher(cache, concurrency=8, max_coalesce_bytes=16 << 20,
                               request_timeout=60.0)
        reader = LayerReader(digest, layer, src, fetcher, read_deadline=120.0)
        reader.fill.rate = 1 << 40
        counting.reset()
        t0 = time.monotonic()
        reader.fill.fetch_rest()
        seconds = time.monotonic() - t0
        stats = reader.stats.as_dict()
        fetcher.close()
        cache.close()       # its writer is done before the directory goes
    print(json.dumps({"seconds": seconds, "bytes": counting.bytes_read,
                      "requests": counting.requests, "blob": len(blob),
                      "state": stats["state"], "total_bytes": stats["total_bytes"]}))
''')

_RATES = {"gbit": 1e9 / 8, "mbit": 1e6 / 8}


def _rate(text: str | None) -> float:
    if not text:
        return 0.0
    for unit, scale in _RATES.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    raise SystemExit(f"--link: {text!r} is not N gbit or N mbit")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image", default="torch")
    ap.add_argument("--tree", action="append", type=Path,
                    help="coldstart checkout to run (repeatable; default: this one)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--link", help="throttle the source, e.g. 1gbit (default: none)")
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/cs-bench-fill-index"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from coldstart.benchmark.images import build_image
    from coldstart.oci.gzindex import index_blob_file

    image = build_image(args.image, progress=lambda s: print(s, file=sys.stderr))
    blobs = image.layout / "blobs" / "sha256"
    blob = max(blobs.iterdir(), key=lambda p: p.stat().st_size)
    args.work.mkdir(parents=True, exist_ok=True)
    index = args.work / f"{blob.name}.index"
    if not index.exists():
        data, _, _ = index_blob_file(blob, layer=f"sha256:{blob.name}")
        index.write_bytes(data)
    trees = args.tree or [REPO]
    rate = _rate(args.link)
    rows: dict[str, list[dict[str, float]]] = {str(t): [] for t in trees}
    for i in range(args.rounds):
        for tree in trees:
            proc = subprocess.run([sys.executable, "-c", _ONE, str(blob), str(index), str(rate)],
                                  capture_output=True, text=True, timeout=1800,
                                  cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)})
            if proc.returncode != 0:
                raise SystemExit(f"{tree}: {proc.stderr[-2000:]}")
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            rows[str(tree)].append(row)
            print(f"round {i + 1} {tree}: {row['bytes'] / 1e6:.1f} MB in {row['requests']} "
                  f"requests, {row['seconds']:.2f} s, state {row['state']}", file=sys.stderr)
    size = rows[str(trees[0])][0]["blob"]
    print(f"fill of {args.image}'s {size / 1e6:.1f} MB gzip layer through its index"
          f"{f' at {args.link}' if args.link else ' (no throttle)'}; medians of "
          f"{args.rounds} rounds, alternated")
    print("| tree | seconds | fetched | requests | fill state's total |")
    print("|---|---|---|---|---|")
    for tree, rs in rows.items():
        def med(key: str, rs: list[dict[str, float]] = rs) -> float:
            return statistics.median(r[key] for r in rs)
        print(f"| {tree} | {med('seconds'):.2f} s | {med('bytes') / 1e6:.1f} MB "
              f"({med('bytes') / size:.2f}x the blob) | {med('requests'):.0f} | "
              f"{med('total_bytes') / 1e6:.1f} MB |")
    if args.json:
        args.json.write_text(json.dumps({"image": args.image, "link": args.link,
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
