"""Sample the first FUSE server that starts: its minor page faults, CPU seconds, peak and
current RSS (kB) and anonymous huge pages (kB), every 0.2 s for 12 s.

    python3 faultwatch.py > faults.log &
    python bench/bench_fuse.py --only big --rounds 1 [--tree T]    # its first server: big_cold

The first server of a bench_fuse.py round serves the cold ``cat`` (from about 0.6 s) and the
re-read from the page cache, then waits out the settle before the chunk-cache read.
"""

import subprocess
import time
from pathlib import Path

pid = None
while pid is None:
    out = subprocess.run(["pgrep", "-f", "coldstart.cli fuse-server"], capture_output=True,
                         text=True).stdout.split()
    if out:
        pid = int(out[0])
    else:
        time.sleep(0.05)
t0 = time.time()
while time.time() - t0 <= 12:
    try:
        st = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/{pid}/status").read_text()
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except FileNotFoundError:
        break
    minflt, cpu = int(st[7]), (int(st[11]) + int(st[12])) / 100
    mem = [ln.split()[1] for ln in status.splitlines() if ln.startswith(("VmRSS", "VmHWM"))]
    huge = [ln.split()[1] for ln in rollup.splitlines() if ln.startswith("AnonHuge")]
    print(f"{time.time() - t0:6.2f} minflt={minflt} cpu={cpu:.2f} {' '.join(mem + huge)}",
          flush=True)
    time.sleep(0.2)
