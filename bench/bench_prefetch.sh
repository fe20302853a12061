#!/usr/bin/env bash
# Issue 11's matrix: start-up profiles and the hybrid fill on the torch image, every mode side
# by side (`coldstart bench`), unshaped and at 1 Gbit/s + 2 ms: containerd's full pull,
# stargz 0.12 on its `ctr-remote image optimize` image, coldstart on demand, coldstart on the
# ctr-remote-optimized image, coldstart on its own `coldstart optimize` image, the same with
# the hybrid fill, and the floor. Each run starts on a fresh node; the modes alternate.
#
#   bash bench/bench_prefetch.sh                 # 5 runs per mode
#   RUNS=3 LINKS="1gbit,2ms" bash bench/bench_prefetch.sh
#
# Then the fill's effect on on-demand reads (bench_fill_latency.py) and how alike two
# recordings of the start-up are (bench_profile_determinism.py).
# Results: bench/results/prefetch-<time>/
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-5}
MODES=${MODES:-overlayfs,stargz-optimized,coldstart,coldstart+ctr-profile,coldstart+profile,coldstart+profile-nowarm,coldstart+fill}
LINKS=${LINKS:-"none 1gbit,2ms"}
OUT=bench/results/prefetch-$(date +%Y%m%dT%H%M%S)
mkdir -p "$OUT"
for link in $LINKS; do
  name=torch
  args=()
  if [ "$link" != none ]; then
    name=torch-${link%%,*}
    args=(--link "$link")
  fi
  echo "== $name" >&2
  .venv/bin/coldstart bench builtin:torch --embedded --runs "$RUNS" --mode "$MODES" \
    "${args[@]}" --json "$OUT/$name.json" --plot "$OUT/$name.png" | tee "$OUT/$name.md"
done
.venv/bin/python bench/bench_fill_latency.py --json "$OUT/fill-latency.json" | tee "$OUT/fill-latency.md"
.venv/bin/python bench/bench_profile_determinism.py --json "$OUT/determinism.json" \
  | tee "$OUT/determinism.md"
echo "results: $OUT" >&2
