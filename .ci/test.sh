#!/usr/bin/env bash
# Set up, lint, and run the suite in its tiers, each phase timed: the unit tier (pyproject's default
# selection), then the cluster and slow tiers together, checked against their time budget
# (tests/durations.json). The local Slurm cluster is started by the first test that needs it and
# stopped by the last; at the end, a table of phase times and the 25 slowest tests, and a check that
# the run left no process, port or temp directory behind (.ci/leftovers.py). Extra arguments go to
# both pytest runs.
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
  [ -x .venv/bin/python ] && .venv/bin/python -m snowcat.slurm.cluster down >/dev/null 2>&1
  python3 .ci/report.py "$phases" "$ci_tmp"/.timings-*.json
  local state
  state="$(cat "$ci_tmp/.before.json")"
  rm -rf "$ci_tmp"
  python3 .ci/leftovers.py check - <<<"$state" || { [ "$rc" -eq 0 ] && rc=1; }
  exit "$rc"
}
trap finish EXIT

phase() {  # phase NAME COMMAND...: run it, record its wall seconds
  local name=$1 start=$SECONDS rc=0
  shift
  "$@" || rc=$?
  echo "$name $((SECONDS - start))" >>"$phases"
  return "$rc"
}

phase set-up bash .ci/setup.sh
. .venv/bin/activate
export OMP_WAIT_POLICY=PASSIVE  # spinning OpenMP threads slow everything down when processes share 2 cores

# Style and layering first: seconds, and they name the file and line.
lint() { ruff check . && ruff format --check . && lint-imports; }
phase lint lint

# GPU tests skip here. The unit tier: pyproject's default selection (two workers). The cluster and
# slow tiers together on three workers with --dist loadgroup: the cluster's tests one after another
# on one worker (tests/conftest.py groups them), waiting on the scheduler much of the time, while the
# slow CPU-bound tests keep both cores busy beside them.
# Both tiers run whatever the first gives, so one CI run shows every failure.
failed=0
phase unit python -m pytest -ra -q --timings "$ci_tmp/.timings-unit.json" "$@" || failed=1
phase cluster+slow python -m pytest -ra -q -m "(slow or cluster) and not gpu" -n 3 --dist loadgroup --budget \
  --timings "$ci_tmp/.timings-slow.json" "$@" || failed=1
exit "$failed"
