#!/usr/bin/env bash
# The GPU check, one prepared run on an NVIDIA host (driver r580+, Python with torch + CUDA, root):
#   here:  scripts/gpu-carry.sh                       # criu, its libraries, pycriu -> .gpu-carry/
#   there: bash tests/gpu/check.sh                    # device tool: carry [".gpu-carry"]
# Runs tests/gpu/check.py (driver API + CRIU dump/restore of a training job, with and without the
# GPU UUID map; the state pre-dump; device-to-host copy time; the driver-code probe; a one-rank NCCL
# job: suspended by the hook and moved (NCCL 2.29.7+), else refused, then with CRIUCTL_NCCL_TRY=1;
# what the boundary's empty_cache saves) in under 7 minutes. Writes every raw result to
# gpu-check.json ($OUT under the device tool: commit it as bench/results/gpu-check.json; then
# `python bench/gpu_table.py` makes docs/benchmarks.md's table). Exits non-zero if any check failed.
# GPU_CHECK_ONLY=cache runs only what the boundary's empty_cache saves (~70 s), into
# gpu-check-cache.json: a short call for what is left of a device budget.
set -uo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
carry=${CRIUCTL_GPU_CARRY:-$repo/.gpu-carry}
py=${PYTHON:-python3}
if [ ! -x "$carry/bin/criu" ]; then
  echo "check.sh: no CRIU at $carry/bin/criu: run scripts/gpu-carry.sh where CRIU is, and carry .gpu-carry" >&2
  exit 2
fi
export PATH="$carry/bin:$PATH"
export LD_LIBRARY_PATH="$carry/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CRIUCTL_CRIU="$carry/bin/criu"
export PYTHONPATH="$repo:$repo/hooks:$carry/site${PYTHONPATH:+:$PYTHONPATH}"
export CRIUCTL_STATE_DIR=${CRIUCTL_STATE_DIR:-/tmp/criuctl-gpu-state}
export PYTHONUNBUFFERED=1
# CRIU locks the network with nf_tables; a kernel without it gets no lock (the job has no TCP peer)
if ! [ -d /sys/module/nf_tables ] && ! grep -qw nf_tables /proc/modules 2>/dev/null; then
  export CRIUCTL_NETWORK_LOCK=skip
fi
echo "== host: $(uname -r); $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -2)"
echo "== criu: $("$CRIUCTL_CRIU" --version 2>&1 | head -1); python: $($py -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1)"
echo "== network lock: ${CRIUCTL_NETWORK_LOCK:-nftables}"
# the namespace init runs as `python -I -m criuctl.core.nsinit` (no PYTHONPATH): criuctl must be installed
for whl in "$carry"/wheels/*.whl; do  # criuctl's dependencies the image lacks (gpu-carry.sh)
  [ -e "$whl" ] && "$py" -m pip install -q --no-deps --no-index "$whl" 2>&1 | tail -1
done
"$py" -c 'import criuctl' 2>/dev/null && "$py" -I -c 'import criuctl' 2>/dev/null ||
  "$py" -m pip install -q --no-deps --no-build-isolation --no-index "$repo" 2>&1 | tail -2
"$CRIUCTL_CRIU" check 2>&1 | tail -3
timeout 420 "$py" tests/gpu/check.py
rc=$?
if [ -n "${OUT:-}" ] && [ -d "$CRIUCTL_STATE_DIR/logs" ]; then  # the device tool brings $OUT back
  tar czf "$OUT/criuctl-logs.tgz" -C "$CRIUCTL_STATE_DIR" logs 2>/dev/null
fi
exit $rc
