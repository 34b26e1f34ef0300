#!/usr/bin/env bash
# Everything `make demo` / `make test` need on a fresh Debian 12 machine, as root: the venv in .venv
# with the project (editable, with its dev extra: the demo's and the tests' packages) and its pinned
# packages, CRIU >= 4.0 with pycriu, containerd. Idempotent and fast when done: the venv is rebuilt
# only when pyproject.toml or setup.py changes or the CRI stubs are missing, CRIU only when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
STAMP=$VENV/.criuctl-installed

log() { echo "bootstrap: $*" >&2; }
[ "$(id -u)" = 0 ] || { log "error: run as root (CRIU needs it to freeze and restore processes); try: sudo make test"; exit 1; }

# The proto first: building the project generates the CRI client stubs from it (setup.py).
bash scripts/cri-proto.sh
want=$(cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1)
stubs_ok() { "$VENV/bin/python" -c 'import criuctl_cri.api_pb2_grpc' >/dev/null 2>&1; }
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ] || ! stubs_ok; then
  # the dev extra holds the demo's (torch, matplotlib) and the tests' packages
  log "creating $VENV and installing Python packages (torch==2.13.0, CPU build)"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e '.[dev]'
  stubs_ok || { log "error: the CRI client stubs do not import after the install: $("$VENV/bin/python" \
    -c 'import criuctl_cri.api_pb2_grpc' 2>&1 | tail -n1)"; exit 1; }
  echo "$want" >"$STAMP"
fi
bash scripts/install-criu.sh "$VENV"
bash scripts/install-containerd.sh
