#!/usr/bin/env bash
# Real things the tests need besides what bootstrap.sh installs (venv, CRIU 4.2.1, containerd 1.6):
#  - Debian 12's own criu 3.17.1, unpacked (not installed) to check that criuctl refuses a CRIU < 4.0.
#  - Kubernetes (scripts/install-kubernetes.sh) for the local cluster the Kubernetes tests start;
#  - containerd 2 (scripts/install-containerd2.sh) for tests/test_cri_archive.py;
#  - from Debian 12: the tools the migration tests build nodes with: ip (network namespaces, veth,
#    bridge), nsenter/unshare (util-linux), openssl (TLS certificates for the agents); a C compiler
#    (gcc: the compiled stand-ins for libcuda and NVML of tests/test_cuda.py); zstd (CRI-O and
#    podman archives compressed with it); buildah and mmdebstrap for the agent image that the local
#    cluster runs (scripts/build-image.sh, tests/test_image.py), and docker-registry (the CNCF
#    distribution server) as a registry on loopback for its push and pull.
# Idempotent: does nothing when already there. What the suite needs, and what `make test` makes of a
# missing one (an error, never a skip), is tests/requirements.py; its list and this one change together.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
log() { echo "test-fixtures: $*" >&2; }
# shellcheck source=scripts/lib.sh
source "$HERE/lib.sh"
[ "$(id -u)" = 0 ] || die "must run as root; try: sudo make test"

missing=()
command -v ip >/dev/null || missing+=(iproute2)
command -v openssl >/dev/null || missing+=(openssl)
{ command -v nsenter && command -v unshare; } >/dev/null || missing+=(util-linux)
{ command -v "${CC:-cc}" || command -v gcc; } >/dev/null || missing+=(gcc libc6-dev)
command -v zstd >/dev/null || missing+=(zstd)
command -v buildah >/dev/null || missing+=(buildah)       # the agent image (scripts/build-image.sh)
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap) # its base where no registry answers
command -v docker-registry >/dev/null || missing+=(docker-registry) # a registry of our own for its push
[ ${#missing[@]} = 0 ] || { log "installing ${missing[*]}"; apt_install "${missing[@]}"; }

OLD=/usr/local/lib/criuctl/criu-3.17
if [ ! -x "$OLD/usr/sbin/criu" ]; then
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && apt-get download -qq "criu=3.17*" >/dev/null 2>&1) || {
    apt-get update -qq && (cd "$tmp" && apt-get download -qq "criu=3.17*" >/dev/null); }
  mkdir -p "$OLD" && dpkg -x "$tmp"/criu_3.17*.deb "$OLD"
fi
bash "$HERE/install-containerd2.sh"  # containerd 2.x for tests/test_cri_archive.py
# Kubernetes v1.20.2 built from Debian 12's source (cached) for the local cluster of tests/test_kube.py
bash "$HERE/install-kubernetes.sh"
