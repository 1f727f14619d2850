"""Teacher rollouts in RL groups (`rl.teacher_rollouts`, docs/recipes.md): the advantages and the loss of
a mixed group against a hand computation, the refusals at load and at stage start, and a tiny run on
CPU whose teacher episodes are present, marked, trained on and kept out of the mismatch statistics."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import snowcat.stages.rl as rl
from snowcat.pipeline.context import StageContext
from snowcat.pipeline.errors import UserError
from snowcat.stages.agent import Trajectory
from snowcat.stages.algorithms import PolicyLossConfig, policy_loss
from snowcat.stages.model import PRESETS, MoEForCausalLM, load_model_dir, save_model_dir
from snowcat.stages.rlcore.episodes import batch_jobs
from snowcat.stages.rlcore.objective import make_batch, policy_mask, teacher_stats
from snowcat.stages.rlcore.trainer import batch_metrics
from snowcat.stages.sft import tokenizer_corpus
from snowcat.stages.taskgen import load_tasks
from snowcat.stages.tokenizer import train_tokenizer
from tests.conftest import mpirun
from tests.test_rl import SMALL, build_inputs, final_sha


def traj(group: int, attempt: int, reward: float, source: str, logprobs: list[float], status: str = "ok") -> Trajectory:
    """A one-turn episode: 2 prompt tokens, then the sampled tokens with their behaviour logprobs."""
    n = len(logprobs)
    return Trajectory(
        task_id=f"t{group}",
        group_id=group,
        attempt=attempt,
        policy_version=0,
        token_ids=[1, 2, *range(3, 3 + n)],
        loss_mask=[0, 0] + [1] * n,
        rollout_logprobs=[0.0, 0.0, *logprobs],
        reward=reward,
        status=status,
        turn_boundaries=[(2, 2 + n)],
        prompt_len=2,
        source=source,
    )


def mixed_batch() -> list[Trajectory]:
    """Group 0: the policy fails twice, the teacher passes once and fails once (only the teacher
    passed); group 1: the policy passes once, the teacher's second episode is an infra failure."""
    return [
        traj(0, 0, 0.0, "policy", [-1.0, -2.0]),
        traj(0, 1, 0.0, "policy", [-0.5]),
        traj(0, 2, 1.0, "teacher", [-0.2, -0.3, -0.4]),
        traj(0, 3, 0.0, "teacher", [-3.0]),
        traj(1, 0, 1.0, "policy", [-0.7]),
        traj(1, 1, 0.0, "policy", [-1.1, -0.9]),
        traj(1, 2, 1.0, "teacher", [-0.1]),
        traj(1, 3, 1.0, "teacher", [-0.6], status="infra_error"),
    ]


def test_teacher_episodes_join_their_tasks_group_for_the_advantage():
    batch = make_batch(mixed_batch(), 0, "rloo_n")
    # RLOO-N by hand: A_i = r_i - mean of the other valid rewards of the group (teacher's included)
    g0 = [0 - (0 + 1 + 0) / 3, 0 - (0 + 1 + 0) / 3, 1 - 0, 0 - (0 + 0 + 1) / 3]
    g1 = [1 - (0 + 1) / 2, 0 - (1 + 1) / 2, 1 - (1 + 0) / 2, 0.0]  # the infra failure: 0, out of the baselines
    assert torch.allclose(batch["advantages"], torch.tensor(g0 + g1), atol=1e-6)
    assert batch["teacher_rows"].tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert batch["mask"][7].sum() == 0  # the teacher's infra failure carries no loss either
    grpo = make_batch(mixed_batch(), 0, "grpo")["advantages"][:4]
    r = np.array([0, 0, 1, 0.0])
    assert np.allclose(grpo.numpy(), (r - r.mean()) / (r.std() + 1e-6), atol=1e-5)


