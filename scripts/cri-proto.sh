#!/usr/bin/env bash
# The CRI `runtime/v1` api.proto that criuctl's build turns into its CRI client stubs (setup.py,
# `criuctl_cri`), as root: taken from the copy vendored in Debian's containerd *source* package,
# fetched through a private apt configuration (the system's sources are never changed), its
# gogoproto lines dropped. Written to $CRIUCTL_CRI_SRC/criuctl_cri/api.proto, where setup.py looks;
# never copied into the repository. Run before `pip install`: scripts/bootstrap.sh and the Dockerfile
# do. Idempotent: with the proto in place it prints one line.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=${CRIUCTL_CRI_SRC:-/usr/local/src/criuctl/containerd}
log() { echo "cri-proto: $*" >&2; }
# shellcheck source=scripts/lib.sh
source "$HERE/lib.sh"

# apt-get with a private list of sources ($1: a sources file); the system's apt state is untouched.
private_apt() {
  local sources=$1; shift
  local d=$SRC/apt; mkdir -p "$d/lists/partial" "$d/cache/archives/partial"
  apt-get -o Dir::Etc::sourcelist="$sources" -o Dir::Etc::sourceparts=- \
    -o Dir::State::Lists="$d/lists" -o Dir::Cache="$d/cache" "$@"
}

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
  tar xOf "$orig" "$member" | sed '/gogoproto/d' >"$proto.tmp"
  mv "$proto.tmp" "$proto"
fi
log "ok: $proto"
