"""The `teacher` stage (docs/recipes.md): a tiny teacher model plays the training tasks in the agent
loop, only its verified successes become demonstrations, with complete provenance, deduplicated;
shards and a preempted-then-resumed unit give what one uninterrupted unit gives; SFT reads them
(`sft.mix: {teacher:<stage>: w}`) rendered through the student's own chat template."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import snowcat.stages.agent.demos as demos_mod
import snowcat.stages.sft as sft
import snowcat.stages.teacher as teacher
from snowcat.pipeline import config as config_mod
from snowcat.pipeline.context import Preempted, StageContext
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import build_manifest
from snowcat.stages.agent import Budget, CalculatorEnv, EpisodeJob, run_episodes, teacher_messages
from snowcat.stages.agent.dataset import DIRNAME, read_manifest, read_rows
from snowcat.stages.config import DEFAULT_VERIFIER
from snowcat.stages.model import load_model_dir, save_model_dir
from snowcat.stages.probe import first_of_each_domain_in_turn
from snowcat.stages.rlcore.episodes import reward_verifier
from snowcat.stages.rollout import SamplingParams, TorchEngine
from snowcat.stages.taskgen import generate_domain, load_tasks, save_tasks, verify
from tests.conftest import write_config
from tests.test_agent import overfit, tiny_model, tiny_tokenizer

SMALL = dict(
    teacher="sft:final",
    env="calculator",
    limit=12,
    attempts=3,
    batch_size=8,
    max_turn_tokens=16,
    max_context=128,
    max_turns=2,
    verifier_timeout_s=0,  # in this process: no verifier worker to start
)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """tasks/ and sft/checkpoints/final, the teacher: a test-micro model that learnt four of the
    twelve played tasks' calculator demonstrations by heart (it solves those and some others, and
    fails the rest under the real verifier)."""
    root = tmp_path_factory.mktemp("teacher_inputs")
    rng = np.random.default_rng(3)
    train = generate_domain(rng, "arith", [2], 30) + generate_domain(rng, "closure", [1], 30)
    save_tasks(root / "tasks", "train", train)
    save_tasks(root / "tasks", "val", generate_domain(rng, "arith", [2], 4))
    tok = tiny_tokenizer(train)
    torch.set_num_threads(1)
    played = demos_mod.domains_in_turn(train, 12)
    assert played == first_of_each_domain_in_turn(train, 12)  # the tasks a probe with the same limit takes
    model = overfit(tiny_model(tok, seed=1), tok, [teacher_messages(t, "calculator") for t in played[:4]], max_steps=40)
    save_model_dir(root / "sft" / "checkpoints" / "final", model, tok)
    return root


class _PreemptAfter(StageContext):
    """The end of the job is announced at the first poll (after the first batch)."""

    def checkpoint_due(self) -> bool:
        return True


def make_ctx(inputs: Path, run_dir: Path, cls=StageContext, **over) -> StageContext:
    return cls.standalone(
        "teacher", {**SMALL, **over}, run_dir=run_dir, inputs={"tasks": inputs / "tasks", "sft": inputs / "sft"}, seed=9
    )


def demos_of(run_dir: Path, name: str = "teacher") -> list[dict]:
    return [json.loads(line) for line in (run_dir / name / demos_mod.DEMOS).read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(inputs, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("teacher_run")
    teacher.run(make_ctx(inputs, run_dir))
    return run_dir


def test_only_verified_successes_enter_with_complete_provenance(inputs, straight):
    """The same episodes played apart (same seeds: group = task index, attempt) and verified by the
    task's verifier: the demonstrations are exactly its successes, each with its provenance."""
    demos = demos_of(straight)
    summary = json.loads((straight / "teacher" / "teacher.json").read_text())
    model, _, tok = load_model_dir(inputs / "sft" / "checkpoints" / "final")
    tasks = demos_mod.domains_in_turn(load_tasks(inputs / "tasks", "train"), 12)
    jobs = [EpisodeJob(t, group_id=i, attempt=a) for i, t in enumerate(tasks) for a in range(3)]
    params = SamplingParams(1.0, 0, 1.0, 16, (tok.end_of_turn_id,))
    env, budget = CalculatorEnv(tok), Budget(128, 16, 2)
    full = reward_verifier(DEFAULT_VERIFIER, "pass")  # reward 1 iff the verdict passed
    trajs = run_episodes(TorchEngine(model), tok, jobs, env, params, budget, 9, 0, verifier=full)
    passed = {(t.task_id, t.attempt) for t in trajs if t.status == "ok" and t.passed}
    # full credit from the tasks' own verifiers is a pass: closure's partial credit for its closers and
    # then junk stays below 1 (it reached 1 and the raw rewards counted more successes than passed)
    raw = run_episodes(TorchEngine(model), tok, jobs, env, params, budget, 9, 0, verifier=verify)
    assert {(t.task_id, t.attempt) for t in raw if t.status == "ok" and t.reward >= 1} == passed
    assert 0 < len(passed) < len(trajs) and summary["verified"] == len(passed) and summary["episodes"] == len(trajs)
    assert summary["kept"] + summary["duplicates"] + summary["cut_turns"] == len(passed)
    kept = {(d["task_id"], d["provenance"]["attempt"]) for d in demos}
    assert kept <= passed and len(kept) == summary["kept"] > 0
    digest = hashlib.sha256(json.dumps(build_manifest(inputs / "sft" / "checkpoints" / "final"), sort_keys=True).encode())
    assert summary["teacher"] == "sft:final" and summary["teacher_sha256"] == digest.hexdigest()  # the card names it
    by_id = {t.task_id: t for t in tasks}
    for d in demos:
        p = d["provenance"]
        assert p["teacher"] == "sft:final" and p["teacher_sha256"] == digest.hexdigest() and p["seed"] == 9
        assert p["tokenizer"] == tok.fingerprint() and p["env"] == "calculator" and p["verifier"] == DEFAULT_VERIFIER
        assert p["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "engine": "torch"}
        assert p["budget"] == {"max_context": 128, "max_turn_tokens": 16, "max_turns": 2}
        assert p["verdict"]["passed"] is True and p["verdict"]["status"] == "ok" and tasks[p["group_id"]].task_id == d["task_id"]
        assert d["id"] == demos_mod.demo_id(d["messages"])
        assert d["messages"][0] == {"role": "user", "content": by_id[d["task_id"]].prompt}
        # the final answer, as the student will be taught it, passes the task's verifier
        assert verify(by_id[d["task_id"]], d["messages"][-1]["content"]).passed
        # rendered by the teacher's own template, the messages are the episode's text: its turns as
        # sampled, the tool results between them as the environment wrote them
        episode = next(t for t in trajs if (t.task_id, t.attempt) == (d["task_id"], p["attempt"]))
        assert tok.decode(tok.encode_chat(d["messages"])[0]) == tok.decode(episode.token_ids)
    assert len({d["id"] for d in demos}) == len(demos)  # deduplicated
    # every episode the teacher played is kept, failures too, as it was played and verified
    rows = read_rows(straight / "teacher" / DIRNAME)
    assert len(rows) == len(trajs) and read_manifest(straight / "teacher" / DIRNAME)["stage"] == "teacher"
    by_play = {(t.task_id, t.attempt): t for t in trajs}
    assert {(r["task_id"], r["attempt"]) for r in rows if r["passed"] == 1} == passed
    for r in rows:
        t = by_play[r["task_id"], r["attempt"]]
        assert r["token_ids"] == t.token_ids.tolist() and (r["status"], r["checkpoint"]) == (t.status, "sft:final")


def test_a_multi_turn_success_keeps_each_observation_as_the_environment_wrote_it(straight):
    """A tool-using success keeps the call, the calculator's result and the answer as three messages."""
    multi = [d for d in demos_of(straight) if len(d["messages"]) > 2]
    assert multi
    for d in multi:
        call, result = d["messages"][1]["content"], d["messages"][2]["content"]
        assert "<tool_call>" in call and result.lstrip("-").isdigit()


def test_shards_and_a_preempted_then_resumed_shard_make_what_one_uninterrupted_unit_makes(inputs, straight, tmp_path):
    """Shard 0 of 2 is stopped after its first batch and resumed, shard 1 runs straight: together
    their demonstrations are line for line those of the unsharded, uninterrupted unit."""
    lines = []
    for shard in (0, 1):
        run_dir = tmp_path / str(shard)
        if shard == 0:
            ctx = make_ctx(inputs, run_dir, cls=_PreemptAfter, shard=0)
            ctx.config.fan_out = {"shard": [0, 1]}
            with pytest.raises(Preempted):
                teacher.run(ctx)
            assert len(list((run_dir / "teacher" / "partial").glob("batch_*.json"))) == 1
        ctx = make_ctx(inputs, run_dir, shard=shard)
        ctx.config.fan_out = {"shard": [0, 1]}
        teacher.run(ctx)
        assert not (run_dir / "teacher" / "partial").exists()
        lines += (run_dir / "teacher" / demos_mod.DEMOS).read_text().splitlines()
    assert sorted(lines) == sorted((straight / "teacher" / demos_mod.DEMOS).read_text().splitlines())
    # the episodes too: the resumed shard's and the other's together are the uninterrupted unit's

    def played(run_dir):
        return sorted(
            (r["task_id"], r["attempt"], r["reward"], tuple(r["token_ids"])) for r in read_rows(run_dir / "teacher" / DIRNAME)
        )

    assert sorted(played(tmp_path / "0") + played(tmp_path / "1")) == played(straight)
    assert list(read_manifest(tmp_path / "1" / "teacher" / DIRNAME)["shards"]) == ["shard_1"]
    assert demos_mod.read_demos(tmp_path / "0" / "teacher") == [json.loads(x) for x in lines[: len(demos_of(tmp_path / "0"))]]


def test_keep_best_is_one_demonstration_per_task_and_greedy_repeats_are_duplicates(inputs, tmp_path):
    teacher.run(make_ctx(inputs, tmp_path, temperature=0.0, keep="all", keep_trajectories="none"))
    assert not (tmp_path / "teacher" / DIRNAME).exists()  # the demonstrations alone
    summary = json.loads((tmp_path / "teacher" / "teacher.json").read_text())
    demos = demos_of(tmp_path)
    assert summary["verified"] == 3 * len(demos) and summary["duplicates"] == 2 * len(demos)  # 3 identical attempts
    assert set(Counter(d["task_id"] for d in demos).values()) == {1}


def sft_ctx(inputs: Path, straight: Path, run_dir: Path, **values) -> StageContext:
    """A small SFT stage reading the tasks, the teacher stage `teach` (the `straight` run's) and, for an
    `init_from`, the `sft` checkpoint."""
    return StageContext.standalone(
        "sft",
        {"seq_len": 96, "batch_rows": 4, "eval_tasks": 0, "threads": 1, **values},
        run_dir=run_dir,
        inputs={"tasks": inputs / "tasks", "sft": inputs / "sft", "teach": straight / "teacher"},
        seed=3,
    )


def test_sft_reads_teacher_demonstrations_by_weight_through_its_own_template(inputs, straight, tmp_path):
    demos = demos_mod.read_demos(straight / "teacher")
    ctx = sft_ctx(
        inputs, straight, tmp_path, model="test-micro", tokenizer_vocab_size=300, steps=2, mix={"tasks": 0, "teacher:teach": 2.5}
    )
    metrics = sft.run(ctx)
    student = load_model_dir(tmp_path / "sft" / "checkpoints" / "final")[2]
    assert student.fingerprint() != demos[0]["provenance"]["tokenizer"]  # its own tokenizer: text, not the teacher's ids
    assert metrics["num_examples"] == 2 * len(demos) + round(0.5 * len(demos))  # weight 2.5, tasks' own not read
    rows = [json.loads(line) for line in (tmp_path / "sft" / "metrics_history.jsonl").read_text().splitlines()]
    assert {k for r in rows for k in r if k.startswith("loss/")} == {"loss/teacher:teach"}
    convs = sft.weighted([(d["messages"], "x") for d in demos], 2.5, 3, "teacher:teach")
    assert convs == sft.weighted([(d["messages"], "x") for d in demos], 2.5, 3, "teacher:teach")  # seeded


def test_sft_from_a_checkpoint_reads_teacher_demonstrations(inputs, straight, tmp_path):
    # configs/north-star.yaml's shape: the student starts from a checkpoint (init_from; `model: hf:...`
    # takes the same path), not a fresh init — the mix's sources must not replace the directory it loads
    ctx = sft_ctx(inputs, straight, tmp_path, init_from="sft:final", steps=1, mix={"tasks": 1, "teacher:teach": 1})
    sft.run(ctx)
    rows = [json.loads(line) for line in (tmp_path / "sft" / "metrics_history.jsonl").read_text().splitlines()]
    assert "loss/teacher:teach" in {k for r in rows for k in r}


def test_bad_teacher_and_mix_configs_name_the_key(inputs, tmp_path):
    with pytest.raises(UserError, match=r"^stages\.teacher\.teacher: name the teacher model"):
        make_ctx(inputs, tmp_path, teacher="")
    with pytest.raises(UserError, match=r"^stages\.teacher\.keep_trajectories: "):
        make_ctx(inputs, tmp_path, keep_trajectories="some")
    with pytest.raises(UserError, match=r"^stages\.teacher\.teacher: 'nope:final' names stage 'nope', which is not in needs"):
        teacher.run(make_ctx(inputs, tmp_path, teacher="nope:final"))
    path = write_config(
        tmp_path / "c.yaml",
        "name: x\nstages:\n  tasks: {kind: tasks}\n  sft: {kind: sft, needs: [tasks]}\n"
        "  teach: {kind: teacher, needs: [tasks, sft], teacher: 'sft:final', fan_out: {shard: [0, 2]}}\n",
    )
    with pytest.raises(
        UserError, match=r"stages\.teach\.fan_out: .*fan_out\.shard: must be the shards 0\.\.N-1 once each, got \[0, 2\]"
    ):
        config_mod.load(path)
    for mix, why in (
        ("{bogus: 1}", r"stages\.s2\.mix\.bogus: not a source"),
        ("{'teacher:teach': 1}", r"stages\.s2\.needs: add 'teach' \(named in mix\.teacher:teach\)"),
        ("{'teacher:sft': 1}", r"stages\.s2\.mix\.teacher:sft: stage 'sft' is a sft stage, not a teacher stage"),
    ):
        needs = "[tasks, sft]"
        path = write_config(
            tmp_path / "m.yaml",
            "name: x\nstages:\n  tasks: {kind: tasks}\n  sft: {kind: sft, needs: [tasks]}\n"
            "  teach: {kind: teacher, needs: [tasks, sft], teacher: 'sft:final'}\n"
            f"  s2: {{kind: sft, needs: {needs}, mix: {mix}}}\n",
        )
        with pytest.raises(UserError, match=why):
            config_mod.load(path)
