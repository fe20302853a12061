"""Which user-space code the FUSE server's page faults come from, from ``perf script``
output of a ``perf record --call-graph dwarf`` run of the server.

    perf record --call-graph dwarf,16384 -F 800 -p $(pgrep -f "coldstart.cli fuse-server") \
        -o /tmp/perf.data -- sleep 7           # while bench_fuse.py's cold ``cat`` runs
    perf script -i /tmp/perf.data > /tmp/perf.txt
    python3 perf_faults.py /tmp/perf.txt

Prints the samples in page faults by their first four user-space frames, then the other
samples by their innermost frame (writes to /dev/fuse counted together).
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path


def main() -> None:
    samples = Path(sys.argv[1]).read_text().split("\n\n")
    total = 0
    faults: collections.Counter[str] = collections.Counter()
    other: collections.Counter[str] = collections.Counter()
    for sample in samples:
        lines = [ln for ln in sample.strip().split("\n") if ln.strip()]
        if len(lines) < 2:
            continue
        total += 1
        frames = [ln.split()[1] if len(ln.split()) > 1 else "" for ln in lines[1:]]
        libs = [ln.rsplit("(", 1)[-1] for ln in lines[1:]]
        if any("asm_exc_page_fault" in f for f in frames):
            user = [f for f, lib in zip(frames, libs, strict=True) if "kernel" not in lib]
            faults[" <- ".join(f.split("+")[0] for f in user[:4])] += 1
        elif any("fuse_dev_write" in f for f in frames):
            other["fuse_dev_write (read answers, page-cache stores)"] += 1
        else:
            other[frames[0].split("+")[0]] += 1
    print(f"{total} samples; in page faults {sum(faults.values())}")
    for key, n in faults.most_common(8):
        print(f"{n:6d} {key}")
    print()
    for key, n in other.most_common(10):
        print(f"{n:6d} {key}")


if __name__ == "__main__":
    main()
