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
