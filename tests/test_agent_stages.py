"""Repository tasks through the stages: tasks (swe_mini + imports), SFT on the scripted expert's
episodes and imported traces, probe and evaluate playing RepoEnv episodes in real sandboxes."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from test_importers import harbor, swebench  # noqa: F401 - fixtures
from test_repo_env import private_tempdir

from snowcat.pipeline.context import StageContext
from snowcat.pipeline.errors import UserError
from snowcat.stages import evaluate, probe, rl, sft, tasks
from snowcat.stages.agent import RepoEnv
from snowcat.stages.agent.repo_env import picked
from snowcat.stages.taskgen import generate_domain, load_tasks
from tests.conftest import write_config

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("git"),
    reason="RepoEnv runs tools in LocalSandbox as root",
)

SANDBOX = {"observation_chars": 300}


def test_tasks_stage_generates_and_imports_repository_tasks(tmp_path, swebench, harbor):  # noqa: F811
    jsonl, repos, _ = swebench
    values = {
        "domains": {"swe_mini": {"count": 12, "val_count": 4, "difficulties": [1, 2]}},
        "imports": [
            {"format": "swebench", "path": str(jsonl), "repos_dir": str(repos), "test_command": "python3 -m unittest -v {tests}"},
            {"format": "harbor", "path": str(harbor.parent), "domain": "terminal"},
        ],
    }
    ctx = StageContext.standalone("tasks", values, run_dir=tmp_path, seed=5)
    metrics = tasks.run(ctx)
    train, val = load_tasks(ctx.out_dir, "train"), load_tasks(ctx.out_dir, "val")
    assert metrics["swe_mini/train"] == 8 and metrics["swe/train"] == 1 and metrics["terminal/train"] == 1 and len(val) == 4
    assert {t.verifier for t in train + val} == {"repo"}
    assert {t.domain for t in train} == {"swe_mini", "swe", "terminal"}
    bad = {**values, "imports": [{"format": "swebench", "path": str(tmp_path / "none.jsonl"), "repos_dir": str(repos)}]}
    with pytest.raises(UserError, match=r"imports\[0\]\.path: .*none.jsonl does not exist"):
        tasks.run(StageContext.standalone("tasks", bad, run_dir=tmp_path / "bad", seed=5))
    with pytest.raises(UserError, match=r"imports\[0\]\.repos_dir: required"):
        StageContext.standalone("tasks", {"imports": [{"format": "swebench", "path": str(jsonl)}]}, run_dir=tmp_path / "b2")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A micro model after a few SFT steps on swe_mini demonstrations and one imported trace."""
    root = tmp_path_factory.mktemp("agent")
    tctx = StageContext.standalone(
        "tasks", {"domains": {"swe_mini": {"count": 8, "val_count": 3, "difficulties": [1]}}}, run_dir=root, seed=2
    )
    tasks.run(tctx)
    trace = {
        "messages": [
            {"role": "user", "content": "Fix it."},
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "test", "arguments": "{}"}}]},
            {"role": "tool", "content": "exit 0"},
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "submit", "arguments": "{}"}}]},
        ]
    }
    (root / "traces.jsonl").write_text(json.dumps(trace) + "\n")
    values = {
        "model": "test-micro",
        "tokenizer_vocab_size": 320,
        "seq_len": 256,
        "batch_rows": 2,
        "steps": 2,
        "warmup_steps": 0,
        "save_every": 0,
        "eval_tasks": 0,
        "threads": 1,
        "relay_fraction": 0.5,
        "detour_fraction": 0.5,
        "explore_fraction": 0.5,
        "sandbox": SANDBOX,
        "traces": [str(root / "traces.jsonl")],
    }
    sctx = StageContext.standalone("sft", values, run_dir=root, inputs={"tasks": tctx.out_dir}, seed=2)
    metrics = sft.run(sctx)
    return root, tctx, sctx, metrics


@pytest.mark.slow
def test_sft_trains_on_expert_episodes_and_traces(trained):
    root, tctx, sctx, metrics = trained
    train = load_tasks(tctx.out_dir, "train")
    demos = json.loads((sctx.out_dir / sft.DEMOS_FILE).read_text())["demos"]
    # explore_fraction 0.5, picked apart from the detours: those tasks demonstrated a second time, viewing a
    # test module (trained), under their own key
    explored = {i for i, msgs in demos.items() if any('"tests/' in json.dumps(m.get("tool_calls")) for m in msgs)}
    picked_ids = {t.task_id for t in train if picked(t, 0.5, "explore")}
    assert explored == {i + sft.EXPLORING for i in picked_ids} and 0 < len(picked_ids) < len(train)
    assert sorted(demos) == sorted([t.task_id for t in train] + list(explored))
    # every repository task once and the picked ones twice (no Relay variant for them), plus the imported trace
    assert metrics["num_examples"] == len(train) + len(explored) + 1
    # detour_fraction 0.5: the demonstrations with an untrained wrong view are those of the tasks the share picks
    detoured = {i for i, msgs in demos.items() if any(m.get("train") is False for m in msgs)}
    want = {t.task_id for t in train if picked(t, 0.5, "detour")}
    assert detoured == want | {i + sft.EXPLORING for i in want & picked_ids} and 0 < len(want) < len(train)
    history = [json.loads(line) for line in (sctx.out_dir / "metrics_history.jsonl").read_text().splitlines()]
    assert history and any("loss/swe_mini" in h for h in history)
    bad = StageContext.standalone(
        "sft", {"model": "test-micro", "traces": [str(root / "nope.jsonl")]}, run_dir=root / "bad", inputs={"tasks": tctx.out_dir}
    )
    with pytest.raises(UserError, match=r"stages\.sft\.traces\[0\]: .*nope.jsonl"):
        sft.run(bad)


