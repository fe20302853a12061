#!/bin/bash
# The GPU checks of the weights loader, as one script for a machine with a CUDA device:
#   1. the weights tests (tests/unit/weights), the CUDA ones among them, on the real device;
#   2. bench/gpu_weights.py: pinned-copy peak against coldstart.load / load_file, safetensors
#      and fastsafetensors on the device, bit-identity, coldstart's pinned staging, and a sweep
#      of staging sizes in fresh processes.
# Everything lands in $OUT (default /tmp/gpu-check): env.txt, pytest.log, gpu-weights.log and
# gpu-weights-<time>.json/.md.
#
#   OUT=/tmp/gpu-check bash bench/gpu_check.sh
#
# Where the machine's Python lacks packages coldstart imports (msgspec, trio, zstandard, ...),
# the fastsafetensors peer or py-spy, put their wheels in .whl/; they are installed into
# /tmp/site first. For the lent H200 machines (Python 3.12), on any machine with pip:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
#     fastsafetensors msgspec trio outcome sniffio zstandard py-spy
# Each step has its own time limit (together under 10 minutes), and a failing step does not
# stop the next.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
PY=${PYTHON:-python3}
SIZE_GB=${SIZE_GB:-4}
RUNS=${RUNS:-5}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH="$PWD"
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>&1 | tail -3
    export PYTHONPATH="/tmp/site:$PWD"
fi
{
    date -u
    nvidia-smi || true
    echo "cpus: $(nproc)"; free -g
    "$PY" - <<'EOF'
import torch, safetensors
print("python", __import__("sys").version.split()[0], "torch", torch.__version__, "cuda",
      torch.version.cuda, "available", torch.cuda.is_available(), "safetensors",
      safetensors.__version__)
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory >> 30, "GiB")
try:
    import fastsafetensors
    print("fastsafetensors", fastsafetensors.__version__)
except Exception as exc:
    print("fastsafetensors: not importable:", exc)
EOF
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== tests/unit/weights"
timeout -k 15 -s INT "${TEST_LIMIT:-150}" "$PY" -m pytest -q -ra -p no:cacheprovider tests/unit/weights \
    2>&1 | tee "$OUT/pytest.log" | tail -25
echo "== bench/gpu_weights.py --size-gb $SIZE_GB --runs $RUNS --sweep"
timeout -k 15 -s INT "${BENCH_LIMIT:-240}" "$PY" bench/gpu_weights.py --size-gb "$SIZE_GB" --runs "$RUNS" \
    --sweep --out "$OUT" 2>&1 | tee "$OUT/gpu-weights.log" | tail -40
if [ -x /tmp/site/bin/py-spy ]; then
    # where a staged load's time goes, natively: one fresh process, 4 MiB reads (many of them)
    echo "== py-spy of one load, 4 MiB reads"
    FILE=/var/tmp/coldstart-gpu-profile.safetensors
    "$PY" -c "import sys; sys.path.insert(0, 'bench'); from bench_weights import write_model; \
from pathlib import Path; write_model(Path('$FILE'), int(2e9))" && cat "$FILE" > /dev/null &&
    timeout -k 15 -s INT 90 /tmp/site/bin/py-spy record --native --format raw --rate 200 \
        -o "$OUT/profile-4mib.txt" -- "$PY" bench/gpu_weights.py --file "$FILE" \
        --child 4,128,0,0 2>&1 | tail -3
    rm -f "$FILE"
fi
echo "== done $(date -u)"
