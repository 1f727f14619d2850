"""Records stay reproducible: a small run that keeps trajectories (evaluate, single-turn and through the
agent loop), run twice from the same config, gives byte-identical hashed outputs (the shards, their
card and the behaviour records beside them); its timings are metrics and the agent loop's
per-episode seconds (JSON Lines beside the records), named with a time unit: the only fields
`snowcat reproduce` leaves out.

The run is made in this process through the real stage runner (seconds, not the minutes of the
shared CLI runs in tests/test_reproduce.py, which cover the subprocess and code-restoring side)."""

from __future__ import annotations

from pathlib import Path

import pytest

from snowcat.pipeline import config
from snowcat.pipeline.dag import Unit
from snowcat.pipeline.fsio import read_json
from snowcat.pipeline.reproduce import compare_runs
from snowcat.pipeline.rundir import RunDir
from snowcat.pipeline.runner import run_unit
from snowcat.pipeline.volatile import strip_volatile
from snowcat.stages.agent import behaviour_records
from snowcat.stages.agent.dataset import CARD, DIRNAME, read_manifest

CONFIG = """\
name: records
seed: 3
executor: {kind: local, max_parallel: 1}
stages:
  tasks:
    kind: tasks
    domains:
      arith: {count: 8, val_count: 3, difficulties: [2]}
  sft:
    kind: sft
    needs: [tasks]
    model: test-micro
    tokenizer_vocab_size: 300
    seq_len: 48
    batch_rows: 2
    steps: 1
    warmup_steps: 0
    save_every: 1
    threads: 1
    eval_tasks: 1
    eval_max_new_tokens: 2
  eval:
    kind: evaluate
    needs: [tasks, sft]
    checkpoints: ["sft:initial", "sft:final"]
    attempts: 2
    pass_k: [1]
    max_tokens: 4
    bootstrap_samples: 10
  eval_calc:
    kind: evaluate
    needs: [tasks, sft]
    checkpoints: ["sft:final"]
    env: calculator
    max_turns: 2
    attempts: 1
    pass_k: [1]
    max_tokens: 4
    bootstrap_samples: 10
"""
STAGES = ("tasks", "sft", "eval", "eval_calc")
EVALS = ("eval", "eval_calc")


def made(root: Path, name: str) -> RunDir:
    """The config run stage by stage into root/name (a run id that is no substring of the other's:
    the comparison replaces each run's id in paths)."""
    (root / "run.yaml").write_text(CONFIG)
    run = RunDir.create(config.load(root / "run.yaml"), root / name)
    for stage in STAGES:
        assert run_unit(run.path, stage) == 0, stage
    return run


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("records")
    original, again = made(root, "original"), made(root, "again")
    return original, compare_runs(original, again)


def test_a_run_with_trajectories_reproduces_identically(report):
    _, rep = report
    assert rep["ok"], {k: s["problems"] for k, s in rep["stages"].items() if s["problems"]}
    for stage in EVALS:
        s = rep["stages"][stage]
        # the dataset card, the shards and the records are equal byte for byte (only JSON may be compared narrowed)
        assert all(rel.endswith((".json", ".timing.jsonl")) for rel in s["files_equal_narrowed"])
        # only timings were left out: from the metrics, and the agent loop's per-episode seconds
        timed = {"metrics.json"} | ({f"{behaviour_records.DIRNAME}/sft_final.timing.jsonl"} if stage == "eval_calc" else set())
        assert set(s["excluded_fields"]) == timed, s["excluded_fields"]
        assert all(why.startswith("a duration") for f in timed for why in s["excluded_fields"][f].values())


def test_the_card_holds_nothing_volatile_and_the_timings_are_metrics(report):
    original, _ = report
    for stage in EVALS:
        kept = original.unit_dir(Unit(stage)) / DIRNAME
        manifest = read_manifest(kept)
        assert manifest["shards"] and strip_volatile(manifest)[1] == {}
        hashed = read_json(original.unit_dir(Unit(stage)) / "manifest.json")["files"]
        assert f"{DIRNAME}/{CARD}" in hashed and f"{DIRNAME}/sft_final.parquet" in hashed
        # the behaviour records beside the shards are hashed too (and equal in the reproduction above)
        assert f"{behaviour_records.DIRNAME}/sft_final.parquet" in hashed
        metrics = original.metrics(Unit(stage))
        refs = original.config().stages[stage].checkpoints
        assert {f"{ref}/sample_s" for ref in refs} <= set(metrics)
        assert all(metrics[f"{ref}/sample_s"] >= 0 for ref in refs)


def test_episodes_the_agent_loop_played_have_their_seconds_beside_their_records(report):
    original, _ = report
    single = original.unit_dir(Unit("eval")) / behaviour_records.DIRNAME
    assert not list(single.glob("*.timing.jsonl"))  # single-turn attempts are not played by the loop
    records = original.unit_dir(Unit("eval_calc")) / behaviour_records.DIRNAME / "sft_final.parquet"
    rows, _ = behaviour_records.read_records(records)
    timings = behaviour_records.read_timings(records)
    assert list(timings) == [r["id"] for r in rows]  # one line per record, in the records' order
    for t in timings.values():
        assert set(t) == {"id", "wall_s", "generate_s", "env_s"}
        # the episode's own parts lie within its wall time (one batch: generate calls and its tool calls)
        assert 0 < t["generate_s"] <= t["wall_s"] and 0 <= t["env_s"] <= t["wall_s"]
