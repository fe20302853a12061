#!/usr/bin/env bash
# The whole cold start to READY, every mode side by side (`coldstart bench`), on the built-in
# GPU-style images: torch and server unshaped and at 1 Gbit/s + 2 ms, cuda-like at 1 Gbit/s.
# Images are built once and cached (bench/images/); each run starts on a fresh node.
#
#   bash bench/bench_cold_start.sh                    # the whole matrix, 5 runs per mode
#   RUNS=3 ONLY="torch" bash bench/bench_cold_start.sh
#
# Results: bench/results/cold-start-<time>/<row>.{json,png,md}
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-5}     # cold starts per mode
MODES=${MODES:-overlayfs,coldstart,stargz}
ONLY=${ONLY:-torch server cuda-like}
OUT=bench/results/cold-start-$(date +%Y%m%dT%H%M%S)
mkdir -p "$OUT"

row() {  # row NAME IMAGE LINK [EXTRA ARGS…]
  local name=$1 image=$2 link=$3
  shift 3
  echo "== $name" >&2
  .venv/bin/coldstart bench "builtin:$image" --embedded --runs "$RUNS" --mode "$MODES" \
    ${link:+--link "$link"} --json "$OUT/$name.json" --plot "$OUT/$name.png" "$@" \
    | tee "$OUT/$name.md"
}

for image in $ONLY; do
  case $image in
    torch|server)
      row "$image" "$image" ""
      row "$image-1gbit" "$image" 1gbit,2ms ;;
    cuda-like)
      # ctr-remote's default gzip level 9 converts 15.7 GB at ~10 MB/s on 2 cores: level 1
      row "$image-1gbit" "$image" 1gbit,2ms --estargz-level 1 ;;
    *) echo "unknown image $image" >&2; exit 2 ;;
  esac
done
echo "results: $OUT" >&2
