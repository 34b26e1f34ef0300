#!/usr/bin/env bash
# The suite as `make test` runs it: two pytest sessions side by side. One runs the modules on the
# local Kubernetes (they share one cluster, up once for the session: tests/conftest.py's
# `local_cluster`) and the image builds; the other runs everything else meanwhile. A cluster test
# is mostly waiting for kubelets and controllers, so on 2 cores the two together take little more
# than the longer one (the suite alone took 69-81 min on a slow VM). Each session has its own share
# of the test nets (tests/cluster.py) and its own temporary folder. The cluster session's output is
# printed once it ends; the exit status is non-zero when either failed.
#   scripts/run-tests.sh PYTHON            both sessions at once
#   scripts/run-tests.sh PYTHON --serial   one session, every test (what a bare pytest does)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${1:?usage: scripts/run-tests.sh PYTHON [--serial]}
ARGS=(-ra --durations=25 -p no:cacheprovider)
tmp=$(mktemp -d /tmp/criuctl-tests.XXXXXX)

if [ "${2:-}" = --serial ]; then
  exec "$PY" -m pytest "${ARGS[@]}" --basetemp "$tmp/all" tests
fi

mapfile -t cluster < <(grep -l -e local_cluster -e '"image-builder"' tests/test_*.py | sort)
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
rm -f "$tmp/cluster.log"  # the sessions' folders stay, as pytest leaves its own
[ "$rest" -eq 0 ] && [ "$kube" -eq 0 ]
