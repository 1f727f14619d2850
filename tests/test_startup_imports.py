"""What a stage process that never trains imports (rollout ranks, evaluate, teacher, export): torch,
not torch's FSDP2/DTensor or TorchDynamo, which cost about 1 s of CPU at every start of such a
process (stages/train/backend.py imports FSDP where a backend shards; a model built on the meta
device to load weights into initialises nothing)."""

from __future__ import annotations

import subprocess
import sys

import torch

from snowcat.stages.model import PRESETS, MoEForCausalLM, save_model_dir
from tests.conftest import REPO

TRAINING_ONLY = ("torch.distributed.fsdp", "torch.distributed.tensor", "torch._dynamo")


def test_loading_a_model_to_sample_from_imports_no_training_machinery(tmp_path):
    torch.manual_seed(0)
    save_model_dir(tmp_path / "model", MoEForCausalLM(PRESETS["test-micro"]))
    code = (
        "import sys\n"
        "import snowcat.stages.rl, snowcat.stages.evaluate\n"
        "from snowcat.stages.model import load_model_dir\n"
        f"model, cfg, _ = load_model_dir({str(tmp_path / 'model')!r})\n"
        "assert model.model.inv_freq.device.type == 'cpu' and not any(p.is_meta for p in model.parameters())\n"
        f"print(sorted(m for m in {TRAINING_ONLY!r} if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_a_training_stage_imports_no_plotting_library():
    # the curves are drawn by `snowcat plot` and the card, not by every training process (pyplot: a
    # second or more of CPU at start-up on a loaded node)
    code = (
        "import sys, snowcat.stages.sft, snowcat.stages.rl\nprint(sorted(m for m in sys.modules if m.startswith('matplotlib')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