def test_the_loss_of_a_mixed_group_is_the_reference_computation():
    """The TIS weight of a teacher token is min(π_old/π_teacher, C): the importance ratio to the teacher,
    capped; the policy's tokens keep the engine-vs-trainer weight. Mismatch statistics: policy rows only."""
    trajs = mixed_batch()
    batch = make_batch(trajs, 0, "rloo_n")
    mask = batch["mask"]
    gen = torch.Generator().manual_seed(0)
    logp_old = (batch["rollout_logprobs"] + 0.05 * torch.randn(mask.shape, generator=gen)) * (mask > 0)
    logp_old[2, 1:4] = torch.tensor([-0.1, -1.5, -0.2])  # the policy likes two of the teacher's tokens more
    logp_old[3, 1] = -1.0  # and this one far more (π_old/π_teacher = e^2: capped)
    logp = (logp_old + 0.01 * torch.randn(mask.shape, generator=gen)).requires_grad_()
    cfg = PolicyLossConfig(tis_cap=2.0)
    loss, stats = policy_loss(logp, logp_old, batch["rollout_logprobs"], batch["advantages"], mask, cfg)

    # by hand, token by token: w = min(exp(old - behaviour), C); loss = -Σ w·A·exp(logp - old) / tokens
    total, tokens, weights = 0.0, 0, []
    logp_ = logp.detach()
    adv = batch["advantages"].tolist()
    for b, t in enumerate(trajs):
        for p in range(len(t) - 1):
            if mask[b, p] == 0:
                continue
            w = min(math.exp(float(logp_old[b, p]) - float(t.rollout_logprobs[p + 1])), 2.0)
            total += -w * adv[b] * math.exp(float(logp_[b, p]) - float(logp_old[b, p]))
            tokens += 1
            weights.append((t.source, w))
    assert tokens == int(mask.sum()) == 11
    assert loss.item() == pytest.approx(total / tokens, rel=1e-5)
    assert stats["tis_weight_mean"] == pytest.approx(np.mean([w for _, w in weights]), rel=1e-5)
    teacher_w = [w for s, w in weights if s == "teacher"]
    assert teacher_w[3] == 2.0 and teacher_w[2] == pytest.approx(math.exp(-0.2 + 0.4))  # capped at C; not
    # the teacher's rows are out of the engine-vs-trainer mask, and have statistics of their own
    own = policy_mask(batch)
    assert own[[2, 3, 6, 7]].sum() == 0 and torch.equal(own[[0, 1, 4, 5]], mask[[0, 1, 4, 5]])
    ts = teacher_stats(logp_old, batch, 2.0)
    assert ts["teacher/tis_clip_frac"].item() == pytest.approx(1 / 5)  # one of the teacher's 5 trained tokens
    loss.backward()
    assert logp.grad[2, 1] != 0 and logp.grad[7].abs().sum() == 0


def test_batch_jobs_number_the_teachers_attempts_after_the_policys():
    jobs = batch_jobs(["a", "b"], attempts=3, teacher_rollouts=2)
    assert [(j.group_id, j.attempt, j.source) for j in jobs[:5]] == [
        (0, 0, "policy"),
        (0, 1, "policy"),
        (0, 2, "policy"),
        (0, 3, "teacher"),
        (0, 4, "teacher"),
    ]
    assert len({(j.group_id, j.attempt) for j in jobs}) == len(jobs) == 10  # distinct seeds per episode


def test_batch_metrics_report_the_policy_and_the_teacher_apart():
    rec = batch_metrics(mixed_batch())
    assert rec["reward/mean"] == pytest.approx(1 / 4) and rec["pass_rate"] == pytest.approx(1 / 4)  # the policy's 4
    assert rec["teacher/reward_mean"] == pytest.approx(2 / 3) and rec["teacher/episodes"] == 4
    assert rec["teacher/tokens"] == 3 + 1 + 1 + 1
    assert rec["teacher/passed"] == 2 and rec["teacher/infra_failures"] == 1  # the pass rate's parts: 2 of 3 scored
    assert rec["teacher/only_teacher_passed_frac"] == 0.5  # group 0
    assert rec["status/infra_error"] == 0  # the teacher's infra failure is not the policy's
    assert rec["exposure/"] == 7  # every row that entered the loss


# ---------------------------------------------------------------- the stage


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """rl_inputs (tests/test_rl.py) and two teachers: `tsft` shares the policy's tokenizer (other
    weights), `other` has a tokenizer of its own."""
    root = tmp_path_factory.mktemp("rl_teacher_inputs")
    build_inputs(root)
    _, _, tok = load_model_dir(root / "sft" / "checkpoints" / "final")
    cfg = PRESETS["test-micro"]
    torch.manual_seed(11)
    save_model_dir(
        root / "tsft" / "checkpoints" / "final", MoEForCausalLM(type(cfg)(**{**cfg.to_dict(), "vocab_size": tok.vocab_size})), tok
    )
    other = train_tokenizer(tokenizer_corpus(load_tasks(root / "tasks", "train")), 280)
    model = MoEForCausalLM(type(cfg)(**{**cfg.to_dict(), "vocab_size": other.vocab_size}))
    save_model_dir(root / "other" / "checkpoints" / "final", model, other)
    return root


