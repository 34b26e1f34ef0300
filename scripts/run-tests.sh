#!/usr/bin/env bash
# The suite as `make test` runs it: three pytest sessions side by side. One runs the modules on the
# local Kubernetes (they share one cluster, up once for the session: tests/conftest.py's
# `local_cluster`) and the image builds; one the kill-at-every-boundary test with the heaviest
# multi-node modules that need no Kubernetes; one everything else. Much of a test is waiting
# (kubelets, controllers, a job's steps: two sessions kept 2 cores 42% busy in CI), so on 2 cores
# the three together take less than one after the other (the suite alone took 69-81 min on a slow
# VM; two sessions 46-57 min in CI; three 44.5-50 min, with the cores ~95% busy: a fourth would not
# help; 2026-12-07). Each session has its own share of the test nets
# (tests/cluster.py) and its own temporary folder. The two helper sessions' output is printed once
# they end; the exit status is non-zero when any failed.
#   scripts/run-tests.sh PYTHON            the three sessions at once
#   scripts/run-tests.sh PYTHON --serial   one session, every test (what a bare pytest does)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${1:?usage: scripts/run-tests.sh PYTHON [--serial]}
ARGS=(-ra --durations=40 -p no:cacheprovider)
tmp=$(mktemp -d /tmp/criuctl-tests.XXXXXX)

if [ "${2:-}" = --serial ]; then
  exec "$PY" -m pytest "${ARGS[@]}" --basetemp "$tmp/all" tests
fi

# seconds per module in CI (2026-12-07, two sessions): the cluster's modules 2280-2760 s; these
# 1510-1620 s; the rest 1710-2210 s
HEAVY=(tests/test_boundaries.py tests/test_multinode.py tests/test_containers_faults.py)
mapfile -t cluster < <(grep -l -e local_cluster -e '"image-builder"' tests/test_*.py | sort)
ignore=()
for f in "${cluster[@]}" "${HEAVY[@]}"; do ignore+=(--ignore "$f"); done

CRIUCTL_TESTS_SHARE=1/3 "$PY" -m pytest "${ARGS[@]}" --basetemp "$tmp/cluster" "${cluster[@]}" \
  >"$tmp/cluster.log" 2>&1 &
kube_pid=$!
CRIUCTL_TESTS_SHARE=2/3 "$PY" -m pytest "${ARGS[@]}" --basetemp "$tmp/heavy" "${HEAVY[@]}" \
  >"$tmp/heavy.log" 2>&1 &
heavy_pid=$!
echo "run-tests: meanwhile, ${#cluster[@]} modules on the local Kubernetes (${cluster[*]#tests/})" \
  "and ${HEAVY[*]#tests/}: printed when they end"
CRIUCTL_TESTS_SHARE=0/3 "$PY" -m pytest "${ARGS[@]}" --basetemp "$tmp/rest" tests "${ignore[@]}"
rest=$?
echo "run-tests: the other modules ended (exit $rest); waiting for the two beside them"
wait "$heavy_pid"
heavy=$?
echo "run-tests: ===================== ${HEAVY[*]#tests/} (exit $heavy) ====================="
cat "$tmp/heavy.log"
wait "$kube_pid"
kube=$?
echo "run-tests: ===================== the modules on the local Kubernetes (exit $kube) ====================="
cat "$tmp/cluster.log"
if [ "$rest" -eq 0 ] && [ "$heavy" -eq 0 ] && [ "$kube" -eq 0 ]; then
  rm -rf --one-file-system "$tmp"  # ~13 GB of jobs' files and bundles; kept when something failed
  exit 0
fi
echo "run-tests: the tests' folders are kept for a look: $tmp"
exit 1
