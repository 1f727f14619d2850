"""`snowcat plan`'s agent, engine and backend terms (pipeline/plan/agent.py, core.py), the teacher
stage, imported task counts, and `plan --compare` reading sacct's allocation (against the TEST
DOUBLE scheduler of tests/fake_slurm). Each term must move the plan the way, and by the amount, its
physics says. Torch-free: nothing runs a model."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from snowcat.pipeline import config as config_mod
from snowcat.pipeline.plan import agent, calibrate, compare, core, lengths, report
from snowcat.stages.registry import KINDS

FAKE = Path(__file__).parent / "fake_slurm"
_spec = importlib.util.spec_from_file_location("fake_slurm", FAKE / "fake_slurm.py")
fake = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake)

SITE = """\
base: local
planner:
  mfu: 0.2
  job_start_s: 5
  decode_step_s: 0.01
  engine_start_s: 20
  engine_reload_s: 8
  sandbox_call_s: 0.5
  verify_s: 1.5
  tool_call_s: 0.01
  sandbox_start_s: 0.1
  tool_workers: 4
  partitions:
    cpu: {charge_per_node_hour: 1, peak_tflops: 0.1, memory_gbps: 10}
    gpu: {charge_per_node_hour: 1, peak_tflops: 0.1, memory_gbps: 10}
"""

CONFIG = """\
name: plan-agent
executor: {kind: local}
stages:
  tasks:
    kind: tasks
    domains:
      swe_mini: {count: 40, val_count: 8, difficulties: [1]}
  sft: {kind: sft, needs: [tasks], model: test-micro, steps: 10, seq_len: 64, batch_rows: 4}
  teacher:
    kind: teacher
    needs: [tasks, sft]
    teacher: "sft:final"
    env: repo
    engine: torch
    limit: 32
    attempts: 2
    max_turns: 6
    max_turn_tokens: 16
    max_context: 512
    batch_size: 16
  rl:
    kind: rl
    needs: [tasks, sft]
    init_from: "sft:final"
    env: repo
    engine: torch
    tasks_per_update: 4
    attempts: 2
    updates: 4
    lag: 1
    max_tokens: 16
    max_turns: 6
    max_total_tokens: 512
    rollout_batch: 8
    eval_every: 0
    resources:
      components:
        trainer: {nodes: 1, tasks_per_node: 1}
        rollout: {nodes: 1, tasks_per_node: 1}
  eval:
    kind: evaluate
    needs: [tasks, sft, rl]
    checkpoints: ["sft:final", "rl:final"]
    env: repo
    engine: torch
    attempts: 2
    pass_k: [1, 2]
    max_tokens: 16
    max_turns: 6
    max_context: 512
    batch_size: 16
