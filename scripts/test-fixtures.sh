#!/usr/bin/env bash
# Real things some tests need besides CRIU 4.1.1 (installed by bootstrap.sh):
#  - Debian 12's own criu 3.17.1, unpacked (not installed) to check that criuctl refuses a CRIU < 4.0.
#  - Kubernetes (scripts/install-kubernetes.sh) for the local cluster the Kubernetes tests start;
#  - the tools the migration tests build nodes with: ip (network namespaces, veth, bridge),
#    nsenter/unshare (util-linux), openssl (TLS certificates for the agents).
# Idempotent: does nothing when already there.
set -euo pipefail
missing=()
command -v ip >/dev/null || missing+=(iproute2)
command -v openssl >/dev/null || missing+=(openssl)
{ command -v nsenter && command -v unshare; } >/dev/null || missing+=(util-linux)
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
OLD=/usr/local/lib/criuctl/criu-3.17
if [ ! -x "$OLD/usr/sbin/criu" ]; then
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && apt-get download -qq "criu=3.17*" >/dev/null 2>&1) || {
    apt-get update -qq && (cd "$tmp" && apt-get download -qq "criu=3.17*" >/dev/null); }
  mkdir -p "$OLD" && dpkg -x "$tmp"/criu_3.17*.deb "$OLD"
fi
bash "$(dirname "$0")/install-containerd2.sh"  # containerd 2.x for tests/test_cri_archive.py
# Kubernetes v1.20.2 built from Debian 12's source (cached) for the local cluster of tests/test_kube.py
bash "$(dirname "$0")/install-kubernetes.sh"
