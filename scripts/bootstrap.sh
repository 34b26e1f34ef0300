#!/usr/bin/env bash
# Everything `make demo` / `make test` need on a fresh Debian 12 machine, as root: the venv in .venv
# with the project and its pinned packages, and CRIU >= 4.0 with pycriu. Idempotent and fast when done:
# the venv is rebuilt only when pyproject.toml changes, CRIU only when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
STAMP=$VENV/.criuctl-installed

log() { echo "bootstrap: $*" >&2; }
[ "$(id -u)" = 0 ] || { log "error: run as root (CRIU needs it to freeze and restore processes); try: sudo make test"; exit 1; }

want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  log "creating $VENV and installing Python packages (torch==2.13.0, CPU build)"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e '.[dev]'
  echo "$want" >"$STAMP"
fi
bash scripts/install-criu.sh "$VENV"
bash scripts/install-containerd.sh "$VENV"