"""


@pytest.fixture
def files(tmp_path):
    site, cfg = tmp_path / "site.yaml", tmp_path / "run.yaml"
    site.write_text(SITE)
    cfg.write_text(CONFIG)
    return cfg, site


def typed(cfg: Path, site: Path, *overrides: str):
    return config_mod.typed(config_mod.load(cfg, list(overrides), site=str(site)))


def with_planner(t, **fields):
    t.site = dataclasses.replace(t.site, planner=dataclasses.replace(t.site.planner, **fields))
    return t


def by_name(plan: dict) -> dict:
    return {r["name"]: r for r in plan["stages"]}


def profile(calls: list[list[str]], verified: list[bool], turns: int, steps: float = 0.0) -> agent.Profile:
    s, v, i = agent._per_turn(calls, verified, turns)
    return agent.Profile(s, v, i, steps, steps, "test")


# ------------------------------------------------------------------------------ the registry


def test_how_each_kind_is_planned_comes_from_the_registry():
    assert {k.plan for k in KINDS.values()} <= {"model", "short", "walltime"}
    assert set(core.MODELLED) == {n for n, k in KINDS.items() if k.plan == "model"} and "teacher" in core.MODELLED
    assert set(core.SHORT) == {n for n, k in KINDS.items() if k.plan == "short"} and "tasks" in core.SHORT
    assert KINDS["validate"].plan == "walltime"


# ------------------------------------------------------------------------------ the environment's terms


def test_a_turn_of_calls_runs_in_rounds_of_the_workers(files):
    cfg, site = files
    t = typed(cfg, site)
    one = profile([["test"]] * 8, [False] * 8, 1)  # 8 episodes, one sandboxed call each at turn 0
    assert agent.wave_env_seconds(t.site, one, wave=8, workers_=4) == pytest.approx(8 * 0.1 + 2 * 0.5)  # starts + 2 rounds
    assert agent.wave_env_seconds(t.site, one, wave=8, workers_=8) == pytest.approx(8 * 0.1 + 1 * 0.5)  # one round
    verified = profile([["test", "submit"]] * 8, [True] * 8, 2)
    extra = agent.wave_env_seconds(t.site, verified, wave=8, workers_=4) - agent.wave_env_seconds(t.site, one, wave=8, workers_=4)
    assert extra == pytest.approx(2 * 1.5)  # the verifications: 2 rounds of verify_s


def test_doubling_the_tool_calls_per_episode_adds_their_time(files):
    cfg, site = files
    t = typed(cfg, site)
    three = profile([["test", "test", "submit"]], [True], 3)
    six = profile([["test"] * 5 + ["submit"]], [True], 6)
    base = agent.env_seconds(t.site, three, episodes=32, wave=16, workers_=4)["env_s"]
    more = agent.env_seconds(t.site, six, episodes=32, wave=16, workers_=4)["env_s"]
    # 3 more sandboxed turns per episode: per wave 3 x ceil(16 / 4) rounds of sandbox_call_s, 2 waves
    assert more - base == pytest.approx(2 * 3 * 4 * 0.5)


def test_the_teacher_is_planned_from_its_config(files):
    cfg, site = files
    rec = by_name(core.make_plan(typed(cfg, site)))["teacher"]
    assert rec["hours_basis"] == "model" and rec["tasks"] == 32  # limit 32 of the 32 generated train tasks
    (env,) = rec["agent"]
    assert env["episodes"] == 64 and env["wave"] == 16 and env["profile"]["upper_bound"]
    # upper bound: every turn a sandboxed call, the last one verified too; 4 waves of 16 on 4 workers
    per_wave = 16 * 0.1 + 6 * 4 * 0.5 + 4 * 1.5
    assert env["env_s"] == pytest.approx(4 * per_wave)
    decode = rec["roles"][0]["decode"]
    assert decode["waves"] == 4 and decode["decode_steps"] == pytest.approx(4 * 6 * 16)  # max_turns x max_turn_tokens
    assert rec["engine"]["builds"] == 1
    seconds = decode["rollout_s"] + env["env_s"] + 20
    assert rec["hours"] * 3600 == pytest.approx(seconds + 5)  # + the job's start
    halves = by_name(core.make_plan(typed(cfg, site, "stages.teacher.fan_out={shard: [0, 1]}")))["teacher"]
    assert halves["tasks"] == 16 and halves["units"] == 2 and halves["agent"][0]["episodes"] == 32


def test_an_endpoint_teacher_is_planned_at_its_walltime(files):
    """Its sampling runs on the service, at a speed this site's figures do not describe."""
    cfg, site = files
    t = typed(
        cfg,
        site,
        "stages.teacher.teacher=''",
        "stages.teacher.endpoint.url=http://node1:8000/v1",
        "stages.teacher.endpoint.model=teacher",
        "stages.teacher.tokenizer=sft:final",
    )
    rec = by_name(core.make_plan(t))["teacher"]
    assert rec["hours_basis"] != "model" and any("endpoint" in n for n in rec["notes"])
    assert rec["hours"] == pytest.approx(t.stages["teacher"].resources.time_min / 60, rel=0.01)


