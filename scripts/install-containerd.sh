#!/usr/bin/env bash
# What container support needs on a node (and the container tests on this machine), as root:
#   - containerd + runc from the distribution (Debian 12: containerd 1.6.20, runc 1.1.5);
#   - the CRI client stubs (`criuctl_cri`) in the venv given as $1, generated with grpcio-tools from
#     the CRI `runtime/v1` api.proto vendored in Debian's containerd *source* package (fetched through
#     a private apt configuration: the system's sources are never changed; the proto is never
#     copied into the repository);
#   - a busybox image (docker-save tar from Debian's busybox-static) for pause and test containers.
# Idempotent: with everything in place it prints one line.
set -euo pipefail
VENV=$(realpath "${1:?usage: install-containerd.sh VENV_DIR}")
HERE=$(cd "$(dirname "$0")" && pwd)
CACHE=${CRIUCTL_CACHE:-/usr/local/lib/criuctl}
SRC=${CRIUCTL_CRI_SRC:-/usr/local/src/criuctl/containerd}
IMAGES=$CACHE/images
log() { echo "install-containerd: $*" >&2; }
# shellcheck source=scripts/lib.sh
source "$HERE/lib.sh"
[ "$(id -u)" = 0 ] || die "must run as root; try: sudo make test"

# apt-get with a private list of sources ($1: a sources file); the system's apt state is untouched.
private_apt() {
  local sources=$1; shift
  local d=$SRC/apt; mkdir -p "$d/lists/partial" "$d/cache/archives/partial"
  apt-get -o Dir::Etc::sourcelist="$sources" -o Dir::Etc::sourceparts=- \
    -o Dir::State::Lists="$d/lists" -o Dir::Cache="$d/cache" "$@"
}

command -v containerd >/dev/null && command -v runc >/dev/null && command -v ctr >/dev/null \
  || { log "installing containerd and runc"; apt_install containerd runc; }

stubs_ok() { "$VENV/bin/python" -c 'import grpc, criuctl_cri.api_pb2_grpc' >/dev/null 2>&1; }
if ! stubs_ok; then
  proto=$SRC/criuctl_cri/api.proto
  if [ ! -f "$proto" ]; then
    log "fetching the CRI api.proto from Debian's containerd source package"
    mkdir -p "$SRC/dl"
    printf 'Types: deb-src\nURIs: %s\nSuites: bookworm\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      "$(debian_uri)" >"$SRC/bookworm-src.sources"
    private_apt "$SRC/bookworm-src.sources" update -qq
    (cd "$SRC/dl" && private_apt "$SRC/bookworm-src.sources" source --download-only containerd >/dev/null 2>&1) || true
    orig=$(ls "$SRC"/dl/containerd_*.orig.tar.* 2>/dev/null | head -n1)
    [ -n "$orig" ] || die "could not download containerd's source package"
    member=$(tar tf "$orig" | grep 'vendor/k8s.io/cri-api/pkg/apis/runtime/v1/api.proto$' || true)
    [ -n "$member" ] || die "no runtime/v1 api.proto in $orig"
    mkdir -p "$SRC/criuctl_cri"
    tar xOf "$orig" "$member" | sed '/gogoproto/d' >"$proto"
  fi
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  rm -rf "$site/criuctl_cri"; mkdir -p "$site/criuctl_cri"
  (cd "$SRC" && "$VENV/bin/python" -m grpc_tools.protoc -I. --python_out="$site" --grpc_python_out="$site" \
    criuctl_cri/api.proto) || die "generating the CRI stubs failed"
  touch "$site/criuctl_cri/__init__.py"
  stubs_ok || die "the CRI stubs do not import: $("$VENV/bin/python" -c 'import criuctl_cri.api_pb2_grpc' 2>&1 | tail -n1)"
fi

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
log "ok: $(containerd --version | awk '{print $1, $3}'), $(runc --version | head -n1), CRI stubs in $VENV"
