"""Where a process's CPU went, from ``perf script`` output of a ``perf record -a -g`` run.

    perf record -a -g -o /tmp/perf.data -- sleep 4      # while bench_fuse.py's cold phase runs
    perf script -i /tmp/perf.data --comm "serve from trio" > /tmp/server.txt
    python3 perf_categories.py /tmp/server.txt

Each sample goes to the first rule one of its frames matches (kernel paths first: a page fault
or a write to /dev/fuse is counted there whichever library made it), else to the library of its
innermost frame. Prints the share and the CPU seconds of each (``--hz``: perf's sample rate).
"""

from __future__ import annotations

import argparse
import collections

RULES = [("pagefault", "asm_exc_page_fault"), ("fuse_write", "fuse_dev_write"),
         ("tcp_recv", "tcp_recvmsg"), ("direct_write", "iomap_dio_rw"),
         ("futex", "__x64_sys_futex"), ("sched", "schedule"), ("openat", "__x64_sys_openat"),
         ("syscall-other", "entry_SYSCALL_64")]
LIBRARIES = [("libcrypto", "sha256"), ("backend_c", "zstd"), ("libpython", "python")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("script", help="perf script output")
    ap.add_argument("--hz", type=float, default=4000.0, help="perf's samples per second")
    args = ap.parse_args()
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    with open(args.script) as f:
        samples = f.read().split("\n\n")
    for sample in samples:
        lines = sample.strip().split("\n")
        if len(lines) < 2:
            continue
        total += 1
        frames = [ln.split()[1].split("+")[0] if len(ln.split()) > 1 else "" for ln in lines[1:]]
        where = next((name for name, key in RULES if any(key in fr for fr in frames)), None)
        if where is None:
            lib = lines[1].rsplit("(", 1)[-1]
            where = next((name for key, name in LIBRARIES if key in lib), None)
            if where is None:
                kind = "libc" if "libc.so" in lib else "kernel" if "kernel" in lib else "other"
                where = f"{kind}:{frames[0]}"
        counts[where] += 1
    print(f"{total} samples = {total / args.hz:.2f} cpu-s")
    for where, n in counts.most_common(16):
        print(f"{n / total * 100:5.1f}% {n / args.hz:5.2f}s {where}")


if __name__ == "__main__":
    main()