def test_more_turns_or_dearer_calls_make_the_teacher_dearer_by_their_cost(files):
    cfg, site = files
    base = by_name(core.make_plan(typed(cfg, site)))["teacher"]
    dear = by_name(core.make_plan(with_planner(typed(cfg, site), sandbox_call_s=1.0)))["teacher"]
    # 6 sandboxed turns x 4 rounds per wave x 4 waves, each 0.5 s dearer
    assert (dear["hours"] - base["hours"]) * 3600 == pytest.approx(6 * 4 * 4 * 0.5)
    longer = by_name(core.make_plan(typed(cfg, site, "stages.teacher.max_turns=12")))["teacher"]
    assert longer["agent"][0]["env_s"] - base["agent"][0]["env_s"] == pytest.approx(4 * 6 * 4 * 0.5)


def test_evaluate_builds_one_engine_per_checkpoint(files):
    cfg, site = files
    rec = by_name(core.make_plan(typed(cfg, site)))["eval"]
    assert rec["engine"]["builds"] == 2 and rec["hours_basis"] == "model"
    seconds = rec["step_s"] + 20 + 8  # the first engine with its imports, the second a build
    assert rec["hours"] * 3600 == pytest.approx(seconds + 5)


def test_rl_rollout_counts_its_tool_calls_and_a_weight_reload_per_update(files):
    cfg, site = files
    rec = by_name(core.make_plan(typed(cfg, site)))["rl"]
    up = rec["update"]
    (env,) = rec["agent"]
    assert env["episodes"] == 8 and up["env_s"] == pytest.approx(env["env_s"])
    assert up["engine_reload_s"] == 8
    decode = rec["roles"][1]["decode"]["rollout_s"]
    assert up["rollout_s"] == pytest.approx(decode + env["env_s"] + 8)  # per batch: sampling, tools, the new weights
    no_reload = by_name(core.make_plan(with_planner(typed(cfg, site), engine_reload_s=0.0)))["rl"]
    assert no_reload["update"]["rollout_s"] == pytest.approx(up["rollout_s"] - 8)
    # 8 episodes on 4 workers: 2 rounds a turn for 5 turns, 4 at the last (tests and verifications)
    assert env["env_s"] == pytest.approx(8 * 0.1 + 5 * 2 * 0.5 + 4 * (0.5 + 1.5) / 2)


def test_a_backends_own_efficiency_replaces_the_mfu_for_its_stages(files):
    cfg, site = files
    base = by_name(core.make_plan(typed(cfg, site)))
    slow = by_name(core.make_plan(with_planner(typed(cfg, site), backend_mfu={"torch": 0.1})))
    step, slow_step = base["sft"]["roles"][0]["step"], slow["sft"]["roles"][0]["step"]
    assert slow_step["compute_s"] == pytest.approx(2 * step["compute_s"])  # half the efficiency, twice the compute
    assert "backend torch" in slow_step["assumes"]
    other = by_name(core.make_plan(with_planner(typed(cfg, site), backend_mfu={"megatron": 0.01})))
    assert other["sft"]["roles"][0]["step"]["compute_s"] == pytest.approx(step["compute_s"])  # not its backend
    bad = with_planner(typed(cfg, site), backend_mfu={"torch": 2.0})
    with pytest.raises(core.UserError, match="planner.backend_mfu.torch"):
        core.make_plan(bad)


def test_sft_counts_the_scripted_experts_demonstrations(files):
    cfg, site = files
    rec = by_name(core.make_plan(typed(cfg, site)))["sft"]
    # 32 repository train tasks, 4 workers: 8 rounds of one expert episode (start, 2 tests, view, edit, verify)
    assert rec["expert"]["env_s"] == pytest.approx(8 * (0.1 + 2 * 0.5 + 2 * 0.01 + 1.5))
    # a measured episode (its sandboxes contending for the cores) replaces the sum of its calls
    measured = by_name(core.make_plan(with_planner(typed(cfg, site), expert_episode_s=4.0)))["sft"]
    assert measured["expert"]["env_s"] == pytest.approx(8 * 4.0) and "expert episode 4 s" in measured["expert"]["assumes"]