def test_probe_and_evaluate_play_repo_episodes(trained):
    root, tctx, sctx, _ = trained
    budget = {"max_context": 224, "max_turns": 2, "sandbox": SANDBOX, "batch_size": 8}
    pctx = StageContext.standalone(
        "probe",
        {
            "checkpoint": "sft:final",
            "env": "repo",
            "attempts": 2,
            "limit": 3,
            "max_turn_tokens": 24,
            "band_max_pass": 2,
            **budget,
        },
        run_dir=root,
        inputs={"tasks": tctx.out_dir, "sft": sctx.out_dir},
        seed=3,
    )
    pmetrics = probe.run(pctx)
    rows = pq.read_table(pctx.out_dir / "probe.parquet").to_pylist()
    assert pmetrics["tasks"] == 3 and pmetrics["infra_failures"] == 0
    assert [r["n"] for r in rows] == [2, 2, 2]
    ectx = StageContext.standalone(
        "evaluate",
        {"checkpoints": ["sft:final"], "env": "repo", "attempts": 2, "pass_k": [1, 2], "max_tokens": 24, **budget},
        run_dir=root,
        inputs={"tasks": tctx.out_dir, "sft": sctx.out_dir},
        seed=3,
    )
    evaluate.run(ectx)
    results = json.loads((ectx.out_dir / "results.json").read_text())
    agent = results["checkpoints"]["sft:final"]["behaviour"]
    assert agent["episodes"] == 6 and agent["turns_mean"] >= 1
    assert set(agent) >= {"invalid_actions_per_episode", "submitted_untested_frac", "claim_precision", "calls/edit"}
    assert results["sampling"]["env"] == "repo" and results["checkpoints"]["sft:final"]["groups"]["all"]["attempts"] == 6


def test_harbor_tasks_get_their_own_image_built_from_the_dockerfile(tmp_path, harbor, monkeypatch):  # noqa: F811
    """`build_images`: each Harbor task's Dockerfile, converted by spython, is built into the task's own
    sandbox image, which RepoEnv and the verifier then use. Apptainer cannot run here: the build and the
    exec go through tests/fake_apptainer (a TEST DOUBLE that checks the arguments and writes a stand-in SIF)."""
    monkeypatch.setenv("PATH", f"{Path(__file__).parent / 'fake_apptainer'}{os.pathsep}{os.environ['PATH']}")
    values = {"imports": [{"format": "harbor", "path": str(harbor), "domain": "terminal", "build_images": True}]}
    ctx = StageContext.standalone("tasks", values, run_dir=tmp_path, seed=1)
    tasks.run(ctx)
    (task,) = load_tasks(ctx.out_dir, "train")
    image = Path(task.meta["sandbox_image"])
    assert image == ctx.out_dir / "images" / f"{task.task_id}.sif" and image.read_text().startswith("FAKE-SIF")
    assert "From: python:3.11-slim" in (ctx.out_dir / "images" / f"{task.task_id}.def").read_text()
    env = RepoEnv(None)
    state = env.reset(task)
    try:
        # the episode's commands run in the task's image (the double exports the image it was given)
        assert str(image) in env.run_tool(state, "bash", {"command": "echo $FAKE_APPTAINER_IMAGE"})
        (state["sandbox"].workdir / "greet.sh").write_text("echo 'hello world'\n")
        assert env.submit(task, state).reward == 1.0  # verified in the same image
    finally:
        env.finish(state)


def test_rl_trains_on_repo_episodes(trained, tmp_path, monkeypatch):
    """RL with env repo in one process: episodes in sandboxes, rewards from the tests, updates applied."""
    root, tctx, sctx, _ = trained
    sandboxes = private_tempdir(tmp_path, monkeypatch)
    values = {
        "env": "repo",
        "sandbox": SANDBOX,
        "updates": 2,
        "tasks_per_update": 2,
        "attempts": 2,
        "max_tokens": 24,
        "max_turns": 2,
        "max_total_tokens": 224,
        "eval_every": 0,
        "eval_tasks": 0,
        "save_every": 1,
        "threads": 1,
        "rollout_batch": 8,
    }
    ctx = StageContext.standalone("rl", values, run_dir=tmp_path, inputs={"tasks": tctx.out_dir, "sft": sctx.out_dir}, seed=4)
    rl.run(ctx)
    rows = [json.loads(line) for line in (ctx.out_dir / "metrics_history.jsonl").read_text().splitlines()]
    updates = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in updates] == [1, 2]
    assert all(r["turns/mean"] >= 1 and "reward/mean" in r for r in updates)
    assert (ctx.out_dir / "checkpoints" / "final").exists()
    assert not list(sandboxes.glob("snowcat-sandbox-*"))  # every episode's sandbox is gone


