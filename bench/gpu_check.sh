#!/usr/bin/env bash
# The GPU host check, one short run: the real CUDA driver's checkpoint API as criuctl sees it.
# Usage, on a host with an NVIDIA driver and a Python with pytest, psutil and rich: bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
export PYTHONPATH="$PWD:$PWD/hooks:${PYTHONPATH:-}"
python3 -c 'from criuctl import cuda; print(cuda.probe())'
python3 -m pytest -q -p no:cacheprovider -c /dev/null --confcutdir tests/gpu tests/gpu