def test_rl_adds_its_start_outside_the_updates_once(files):
    cfg, site = files
    base = by_name(core.make_plan(typed(cfg, site)))["rl"]
    started = by_name(core.make_plan(with_planner(typed(cfg, site), rl_start_s=12.0)))["rl"]
    assert (started["hours"] - base["hours"]) * 3600 == pytest.approx(12.0)  # once, not per update
    assert started["start"]["assumes"] == "rl_start_s 12 s (site local)" and started["step_s"] == base["step_s"]
    assert any("gives no rl_start_s" in n for n in base["notes"])
    assert "start and end outside the updates: 12 s [rl_start_s 12 s" in "\n".join(report.stage_lines(started, "node-hours"))


# ------------------------------------------------------------------------------ a run that has started


def _done_tasks(tmp_path: Path, t, train: int, val: int) -> lengths.Inputs:
    """A finished tasks stage of imported repository tasks: `train` and `val` rows."""
    d = tmp_path / "tasks"
    d.mkdir()
    for split, n in (("train", train), ("val", val)):
        pq.write_table(pa.table({"task_id": [f"{split}{i}" for i in range(n)], "verifier": ["repo"] * n}), d / f"{split}.parquet")
    return lengths.Inputs("x", {"tasks": d}, {"tasks": "tasks"})


def test_imported_tasks_are_counted_from_the_finished_tasks_stage(files, tmp_path):
    cfg, site = files
    t = typed(cfg, site, "stages.tasks.domains={}", "stages.tasks.imports=[{format: swebench, path: x.jsonl, repos_dir: repos}]")
    before = by_name(core.make_plan(t))
    assert before["eval"]["tasks"] == 8  # the generated val split: the import holds none out (val_count 0)
    assert before["teacher"]["tasks"] == 32 and any("limit 32 stands in" in n for n in before["teacher"]["notes"])
    assert any("scripted expert" in n for n in before["sft"]["notes"])  # not counted yet, said so
    # the import file readable here: its rows less val_count stand in before the tasks stage runs
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"instance_id": f"r{i}"}) + "\n" for i in range(30)) + "\n")  # a blank line is no row
    t_rows = typed(
        cfg,
        site,
        "stages.tasks.domains={}",
        f"stages.tasks.imports=[{{format: swebench, path: {rows}, repos_dir: repos, val_count: 5}}]",
    )
    counted = by_name(core.make_plan(t_rows))
    # 25 imported beside the config's 32 generated training tasks; the teacher plays at most its limit
    assert counted["sft"]["expert"]["tasks"] == 25 + 32 and counted["teacher"]["tasks"] == 32
    assert any("rows less val_count (57) stands in" in n for n in counted["sft"]["notes"])
    assert counted["eval"]["tasks"] == 5 + 8  # held out by count
    inputs = _done_tasks(tmp_path, t, train=20, val=6)
    after = by_name(core.make_plan(t, inputs=lambda name: inputs))
    assert after["eval"]["hours_basis"] == "model" and after["eval"]["tasks"] == 6
    assert after["teacher"]["tasks"] == 20  # fewer than its limit
    assert after["sft"]["expert"]["tasks"] == 20


def test_agent_profile_read_from_episodes_a_finished_input_played(tmp_path):
    rows = [
        {"tool_names": ["test", "view", "submit"], "status": "ok", "turn_starts": [10, 30, 50], "turn_ends": [20, 45, 52]},
        {"tool_names": ["test", "", ""], "status": "truncated", "turn_starts": [10, 30, 60], "turn_ends": [26, 40, 76]},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "step_000000.parquet")
    p = agent.from_episodes(tmp_path, max_turns=6, max_turn_tokens=15)
    assert p.sandboxed == (1.0, 0, 0) and p.verified == (0, 0, 0.5) and p.in_process == (0, 1.0, 0.5)
    assert p.wave_steps == 15 + 15 + 15  # per turn the longest turn (16, 15, 16), cut at max_turn_tokens
    assert agent.from_episodes(tmp_path, max_turns=2, max_turn_tokens=20).wave_steps == 16 + 15  # 2 turns kept
    pq.write_table(pa.table({"tool_names": [["test"]]}), tmp_path / "step_000001.parquet")
    with pytest.raises(core.UserError, match="step_000001.parquet: no column"):
        agent.from_episodes(tmp_path, 6, 12)


