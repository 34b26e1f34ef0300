#!/usr/bin/env bash
# The admission webhook's TLS (docs/webhook.md): a private CA and a serving certificate for
# criuctl-webhook.criuctl-system.svc, the name the API server checks when it calls the Service.
#
#   scripts/webhook-cert.sh                  make them, then, with kubectl on the current cluster:
#                                            trust the new CA in the MutatingWebhookConfiguration's
#                                            caBundle (beside the CA it replaces), apply the Secret
#                                            criuctl-webhook-tls, restart the webhook's Deployment
#   scripts/webhook-cert.sh --print-only DIR only write ca.crt, tls.crt, tls.key, secret.yaml and
#                                            cabundle.b64 into DIR; touch no cluster
#   --days N                                 the serving certificate's lifetime (default 365)
#
# The CA signs this one certificate and its key is thrown away at once: rotating means running the
# script again. The order keeps the webhook callable throughout: the caBundle first trusts old and
# new CA, then the pods restart with the new certificate; the next run drops the older CA.
# Needs openssl (1.1.1 or 3.x); kubectl unless --print-only.
set -euo pipefail

NAMESPACE=criuctl-system
SERVICE=criuctl-webhook
SECRET=criuctl-webhook-tls
CONFIG=criuctl # the MutatingWebhookConfiguration (manifests/webhook.yaml)
DNS="$SERVICE.$NAMESPACE.svc"

log() { echo "webhook-cert: $*" >&2; }
. "$(dirname "$0")/lib.sh"
usage() { sed -n '2,16s/^# \{0,1\}//p' "$0" >&2; exit "${1:-2}"; }

out="" days=365 print_only=0
while [ $# -gt 0 ]; do
  case $1 in
    --print-only) [ $# -ge 2 ] || usage; print_only=1; out=$2; shift 2 ;;
    --days) [[ ${2:-} =~ ^[1-9][0-9]*$ ]] || die "--days takes a number of days"; days=$2; shift 2 ;;
    -h | --help) usage 0 ;;
    *) log "unknown argument: $1"; usage ;;
  esac
done
command -v openssl >/dev/null || die "openssl is not on PATH"
[ $print_only = 1 ] || command -v kubectl >/dev/null || die "kubectl is not on PATH (or use --print-only DIR)"

umask 077 # the keys: readable by their owner only
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -z "$out" ]; then
  out=$work/out
fi
mkdir -p "$out"

# EC P-256 and the extensions Python's ssl wants under VERIFY_X509_STRICT (as in docs/deploy.md).
# -nodes, not -noenc: OpenSSL 1.1.1 knows only the former, 3.x both.
openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days $((days + 1)) \
  -subj "/CN=criuctl webhook CA" \
  -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
  -keyout "$work/ca.key" -out "$out/ca.crt" 2>/dev/null
serving_cert "$DNS" "DNS:$DNS,DNS:$DNS.cluster.local,DNS:$SERVICE.$NAMESPACE,DNS:$SERVICE" \
  "$out/ca.crt" "$work/ca.key" "$work/ca.srl" "$days" "$out/tls"

b64() { openssl base64 -A <"$1"; }
cat >"$out/secret.yaml" <<EOF
apiVersion: v1
kind: Secret
metadata:
  name: $SECRET
  namespace: $NAMESPACE
  labels:
    app.kubernetes.io/part-of: criuctl
type: kubernetes.io/tls
data:
  tls.crt: $(b64 "$out/tls.crt")
  tls.key: $(b64 "$out/tls.key")
  ca.crt: $(b64 "$out/ca.crt")
EOF
b64 "$out/ca.crt" >"$out/cabundle.b64"
if [ $print_only = 1 ]; then
  log "wrote ca.crt tls.crt tls.key secret.yaml cabundle.b64 to $out"
  exit 0
fi

count=$(kubectl get mutatingwebhookconfiguration "$CONFIG" -o jsonpath='{range .webhooks[*]}{.name}{"\n"}{end}' |
  grep -c .) || die "no MutatingWebhookConfiguration $CONFIG: apply the manifests first (kubectl apply -k manifests/)"
# the CA of the certificate the webhook serves now stays trusted until its pods have restarted
old_ca=$(kubectl -n "$NAMESPACE" get secret "$SECRET" --ignore-not-found -o jsonpath='{.data.ca\.crt}' |
  openssl base64 -d -A)
bundle=$({ cat "$out/ca.crt"; [ -z "$old_ca" ] || printf '%s\n' "$old_ca"; } | openssl base64 -A)
ops=""
for ((i = 0; i < count; i++)); do
  ops+="${ops:+,}{\"op\":\"add\",\"path\":\"/webhooks/$i/clientConfig/caBundle\",\"value\":\"$bundle\"}"
done
kubectl patch mutatingwebhookconfiguration "$CONFIG" --type=json -p "[$ops]" >/dev/null
log "caBundle of $count webhook(s) in $CONFIG: the new CA${old_ca:+ and the previous one}"
kubectl apply -f "$out/secret.yaml" >/dev/null
log "Secret $NAMESPACE/$SECRET applied"
if kubectl -n "$NAMESPACE" get deployment "$SERVICE" >/dev/null 2>&1; then
  kubectl -n "$NAMESPACE" rollout restart deployment "$SERVICE" >/dev/null
  kubectl -n "$NAMESPACE" rollout status deployment "$SERVICE" --timeout=180s >&2
else
  log "no Deployment $NAMESPACE/$SERVICE yet: its pods will start with this certificate"
fi
