#!/usr/bin/env bash
# What container support needs on a node (and the container tests on this machine), as root:
#   - containerd + runc from the distribution (Debian 12: containerd 1.6.20, runc 1.1.5);
#   - a busybox image (docker-save tar from Debian's busybox-static) for pause and test containers.
# The CRI client stubs are not made here: criuctl's build generates them (setup.py) from the proto
# scripts/cri-proto.sh fetches. Idempotent: with everything in place it prints one line.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
CACHE=${CRIUCTL_CACHE:-/usr/local/lib/criuctl}
IMAGES=$CACHE/images
log() { echo "install-containerd: $*" >&2; }
# shellcheck source=scripts/lib.sh
source "$HERE/lib.sh"
[ "$(id -u)" = 0 ] || die "must run as root; try: sudo make test"

command -v containerd >/dev/null && command -v runc >/dev/null && command -v ctr >/dev/null \
  || { log "installing containerd and runc"; apt_install containerd runc; }

if [ ! -f "$IMAGES/busybox.tar" ]; then
  log "building the busybox test image"
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && apt-get download -qq busybox-static >/dev/null 2>&1) \
    || { apt-get update -qq && (cd "$tmp" && apt-get download -qq busybox-static >/dev/null); }
  dpkg -x "$tmp"/busybox-static_*.deb "$tmp/x"
  mkdir -p "$tmp/rootfs/bin" "$tmp/rootfs/etc" "$tmp/rootfs/tmp" "$tmp/rootfs/run" "$tmp/rootfs/workspace"
  cp "$tmp/x/bin/busybox" "$tmp/rootfs/bin/busybox"
  for c in sh sleep cat ls echo; do ln -sf busybox "$tmp/rootfs/bin/$c"; done
  chmod 1777 "$tmp/rootfs/tmp"
  python3 "$HERE/image-tar.py" "$tmp/rootfs" criuctl.test/busybox:1 "$IMAGES/busybox.tar" --cmd /bin/sleep infinity
fi
log "ok: $(containerd --version | awk '{print $1, $3}'), $(runc --version | head -n1)"
