#!/usr/bin/env bash
# The suite as `make test` runs it: two pytest sessions side by side. One runs the modules on the
# local Kubernetes (they share one cluster, up once for the session: tests/conftest.py's
# `local_cluster`), the image builds and a few heavy modules that balance the two; the other runs
# everything else meanwhile. Much of a test is waiting (kubelets, controllers, a job's steps), so
# on 2 cores the two together take less than one after the other (the suite alone took 69-81 min
# on a slow VM). Each session has its own share of the test nets (tests/cluster.py) and its own
# temporary folder. The cluster session's output is printed once it ends; the exit status is
# non-zero when either failed.
#   scripts/run-tests.sh PYTHON            both sessions at once
#   scripts/run-tests.sh PYTHON --serial   one session, every test (what a bare pytest does)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${1:?usage: scripts/run-tests.sh PYTHON [--serial]}
ARGS=(-ra --durations=40 -p no:cacheprovider)
tmp=$(mktemp -d /tmp/criuctl-tests.XXXXXX)

if [ "${2:-}" = --serial ]; then
  exec "$PY" -m pytest "${ARGS[@]}" --basetemp "$tmp/all" tests
fi

# with them, the heaviest modules of the others that need no Kubernetes, so both sessions take
# about as long (38 against 64 min without them, on 2 cores, 2026-12-03; test_containers.py back
# with the others 2026-12-06, when the cluster's session had grown to 55 min)
BALANCE=(tests/test_multinode.py tests/test_containers_faults.py)
mapfile -t cluster < <({ grep -l -e local_cluster -e '"image-builder"' tests/test_*.py; printf '%s\n' "${BALANCE[@]}"; } | sort)
ignore=()
for f in "${cluster[@]}"; do ignore+=(--ignore "$f"); done

CRIUCTL_TESTS_SHARE=1/2 "$PY" -m pytest "${ARGS[@]}" --basetemp "$tmp/cluster" "${cluster[@]}" \
  >"$tmp/cluster.log" 2>&1 &
bg=$!
echo "run-tests: ${#cluster[@]} modules on the local Kubernetes run meanwhile (printed when they end):" \
  "${cluster[*]#tests/}"
CRIUCTL_TESTS_SHARE=0/2 "$PY" -m pytest "${ARGS[@]}" --basetemp "$tmp/rest" tests "${ignore[@]}"
rest=$?
echo "run-tests: the other modules ended (exit $rest); waiting for the cluster's"
wait "$bg"
kube=$?
echo "run-tests: ===================== the modules on the local Kubernetes (exit $kube) ====================="
cat "$tmp/cluster.log"
if [ "$rest" -eq 0 ] && [ "$kube" -eq 0 ]; then
  rm -rf --one-file-system "$tmp"  # ~13 GB of jobs' files and bundles; kept when something failed
  exit 0
fi
echo "run-tests: the tests' folders are kept for a look: $tmp"
exit 1
