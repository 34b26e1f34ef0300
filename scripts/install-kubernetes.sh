#!/usr/bin/env bash
# A real Kubernetes for the local cluster (`scripts/local-cluster up`) and its tests, as root:
#   - kube-apiserver, kubelet, kube-scheduler, kube-controller-manager, kube-proxy v1.20.2, built from Debian 12's
#     own `kubernetes` source package (the full upstream tree with its vendor/; newer Debian packages
#     strip everything but kubectl) with Debian 12's Go 1.19, offline (GOPROXY=off);
#   - etcd 3.4 (etcd-server) and the CNI plugins (containernetworking-plugins) from Debian 12.
# The build (~10 min on 2 cores, 1.4 GB peak) is cached outside the repository in
# $CRIUCTL_CACHE/kubernetes-1.20.2/bin; with everything in place this prints one line.
# The source is fetched through a private apt configuration: the system's apt sources are untouched.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
CACHE=${CRIUCTL_CACHE:-/usr/local/lib/criuctl}
BIN=$CACHE/kubernetes-1.20.2/bin
SRC=${CRIUCTL_K8S_SRC:-/usr/local/src/criuctl/kubernetes}
WHAT="kube-apiserver kubelet kube-scheduler kube-controller-manager kube-proxy"
log() { echo "install-kubernetes: $*" >&2; }
# shellcheck source=scripts/lib.sh
source "$HERE/lib.sh"
[ "$(id -u)" = 0 ] || die "must run as root; try: sudo make test"

missing=()
command -v etcd >/dev/null || missing+=(etcd-server)
[ -x /usr/lib/cni/bridge ] || [ -x /usr/lib/cni/host-local ] || missing+=(containernetworking-plugins)
command -v kubectl >/dev/null || missing+=(kubernetes-client)
command -v openssl >/dev/null || missing+=(openssl)
command -v dnsmasq >/dev/null || [ -x /usr/sbin/dnsmasq ] || missing+=(dnsmasq-base) # the cluster's DNS
# the binaries not built yet: only those are built (a cache from before kube-proxy builds just it)
unbuilt() { for b in $WHAT; do [ -x "$BIN/$b" ] || printf '%s ' "$b"; done; }
built() { [ -z "$(unbuilt)" ]; }
built || missing+=(golang-1.19-go golang-1.19-src rsync dpkg-dev golang-github-modern-go-reflect2-dev)
[ ${#missing[@]} = 0 ] || { log "installing ${missing[*]}"; apt_install "${missing[@]}"; }

private_apt() {
  local sources=$1; shift
  local d=$SRC/apt; mkdir -p "$d/lists/partial" "$d/cache/archives/partial"
  apt-get -o Dir::Etc::sourcelist="$sources" -o Dir::Etc::sourceparts=- \
    -o Dir::State::Lists="$d/lists" -o Dir::Cache="$d/cache" "$@"
}

if ! built; then
  tree=$(ls -d "$SRC"/dl/kubernetes-1.20*/ 2>/dev/null | head -n1 || true)
  if [ -z "$tree" ]; then
    log "fetching Debian 12's kubernetes source package"
    mkdir -p "$SRC/dl"
    printf 'Types: deb-src\nURIs: %s\nSuites: bookworm\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      "$(debian_uri)" >"$SRC/bookworm-src.sources"
    private_apt "$SRC/bookworm-src.sources" update -qq
    (cd "$SRC/dl" && private_apt "$SRC/bookworm-src.sources" source "kubernetes/bookworm" >/dev/null) \
      || die "could not fetch and unpack Debian's kubernetes source package"
    tree=$(ls -d "$SRC"/dl/kubernetes-1.20*/ | head -n1)
  fi
  # v1.20.2 vendors modern-go/reflect2 1.0.1, whose map iteration faults under Go >= 1.18 (the
  # API server dies with SIGSEGV in mapiterinit the first time it JSON-encodes a map, e.g. a
  # webhook's patch): the vendored copy is replaced with Debian 12's reflect2 1.0.2, which fixes it.
  r2=$tree/vendor/github.com/modern-go/reflect2
  if [ ! -f "$r2/go_above_118.go" ]; then
    log "replacing the vendored reflect2 1.0.1 with Debian's 1.0.2 (Go 1.18+ map iteration)"
    rm -rf "$r2" && cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 "$r2"
    rm -rf "$r2"/*_test.go "$r2"/test* "$r2"/.??* "$r2"/go.mod
  fi
  todo=$(unbuilt)
  log "building ${todo% } v1.20.2 (cached in $BIN; ~2-3 min each on 2 cores)"
  (cd "$tree" && PATH=/usr/lib/go-1.19/bin:$PATH GOPROXY=off GOFLAGS=-mod=vendor GO111MODULE=on \
    KUBE_GIT_VERSION=v1.20.2 KUBE_GIT_TREE_STATE=clean \
    make WHAT="$(for b in $todo; do printf 'cmd/%s ' "$b"; done)" >"$SRC/build.log" 2>&1) \
    || die "the build failed; see $SRC/build.log"
  mkdir -p "$BIN"
  for b in $todo; do
    f=$(ls "$tree"/_output/local/bin/linux/*/"$b" "$tree"/_output/bin/"$b" 2>/dev/null | head -n1)
    [ -n "$f" ] || die "the build made no $b; see $SRC/build.log"
    install -m 0755 "$f" "$BIN/$b"
  done
fi
log "ok: $("$BIN/kube-apiserver" --version), etcd $(etcd --version | awk 'NR==1{print $3}'), in $BIN"
