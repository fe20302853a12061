#!/usr/bin/env bash
# Warm-up caches (issue 51) on the built-in `compile` image: a six-block transformer compiled
# at start (torch.compile, Inductor's C++ backend, g++ in the image), every mode side by side
# (`coldstart bench`), each run on a fresh node, the modes alternated. Two rows:
#   jit   the default: restored Inductor caches skip code generation and C++ builds (Dynamo
#         still traces); against the cold compile (overlayfs, stargz, coldstart, the profile)
#         and the warm start with the caches already on the node (floor+cache)
#   fill  the same with the product's default, the hybrid fill on (coldstart+fill+warmcache)
#   aoti  COMPILE_MODE=aoti: the app loads an AOTInductor package from its cache directory
#         (no tracing); the same comparison, fill off and on
#
#   bash bench/bench_warmup.sh                     # both rows, 5 runs per mode
#   RUNS=3 ONLY=aoti bash bench/bench_warmup.sh
#
# Results: bench/results/warmup-<time>/<row>.{json,png,md}
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-5}
ONLY=${ONLY:-jit fill aoti}
OUT=bench/results/warmup-$(date +%Y%m%dT%H%M%S)
mkdir -p "$OUT"

row() {  # row NAME MODES [EXTRA ARGS…]
  local name=$1 modes=$2
  shift 2
  echo "== $name" >&2
  .venv/bin/coldstart bench builtin:compile --embedded --runs "$RUNS" --mode "$modes" \
    --json "$OUT/$name.json" --plot "$OUT/$name.png" "$@" | tee "$OUT/$name.md"
}

for r in $ONLY; do
  case $r in
    jit) row jit overlayfs,stargz,coldstart,coldstart+profile,coldstart+warmcache,coldstart+profile+warmcache ;;
    fill) row fill overlayfs,coldstart+profile+warmcache,coldstart+fill+warmcache ;;
    aoti) row aoti overlayfs,coldstart+profile+warmcache,coldstart+fill+warmcache --env COMPILE_MODE=aoti ;;
    *) echo "unknown row $r (jit, fill, aoti)" >&2; exit 2 ;;
  esac
done
echo "results: $OUT" >&2
