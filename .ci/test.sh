#!/usr/bin/env bash
# Set up, lint, and run the suite in its tiers, each phase timed: the cluster tier in the background
# from the start (its tests wait on the scheduler much of the time), the unit tier (pyproject's
# default selection) beside it, then the slow tier; the cluster and slow tiers are checked against
# their time budget (tests/durations.json). The local Slurm cluster is started by the first test
# that needs it and stopped by the last; at the end, a table of phase times and the 25 slowest
# tests, and a check that the run left no process, port or temp directory behind
# (.ci/leftovers.py). Extra arguments go to every pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."

# Every process of this run inherits the nonce (leftovers.py finds them by it), and all temp files go
# to one directory removed at the end.
SNOWCAT_CI_NONCE="$(date +%s%N)-$$"
export SNOWCAT_CI_NONCE
ci_tmp="$(mktemp -d /tmp/ci.XXXXXX)"  # short: paths under it are printed by tests
python3 .ci/leftovers.py snapshot "$ci_tmp/.before.json"
export TMPDIR="$ci_tmp"
phases="$ci_tmp/.phases"
: >"$phases"

finish() {
  local rc=$?
  set +e
  if [ -n "${cluster_pid:-}" ] && kill -0 "$cluster_pid" 2>/dev/null; then  # ended early: stop the cluster tier too
    pkill -TERM -f -- "--timings $ci_tmp/.timings-cluster.json"
    wait "$cluster_pid"
  fi
  [ -x .venv/bin/python ] && .venv/bin/python -m snowcat.slurm.cluster down >/dev/null 2>&1
  python3 .ci/report.py "$phases" "$ci_tmp"/.timings-*.json
  local state
  state="$(cat "$ci_tmp/.before.json")"
  rm -rf "$ci_tmp"
  python3 .ci/leftovers.py check - <<<"$state" || { [ "$rc" -eq 0 ] && rc=1; }
  exit "$rc"
}
trap finish EXIT

phase() {  # phase NAME COMMAND...: run it, record when it started and ended (seconds into the run)
  local name=$1 start=$SECONDS rc=0
  shift
  "$@" || rc=$?
  echo "$name $start $SECONDS" >>"$phases"
  return "$rc"
}

phase set-up bash .ci/setup.sh
. .venv/bin/activate
export OMP_WAIT_POLICY=PASSIVE  # spinning OpenMP threads slow everything down when processes share 2 cores

# Style and layering first: seconds, and they name the file and line.
lint() { ruff check . && ruff format --check . && lint-imports; }
phase lint lint

# GPU tests skip here; the fresh-machine tests (`fresh`, minutes of installs) are the full tier's,
# .ci/full.sh. The cluster tier's tests run one after another (they share the cluster) in a pytest of
# their own, started first, in the background: waiting on the scheduler much of the time, it runs
# beside the unit tier (pyproject's default selection, two workers) and then beside the slow tier (two
# workers, --dist loadgroup: a shared run's tests on one worker; the longest blocks first, by
# tests/durations.json), which keep both cores busy: CI's time is its CPU work over the 2 cores. Every
# tier runs whatever another gives, so one CI run shows every failure.
failed=0
phase cluster python -m pytest -ra -q -m "cluster and not gpu and not fresh" -n 0 --budget --timings "$ci_tmp/.timings-cluster.json" "$@" \
  >"$ci_tmp/.cluster.log" 2>&1 &
cluster_pid=$!
phase unit python -m pytest -ra -q --timings "$ci_tmp/.timings-unit.json" "$@" || failed=1
phase slow python -m pytest -ra -q -m "slow and not cluster and not gpu and not fresh" -n 2 --dist loadgroup --budget \
  --timings "$ci_tmp/.timings-slow.json" "$@" || failed=1
wait "$cluster_pid" || failed=1
echo "== the cluster tier (it ran in the background) =="
cat "$ci_tmp/.cluster.log"
exit "$failed"
