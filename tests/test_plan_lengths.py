"""`snowcat plan`'s time beside the FLOPs (pipeline/plan/lengths.py, core.py): episode lengths read
from what a run recorded before each stage started (never the stage's own records or a later
stage's), the upper bound for a bare config, short stages modelled from the site's start cost, and
bad input. A hand-built run directory; nothing runs a model or times anything."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from snowcat.pipeline import cli
from snowcat.pipeline import config as config_mod
from snowcat.pipeline.dag import Unit
from snowcat.pipeline.plan import core, lengths
from snowcat.pipeline.rundir import RunDir
from snowcat.stages.taskgen import demonstration, generate_domain, save_tasks
from snowcat.stages.tokenizer import train_tokenizer

SITE = """\
base: local
planner:
  charge_unit: node-hours
  mfu: 0.2
  job_start_s: 5
  decode_step_s: 0.001
  decode_token_s: 0.0001
  stage_work_s: {tasks: 2, card: 3}
  partitions:
    cpu: {charge_per_node_hour: 1, peak_tflops: 0.1, memory_gbps: 10}
    gpu: {charge_per_node_hour: 1, peak_tflops: 0.1, memory_gbps: 10}
"""

CONFIG = """\
name: plan-lengths
executor: {kind: local}
stages:
  tasks:
    kind: tasks
    domains:
      arith: {count: 40, val_count: 8, dev_count: 4, difficulties: [2]}
      closure: {count: 40, val_count: 8, dev_count: 4, difficulties: [2]}
  sft: {kind: sft, needs: [tasks], model: test-micro, steps: 10, seq_len: 64, batch_rows: 4}
  probe: {kind: probe, needs: [tasks, sft], checkpoint: "sft:final", attempts: 4, batch_size: 8, band_max_pass: 3}
  select: {kind: select, needs: [tasks, probe], max_pass: 3}
  rl:
    kind: rl
    needs: [tasks, sft, select]
    init_from: "sft:final"
    tasks_per_update: 4
    attempts: 4
    updates: 5
    eval_every: 0
    resources:
      components:
        trainer: {nodes: 1, tasks_per_node: 1}
        rollout: {nodes: 1, tasks_per_node: 1}
  eval: {kind: evaluate, needs: [tasks, sft, rl], checkpoints: ["sft:final", "sft:initial", "rl:final"], attempts: 2, pass_k: [1, 2]}
  card: {kind: card, needs: [tasks, sft, rl, eval]}
