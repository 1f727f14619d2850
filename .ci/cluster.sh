#!/usr/bin/env bash
# Start the local Slurm test cluster for CI (tests marked `cluster` use it). Installs Debian's
# packages if a program is missing, then runs `python -m snowcat.slurm.cluster up` (idempotent).
# Usage: .ci/cluster.sh [--root DIR]     Clients then need: source <root>/env.sh  (sets SLURM_CONF)
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
for prog in munged mariadbd slurmdbd slurmctld slurmd sbatch mpirun; do
  command -v "$prog" >/dev/null 2>&1 || [ -x "/usr/sbin/$prog" ] || need+=("$prog")
done
if [ "${#need[@]}" -gt 0 ]; then
  echo "cluster.sh: missing ${need[*]}; installing Debian packages" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends \
    slurm-wlm slurmdbd munge mariadb-server openmpi-bin libopenmpi-dev
fi

PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
exec "$PY" -m snowcat.slurm.cluster up "$@"
