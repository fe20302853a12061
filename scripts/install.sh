#!/usr/bin/env bash
# Installs everything coldstart and its tests need on Debian 12, as root; safe to run again.
#   apt: containerd + runc, the OCI registry, skopeo, ctr-remote (stargz-snapshotter), redis-server,
#        FUSE 3 (and its headers, to build pyfuse3), busybox-static (test images), zstd
#   a virtualenv in .venv with coldstart and all its extras, torch 2.13.0 (CPU) included,
#   then compiles the containerd protos into coldstart/_proto.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
  python3 python3-venv python3-dev gcc pkg-config
  containerd runc docker-registry skopeo stargz-snapshotter redis-server
  fuse3 libfuse3-dev busybox-static zstd util-linux procps debootstrap
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
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  echo "install: torch 2.13.0 (CPU)" >&2
  pip_install torch==2.13.0
fi
echo "install: coldstart and its extras" >&2
pip_install -e '.[snapshotter,weights,probe,test,bench,plot]'
.venv/bin/python -m coldstart._proto.build >>"$LOG" 2>&1 || {
  tail -n 40 "$LOG" >&2; echo "install: compiling the protos failed" >&2; exit 1; }
rm -f "$LOG"
echo "install: done (.venv/bin/coldstart)" >&2
