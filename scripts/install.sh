#!/usr/bin/env bash
# Installs everything coldstart and its tests need on Debian 12, as root; safe to run again.
#   apt: containerd + runc, the OCI registry, skopeo, ctr-remote (stargz-snapshotter), redis-server,
#        FUSE 3 tools, busybox-static (test images), zstd
#   CRIU 4.2.1 (snapshot restore), built from Debian's source when the node has no CRIU that
#        passes `criu check` (scripts/install-criu.sh)
#   a virtualenv in .venv with coldstart and all its extras, and torch: the CPU build by default
#   (TORCH_VARIANT, see --help), then compiles the containerd protos into coldstart/_proto.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: bash scripts/install.sh [--help]

Installs coldstart's system packages (apt, as root) and a virtualenv in .venv with coldstart,
all its extras and torch; safe to run again. Settings, from the environment:

  TORCH_VARIANT=cpu|cuda  which torch build goes into .venv (default: cpu).
                          cpu:  torch==TORCH_VERSION+cpu, a few hundred MB; enough for the
                                test suite, which never needs a GPU.
                          cuda: a CUDA build of torch==TORCH_VERSION (several GB), for GPU nodes.
  TORCH_VERSION=V         the torch release (default: 2.13.0).
  TORCH_INDEX=URL         an extra package index for torch, e.g. https://download.pytorch.org/whl/cpu
                          or https://download.pytorch.org/whl/cu128. Default: pip's configured
                          indexes first; for cpu, where they have no +cpu build (PyPI's Linux
                          wheels are CUDA builds), then https://download.pytorch.org/whl/cpu.
                          cuda takes PyPI's build unless TORCH_INDEX names another.
  PYTHON=python3          the interpreter that creates .venv.

A torch already in .venv that is the asked version and variant is kept; any other one is named
and replaced. The script never picks a CUDA build unless TORCH_VARIANT=cuda.
USAGE
}
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  "") ;;
  *) usage >&2; echo "install: unknown argument: $1" >&2; exit 2 ;;
esac

TORCH_VARIANT=${TORCH_VARIANT:-cpu}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_VERSION=${TORCH_VERSION%%+*}  # the public part: the variant says which build
TORCH_INDEX=${TORCH_INDEX:-}
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
case "$TORCH_VARIANT" in
  cpu|cuda) ;;
  *) echo "install: TORCH_VARIANT must be cpu or cuda, not '$TORCH_VARIANT' (see --help)" >&2; exit 2 ;;
esac

cd "$(dirname "$0")/.."

# g++ and openssl: what torch.compile's C++ backend (Inductor) runs, for the warm-up tests
APT_PACKAGES=(
  python3 python3-venv python3-dev gcc g++ openssl pkg-config
  containerd runc docker-registry skopeo stargz-snapshotter redis-server
  fuse3 busybox-static zstd util-linux procps debootstrap
  golang-go golang-github-containerd-stargz-snapshotter-dev golang-github-containerd-containerd-dev
)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install: apt packages: ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# containerd and redis come from Debian with systemd units; coldstart starts its own instances
# with their own sockets and directories, so nothing else needs to run.

# CRIU >= 4.2 for snapshot restore (Debian 12's 3.17 fails `criu check` on current kernels):
# built from Debian 13's source when the node has none that passes
# (optional: without it containers start normally, and the snapshot tests fail saying why)
bash scripts/install-criu.sh || \
  echo "install: warning: no working CRIU: snapshots cannot be taken or restored here" >&2

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "install: creating .venv" >&2
  "$PY" -m venv .venv
fi
LOG=$(mktemp /tmp/coldstart-install.XXXXXX.log)
pip_install() {
  # pip's output goes to a log; it is shown only when pip fails
  if ! .venv/bin/python -m pip install "$@" >>"$LOG" 2>&1; then
    tail -n 40 "$LOG" >&2
    echo "install: pip install $* failed (full log: $LOG)" >&2
    exit 1
  fi
}
pip_install --upgrade pip

# torch: the asked version and variant, or nothing changes. "VERSION VARIANT" of the torch in .venv
# (VARIANT: cpu, cuda, rocm), "broken" when it is installed but does not import, "none" without it.
torch_installed() {
  .venv/bin/python - <<'PY' 2>/dev/null || echo broken
import importlib.util, sys
if importlib.util.find_spec("torch") is None:
    print("none"); sys.exit()
import torch
v = torch.version
print(torch.__version__, "cuda" if v.cuda else "rocm" if getattr(v, "hip", None) else "cpu")
PY
}
if [ "$TORCH_VARIANT" = cpu ]; then
  # the local version label pins the CPU build: a CUDA build can never satisfy it
  torch_req="torch==$TORCH_VERSION+cpu"
else
  torch_req="torch==$TORCH_VERSION,!=$TORCH_VERSION+cpu"
fi
have=$(torch_installed)
case "$have" in
  "$TORCH_VERSION $TORCH_VARIANT"|"$TORCH_VERSION+"*" $TORCH_VARIANT")
    echo "install: torch ${have% *} (${have##* }) already in .venv, kept" >&2
    torch_req="" ;;
  none) ;;
  broken)
    echo "install: the torch in .venv does not import; reinstalling it" >&2
    .venv/bin/python -m pip uninstall -y torch >>"$LOG" 2>&1 || true ;;
  *)
    echo "install: .venv has torch ${have% *} (${have##* }), but TORCH_VARIANT=$TORCH_VARIANT" \
      "TORCH_VERSION=$TORCH_VERSION asks for $torch_req: replacing it" >&2 ;;
esac
if [ -n "$torch_req" ]; then
  if [ -n "$TORCH_INDEX" ]; then
    echo "install: $torch_req (TORCH_VARIANT=$TORCH_VARIANT) from pip's indexes and $TORCH_INDEX" >&2
    pip_install "$torch_req" --extra-index-url "$TORCH_INDEX"
  elif [ "$TORCH_VARIANT" = cpu ]; then
    echo "install: $torch_req (TORCH_VARIANT=cpu)" >&2
    if ! .venv/bin/python -m pip install "$torch_req" >>"$LOG" 2>&1; then
      echo "install: pip's configured indexes have no $torch_req; trying $TORCH_CPU_INDEX" >&2
      pip_install "$torch_req" --extra-index-url "$TORCH_CPU_INDEX"
    fi
  else
    echo "install: $torch_req (TORCH_VARIANT=cuda: a CUDA build, several GB)" >&2
    pip_install "$torch_req"
  fi
  have=$(torch_installed)
  case "$have" in
    *" $TORCH_VARIANT") echo "install: torch ${have% *} (${have##* }) installed" >&2 ;;
    *) echo "install: asked for TORCH_VARIANT=$TORCH_VARIANT, but .venv now has torch" \
         "${have% *} (${have##* }) (full log: $LOG)" >&2
       exit 1 ;;
  esac
fi
echo "install: coldstart and its extras" >&2
pip_install -e '.[snapshotter,weights,probe,test,bench,plot]'
.venv/bin/python -m coldstart._proto.build >>"$LOG" 2>&1 || {
  tail -n 40 "$LOG" >&2; echo "install: compiling the protos failed" >&2; exit 1; }
rm -f "$LOG"
echo "install: done (.venv/bin/coldstart)" >&2