"""

TRAJECTORY_SCHEMA = pa.schema(
    [
        ("task_id", pa.string()),
        ("domain", pa.string()),
        ("prompt_len", pa.int64()),
        ("response_tokens", pa.int64()),
        ("token_ids", pa.list_(pa.int32())),
        ("turn_starts", pa.list_(pa.int64())),
    ]
)


@pytest.fixture
def files(tmp_path):
    site, cfg = tmp_path / "site.yaml", tmp_path / "run.yaml"
    site.write_text(SITE)
    cfg.write_text(CONFIG)
    return cfg, site


def typed(cfg: Path, site: Path, *overrides: str):
    return config_mod.typed(config_mod.load(cfg, list(overrides), site=str(site)))


def episodes(rows: list[tuple[str, str, int, int]]) -> pa.Table:
    """(task_id, domain, prompt tokens, response tokens) per episode, as stages/agent/dataset.py keeps them."""
    return pa.Table.from_pylist(
        [
            {
                "task_id": t,
                "domain": d,
                "prompt_len": p,
                "response_tokens": r,
                "token_ids": [1] * (p + r),
                "turn_starts": [p],
            }
            for t, d, p, r in rows
        ],
        schema=TRAJECTORY_SCHEMA,
    )


def checkpoint(stage_dir: Path, name: str, tok) -> None:
    path = stage_dir / "checkpoints" / name
    path.mkdir(parents=True)
    (path / "model_config.json").write_text("{}")
    tok.save(path)


def build_run(tmp_path: Path, cfg: Path, site: Path) -> tuple[RunDir, dict]:
    """A finished run by hand: tasks, an SFT stage's checkpoints (tokenizer only), a probe's
    episodes, select's band; RL's and evaluate's own episodes much longer than the probe's (what a
    prediction of them must not read)."""
    run = RunDir.create(config_mod.load(cfg, [], site=str(site)), tmp_path / "run")
    rng = np.random.default_rng(0)
    tasks = {d: generate_domain(rng, d, [2], 40) for d in ("arith", "closure")}
    train = tasks["arith"][:28] + tasks["closure"][:28]
    unit = {s: run.unit_dir(Unit(s, None)) for s in ("tasks", "sft", "probe", "select", "rl", "eval")}
    for d in unit.values():
        d.mkdir(parents=True, exist_ok=True)
    save_tasks(unit["tasks"], "train", train)
    save_tasks(unit["tasks"], "val", tasks["arith"][28:36] + tasks["closure"][28:36])
    save_tasks(unit["tasks"], "dev", tasks["arith"][36:] + tasks["closure"][36:])
    tok = train_tokenizer([t.prompt + " " + demonstration(t) for t in train], vocab_size=300)
    for name in ("final", "initial"):
        checkpoint(unit["sft"], name, tok)
    checkpoint(unit["rl"], "final", tok)
    band = train[:4] + train[28:32]  # 4 arith, 4 closure
    probe_rows = [(t.task_id, t.domain, 10 + i, 3 + a) for i, t in enumerate(train) for a in range(4)]
    (unit["probe"] / "trajectories").mkdir()
    pq.write_table(episodes(probe_rows), unit["probe"] / "trajectories" / "sft_final.parquet")
    pq.write_table(pa.Table.from_pylist([{"task_id": t.task_id} for t in band]), unit["select"] / "band.parquet")
    for later in ("rl", "eval"):  # 200-token responses: a plan that read them would show it
        (unit[later] / "trajectories").mkdir()
        pq.write_table(episodes([(t.task_id, t.domain, 10, 200) for t in band]), unit[later] / "trajectories" / "x.parquet")
    for s in ("tasks", "sft", "probe", "select"):
        run.mark_done(Unit(s, None), {"duration_s": 1.0})
    return run, {"train": train, "band": band, "tok": tok, "probe_rows": probe_rows}


def plan_of(run: RunDir, cfg: Path, site: Path) -> dict:
    from snowcat.pipeline.dag import build  # noqa: PLC0415
    from snowcat.pipeline.plan.compare import finished  # noqa: PLC0415

    frozen = config_mod.load(cfg, [], site=str(site))
    t = config_mod.typed(frozen)
    done = finished(run, build(frozen))
    return core.make_plan(t, inputs=lambda name: lengths.inputs_of(t, name, done))


def by_name(plan: dict) -> dict:
    return {r["name"]: r for r in plan["stages"]}


# ------------------------------------------------------------------------------ arithmetic


def test_expected_max_and_the_longest_of_a_tasks_attempts():
    assert lengths.expected_max([([1, 2], 2)]) == pytest.approx(1.75)  # P(max = 1) = 1/4
    assert lengths.expected_max([([5], 3), ([1, 9], 1)]) == pytest.approx(7.0)  # half the time 9, else 5
    assert lengths.longest_of((3, 7, 4), 3) == 7  # as many seen as drawn: the largest seen
    assert lengths.longest_of((3, 7), 1) == pytest.approx(5.0)


def test_waves_pad_each_to_its_longest_prompt_and_run_to_its_longest_response():
    a = lengths.TaskLengths("a", 10, (2,), (12,))
    b = lengths.TaskLengths("b", 30, (8,), (38,))
    waves = lengths.ordered_waves(lengths.Lengths((a, a, b, b), 1.0, "test"), attempts=2, batch=4)
    assert waves.count == 2 and waves.sequences == 8
    assert waves.prefill_tokens == 4 * 10 + 4 * 30 and waves.steps == 2 + 8 and waves.sampled == 4 * 2 + 4 * 8
    at = lengths.ordered_waves(lengths.upper_bound(5, 20, 6, 1, "test"), attempts=2, batch=4)  # every sequence at the limits
    assert (at.count, at.steps, at.sampled, at.prefill_tokens) == (3, 18, 60, 200)
    pool = lengths.Lengths((a, b), 1.0, "test")
    assert lengths.padded_length(pool, tasks=2, attempts=1) == pytest.approx(0.25 * 12 + 0.75 * 38)


# ------------------------------------------------------------------------------ a plan of a config


def test_a_plan_of_a_config_counts_episodes_at_their_limits(files):
    cfg, site = files
    plan = core.make_plan(typed(cfg, site))
    stages = by_name(plan)
    for name in ("probe", "rl", "eval"):
        assert all(item["upper_bound"] for item in stages[name]["lengths"]), name
        assert any("upper bound" in n and "nothing has run" in n for n in stages[name]["notes"]), name
    rl = stages["rl"]
    assert rl["update"]["padded_tokens_per_row"] == 256  # max_total_tokens
    assert "upper bound" in plan["total"]["lengths"]


def test_short_stages_are_modelled_from_the_start_cost_not_their_walltime(files):
    cfg, site = files
    t = typed(cfg, site, "stages.select.resources.time_min=600")
    t.site = dataclasses.replace(t.site, planner=dataclasses.replace(t.site.planner, stage_work_s={"tasks": 2, "card": 3}))
    stages = by_name(core.make_plan(t))
    assert stages["tasks"]["hours_basis"] == "model"
    assert stages["tasks"]["hours"] == pytest.approx((5 + 2) / 3600)  # job_start_s + stage_work_s.tasks
    assert stages["card"]["hours"] == pytest.approx((5 + 3) / 3600)
    assert stages["select"]["hours"] == pytest.approx(5 / 3600)  # no stage_work_s.select: the start alone, said so
    assert any("stage_work_s.select" in n for n in stages["select"]["notes"])
    assert stages["select"]["jobs"]["walltime_min"] == 60  # the walltime still bounds a job (capped by the partition)
    sft = stages["sft"]
    assert sft["hours"] * 3600 == pytest.approx(
        sft["steps"] * sft["step_s"] + sft["checkpoints"]["count"] * sft["checkpoints"]["each_s"] + 5
    )


def test_validate_keeps_its_walltime(files):
    cfg, site = files
    t = typed(cfg, site)
    t.stages["tasks"].kind = "validate"  # a kind whose work (every imported task's verifier) is not modelled
    rec = core.plan_stage(t, "tasks", {})
    assert rec["hours_basis"] == "walltime" and "not modelled" in rec["notes"][0]


# ------------------------------------------------------------------------------ a run that has started


def test_rl_lengths_come_from_the_probe_on_the_band_never_from_rl_or_later(files, tmp_path):
    cfg, site = files
    run, made = build_run(tmp_path, cfg, site)
    rl = by_name(plan_of(run, cfg, site))["rl"]
    (item,) = rl["lengths"]
    band = {t.task_id for t in made["band"]}
    rows = [r for r in made["probe_rows"] if r[0] in band]
    assert not item["upper_bound"] and item["tasks"] == len(band)
    assert item["prompt_mean"] == pytest.approx(np.mean([p for _, _, p, _ in rows[::4]]))
    assert item["response_mean"] == pytest.approx(np.mean([r for *_, r in rows]))
    assert "stage probe" in item["source"] and "select kept" in item["source"]
    # rows padded to the batch's longest episode: a prompt of at most 41 tokens + 6 sampled
    assert 12 < rl["update"]["padded_tokens_per_row"] <= 41 + 6
    # RL's own episodes (200 tokens each) and evaluate's are not among its inputs
    inputs = lengths.inputs_of(typed(cfg, site), "rl", lambda s: run.unit_dir(Unit(s, None)))
    assert set(inputs.dirs) == {"tasks", "sft", "select", "probe"}


def test_a_later_stage_finishing_changes_no_earlier_prediction(files, tmp_path):
    cfg, site = files
    run, _ = build_run(tmp_path, cfg, site)
    before = by_name(plan_of(run, cfg, site))
    for s in ("rl", "eval"):
        run.mark_done(Unit(s, None), {"duration_s": 1.0})
    after = by_name(plan_of(run, cfg, site))
    for s in ("probe", "rl"):
        assert after[s]["hours"] == before[s]["hours"] and after[s]["lengths"] == before[s]["lengths"], s
    # evaluate now reads rl's checkpoint tokenizer, but its responses still come from the probe
    assert all("stage probe" in item["source"] for item in after["eval"]["lengths"] if not item["upper_bound"])


def test_probe_lengths_come_from_the_tasks_and_the_demonstrations(files, tmp_path):
    cfg, site = files
    run, made = build_run(tmp_path, cfg, site)
    probe = by_name(plan_of(run, cfg, site))["probe"]
    (item,) = probe["lengths"]
    tok, train = made["tok"], made["train"]
    prompts = [len(tok.render_prompt(t.messages(with_answer=False))) for t in train]
    demos = [len(tok.encode(demonstration(t))) + 1 for t in train]
    assert item["prompt_mean"] == pytest.approx(np.mean(prompts), abs=0.01)
    assert item["response_mean"] == pytest.approx(np.mean(demos), abs=0.01)
    assert "demonstrations" in item["source"] and not item["upper_bound"]


def test_evaluate_reads_the_probe_per_domain_and_a_fresh_init_writes_to_the_limit(files, tmp_path):
    cfg, site = files
    run, made = build_run(tmp_path, cfg, site)
    run.mark_done(Unit("rl", None), {"duration_s": 1.0})
    items = {item["for"]: item for item in by_name(plan_of(run, cfg, site))["eval"]["lengths"]}
    probe_mean = np.mean([r for *_, r in made["probe_rows"]])
    assert items["sft:final"]["response_mean"] == pytest.approx(probe_mean)  # both domains sampled alike here
    assert items["rl:final"]["response_mean"] == pytest.approx(probe_mean)  # not rl's 200-token episodes
    assert items["sft:initial"]["upper_bound"] and items["sft:initial"]["response_mean"] == 48
    assert "fresh initialisation" in items["sft:initial"]["source"]


def test_compare_says_where_each_stages_lengths_came_from(files, tmp_path, capsys):
    cfg, site = files
    run, _ = build_run(tmp_path, cfg, site)
    assert cli.main(["plan", "--compare", str(run.path), "--site", str(site), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {r["stage"]: r for r in result["stages"]}
    (updates,) = rows["rl"]["lengths"]
    assert "stage probe" in updates["source"] and updates["plan"]["response_mean"] == pytest.approx(4.5)
    assert updates["measured"] is None  # RL kept no step_* episodes here: nothing sampled to put beside it
    assert rows["tasks"]["plan_basis"] == "model" and "total" in result


def test_a_trajectories_file_without_the_columns_is_refused_naming_it(files, tmp_path, capsys):
    cfg, site = files
    run, _ = build_run(tmp_path, cfg, site)
    bad = run.unit_dir(Unit("probe", None)) / "trajectories" / "sft_final.parquet"
    pq.write_table(pa.table({"task_id": ["a"], "domain": ["arith"]}), bad)
    assert cli.main(["plan", "--compare", str(run.path), "--site", str(site)]) == 2
    err = capsys.readouterr().err.strip()
    assert str(bad) in err and "prompt_len" in err and len(err.splitlines()) == 1


def test_missing_inputs_fall_back_to_the_upper_bound_with_a_note(files, tmp_path):
    cfg, site = files
    run, _ = build_run(tmp_path, cfg, site)
    (run.unit_dir(Unit("select", None)) / "DONE").unlink()  # select not done: RL has no band to read
    (run.unit_dir(Unit("probe", None)) / "DONE").unlink()
    rl = by_name(plan_of(run, cfg, site))["rl"]
    assert rl["lengths"][0]["upper_bound"] and "no finished probe" in rl["lengths"][0]["source"]
