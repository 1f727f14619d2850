"""`snowcat bench demo` times each run it makes, whole, and says so against the goal on its last line."""

from __future__ import annotations

import json

import pytest

from snowcat.benchmarks import demo

CONFIG = """\
name: bench-demo-test
seed: 1
executor: {kind: local, max_parallel: 1}
stages:
  tasks:
    kind: tasks
    domains:
      arith: {count: 40, val_count: 8, dev_count: 4, difficulties: [2]}
"""


@pytest.mark.slow
def test_each_run_is_timed_whole_and_a_reused_run_is_not(tmp_path, capsys):
    cfg = tmp_path / "bench.yaml"
    cfg.write_text(CONFIG)
    out, root = tmp_path / "results.json", tmp_path / "runs"
    args = ["--config", str(cfg), "--seeds", "2", "--first-seed", "5", "--root", str(root), "--json", str(out)]
    assert demo.main([*args, "--reference-steps", "1"]) == 0
    results = json.loads(out.read_text())
    assert results["seeds"] == [5, 6] and results["revision"]["commit"]
    for rows in results["per_seed"].values():
        # the whole `snowcat run`: its stages' own times and the process starts around them
        assert rows["wall_s"] > rows["duration_s/total"] > 0
        assert rows["load_before"] >= 0 and rows["load_after"] >= 0
        assert 0 < rows["reference_step_s"] < rows["wall_s"]  # the VM's speed just before, timed apart
    last = capsys.readouterr().out.strip().splitlines()[-1]
    worst = max(rows["wall_s"] for rows in results["per_seed"].values())
    assert last == f"demo wall-clock: max {worst:.0f} s over 2 runs, {worst / demo.GOAL_S:.2f}x the {demo.GOAL_S} s goal"

    assert demo.main(args) == 0  # finished runs are reused: nothing was timed
    again = json.loads(out.read_text())
    assert all("wall_s" not in rows and "reference_step_s" not in rows for rows in again["per_seed"].values())
    assert "demo wall-clock" not in capsys.readouterr().out


def test_each_gate_is_judged_per_seed_and_a_missing_value_fails_it():
    gates = demo.GATES["demo"]
    per_seed = {
        1: {"sft/val_greedy_pass@1/closure": 0.90, "sft/val_greedy_pass@1/arith": 0.55, demo.RL_Z: 3.2},
        2: {"sft/val_greedy_pass@1/closure": 0.84, "sft/val_greedy_pass@1/arith": 0.70, demo.RL_Z: 3.0},
        3: {"sft/val_greedy_pass@1/closure": 0.85},
    }
    verdicts = {v["key"]: v["held"] for v in demo.judge(gates, per_seed)}
    assert verdicts["sft/val_greedy_pass@1/closure"] == {1: True, 2: False, 3: True}  # >= holds at the threshold
    assert verdicts["sft/val_greedy_pass@1/arith"] == {1: True, 2: True, 3: False}
    assert verdicts[demo.RL_Z] == {1: True, 2: False, 3: False}  # > 3: exactly 3 SE is not above it


def test_the_rl_gain_in_standard_errors_is_collected_from_the_evaluation(tmp_path):
    stage = tmp_path / "stages" / "eval"
    stage.mkdir(parents=True)
    comparison = {"all": {"pass@1": {"diff": 0.03, "se": 0.01}}}
    (stage / "results.json").write_text(json.dumps({"checkpoints": {}, "comparisons": {"rl:final - sft:final": comparison}}))
    rows = demo.collect(tmp_path)
    assert rows[demo.RL_Z] == pytest.approx(3.0)