# ------------------------------------------------------------------------------ --compare reads sacct


def _fake_scheduler(tmp_path: Path, monkeypatch, jobs: dict[str, list[tuple[str, int, int]]]) -> None:
    """The fake scheduler on PATH, holding `jobs`: id -> [(component key, ElapsedRaw, NNodes)]."""
    state = tmp_path / "fake-slurm.json"
    monkeypatch.setenv("PATH", f"{FAKE / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_STATE", str(state))
    state.write_text(
        json.dumps(
            {
                "next": 2000,
                "calls": [],
                "jobs": {
                    jid: {
                        "name": jid,
                        "tasks": {key: {"state": "COMPLETED", "exit": "0:0", "partition": "cpu"} for key, _, _ in comps},
                    }
                    for jid, comps in jobs.items()
                },
            }
        )
    )
    for jid, comps in jobs.items():
        for key, elapsed, nodes in comps:
            fake.set_allocation(jid + key, elapsed, nodes)


class _SlurmRun:
    """A run whose units ran as Slurm jobs, their runner stamps 1 s a job short of the allocation."""

    def __init__(self, path: Path, jobs: dict[str, list[str]]):
        self.path, self.run_id, self.jobs = path, "r", jobs

    def is_done(self, unit):
        return True

    def metrics(self, unit):
        return {}

    def record(self, key):
        return {"executor": "slurm", "own_job_ids": self.jobs.get(key, [])}

    def record_stamps(self, key):
        return {"started": 0, "ended": 9_000_000_000}

    def unit_dir(self, unit):
        return self.path / unit.stage


def test_compare_reads_the_allocation_sacct_reports(files, tmp_path, monkeypatch):
    cfg, site = files
    from snowcat.pipeline.dag import build  # noqa: PLC0415

    frozen = config_mod.load(cfg, [], site=str(site))
    t = config_mod.typed(frozen)
    plan = core.make_plan(t)
    jobs = {"tasks": ["1000"], "sft": ["1001", "1003"], "teacher": ["1002"], "rl": ["1004"], "eval": ["1005"]}
    _fake_scheduler(
        tmp_path,
        monkeypatch,
        {
            "1000": [("", 10, 1)],
            "1001": [("", 100, 1)],  # sft's first job ran out of walltime, 1003 continued it
            "1003": [("", 50, 1)],
            "1002": [("", 40, 1)],
            "1004": [("+0", 60, 1), ("+1", 58, 2)],  # a hetjob: trainer on 1 node, rollout on 2
            "1005": [("", 30, 1)],
        },
    )
    result = compare.compare(_SlurmRun(tmp_path, jobs), build(frozen), plan)
    rows = {r["stage"]: r for r in result["stages"]}
    assert rows["sft"]["node_hours"]["measured"] * 3600 == pytest.approx(150)  # both jobs charged
    assert rows["rl"]["node_hours"]["measured"] * 3600 == pytest.approx(60 * 1 + 58 * 2)
    assert rows["tasks"]["node_hours"]["measured"] * 3600 == pytest.approx(10)  # not the runner's 9 s
    assert rows["rl"]["time_measure"] == compare.SACCT and result["time_measure"] == compare.SACCT


