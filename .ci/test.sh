#!/usr/bin/env bash
# Set up, start the local Slurm test cluster, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/setup.sh
. .venv/bin/activate
if [ -f .ci/cluster.sh ]; then
  bash .ci/cluster.sh
  # shellcheck disable=SC1091
  [ -f .cluster/env.sh ] && . .cluster/env.sh
fi
export OMP_WAIT_POLICY=PASSIVE  # spinning OpenMP threads slow everything down when processes share 2 cores
# Style and layering first: seconds, and they name the file and line.
ruff check .
ruff format --check .
lint-imports
# The whole suite (pyproject's default selection is the developer's quick loop); GPU tests skip here.
# Two workers: the Slurm cluster's tests (one after another, tests/conftest.py groups them) wait on the
# scheduler much of the time, so the CPU-bound tests run beside them.
python -m pytest -ra --durations=25 -m "not gpu" -n 2 --dist loadgroup "$@"
