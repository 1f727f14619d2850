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
python -m pytest -ra "$@"
