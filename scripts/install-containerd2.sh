#!/usr/bin/env bash
# containerd 2.x for the CRI CheckpointContainer tests, extracted (not installed) into
# /usr/local/lib/criuctl/containerd-2 (override with $CRIUCTL_CONTAINERD2).
#
# Why extracted from Debian sid's package: containerd 1.6 and 1.7 (Debian 12) do not implement
# CheckpointContainer; 2.1.x does, and sid's binaries need only GLIBC_2.34, so they run on Debian 12.
# The .deb is fetched through a PRIVATE apt configuration that names sid (its own source list,
# lists and cache in a temporary folder): the system's apt sources are never touched, so no apt
# run on this machine can ever pull sid's libc. The mirror is the one this machine already uses.
#
# The test image (busybox) comes from scripts/install-containerd.sh, which `make install` runs.
#
# Idempotent: does nothing (but print its one line) when the folder is there and its containerd runs.
# Layout: bin/{containerd,containerd-shim-runc-v2,ctr}, doc/ (copyright), VERSION.
set -euo pipefail

DEST=${CRIUCTL_CONTAINERD2:-/usr/local/lib/criuctl/containerd-2}
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

log() { echo "install-containerd2: $*" >&2; }
# shellcheck source=scripts/lib.sh
source "$(cd "$(dirname "$0")" && pwd)/lib.sh"
[ "$(id -u)" = 0 ] || die "must run as root (it writes under /usr/local/lib); try: sudo make test"

# "containerd github.com/containerd/containerd/v2 2.1.x~ds1 ..." -> its version, when it runs here
runs() { "$1/bin/containerd" --version 2>/dev/null | awk '$1=="containerd"{print $3; exit}'; }

if v=$(runs "$DEST") && [ -n "$v" ]; then
  echo "containerd 2: $v at $DEST (already there)"
  exit 0
fi

[ -r "$KEYRING" ] || die "$KEYRING is missing (apt-get install debian-archive-keyring)"
command -v dpkg-deb >/dev/null || die "dpkg-deb is missing"

work=$(mktemp -d /tmp/criuctl-containerd2.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/deb"
uri=$(debian_uri)
echo "deb [signed-by=$KEYRING] $uri sid main" >"$work/sources.list"

# Everything apt reads or writes for this lives in $work: sources, lists, cache. The system's
# preferences and dpkg status are still read (harmless: this only downloads one .deb).
apt_private=(
  -o "Dir::Etc::sourcelist=$work/sources.list"
  -o "Dir::Etc::sourceparts=-"
  -o "Dir::State::Lists=$work/lists"
  -o "Dir::Cache=$work/cache"
  -o "APT::Get::List-Cleanup=0"
)
log "fetching the containerd package list of Debian sid from $uri (private apt configuration)"
apt-get "${apt_private[@]}" -qq update >"$work/update.log" 2>&1 ||
  { cat "$work/update.log" >&2; die "apt-get update of the private sid source failed"; }
(cd "$work/deb" && apt-get "${apt_private[@]}" -qq download containerd) >"$work/download.log" 2>&1 ||
  { cat "$work/download.log" >&2; die "apt-get download containerd (sid) failed"; }
deb=$(ls "$work"/deb/containerd_*.deb 2>/dev/null | head -n1)
[ -n "$deb" ] || die "no containerd .deb was downloaded"
pkgver=$(dpkg-deb -f "$deb" Version)
case "$pkgver" in
  2.*) ;;
  *) die "sid's containerd is $pkgver, not 2.x: this script expects containerd 2 (CheckpointContainer)" ;;
esac

# Build the folder next to DEST and rename it in place: a half-extracted folder is never DEST.
stage="$DEST.tmp.$$"
rm -rf "$stage"
mkdir -p "$stage/pkg"
dpkg-deb -x "$deb" "$stage/pkg"
[ -x "$stage/pkg/usr/bin/containerd" ] || die "the package has no usr/bin/containerd"
mv "$stage/pkg/usr/bin" "$stage/bin"
[ -d "$stage/pkg/usr/share/doc/containerd" ] && mv "$stage/pkg/usr/share/doc/containerd" "$stage/doc"
rm -rf "$stage/pkg"
echo "$pkgver" >"$stage/VERSION"

# It must run on this machine's glibc (sid moving to a newer libc would show here, not in a test).
for b in "containerd --version" "containerd-shim-runc-v2 -v" "ctr --version"; do
  set -- $b
  [ -x "$stage/bin/$1" ] || { rm -rf "$stage"; die "the package has no $1"; }
  if ! out=$("$stage/bin/$1" "$2" 2>&1); then
    rm -rf "$stage"
    die "sid's $1 $pkgver does not run here ($(echo "$out" | head -n1)); glibc: $(ldd --version | head -n1)"
  fi
done
rm -rf "$DEST"
mkdir -p "$(dirname "$DEST")"
mv "$stage" "$DEST"
echo "containerd 2: $(runs "$DEST") at $DEST (Debian sid $pkgver, extracted)"
