#!/usr/bin/env bash
# The GPU acceptance run: one script, one GPU (sized for one H200, under 8 minutes), one JSON.
#
#   benchmarks/gpu/run.sh [--json FILE] [--only SECTIONS] [--dry-run]
#
# Runs benchmarks/gpu/acceptance.py (its docstring says what each section measures) with the python
# in $PYTHON (default python3): the fused logprob kernel against Liger and torch.compile, vLLM's
# processed logprobs against the trainer's in bf16, in-place reload against a fresh engine, router
# replay through vLLM's routed experts. snowcat need not be installed: the checkout is put on the
# path as the `snowcat` package (a link in a temporary folder, so the checkout's own folders never
# shadow installed packages). The JSON goes to benchmarks/results/gpu-acceptance.json unless --json
# says otherwise; the last line printed is the verdict. --dry-run: on a CPU, imports, shapes, schema.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
python=${PYTHON:-python3}
args=("$@")
[[ " ${args[*]} " == *" --json "* ]] || args+=(--json "$repo/benchmarks/results/gpu-acceptance.json")
if ! "$python" -c "import snowcat" 2>/dev/null; then
  link=$(mktemp -d)
  trap 'rm -rf "$link"' EXIT
  ln -s "$repo" "$link/snowcat"
  export PYTHONPATH="$link${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 TOKENIZERS_PARALLELISM=false
timeout --signal=TERM --kill-after=20 470 "$python" "$repo/benchmarks/gpu/acceptance.py" "${args[@]}"
