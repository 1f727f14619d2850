#!/usr/bin/env bash
# CI's full tier: what a release or a nightly runs after .ci/run, too long for its 30 minutes. The
# tests marked `fresh` (tests/test_fresh.py), each from the checkout root:
#   - a brand-new venv from the CPU lock, made by `.ci/setup.sh DIR` as CI makes .venv; with it the
#     README's demo command to its first finished stage (then cancelled, nothing left running) and
#     configs/hf-tiny.yaml through export (its equivalence check passing);
#   - the import and export equivalence tests in a scratch venv from the same lock with the newest
#     transformers release pyproject.toml allows (it prints the versions it tested).
# Needs .venv (bash .ci/setup.sh) and the package index; temp files, the venvs included (several GB),
# go to one directory under $TMPDIR (default /tmp), removed at the end, and the run must leave no
# process, port or /tmp entry behind (.ci/leftovers.py). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  echo "[full] error: no .venv here: make it first with \`bash .ci/setup.sh\` (or run .ci/run)" >&2
  exit 2
fi

SNOWCAT_CI_NONCE="$(date +%s%N)-$$"
export SNOWCAT_CI_NONCE
ci_tmp="$(mktemp -d "${TMPDIR:-/tmp}/ci-full.XXXXXX")"
python3 .ci/leftovers.py snapshot "$ci_tmp/.before.json"
export TMPDIR="$ci_tmp"
start=$SECONDS

finish() {
  local rc=$?
  set +e
  echo "[full] the fresh tier took $(((SECONDS - start) / 60)) min $(((SECONDS - start) % 60)) s"
  local state
  state="$(cat "$ci_tmp/.before.json")"
  rm -rf "$ci_tmp"
  python3 .ci/leftovers.py check - <<<"$state" || { [ "$rc" -eq 0 ] && rc=1; }
  exit "$rc"
}
trap finish EXIT

export OMP_WAIT_POLICY=PASSIVE  # as in .ci/test.sh: processes share the cores
# One process: the tests install and run in turn, and -rP shows what the equivalence check tested.
.venv/bin/python -m pytest -ra -rP -q -m fresh -n 0 --durations 0 "$@"
