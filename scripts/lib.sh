# Shell helpers the install scripts share; sourced after the script defines `log` (its own prefix).
# shellcheck shell=bash

die() { log "error: $*"; exit 1; }

apt_updated=0
apt_install() {
  [ $apt_updated = 1 ] || { apt-get update -qq; apt_updated=1; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# The Debian mirror this machine already uses (deb822 or one-line format), never a hard-coded host;
# the security archive is skipped (it has no source packages and no sid).
debian_uri() {
  local f uri=""
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    uri=$(awk '/^URIs:/{for(i=2;i<=NF;i++) if ($i !~ /security/) {print $i; exit}}' "$f")
    [ -n "$uri" ] && break
  done
  if [ -z "$uri" ]; then
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
      [ -f "$f" ] || continue
      uri=$(awk '$1=="deb"{for(i=2;i<=NF;i++) if ($i ~ /^[a-z+]+:\/\// && $i !~ /security/) {print $i; exit}}' "$f")
      [ -n "$uri" ] && break
    done
  fi
  [ -n "$uri" ] || die "no Debian apt source found (in /etc/apt) to fetch packages from"
  echo "${uri%/}"
}

# A serving certificate: an EC P-256 key and a certificate for CN with subjectAltName SAN, signed by
# CA_CRT/CA_KEY (serial numbers kept in SERIAL), valid DAYS days, with the extensions Python's ssl
# wants under VERIFY_X509_STRICT; written to OUT.key and OUT.crt only once it verifies. USAGE: the
# extended key usage (an agent's also authenticates it to other agents: serverAuth,clientAuth).
serving_cert() {
  local cn=$1 san=$2 ca_crt=$3 ca_key=$4 serial=$5 days=$6 out=$7 usage=${8:-serverAuth} tmp
  tmp=$(mktemp -d)
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$cn" \
    -keyout "$tmp/tls.key" -out "$tmp/tls.csr" 2>/dev/null
  cat >"$tmp/tls.ext" <<EXT
subjectAltName=$san
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=$usage
subjectKeyIdentifier=hash
authorityKeyIdentifier=keyid
EXT
  openssl x509 -req -in "$tmp/tls.csr" -CA "$ca_crt" -CAkey "$ca_key" -CAcreateserial \
    -CAserial "$serial" -days "$days" -extfile "$tmp/tls.ext" -out "$tmp/tls.crt" 2>/dev/null
  if ! openssl verify -CAfile "$ca_crt" "$tmp/tls.crt" >/dev/null; then
    rm -rf "$tmp"
    die "the new certificate does not verify"
  fi
  chmod 600 "$tmp/tls.key"
  mv "$tmp/tls.key" "$out.key"
  mv "$tmp/tls.crt" "$out.crt"
  rm -rf "$tmp"
}
