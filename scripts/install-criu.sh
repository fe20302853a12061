#!/usr/bin/env bash
# Installs CRIU 4.2.1 into /usr/local/sbin when the node has no CRIU that passes `criu check`
# at 4.2 or newer; as root, safe to run again. Debian 12's CRIU 3.17 fails `criu check` on
# current kernels (the vDSO's layout); 4.1.1 (Debian 13's) passes it but cannot dump a process
# holding an inet socket on Linux 6.18 (SO_PASSCRED is now unix and netlink only), which 4.2
# fixed. Debian's 4.2.1 source builds on Debian 12 in under a minute; the orig tarball comes
# from Debian's pool (or its snapshot archive) and is checked against its SHA-256.
#   bash scripts/install-criu.sh            install if needed, then `criu check`
#   CRIU_FORCE=1 bash scripts/install-criu.sh   build and install even if a good one is there
set -euo pipefail

VERSION=4.2.1
ORIG_SHA256=29ec0ee09e296479fe7048c80980e8ef1d0684d0b0204c2b101dfea19f6725b9
MIRROR=${CRIU_MIRROR:-http://deb.debian.org/debian}
PREFIX=/usr/local

version_ok() {   # $1: a criu binary; true if it runs, is >= 4.2 and passes `criu check`
  local v
  v=$("$1" --version 2>/dev/null | sed -n 's/^Version: *//p') || return 1
  [ -n "$v" ] || return 1
  case "$v" in
    [0-3].*|4.0|4.0.*|4.1|4.1.*) return 1 ;;
  esac
  "$1" check >/dev/null 2>&1
}

if [ "${CRIU_FORCE:-0}" != 1 ]; then
  for c in "$(command -v criu || true)" "$PREFIX/sbin/criu"; do
    if [ -n "$c" ] && [ -x "$c" ] && version_ok "$c"; then
      echo "install-criu: $c ($("$c" --version | sed -n 's/^Version: *//p')) passes criu check, kept" >&2
      exit 0
    fi
  done
fi

BUILD_DEPS=(build-essential pkg-config libprotobuf-c-dev protobuf-c-compiler libprotobuf-dev
            protobuf-compiler python3-protobuf libnl-3-dev libnet1-dev libcap-dev libbsd-dev
            libgnutls28-dev uuid-dev libnftables-dev iproute2 curl ca-certificates)
missing=()
for p in "${BUILD_DEPS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-criu: apt packages: ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

WORK=$(mktemp -d /tmp/coldstart-criu.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
TARBALL="$WORK/criu_$VERSION.orig.tar.xz"
# Debian's pool, then its archive (the pool drops a version when a newer one lands)
URLS=("$MIRROR/pool/main/c/criu/criu_$VERSION.orig.tar.xz"
      "https://snapshot.debian.org/archive/debian/20251215T000000Z/pool/main/c/criu/criu_$VERSION.orig.tar.xz")
fetched=""
for URL in "${URLS[@]}"; do
  echo "install-criu: fetching $URL" >&2
  if curl -fsSL --retry 3 --connect-timeout 20 --max-time 300 -o "$TARBALL" "$URL"; then
    fetched=$URL; break
  fi
done
[ -n "$fetched" ] || { echo "install-criu: could not fetch criu_$VERSION.orig.tar.xz" >&2; exit 1; }
echo "$ORIG_SHA256  $TARBALL" | sha256sum -c --quiet - || {
  echo "install-criu: criu_$VERSION.orig.tar.xz does not match its SHA-256" >&2; exit 1; }
tar -xf "$TARBALL" -C "$WORK"
echo "install-criu: building CRIU $VERSION (about a minute on 2 cores)" >&2
if ! make -C "$WORK/criu-$VERSION" -j"$(nproc)" criu >"$WORK/build.log" 2>&1; then
  tail -n 30 "$WORK/build.log" >&2
  echo "install-criu: the build failed" >&2
  exit 1
fi
make -C "$WORK/criu-$VERSION" install-criu PREFIX="$PREFIX" >>"$WORK/build.log" 2>&1
if ! "$PREFIX/sbin/criu" check; then
  echo "install-criu: CRIU $VERSION installed in $PREFIX/sbin but \`criu check\` fails on this" \
       "kernel: snapshots cannot be restored on this node (containers start normally)" >&2
  exit 1
fi
echo "install-criu: CRIU $VERSION installed ($PREFIX/sbin/criu)" >&2
