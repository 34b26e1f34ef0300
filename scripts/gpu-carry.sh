#!/usr/bin/env bash
# Pack what tests/gpu/check.sh needs on a GPU host that has Python, torch and the NVIDIA driver but
# no CRIU and no network: this node's criu binary, the shared libraries it links (glibc excepted: the
# host's is newer), and pycriu. Into DIR (default .gpu-carry, ignored by git), under 64 MiB.
#   scripts/gpu-carry.sh [DIR]     then carry DIR with the device tool and run tests/gpu/check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.gpu-carry}
criu=$(command -v "${CRIUCTL_CRIU:-criu}") || { echo "gpu-carry: no criu here: run make test first" >&2; exit 1; }
rm -rf "$dir"
mkdir -p "$dir/bin" "$dir/lib" "$dir/site"
cp "$criu" "$dir/bin/criu"
ldd "$criu" | awk '/=> \// {print $3}' | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*) ;;  # glibc: the host's
    *) cp -L "$lib" "$dir/lib/" ;;
  esac
done
pycriu=$(.venv/bin/python -c 'import os, pycriu; print(os.path.dirname(pycriu.__file__))')
cp -r "$pycriu" "$dir/site/"
# the wheels of criuctl's own dependencies that the GPU image lacks (blake3), for its Python 3.12
mkdir -p "$dir/wheels"
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir/wheels" blake3
git describe --always --dirty > "$dir/COMMIT" 2>/dev/null || echo unknown > "$dir/COMMIT"  # check.py records it
find "$dir" -name __pycache__ -prune -exec rm -rf {} +
grep -qxF "/$dir/" .git/info/exclude 2>/dev/null || echo "/$dir/" >> .git/info/exclude
du -sh "$dir"