@pytest.mark.slow
def test_demonstrations_are_made_once_and_shared_by_every_rank(tmp_path, monkeypatch, capsys):
    """Rank 0 runs the expert and writes the file; another rank ignores an earlier attempt's file for
    other tasks and waits for rank 0's; both get the same bytes as the expert run in-process, and a
    resumed stage reads them without running the expert again."""
    train = generate_domain(np.random.default_rng(4), "swe_mini", [1], 3)
    path = tmp_path / "sft" / sft.DEMOS_FILE
    path.parent.mkdir()
    path.write_text(json.dumps({"key": "an earlier attempt's, for other tasks", "demos": {"x": []}}))
    got: dict = {}
    other = threading.Thread(target=lambda: got.update(rank1=sft.shared_teacher_demos(path, train, SANDBOX, rank=1)))
    other.start()
    rank0 = sft.shared_teacher_demos(path, train, SANDBOX, rank=0)
    other.join(timeout=600)  # a guard against a hang, not a measurement
    assert not other.is_alive()
    assert capsys.readouterr().out.count("[snowcat] scripted expert: 3 repository-task episodes") == 1
    direct = sft.teacher_demos(train, SANDBOX)
    assert json.dumps(rank0) == json.dumps(got["rank1"]) == json.dumps(direct)  # key order included (templates render it)
    monkeypatch.setattr(sft, "teacher_demos", lambda *a, **k: pytest.fail("the expert ran again"))
    assert json.dumps(sft.shared_teacher_demos(path, train, SANDBOX, rank=0)) == json.dumps(direct)
    with pytest.raises(pytest.fail.Exception):  # other sandbox settings: rank 0 makes them anew
        sft.shared_teacher_demos(path, train, {**SANDBOX, "observation_chars": 400}, rank=0)
    with pytest.raises(pytest.fail.Exception):  # so does another share of detours
        sft.shared_teacher_demos(path, train, SANDBOX, rank=0, detours=0.5)
    with pytest.raises(pytest.fail.Exception):  # or of explores
        sft.shared_teacher_demos(path, train, SANDBOX, rank=0, explores=0.5)
    arith = generate_domain(np.random.default_rng(4), "arith", [2], 3)
    assert sft.shared_teacher_demos(tmp_path / "none.json", arith, SANDBOX, rank=1) == {}
    assert not (tmp_path / "none.json").exists()


AGENT_SFT = """\
name: agent-sft
seed: 3
executor: {kind: local, max_parallel: 1}
stages:
  tasks:
    kind: tasks
    domains:
      swe_mini: {count: 8, val_count: 2, difficulties: [1]}
  sft:
    kind: sft
    needs: [tasks]
    model: test-micro
    tokenizer_vocab_size: 320
    seq_len: 512
    batch_rows: 4
    steps: 4
    warmup_steps: 0
    save_every: 4
    threads: 1
    eval_tasks: 0
    relay_fraction: 0.0
    sandbox: {observation_chars: 300}
"""


@pytest.mark.slow
def test_two_rank_sft_runs_the_expert_once_and_trains_as_one_rank(snowcat, tmp_path):
    """A 2-rank SFT on swe_mini under the local mpirun: the expert's episodes run once (one report
    of them in the stage's log, which both ranks write to), both ranks train on rank 0's file, and
    the loss curve is the single rank's."""
    cfg = write_config(tmp_path / "agent-sft.yaml", AGENT_SFT)
    curves, files = {}, {}
    for ranks in (1, 2):
        run_dir = tmp_path / f"ranks{ranks}"
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        snowcat("run", cfg, f"stages.sft.resources.tasks_per_node={ranks}", "--run-dir", run_dir, env=env, check=True)
        sft_dir = run_dir / "stages" / "sft"
        curves[ranks] = [json.loads(line)["loss"] for line in (sft_dir / "metrics_history.jsonl").read_text().splitlines()]
        files[ranks] = (sft_dir / sft.DEMOS_FILE).read_bytes()
        log = (run_dir / "logs" / "sft.log").read_text(errors="replace")
        assert log.count("rank 1/2") == (ranks == 2)  # both ranks write to it
        assert log.count("[snowcat] scripted expert: 6 repository-task episodes") == 1, log[-3000:]
        assert json.loads((sft_dir / "checkpoints" / "step_000004" / "meta.json").read_text())["world_size"] == ranks
    assert files[1] == files[2]
    assert len(curves[2]) == 4 and curves[2] == pytest.approx(curves[1], rel=1e-5)
