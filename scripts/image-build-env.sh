#!/bin/sh
# Runs one step of the image build (the Dockerfile's RUN lines) with the package configuration of
# the machine that builds it, handed in as build secrets by scripts/build-image.sh, never copied
# into a layer:
#   /run/secrets/ca           a CA bundle: pip and Python's ssl trust it (a proxy's CA, a mirror's)
#   /run/secrets/pip.conf     pip's configuration (an index mirror, timeouts)
#   /run/secrets/apt.sources  apt's sources (deb822, or one-line `deb URI SUITE ...`): used instead
#                             of the base image's for this step
# Each is optional: a plain `docker build .` without secrets uses the base image's defaults. The apt
# sources the step replaces are put back before it ends, so the layer holds the base's own.
set -eu
S=/run/secrets
if [ -s "$S/ca" ]; then
  export PIP_CERT="$S/ca" SSL_CERT_FILE="$S/ca" REQUESTS_CA_BUNDLE="$S/ca"
fi
if [ -s "$S/pip.conf" ]; then
  export PIP_CONFIG_FILE="$S/pip.conf"
fi
if [ -s "$S/apt.sources" ]; then
  aside=$(mktemp -d /tmp/apt-sources.XXXXXX)
  [ ! -e /etc/apt/sources.list ] || mv /etc/apt/sources.list "$aside/"
  mkdir -p "$aside/parts"
  for f in /etc/apt/sources.list.d/*; do [ ! -e "$f" ] || mv "$f" "$aside/parts/"; done
  # apt reads a file by its extension: .sources as deb822, .list as one-line entries
  ext=sources
  if grep -Eq '^[[:space:]]*deb(-src)?[[:space:]]' "$S/apt.sources"; then ext=list; fi
  cp "$S/apt.sources" "/etc/apt/sources.list.d/build.$ext"
  status=0
  "$@" || status=$?
  rm -f /etc/apt/sources.list.d/build.sources /etc/apt/sources.list.d/build.list
  [ ! -e "$aside/sources.list" ] || mv "$aside/sources.list" /etc/apt/
  for f in "$aside"/parts/*; do [ ! -e "$f" ] || mv "$f" /etc/apt/sources.list.d/; done
  rm -rf "$aside"
  exit $status
fi
exec "$@"