def test_compare_says_it_fell_back_when_sacct_does_not_answer(files, tmp_path, monkeypatch):
    cfg, site = files
    from snowcat.pipeline.dag import build  # noqa: PLC0415

    frozen = config_mod.load(cfg, [], site=str(site))
    plan = core.make_plan(config_mod.typed(frozen))
    _fake_scheduler(tmp_path, monkeypatch, {})
    monkeypatch.setenv("FAKE_SLURM_STATE", str(tmp_path / "missing" / "state.json"))  # the fake cannot read its state: fails
    result = compare.compare(_SlurmRun(tmp_path, {"tasks": ["1000"]}), build(frozen), plan)
    rows = {r["stage"]: r for r in result["stages"]}
    assert rows["tasks"]["node_hours"]["measured"] * 3600 == pytest.approx(9)  # the runner's stamps
    assert rows["tasks"]["time_measure"] == compare.RUNNER
    assert result["time_measure"].startswith(compare.RUNNER) and "fell back from sacct" in result["time_measure"]
    assert math.isfinite(result["total"]["node_hours"]["plan"])


# ------------------------------------------------------------------------------ calibration


def test_calibration_reads_each_term_from_its_own_measurement():
    def episode(sandboxed: int, verified: int, in_process: int = 0) -> dict:
        return {
            "sandboxed": sandboxed,
            "verified": verified,
            "in_process": in_process,
            "env_s": 0.5 * sandboxed + 1.5 * verified + 0.02 * (in_process + 1),
            "turns": [10] * (sandboxed + in_process + 1),
            "sandboxed_at": [1] * sandboxed + [0] * (in_process + 1),
        }

    wave = [episode(1, 1), episode(2, 0, 1), episode(3, 1, 2), episode(0, 0, 4)]
    points = {
        "episodes": [{"shard": "a", "episodes": wave, "wall_s": 30.0, "generate_s": 4.0, "decode_steps": 400.0}],
        "expert": [{"stage": "sft", "tasks": 16, "seconds": 9.0}],
        "engine": {"later_reload_s": [8.0, 12.0], "evaluate": [{"stage": "eval", "duration_s": 60.0, "sample_s": [15.0, 15.0]}]},
        "backends": [
            {
                "backend": "megatron",
                "ranks": 2,
                "flops_per_step": 1e10,
                "comm_s": 0.1,
                "pipeline_bubble": 0.0,
                "rank_peak_flops": 1e11,
                "measured_step_s": 1.1,
            }
        ],
    }
    points["rl_starts"] = [10.0, 12.0]
    points["jobs"] = [
        {"stage": "tasks", "kind": "tasks", "allocated_s": 23.0, "duration_s": 21.0},
        {"stage": "sft", "kind": "sft", "allocated_s": 43.0, "duration_s": 39.5},
        {"stage": "card", "kind": "card", "allocated_s": 4.0, "duration_s": 2.0},
    ]
    fitted = calibrate.fit(points, workers=8)
    assert fitted["expert_episode_s"] == pytest.approx(9.0 / 2)  # 16 tasks on 8 workers: 2 rounds
    assert fitted["rl_start_s"] == pytest.approx(11.0)
    assert fitted["job_start_s"] == pytest.approx(2.0)  # the median of 2.0, 3.5, 2.0: allocated less duration
    assert fitted["stage_work_s"] == {"card": 2.0, "tasks": 21.0}  # the short kinds only
    assert fitted["sandbox_call_s"] == pytest.approx(0.5) and fitted["verify_s"] == pytest.approx(1.5)
    assert fitted["tool_call_s"] == pytest.approx(0.02)  # the episode without a sandboxed call or verification
    assert fitted["decode_step_s"] == pytest.approx(0.01)  # 4 s over 400 steps
    assert fitted["engine_reload_s"] == pytest.approx(10.0)
    assert fitted["engine_start_s"] == pytest.approx(60 - 30 - 10)  # less the sampling and the second build
    assert fitted["backend_mfu"]["megatron"] == pytest.approx(1e10 / (2 * 1e11 * 1.0))  # the step less its communication
    (expert,) = fitted["checks"]["expert"]
    assert expert["model_s"] == pytest.approx(2 * (2 * 0.5 + 1.5 + 3 * 0.02))  # 16 tasks on 8 workers: 2 rounds
