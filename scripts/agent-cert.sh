#!/usr/bin/env bash
# A TLS certificate for one node's agent (README "Security", docs/deploy.md "Agents outside
# Kubernetes"): a private CA, made once in DIR and reused for every later node, signs a key and a
# certificate that name the addresses clients and other agents use to reach that node.
#
#   scripts/agent-cert.sh [--dir DIR] [--days N] NODE ADDRESS [ADDRESS...]
#     NODE      the node's name (the certificate's CN, and the folder its files go in)
#     ADDRESS   an IP address or DNS name of the node, as it appears in `criuctl node add` URLs
#     --dir     where the CA lives and NODE's files go (default ./criuctl-pki)
#     --days    the node certificate's lifetime (default 365; the CA's: 10 years)
#
# Writes DIR/ca.crt (for every client: criuctl node add NODE https://ADDRESS:7070 ... --ca ca.crt),
# DIR/ca.key (keep it for the next node, then offline), and DIR/NODE/tls.crt, DIR/NODE/tls.key
# (for that node: criuctl agent --tls-cert DIR/NODE/tls.crt --tls-key DIR/NODE/tls.key). Running it
# again for a node re-issues that node's pair from the same CA; clients keep their ca.crt.
# EC P-256 keys (fast to make), with the extensions Python's ssl wants under VERIFY_X509_STRICT.
# Needs openssl (1.1.1 or 3.x) and flock.
set -euo pipefail

log() { echo "agent-cert: $*" >&2; }
. "$(dirname "$0")/lib.sh"
usage() { sed -n '2,17s/^# \{0,1\}//p' "$0" >&2; exit "${1:-2}"; }

dir=./criuctl-pki days=365
while [ $# -gt 0 ]; do
  case $1 in
    --dir) [ $# -ge 2 ] || usage; dir=$2; shift 2 ;;
    --days) [[ ${2:-} =~ ^[1-9][0-9]*$ ]] || die "--days takes a number of days"; days=$2; shift 2 ;;
    -h | --help) usage 0 ;;
    -*) log "unknown option: $1"; usage ;;
    *) break ;;
  esac
done
[ $# -ge 2 ] || usage
node=$1
shift
[[ $node =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] || die "NODE $node: use letters, digits, '.', '_' and '-'"
san=""
for addr in "$@"; do
  if [[ $addr =~ ^[0-9.]+$ || $addr == *:* ]]; then
    san+="${san:+,}IP:$addr"
  elif [[ $addr =~ ^[A-Za-z0-9*]([A-Za-z0-9.-]*[A-Za-z0-9])?$ ]]; then
    san+="${san:+,}DNS:$addr"
  else
    die "$addr is neither an IP address nor a DNS name"
  fi
done
command -v openssl >/dev/null || die "openssl is not on PATH"

umask 077 # the keys: readable by their owner only
mkdir -p "$dir/$node"
exec 9>"$dir/.lock" # one CA, also when several nodes' certificates are made at once
flock 9
if [ ! -e "$dir/ca.crt" ]; then
  # -nodes, not -noenc: OpenSSL 1.1.1 knows only the former, 3.x both
  openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 \
    -subj "/CN=criuctl agents CA" \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
    -keyout "$dir/ca.key" -out "$dir/ca.crt" 2>/dev/null
  chmod 644 "$dir/ca.crt"
  log "made a CA: $dir/ca.crt (give it to clients), $dir/ca.key (keep it private)"
fi
[ -r "$dir/ca.key" ] || die "$dir/ca.crt has no $dir/ca.key beside it: sign with the CA's key, or move ca.crt away"
serving_cert "$node" "$san" "$dir/ca.crt" "$dir/ca.key" "$dir/ca.srl" "$days" "$dir/$node/tls" serverAuth,clientAuth
log "node $node ($san): criuctl agent --tls-cert $dir/$node/tls.crt --tls-key $dir/$node/tls.key ..."