def make_ctx(inputs: Path, run_dir: Path, stage: str = "tsft", *, rank: int = 0, role: str | None = None, world: int = 1, **over):
    """The RL stage with `stage`'s final checkpoint as its teacher ("" none), 2 teacher episodes per task
    (`rank`, `role`, `world`: one rank of a world under mpirun)."""
    names = {"tasks", "sft", stage} if stage else {"tasks", "sft"}
    values = {**SMALL, "teacher_rollouts": 2, **({"teacher": f"{stage}:final"} if stage else {}), **over}
    return StageContext.standalone(
        "rl",
        values,
        run_dir=run_dir,
        inputs={n: inputs / n for n in sorted(names)},
        seed=5,
        rank=rank,
        world_size=world,
        role=role,
    )


def test_bad_teacher_configs_are_refused_at_load_naming_the_key(inputs, tmp_path):
    with pytest.raises(UserError, match=r"^stages\.rl\.teacher: teacher_rollouts is 2: name the teacher"):
        make_ctx(inputs, tmp_path, stage="")
    with pytest.raises(UserError, match=r"^stages\.rl\.tis_cap: teacher_rollouts need a TIS cap"):
        make_ctx(inputs, tmp_path, tis_cap=None)
    with pytest.raises(UserError, match=r"^stages\.rl\.router_replay: cannot go with teacher_rollouts"):
        make_ctx(inputs, tmp_path, router_replay=True)
    with pytest.raises(UserError, match=r"^stages\.rl\.teacher: 'nope:final' names stage 'nope', which is not in"):
        rl.run(make_ctx(inputs, tmp_path, teacher="nope:final"))  # at load: pipeline.config._ref_problems
    # both local Hugging Face-style directories: known at load
    hf = {"init_from": f"hf:{inputs / 'sft/checkpoints/final'}", "teacher": f"hf:{inputs / 'other/checkpoints/final'}"}
    with pytest.raises(UserError, match=r"^stages\.rl\.teacher: 'hf:.*other.*' has another tokenizer than the policy"):
        make_ctx(inputs, tmp_path, stage="", **hf)
    same = {**hf, "teacher": f"hf:{inputs / 'tsft/checkpoints/final'}"}
    assert make_ctx(inputs, tmp_path, stage="", **same).config.teacher_rollouts == 2


def test_a_run_checkpoint_teacher_with_another_tokenizer_is_refused_at_stage_start(inputs, tmp_path):
    ctx = make_ctx(inputs, tmp_path, stage="other")  # run checkpoints: not known at load
    with pytest.raises(UserError, match=r"^stages\.rl\.teacher: 'other:final' has another tokenizer than the policy"):
        rl.run(ctx)
    assert not (tmp_path / "rl" / "queue").exists() or not any((tmp_path / "rl" / "queue").iterdir())


def kept_rows(run_dir: Path) -> list[dict]:
    shards = sorted((run_dir / "rl" / "trajectories").glob("step_*.parquet"))
    return [
        row for s in shards for row in pq.read_table(s, columns=["step", "group_id", "attempt", "source", "reward"]).to_pylist()
    ]


def updates(run_dir: Path) -> list[dict]:
    """The history's update rows (the first row is the initial evaluation)."""
    return [json.loads(line) for line in (run_dir / "rl" / "metrics_history.jsonl").read_text().splitlines()][1:]


@pytest.fixture(scope="module")
def one_rank(inputs, tmp_path_factory) -> Path:
    """An uninterrupted run in one process (trainer and rollout alternating)."""
    run_dir = tmp_path_factory.mktemp("rl_teacher_one_rank")
    rl.run(make_ctx(inputs, run_dir, timeout_s=120))
    return run_dir


