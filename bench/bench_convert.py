"""Benchmark: coldstart's layer converters against ctr-remote's, on the same data, in one run.

Data: a generated tar layer (default 1 GiB) mixing big files ("weights": float16-like bytes
that zstd shrinks ~10-20%; "binaries": text-like, ~3-4x) and many small files (text and
random), gzip-compressed like a registry layer. Every converter starts from that gzip blob.

Measured, each as the median of ``--runs``:
* conversion throughput (MB/s of uncompressed tar) of coldstart zstd:chunked and eStargz, and
  of ``ctr-remote images convert --estargz`` / ``--zstdchunked`` (a containerd is started here
  with its own root/state/socket; the time is the ctr-remote process' wall time);
* compressed size against the original gzip;
* range reads and bytes to open each converted layer, and to read a random 1 MiB (and 4 KiB)
  of a big file (through coldstart.format on a counting ReadAt; same reader for every output);
* a chunk-size sweep (1/4/16 MiB, zstd:chunked) to justify the 4 MiB default.

    .venv/bin/python bench/bench_convert.py                 # 1 GiB, one run
    .venv/bin/python bench/bench_convert.py --size-mb 200 --runs 3 --no-ctr-remote  # smoke

Results: a table on stdout and bench/results/convert-<time>.json. Generated files are deleted.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coldstart.format import CountingReadAt, FileReadAt, convert_layer, open_layer

MB = 1_000_000
MiB = 1 << 20

# -- data --------------------------------------------------------------------------------------


def _text_base(rng: random.Random, size: int) -> bytes:
    words = [bytes(rng.choice(b"abcdefghijklmnopqrstuvwxyz_") for _ in range(rng.randint(2, 10)))
             for _ in range(5000)]
    out = bytearray()
    while len(out) < size:
        line = b" ".join(rng.choices(words, k=12))
        out += line + (b";\n" if rng.random() < 0.5 else b"(){}\n")
    return bytes(out[:size])


def _weights(rng: random.Random, size: int) -> bytes:
    data = bytearray(rng.randbytes(size))
    # float16 weights: the high byte's exponent bits cluster (small magnitudes).
    table = bytes((b & 0x83) | 0x38 for b in range(256))
    data[1::2] = bytes(data[1::2]).translate(table)
    return bytes(data)


def make_layer(dir: Path, size_mb: int, seed: int = 7) -> tuple[Path, Path, dict[str, int]]:
    """Write layer.tar and layer.tar.gz into ``dir``; return paths and the big files' sizes."""
    rng = random.Random(seed)
    base = _text_base(rng, 16 * MiB)
    total = size_mb * MiB
    big: dict[str, int] = {}
    tar_path = dir / "layer.tar"
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tf:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1_700_000_000
            info.mode = 0o644
            tf.addfile(info, io.BytesIO(data))

        weights_total = total // 2
        n_w = max(1, weights_total // (128 * MiB))
        for i in range(n_w):
            name = f"models/shard-{i:02d}.safetensors"
            size = weights_total // n_w
            add(name, _weights(rng, size))
            big[name] = size
        bins_total = total // 8
        for i in range(max(1, bins_total // (32 * MiB))):
            name = f"usr/lib/libbig{i}.so"
            parts = []
            size = 0
            while size < 32 * MiB:
                off = rng.randrange(len(base) - 256 * 1024)
                piece = base[off : off + 256 * 1024] + rng.randbytes(16 * 1024)
                parts.append(piece)
                size += len(piece)
            data = b"".join(parts)[: 32 * MiB]
            add(name, data)
            big[name] = len(data)
        small_total = total - weights_total - bins_total
        done = 0
        i = 0
        while done < small_total:
            n = int(rng.lognormvariate(8.5, 1.2)) % (256 * 1024) + 1
            if rng.random() < 0.8:
                off = rng.randrange(len(base) - n)
                data = base[off : off + n]
            else:
                data = rng.randbytes(n)
            add(f"usr/share/pkg{i // 200:04d}/file{i:06d}.py", data)
            done += n + 512
            i += 1
    gz_path = dir / "layer.tar.gz"
    with open(gz_path, "wb") as out:
        subprocess.run(["gzip", "-6", "-c", str(tar_path)], stdout=out, check=True)
    return tar_path, gz_path, big


# -- containerd + ctr-remote --------------------------------------------------------------------


class Containerd:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.sock = base / "c.sock"
        cfg = base / "config.toml"
        cfg.write_text(
            f'version = 2\nroot = "{base}/root"\nstate = "{base}/state"\n'
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
            f'[grpc]\n  address = "{self.sock}"\n[ttrpc]\n  address = "{base}/c.sock.ttrpc"\n')
        self.log = open(base / "containerd.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(["containerd", "--config", str(cfg)], stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(self.sock))
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("containerd did not start")

    def run(self, tool: str, *args: str) -> str:
        return subprocess.run([tool, "--address", str(self.sock), "--namespace", "bench", *args],
                              check=True, capture_output=True, text=True).stdout

    def blob(self, digest: str) -> Path:
        return self.base / "root/io.containerd.content.v1.content/blobs/sha256" / digest[7:]

    def layer_of(self, ref: str) -> tuple[Path, dict[str, str]]:
        for line in self.run("ctr", "images", "ls").splitlines()[1:]:
            cols = line.split()
            if cols and cols[0] == ref:
                manifest = json.loads(self.blob(cols[2]).read_text())
                desc = manifest["layers"][0]
                return self.blob(desc["digest"]), desc.get("annotations", {})
        raise RuntimeError(f"{ref} not found")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def import_gzip_image(ctr: Containerd, gz: Path, tar_digest: str, ref: str) -> None:
    def sha(b: bytes) -> str:
        return "sha256:" + hashlib.sha256(b).hexdigest()
    h = hashlib.sha256()
    with open(gz, "rb") as f:
        while chunk := f.read(8 * MiB):
            h.update(chunk)
    layer_digest = "sha256:" + h.hexdigest()
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                         "rootfs": {"type": "layers", "diff_ids": [tar_digest]}}).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": sha(config), "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": layer_digest, "size": gz.stat().st_size}]}).encode()
    index = json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": sha(manifest),
        "size": len(manifest), "annotations": {"io.containerd.image.name": ref}}]}).encode()
    archive = ctr.base / "image.tar"
    with tarfile.open(archive, "w") as tf:
        for name, data in [("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'),
                           ("index.json", index), (f"blobs/sha256/{sha(config)[7:]}", config),
                           (f"blobs/sha256/{sha(manifest)[7:]}", manifest)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        tf.add(gz, f"blobs/sha256/{layer_digest[7:]}")
    ctr.run("ctr", "images", "import", "--no-unpack", str(archive))
    archive.unlink()


# -- measurements -------------------------------------------------------------------------------


def read_costs(blob: Path, annotations: dict[str, str], big: dict[str, int],
               samples: int, seed: int = 3) -> dict[str, Any]:
    """Requests and bytes to open the layer and to read random ranges of the big files."""
    with FileReadAt(blob) as fra:
        counting = CountingReadAt(fra)
        layer = open_layer(counting, annotations=annotations)
        out: dict[str, Any] = {
            "open_requests": counting.requests, "open_bytes": counting.bytes_read,
            "toc_entries": len(layer.toc.entries),
            "toc_bytes": fra.size() - layer.toc_offset,  # TOC + footer, compressed
            "chunks": sum(len(e.chunks) for e in layer.toc.entries.values())}
        rng = random.Random(seed)
        for label, length in (("1MiB", MiB), ("4KiB", 4096)):
            reqs, byts, secs = [], [], []
            for _ in range(samples):
                name = rng.choice(sorted(big))
                off = rng.randrange(big[name] - length)
                counting.reset()
                t0 = time.perf_counter()
                data = layer.read_file(name, off, length)
                secs.append(time.perf_counter() - t0)
                assert len(data) == length
                reqs.append(counting.requests)
                byts.append(counting.bytes_read)
            out[f"read_{label}_requests"] = statistics.median(reqs)
            out[f"read_{label}_bytes"] = statistics.median(byts)
            out[f"read_{label}_ms"] = round(statistics.median(secs) * 1000, 2)
    return out


def timed(fn: Callable[[], Any], runs: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=1024, help="uncompressed layer size (MiB)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--samples", type=int, default=21, help="random reads per layer")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--level-gzip", type=int, default=6)
    ap.add_argument("--no-ctr-remote", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="cbench", dir=args.workdir or "/tmp"))
    rows: list[dict[str, Any]] = []
    ctr: Containerd | None = None
    try:
        t0 = time.perf_counter()
        tar_path, gz_path, big = make_layer(work, args.size_mb)
        usize = tar_path.stat().st_size
        gz_size = gz_path.stat().st_size
        h = hashlib.sha256()
        with open(tar_path, "rb") as f:
            while block := f.read(8 * MiB):
                h.update(block)
        tar_digest = "sha256:" + h.hexdigest()
        print(f"generated {usize / MB:.0f} MB tar, {gz_size / MB:.0f} MB gzip "
              f"in {time.perf_counter() - t0:.0f} s; {len(big)} big files", flush=True)
        tar_path.unlink()  # every converter starts from the gzip blob

        def ours(fmt: str, chunk: int, level: int | None) -> dict[str, Any]:
            out = work / f"ours-{fmt.replace(':', '_')}-{chunk}"

            def go() -> Any:
                with open(gz_path, "rb") as src, open(out, "wb") as dst:
                    return convert_layer(src, dst, format=fmt, chunk_size=chunk, level=level,
                                         threads=args.threads)
            secs, res = timed(go, args.runs)
            row = {"converter": f"coldstart {fmt}", "chunk_MiB": chunk // MiB,
                   "seconds": round(secs, 2), "MB_s": round(usize / MB / secs, 1),
                   "size_MB": round(res.size / MB, 1), "vs_gzip": round(res.size / gz_size, 3)}
            row.update(read_costs(out, res.annotations, big, args.samples))
            out.unlink()
            return row

        rows.append(ours("zstd:chunked", 4 * MiB, None))
        print(rows[-1], flush=True)
        rows.append(ours("estargz", 4 * MiB, args.level_gzip))
        print(rows[-1], flush=True)

        if not args.no_ctr_remote and shutil.which("ctr-remote") and shutil.which("containerd"):
            ctr = c = Containerd(work)
            import_gzip_image(c, gz_path, tar_digest, "bench/orig:v1")
            peers = [("ctr-remote --estargz", ["--estargz", "--estargz-compression-level",
                                                str(args.level_gzip)]),
                     ("ctr-remote --estargz (level 9 default)", ["--estargz"]),
                     ("ctr-remote --zstdchunked", ["--zstdchunked"])]
            for i, (label, flags) in enumerate(peers):
                ref = f"bench/conv{i}:v1"

                def go(flags: list[str] = flags, ref: str = ref) -> None:
                    if ref in c.run("ctr", "images", "ls", "-q"):
                        c.run("ctr", "images", "rm", ref)
                    c.run("ctr-remote", "images", "convert", *flags, "--oci",
                          "bench/orig:v1", ref)
                secs, _ = timed(go, args.runs)
                blob, ann = c.layer_of(ref)
                row = {"converter": label, "chunk_MiB": 4, "seconds": round(secs, 2),
                       "MB_s": round(usize / MB / secs, 1),
                       "size_MB": round(blob.stat().st_size / MB, 1),
                       "vs_gzip": round(blob.stat().st_size / gz_size, 3)}
                row.update(read_costs(blob, ann, big, args.samples))
                rows.append(row)
                print(rows[-1], flush=True)
            ctr.stop()
            ctr = None

        sweep: list[dict[str, Any]] = []
        if not args.no_sweep:
            for size in (1 * MiB, 4 * MiB, 16 * MiB):
                sweep.append(ours("zstd:chunked", size, None))
                sweep[-1]["converter"] += " (sweep)"
                print(sweep[-1], flush=True)

        base = rows[0]
        print(f"\nlayer: {usize / MB:.0f} MB uncompressed, gzip {gz_size / MB:.0f} MB; "
              f"threads={args.threads}; runs={args.runs} (medians); cpus={os.cpu_count()}")
        hdr = (f"{'converter':40} {'chunk':>5} {'MB/s':>7} {'x ours':>7} {'MB':>7} {'/gzip':>6}"
               f" {'TOC KB':>7} {'open req':>8} {'open KB':>8} {'1MiB req':>8} {'1MiB KB':>8}"
               f" {'4KiB KB':>8}")
        print(hdr)
        for r in [*rows, *sweep]:
            print(f"{r['converter']:40} {r['chunk_MiB']:>5} {r['MB_s']:>7} "
                  f"{r['MB_s'] / base['MB_s']:>7.2f} {r['size_MB']:>7} {r['vs_gzip']:>6} "
                  f"{r['toc_bytes'] / 1000:>7.0f} "
                  f"{r['open_requests']:>8} {r['open_bytes'] / 1000:>8.0f} "
                  f"{r['read_1MiB_requests']:>8} {r['read_1MiB_bytes'] / 1000:>8.0f} "
                  f"{r['read_4KiB_bytes'] / 1000:>8.0f}")
        results = Path(__file__).resolve().parent / "results"
        results.mkdir(exist_ok=True)
        path = results / f"convert-{time.strftime('%Y%m%dT%H%M%S')}.json"
        path.write_text(json.dumps({"uncompressed_bytes": usize, "gzip_bytes": gz_size,
                                    "threads": args.threads, "runs": args.runs,
                                    "cpus": os.cpu_count(), "rows": rows, "sweep": sweep},
                                   indent=2))
        print(f"\nwrote {path}")
    finally:
        if ctr is not None:
            ctr.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
