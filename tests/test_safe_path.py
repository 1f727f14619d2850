"""The checkout never shadows an installed package: snowcat's top-level folders (`kernels`,
`pipeline`, `stages`, ...) are importable as such from the checkout root, and Hugging Face's real
`kernels` package (a dependency of recent transformers, installed with the test extras) must win in
every Python snowcat starts there."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from snowcat.pipeline.config import load
from snowcat.pipeline.dag import Unit, build
from snowcat.pipeline.executors.local import LocalExecutor
from snowcat.pipeline.rundir import RunDir
from snowcat.stages.model.tiny_hf import tiny_checkpoint
from tests.conftest import REPO, Snowcat

PROBE = "import kernels, transformers; print(kernels.__file__)"


def test_the_checkout_shadows_kernels_for_a_plain_python_there():
    """What the bug was: a plain `python` started in the checkout imports snowcat's folder."""
    plain = subprocess.run(
        [sys.executable, "-c", "import kernels; print(kernels.__file__)"], cwd=REPO, capture_output=True, text=True
    )
    assert plain.stdout.strip() == str(REPO / "kernels" / "__init__.py")


def test_stage_processes_started_from_the_checkout_import_the_installed_kernels(tmp_path):
    # the interpreter and flags the local executor starts a stage with, running the probe instead
    cfg = tmp_path / "c.yaml"
    cfg.write_text("name: probe\nstages:\n  tasks: {kind: tasks}\n")
    config = load(cfg)
    executor = LocalExecutor(RunDir.create(config, tmp_path / "run"), build(config), config)
    cmd = executor.command(Unit("tasks"))
    interpreter = cmd[: cmd.index("-m")]
    assert interpreter == [sys.executable, "-P"]
    out = subprocess.run([*interpreter, "-c", PROBE], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    assert "site-packages" in out and out != str(REPO / "kernels" / "__init__.py"), out


@pytest.mark.slow
def test_an_hf_moe_exports_from_the_checkout_root_with_kernels_installed(tmp_path):
    """The export stage, started by `snowcat run` from the checkout root, loads a Hugging Face MoE
    checkpoint with snowcat and with transformers (its own -P process) and proves them equal."""
    tiny_checkpoint(tmp_path / "model", ["What is 12+30?", "42", "hello world"])
    config = tmp_path / "export.yaml"
    config.write_text(
        "name: shadow\nstages:\n  export:\n    kind: export\n"
        f"    checkpoint: 'hf:{tmp_path / 'model'}'\n    max_new_tokens: 4\n    probe_prompts: [hello]\n"
    )
    Snowcat(REPO)("run", config, "--run-dir", tmp_path / "run", check=True, timeout=600)
    record = json.loads((tmp_path / "run" / "stages" / "export" / "export.json").read_text())
    assert record["equivalence"]["logits_match"] and record["format"]["architecture"] == "Qwen3MoeForCausalLM"
