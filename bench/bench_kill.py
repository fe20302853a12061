"""Benchmark: a running container's reads across kills of coldstart's daemons (issue 15,
item 1). Needs root, containerd, runc.

Per scenario, a fresh containerd and ``coldstart snapshotter`` (which spawns and watches its
FUSE server), ``coldstart pull`` of a converted busybox image with a data layer (a few hundred
files and a few multi-chunk ones), then ``ctr run`` of a script that checks the SHA-256 of
every data file over and over (``sha256sum -c``) for ``--seconds``; the host drops the page
cache every half second, so each pass reaches the FUSE server. During the run, ``kill -9``:

* ``grpc``: the gRPC snapshotter; it is started again a second later;
* ``fuse``: the FUSE server; the snapshotter's watchdog starts a new one, which takes over
  the dead one's kernel connection (kept by the descriptor holder);
* ``both``: both; the snapshotter is started again a second later, and starts the FUSE server;
* ``cold``: the FUSE server, half a second into the run, while the first (cold) reads fetch
  from the registry: the requests it had taken are resent to its successor;
* ``fill``: the FUSE server while the background fill runs (``fetch.background_rate``).

Reported per scenario: the files read (attempted), the reads that failed or gave wrong bytes
(must be 0), the passes, how long until a new FUSE server answered, and whether the run
exited 0. Prints a markdown table; ``--json FILE`` writes the rows.

    sudo .venv/bin/python bench/bench_kill.py [--scenario fuse --scenario cold] [--seconds 12]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from coldstart.lazyfs.client import FuseServerClient  # noqa: E402
from coldstart.stack.containerd import start_containerd  # noqa: E402
from coldstart.stack.images import Entry  # noqa: E402
from coldstart.stack.mounts import unmount_under  # noqa: E402
from coldstart.stack.procs import coldstart_cli  # noqa: E402
from coldstart.stack.registry import start_registry  # noqa: E402
from coldstart.stack.snapshotter import SnapshotterDaemon, missing_tools, start_snapshotter  # noqa: E402
from tests.integration.lazy.lazy_faults import fault_tree  # noqa: E402
from tests.integration.pull.pull_env import push_converted_app  # noqa: E402

SCENARIOS = ("grpc", "fuse", "both", "cold", "fill")
SCRIPT = b"""#!/bin/sh
cd /
end=$(( $(date +%s) + $1 ))
while [ "$(date +%s)" -lt "$end" ]; do
  sha256sum -c /sums.txt > /tmp/out 2>&1
  echo "pass $(grep -c ': OK$' /tmp/out) $(grep -vc ': OK$' /tmp/out)"
done
"""


def push_app(host: str, seed: int) -> tuple[str, int]:
    """A busybox image with a data layer and its sums, converted to zstd:chunked; its
    reference and the number of data files."""
    files = fault_tree(seed, small=300, big=4, big_size=2 << 20)
    sums = "".join(f"{hashlib.sha256(b).hexdigest()}  data/{n}\n" for n, b in files.items())
    ref = push_converted_app(host, "bench-kill/app", files,
                             [Entry("run.sh", data=SCRIPT, mode=0o755),
                              Entry("sums.txt", data=sums.encode())])
    return ref, len(files)


def _drop_caches(stop: threading.Event) -> None:
    while not stop.wait(0.5):
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")


def _answers(sn: SnapshotterDaemon) -> bool:
    try:
        FuseServerClient(sn.fuse_socket, timeout=1.0).ping()
    except Exception:
        return False
    return True


def _kill(scenario: str, sn: SnapshotterDaemon, give_up: float) -> float | None:
    """Do the scenario's kill; seconds until a FUSE server answers again (None: none did
    within ``give_up`` seconds)."""
    t0 = time.monotonic()
    old = sn.fuse_pid
    if scenario in ("grpc", "both"):
        sn.kill(signal.SIGKILL)
    if scenario != "grpc" and old is not None:
        os.kill(old, signal.SIGKILL)
    if scenario in ("grpc", "both"):
        time.sleep(1.0)
        sn.start()
    while time.monotonic() - t0 < give_up:
        if (sn.fuse_pid not in (None, old) or scenario == "grpc") and _answers(sn):
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def run_scenario(scenario: str, ref: str, files: int, seconds: int,
                 give_up: float) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="cs-kill-", dir="/tmp"))
    rate = 4 << 20 if scenario == "fill" else 0
    out: dict[str, Any] = {"scenario": scenario}
    try:
        with start_snapshotter(base / "sn", metrics=False, log_level="info",
                               background_rate=rate) as sn, \
                start_containerd(base / "ctrd", proxy_socket=sn.socket) as ctd:
            ctd.namespace = "default"
            pull = coldstart_cli("pull", "--address", ctd.address, "-o", "json", "--quiet",
                                 ref, timeout=600)
            if pull.returncode != 0:
                raise SystemExit(f"pull failed: {pull.stderr[-2000:]}")
            result: dict[str, Any] = {}

            def run() -> None:
                result["run"] = ctd.ctr("run", "--rm", "--snapshotter", "coldstart", ref,
                                        f"kill-{scenario}", "/run.sh", str(seconds),
                                        check=False, timeout=seconds + 300)

            stop = threading.Event()
            dropper = threading.Thread(target=_drop_caches, args=(stop,), daemon=True)
            runner = threading.Thread(target=run, daemon=True)
            runner.start()
            dropper.start()
            time.sleep(0.5 if scenario == "cold" else seconds / 3)
            recovered = _kill(scenario, sn, give_up)
            out["recovered_s"] = round(recovered, 2) if recovered is not None else None
            runner.join(seconds + 300)
            stop.set()
            proc: subprocess.CompletedProcess[str] = result["run"]
    finally:
        unmount_under(base, abort_fuse=True)
        shutil.rmtree(base, ignore_errors=True)
    # each pass checks every file: what it does not report OK failed (a pass whose tools
    # could not even run, on a dead mount, reports nothing)
    passes = [line.split() for line in proc.stdout.splitlines() if line.startswith("pass")]
    ok = sum(int(p[1]) for p in passes if len(p) > 1 and p[1].isdigit())
    bad = files * len(passes) - ok
    out.update({"passes": len(passes), "reads": ok + bad, "failed": bad,
                "run_rc": proc.returncode,
                "run_error": proc.stderr[-500:].strip() if proc.returncode else ""})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", action="append", choices=SCENARIOS,
                    help="run these (repeatable; default: all)")
    ap.add_argument("--seconds", type=int, default=12, help="each run's reading time")
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--give-up", type=float, default=60.0, metavar="SECONDS",
                    help="how long to wait for a FUSE server to answer again after the kill")
    ap.add_argument("--json", type=Path, default=None, metavar="FILE")
    args = ap.parse_args()
    missing = missing_tools()
    if missing:
        raise SystemExit(f"needs {', '.join(missing)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="cs-kill-reg-", dir="/tmp") as tmp, \
            start_registry(Path(tmp) / "registry", access_log=False) as registry:
        ref, files = push_app(registry.host, args.seed)
        for scenario in args.scenario or SCENARIOS:
            row = run_scenario(scenario, ref, files, args.seconds, args.give_up)
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    print("| kill -9 of | reads | failed | passes | FUSE server answers again after | "
          "container exit |\n|---|---|---|---|---|---|")
    for r in rows:
        back = "never" if r["recovered_s"] is None else f"{r['recovered_s']:.2f} s"
        print(f"| {r['scenario']} | {r['reads']} | **{r['failed']}** | {r['passes']} | "
              f"{back} | {r['run_rc']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["failed"] == 0 and r["run_rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
