"""The SFT and RL stages on trainer.backend megatron, run as a user runs them (`snowcat run`, the local
executor): one rank each, then SFT under tensor x expert parallelism (TP2 x EP2, four ranks) and RL
under pipeline parallelism (two trainer ranks beside the rollout rank). The layouts must train as
one rank does: the data is split over data-parallel ranks only, and a replica's numbers are
counted once."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

CONFIG = """
name: megatron-stages
seed: 7
executor: {kind: local, max_parallel: 1}
stages:
  tasks:
    kind: tasks
    domains:
      arith: {count: 120, val_count: 10, dev_count: 10, difficulties: [2]}
  sft:
    kind: sft
    needs: [tasks]
    model: demo-tiny
    backend: megatron
    steps: 3
    batch_rows: 8
    micro_batches: 2
    seq_len: 64
    warmup_steps: 1
    eval_tasks: 2
  rl:
    kind: rl
    needs: [tasks, sft]
    init_from: "sft:final"
    backend: megatron
    estimator: rloo_n
    lag: 1
    tasks_per_update: 4
    attempts: 4
    updates: 2
    lr: 5.0e-5
    warmup_steps: 1
    max_tokens: 16
    eval_every: 0
    eval_tasks: 0
    threads: 1
    resources:
      components:
        trainer: {nodes: 1, tasks_per_node: 1}
        rollout: {nodes: 1, tasks_per_node: 1}
"""


def _history(run: Path, stage: str) -> list[dict]:
    return [json.loads(line) for line in (run / "stages" / stage / "metrics_history.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sft_and_rl_stages_train_on_megatron_layouts_as_on_one_rank(snowcat, tmp_path):
    cfg = tmp_path / "megatron.yaml"
    cfg.write_text(CONFIG)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    one, split = tmp_path / "one", tmp_path / "split"
    snowcat("run", cfg, "--run-dir", one, env=env, check=True)
    layouts = (
        "stages.sft.resources.tasks_per_node=4",
        "stages.sft.tensor_parallel=2",
        "stages.sft.expert_parallel=2",
        "stages.rl.resources.components.trainer.tasks_per_node=2",
        "stages.rl.pipeline_parallel=2",
        # RL from the one-rank run's SFT model, so that both RL runs start from the same weights
        f"stages.rl.init_from=hf:{one / 'stages' / 'sft' / 'checkpoints' / 'final'}",
    )
    snowcat("run", cfg, *layouts, "--run-dir", split, env=env, check=True)

    # SFT under TP2 x EP2 on four ranks: two data-parallel replicas, each a sequence-parallel pair,
    # the experts split over the replicas. The first step sees the one-rank weights: its loss is
    # the whole batch's (each row counted once) and its gradient the same but for the router's aux
    # and z losses, which megatron takes over each replica's tokens (2e-6 of the norm here). The
    # runs then part a little (5e-4 of the loss at step 3, measured; the same model under EP2 in
    # tests/test_megatron.py parts by 2e-4 with router losses on and agrees to 1e-5 with them off).
    sft_one, sft_split = _history(one, "sft"), _history(split, "sft")
    assert [r["step"] for r in sft_split] == [1, 2, 3]
    assert sft_split[0]["loss"] == pytest.approx(sft_one[0]["loss"], rel=1e-6)
    assert sft_split[0]["grad_norm"] == pytest.approx(sft_one[0]["grad_norm"], rel=2e-5)
    assert [r["loss"] for r in sft_split] == pytest.approx([r["loss"] for r in sft_one], rel=3e-3)
    meta = json.loads((split / "stages" / "sft" / "checkpoints" / "step_000003" / "meta.json").read_text())
    assert meta["backend"] == "megatron" and meta["world_size"] == 4
    # the trained model is an ordinary model directory: the stage's own greedy check read it
    assert "val_greedy_pass@1/arith" in json.loads((split / "stages" / "sft" / "metrics.json").read_text())

    rl_one, rl_split = _history(one, "rl"), _history(split, "rl")
    assert [r["step"] for r in rl_split] == [1, 2]
    for a, b in zip(rl_one, rl_split, strict=True):
        assert b["tokens"] == a["tokens"]  # two pipeline stages, one replica: its tokens counted once
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["mismatch/k3_kl"] < 1e-6  # what the rollout engine sampled is what megatron scores