@pytest.mark.slow
@pytest.mark.xdist_group("rl_teacher_one_rank")  # the worker that ran `one_rank` reuses it
def test_a_run_with_teacher_rollouts_trains_on_them_and_resumes_bit_identically(inputs, one_rank, tmp_path):
    rows = updates(one_rank)
    kept = kept_rows(one_rank)
    # present and marked: 4 tasks x (4 policy + 2 teacher) episodes per update, the teacher's attempts 4 and 5
    assert len(kept) == 6 * 24
    assert {(r["attempt"], r["source"]) for r in kept} == {(a, "policy") for a in range(4)} | {(4, "teacher"), (5, "teacher")}
    for r in rows:
        assert r["teacher/episodes"] == 8 and r["teacher/tokens"] > 0 and "teacher/tis_clip_frac" in r
        # excluded from the engine-vs-trainer statistics: the teacher's ratios are far from 1, the engine's are not
        assert r["mismatch/max_abs_dlogp"] < 1e-3 and r["teacher/mean_abs_dlogp"] > 0.1
    # trained on: their tokens are in the loss, weighted by min(π_old/π_teacher, C) (the mixed-group test
    # above checks the weights and the gradient), and they carry signal the policy's episodes lack
    assert all(math.isfinite(r["teacher/ratio_p50"]) and 0 <= r["teacher/tis_clip_frac"] < 1 for r in rows)
    assert any(r["teacher/reward_mean"] != r["reward/mean"] for r in rows)
    assert all(sum(v for k, v in r.items() if k.startswith("exposure/")) > 16 for r in rows)  # more than the policy's 16
    # the same seed gives the same run; a preempted and resumed run ends where the uninterrupted one does
    preempt = make_ctx(inputs, tmp_path / "b", timeout_s=120)
    polls = iter(range(1000))
    preempt.checkpoint_due = lambda: next(polls) == 3
    with pytest.raises(StageContext.Preempted):
        rl.run(preempt)
    rl.run(make_ctx(inputs, tmp_path / "b", timeout_s=120))
    assert final_sha(tmp_path / "b") == final_sha(one_rank)
    assert kept_rows(tmp_path / "b") == kept


# ---------------------------------------------------------------- several trainer ranks

_CHILD = """
import json, os, sys
from pathlib import Path
sys.path.insert(0, os.environ["PYTHONPATH"])
import snowcat.stages.rl as rl
from tests.test_rl_teacher import make_ctx
inputs, run_dir, trainers = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
rank, world = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
role = "trainer" if rank < trainers else "rollout"
print(json.dumps(rl.run(make_ctx(inputs, run_dir, rank=rank, role=role, world=world, timeout_s=120))), flush=True)
"""

# the teacher's episodes, counted by rank 0 on the whole batch: the same batches give the same numbers
EPISODE_KEYS = ("teacher/episodes", "teacher/passed", "teacher/infra_failures", "teacher/tokens", "teacher/pass_rate")
EPISODE_KEYS += ("teacher/reward_mean", "teacher/only_teacher_passed_frac", "reward/mean", "pass_rate")
# means over one source's trained tokens, each rank's slice merged by that source's token count
TOKEN_MEANS = ("teacher/mean_abs_dlogp", "teacher/tis_clip_frac", "mismatch/mean_abs_dlogp", "mismatch/k3_kl")


@pytest.mark.slow  # with its fixture: a 1-rank run, then 2 trainer ranks + 1 rollout rank under mpirun
@pytest.mark.xdist_group("rl_teacher_one_rank")
def test_two_trainer_ranks_report_the_teacher_figures_of_one(inputs, one_rank, tmp_path):
    if shutil.which("mpirun") is None:
        pytest.skip("needs OpenMPI's mpirun")
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    proc = mpirun(3, script, inputs, tmp_path, 2, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    one, two = updates(one_rank), updates(tmp_path)
    assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(1, 7))
    # rows 0-11 to trainer rank 0, 12-23 to rank 1: both hold teacher rows, in other shares of their tokens
    for r1, r2 in zip(one, two):
        assert {k: r2[k] for k in EPISODE_KEYS} == {k: r1[k] for k in EPISODE_KEYS}
        for k in TOKEN_MEANS:
            assert r2[k] == pytest.approx(r1[k], rel=1e-4, abs=1e-7), k
        # counts are summed over the ranks: each source's trained tokens, together every trained token
        assert r2["teacher/trained_tokens"] == r1["teacher/trained_tokens"] > 0
        assert r2["mismatch/tokens"] == r1["mismatch/tokens"] > 0
        assert r2["teacher/trained_tokens"] + r2["mismatch/tokens"] == r2["tokens"] == r1["tokens"]
        assert math.isfinite(r2["teacher/ratio_p50"])  # a weighted mean of the ranks' medians: not the median
    assert kept_rows(tmp_path) == kept_rows(one_rank)
