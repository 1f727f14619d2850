"""RL with vLLM rollouts end to end, through the CLI: 1 trainer + 1 rollout rank under mpirun, the
rollout rank serving each published weight version with vLLM (CPU), the trainer scoring on the
supports vLLM reports; then evaluate on vLLM, and the run passes `audit`."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import TINY, make_run, snowcat_in_repo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

CONFIG = (
    TINY.replace("name: tiny", "name: tiny-vllm")
    + """\
  rl:
    kind: rl
    needs: [tasks, sft]
    init_from: "sft:final"
    engine: vllm
    tasks_per_update: 4
    attempts: 4
    updates: 4
    lag: 1
    top_k: 40              # truncated sampling: the supports travel from vLLM to the trainer
    max_tokens: 12
    max_total_tokens: 96
    eval_every: 2
    eval_tasks: 4
    save_every: 2
    threads: 1
    vllm: {check_reload_every: 2}
    resources:
      components:
        trainer: {nodes: 1, tasks_per_node: 1}
        rollout: {nodes: 1, tasks_per_node: 1}
  eval:
    kind: evaluate
    needs: [tasks, sft, rl]
    engine: vllm
    checkpoints: ["sft:final", "rl:final"]
    limit: 8
    attempts: 2
    pass_k: [1, 2]
    max_tokens: 8
    bootstrap_samples: 100
"""
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if shutil.which("mpirun") is None:
        pytest.skip("needs OpenMPI's mpirun")
    return make_run(tmp_path_factory.mktemp("rl-vllm"), CONFIG)


def test_rollouts_come_from_vllm_and_the_trainer_scores_them_on_vllms_supports(run):
    rows = [json.loads(line) for line in (run / "stages" / "rl" / "metrics_history.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "mismatch/k3_kl" in r]
    assert len(steps) == 4
    # fp32 on both sides, scored on the engine's own support: the two implementations agree
    assert all(r["mismatch/k3_kl"] < 1e-6 and r["mismatch/max_abs_dlogp"] < 1e-3 for r in steps)
    assert all(r["mismatch/support_rebuilt_frac"] == 0.0 for r in steps)
    assert all(r["alarm/mismatch_kl"] == 0.0 for r in steps)
    # versions 0..3 served: every load went through the engine and was counted, the first checked
    last = steps[-1]
    assert last["engine/reloads"] + last["engine/rebuilds"] - last["engine/reload_checks"] >= 1
    assert last["engine/reload_checks"] >= 1
    metrics = json.loads((run / "stages" / "rl" / "metrics.json").read_text())
    assert metrics["trainer_imported_vllm"] is False  # the trainer rank never imported vLLM


def test_evaluate_on_vllm_and_the_run_passes_audit(run):
    evaluation = json.loads((run / "stages" / "eval" / "metrics.json").read_text())
    for ref in ("sft:final", "rl:final"):
        assert evaluation[f"{ref}/infra_rate"] == 0.0  # every episode was sampled and verified
        assert 0.0 <= evaluation[f"{ref}/all/pass@1"] <= 1.0
    proc = snowcat_in_repo("audit", run)
    assert proc.returncode == 0, proc.stdout + proc.stderr
