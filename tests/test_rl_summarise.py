"""Transcript summarisation in RL (`rl.context`, docs/recipes.md "Transcript summarisation"): a
summarised episode is several records, each trained on exactly what was sampled in it; its records
share the one advantage the episode earns in its group; episode metrics count episodes, not records;
a summary that cannot be written makes the attempt infra (out of the pass rate and neutral in the
advantages); refusals at load; and a tiny run that resumes to the uninterrupted run's weights.

The policy is a tiny model taught calculator episodes of a few tasks by heart (a tool call, its
result, the answer), so that its episodes are multi-turn and end with answers whose reward varies
(the parity verifier of tests/test_rl.py); a summary comes before the answer once the call and its
result are in context."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from test_agent import overfit, tiny_model, tiny_tasks
from test_recipes_context import REQUEST, Recording, corpus

import snowcat.stages.rl as rl
from snowcat.pipeline.context import StageContext
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import sha256_file
from snowcat.stages.agent import Trajectory, TrajectoryBatch, make_env, teacher_messages
from snowcat.stages.agent import context as ctxmod
from snowcat.stages.agent.prompting import PromptStripper, prompt_span
from snowcat.stages.agent.summariser import context_policy
from snowcat.stages.agent.trajectory import segments
from snowcat.stages.algorithms import group_advantages, rloo_n_advantages
from snowcat.stages.model import load_model_dir, save_model_dir
from snowcat.stages.rlcore.episodes import generate_batch
from snowcat.stages.rlcore.objective import make_batch, sampled_logprobs, update_rows
from snowcat.stages.rlcore.trainer import batch_metrics, episode_turns, prompt_gap_sums
from snowcat.stages.rollout import SamplingParams, TorchEngine
from snowcat.stages.taskgen import load_tasks, save_tasks
from snowcat.stages.tokenizer import train_tokenizer
from tests.test_rl import final_sha

pytestmark = pytest.mark.xdist_group("rl_summarise")  # one worker builds the module's model once


# ---------------------------------------------------------------- by hand: advantages and metrics


def record(group: int, attempt: int, reward: float, segment: int, sampled: int, status: str = "ok", kind: str = "context"):
    """One record: 2 context tokens, then `sampled` sampled tokens (one turn)."""
    return Trajectory(
        task_id=f"t{group}",
        group_id=group,
        attempt=attempt,
        policy_version=0,
        token_ids=[1, 2, *range(3, 3 + sampled)],
        loss_mask=[0, 0] + [1] * sampled,
        rollout_logprobs=[0.0, 0.0] + [-1.0] * sampled,
        reward=reward,
        status=status,
        turn_boundaries=[(2, 2 + sampled)],
        prompt_len=2,
        segment=segment,
        segment_kind=kind,
        detail="summary: took 1 s, over timeout_s 1e-09" if status == "infra_error" else "",
    )


def episode(group: int, attempt: int, reward: float, kinds: tuple[str, ...], status: str = "ok") -> Trajectory:
    """An episode of len(kinds) records (its last holding the others), each with 1 + segment sampled tokens."""
    recs = [record(group, attempt, reward, s, 1 + s, status, kind) for s, kind in enumerate(kinds)]
    last = recs[-1]
    last.earlier = tuple(recs[:-1])
    return last


SUMMARISED = ("context", "summary", "context")


def hand_batch() -> list[Trajectory]:
    """Group 0: a passing episode summarised once (3 records), two failing ones (one summarised by a
    helper: 2 records), one whose summary failed (infra). Group 1: plain episodes, one passing."""
    return [
        episode(0, 0, 1.0, SUMMARISED),
        episode(0, 1, 0.0, ("context",)),
        episode(0, 2, 0.0, ("context", "context")),
        episode(0, 3, 0.0, ("context",), status="infra_error"),
        episode(1, 0, 1.0, ("context",)),
        episode(1, 1, 0.0, ("context",)),
        episode(1, 2, 0.0, ("context",)),
        episode(1, 3, 0.0, ("context",)),
    ]


@pytest.mark.parametrize("estimator", ["rloo_n", "grpo", "dr_grpo", "rloo"])
def test_a_summarised_episodes_records_share_the_advantage_of_the_episode(estimator):
    trajs = hand_batch()
    batch = make_batch(trajs, 0, estimator)
    rows = update_rows(trajs)
    assert len(rows) == batch["input_ids"].shape[0] == 11  # every record is a row: 3 + 1 + 2 + 1 + 4
    # the reference: each episode once, in its group (the infra one left out where the estimator can)
    if estimator == "rloo_n":
        # RLOO-N over the valid episodes: group 0 is {1, 0, 0} -> 1 - 0, 0 - 1/2, 0 - 1/2, infra 0
        hand = {(0, 0): 1.0, (0, 1): -0.5, (0, 2): -0.5, (0, 3): 0.0, (1, 0): 1.0, (1, 1): -1 / 3, (1, 2): -1 / 3, (1, 3): -1 / 3}
    else:
        per_episode, _ = group_advantages(
            [t.group_id for t in trajs], [t.reward for t in trajs], [t.trainable for t in trajs], estimator
        )
        hand = {(t.group_id, t.attempt): float(a) for t, a in zip(trajs, per_episode)}
    got = [float(a) for a in batch["advantages"]]
    assert got == pytest.approx([hand[(r.group_id, r.attempt)] for r in rows], abs=1e-5)
    # the records as members of their group (the mistake this avoids) would give another baseline
    as_members, _ = group_advantages([r.group_id for r in rows], [r.reward for r in rows], [r.trainable for r in rows], estimator)
    assert not torch.allclose(as_members, batch["advantages"], atol=1e-4)
    # the infra episode: no loss at all, and its reward entered nobody's rloo_n baseline
    infra = [b for b, r in enumerate(rows) if r.status == "infra_error"]
    assert infra and not batch["mask"][infra].any() and not batch["trainable"][infra].any()
    # every sampled token of every valid record is a target of its row, in its own context
    for b, r in enumerate(rows):
        want = r.token_ids[1:][r.loss_mask[1:] > 0].tolist() if r.trainable else []
        assert batch["targets"][b][batch["mask"][b] > 0].tolist() == want


def test_records_of_one_episode_that_disagree_on_its_reward_are_refused():
    trajs = hand_batch()
    trajs[0].earlier[1].reward = 0.0
    with pytest.raises(ValueError, match="records 0 and 1 of episode 0 in group 0 disagree"):
        make_batch(trajs, 0, "rloo_n")


def test_batch_metrics_count_episodes_not_records():
    trajs = hand_batch()
    rec = batch_metrics(trajs, summarised=True)
    scored = [t for t in trajs if t.trainable]
    assert rec["pass_rate"] == pytest.approx(2 / 7) and rec["reward/mean"] == pytest.approx(2 / 7)  # 7 scored episodes
    assert rec["exposure/"] == len(scored) == 7
    assert rec["status/infra_error"] == pytest.approx(1 / 8) and rec["status/ok"] == pytest.approx(7 / 8)
    # lengths and turns per episode, over its records (the summarised one: 1 + 2 + 3 sampled tokens)
    assert rec["length/response_mean"] == pytest.approx((6 + 1 + 3 + 1 + 4) / 8)
    assert rec["length/total_mean"] == pytest.approx((6 + 6 + 3 + 7 + 3 + 3 * 4) / 8)
    assert rec["turns/mean"] == pytest.approx((2 + 1 + 2 + 1 + 4) / 8)  # a summary the policy wrote is no turn
    assert rec["context/summary_failures"] == 1
    assert rec["context/summaries_per_episode"] == pytest.approx((1 + 1) / 7)  # context records after the first
    assert rec["context/summarised_frac"] == pytest.approx(2 / 7)


# ---------------------------------------------------------------- a tiny policy and its run


BUDGET = dict(max_turns=3, max_tokens=12, max_total_tokens=160)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, int]:
    """tasks/ and sft/checkpoints/final (a tiny model taught 8 tasks' calculator episodes), and a
    threshold every episode with a tool call and its result in context reaches, and none before it."""
    torch.set_num_threads(1)
    arith, closure = tiny_tasks()
    tok = train_tokenizer(corpus(arith, closure) * 2, vocab_size=400)
    demos = [teacher_messages(t, "calculator") for t in arith[:8]]
    model = overfit(tiny_model(tok, seed=1), tok, demos, max_steps=60)
    root = tmp_path_factory.mktemp("rl_summarise")
    save_tasks(root / "tasks", "train", arith[:8])
    save_tasks(root / "tasks", "val", arith[8:12])
    save_model_dir(root / "sft" / "checkpoints" / "final", model, tok)
    opening = min(len(tok.render_prompt(d[:1])) for d in demos)
    after_call = min(len(tok.render_prompt(d[:3])) for d in demos)  # the prompt, the call, its result
    assert opening < after_call
    return root, after_call


def context(at: int, **over) -> dict:
    return {"policy": "summarise", "at_tokens": at, "keep_turns": 0, "max_tokens": 8, "request": REQUEST, **over}


def make_ctx(root: Path, run_dir: Path, at: int, context_over: dict | None = None, **over) -> StageContext:
    values = {
        "env": "calculator",
        **BUDGET,
        "context": context(at, **(context_over or {})),
        "updates": 4,
        "tasks_per_update": 4,
        "attempts": 4,
        "lag": 1,
        "eval_every": 0,
        "save_every": 2,
        "keep_last": 1,
        "threads": 1,
        "timeout_s": 120,
        "verifier": "tests.test_rl:parity_verify",
        **over,
    }
    return StageContext.standalone("rl", values, run_dir=run_dir, inputs={"tasks": root / "tasks", "sft": root / "sft"}, seed=5)


def sampled_batch(inputs, tmp_path, context_over: dict | None = None, **over):
    """Batch 0 as the rollout rank makes it (the stage's config, context policy and engine), read back
    as the trainer receives it; with the engine's every call kept."""
    root, at = inputs
    ctx = make_ctx(root, tmp_path, at, context_over, **over)
    cfg = ctx.config
    model, _, tok = load_model_dir(root / "sft" / "checkpoints" / "final")
    model.eval()
    engine = Recording(TorchEngine(model, max_batch=16))
    params = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p, cfg.max_tokens, (tok.end_of_turn_id,))
    tasks = rl.tasks_of_batch(cfg, rl.load_pool(ctx, cfg)[0], ctx.seed, 0)
    policy = context_policy(ctx, cfg, "stages.rl.context")
    sent = generate_batch(
        engine, tok, tasks, cfg, params, seed=rl.batch_seed(ctx.seed, 0), policy_version=0, batch_index=0, context=policy
    )
    received = TrajectoryBatch.read(sent.buffer.copy())
    return model, tok, params, received, engine.calls


def test_the_update_trains_exactly_the_tokens_each_record_sampled(inputs, tmp_path):
    """Rows are the batch's records; a row's targets are the ids the engine sampled in that record's
    context (each turn one engine completion of exactly the ids before it; the summaries the policy
    wrote too); the trainer's scores of them are the engine's logprobs, also under router replay."""
    model, tok, params, trajs, calls = sampled_batch(inputs, tmp_path)
    rows = update_rows(trajs)
    assert len(trajs) == 16 and len(rows) > len(trajs) and update_rows(rows) == rows
    summarised = [t for t in trajs if t.earlier]
    assert summarised and any(r.segment_kind == "summary" for t in summarised for r in segments(t))
    assert any(t.reward == 1.0 for t in summarised) and any(t.trainable and t.reward == 0.0 for t in trajs)
    batch = make_batch(trajs, tok.pad_id, "rloo_n")
    used = [False] * len(calls)
    for b, r in enumerate(rows):
        ids = r.token_ids.tolist()
        sampled = []
        for s, e in r.turn_boundaries:
            hit = next(i for i, (p, c) in enumerate(calls) if not used[i] and p == ids[:s] and c.token_ids[: e - s] == ids[s:e])
            used[hit] = True
            sampled += ids[s:e]
        assert batch["targets"][b][batch["mask"][b] > 0].tolist() == sampled
    assert all(used)  # every completion the engine made is trained once, in one row
    for t in summarised:  # one advantage for all of an episode's records
        mine = [i for i, r in enumerate(rows) if (r.group_id, r.attempt) == (t.group_id, t.attempt)]
        assert len(mine) == len(segments(t)) and len({float(batch["advantages"][i]) for i in mine}) == 1
    with torch.no_grad():
        for replay in (False, True):
            logp = sampled_logprobs(model, batch, params, replay=replay)[0]
            mask = batch["mask"] > 0
            torch.testing.assert_close(logp[mask], batch["rollout_logprobs"][mask], atol=1e-4, rtol=0)


def test_a_helper_served_by_the_rollout_side_writes_summaries_that_are_never_trained(inputs, tmp_path):
    """`summariser: "<stage>:<checkpoint>"`: the rollout side serves it (here the policy's own weights,
    another engine); the episodes are still several records, but no summary record is trained."""
    _, tok, _, trajs, calls = sampled_batch(inputs, tmp_path, {"summariser": "sft:final"})
    rows = update_rows(trajs)
    assert len(rows) > len(trajs) and {r.segment_kind for r in rows} == {"context"}
    assert sum(len(r.turn_boundaries) for r in rows) == len(calls)  # the policy's engine served turns only
    batch = make_batch(trajs, tok.pad_id, "rloo_n")
    assert int(batch["mask"].sum()) == sum(int(r.loss_mask.sum()) for r in rows if r.trainable)


def test_a_failed_summary_is_infra_out_of_the_pass_rate_and_neutral_in_the_advantages(inputs, tmp_path):
    # a time-out no summary meets; a threshold the longest openings with a call and its result reach
    _, tok, _, trajs, _ = sampled_batch(inputs, tmp_path, {"timeout_s": 1e-9, "at_tokens": inputs[1] + 2})
    failed = [t for t in trajs if t.status == "infra_error"]
    assert failed and all(ctxmod.is_failure(t.detail) and not t.earlier for t in failed)
    scored = [t for t in trajs if t.trainable]
    assert scored and any(t.passed for t in scored)
    rec = batch_metrics(trajs, summarised=True)
    assert rec["context/summary_failures"] == len(failed)
    assert rec["pass_rate"] == pytest.approx(np.mean([t.passed for t in scored]))  # failures left out, not zeros
    batch = make_batch(trajs, tok.pad_id, "rloo_n")
    groups = sorted({t.group_id for t in trajs})
    rewards = torch.tensor([[t.reward for t in trajs if t.group_id == g] for g in groups], dtype=torch.float64)
    valid = torch.tensor([[t.trainable for t in trajs if t.group_id == g] for g in groups])
    hand = rloo_n_advantages(rewards, valid).flatten()  # the failed attempts neutral, out of the baselines
    torch.testing.assert_close(batch["advantages"].double(), hand.float().double(), atol=1e-6, rtol=0)
    assert not batch["mask"][[not t.trainable for t in trajs]].any()


PROMPT = "Check each step."


def test_a_rollout_prompt_leaves_every_record_and_the_gap_is_per_episode_turn(inputs, tmp_path):
    """With `rollout_prompt`, every record of a summarised episode opens with the prompt (each context,
    each summary request) and the update's rows lose it token-exactly; `prompt_gap/turn_<t>` numbers
    the turns over the episode's contexts, and a summary the policy wrote counts in the mean only."""
    model, tok, params, trajs, _ = sampled_batch(inputs, tmp_path, rollout_prompt=PROMPT)
    env = make_env("calculator", tok)
    tasks = {t.task_id: t for t in load_tasks(inputs[0] / "tasks", "train")}
    update = PromptStripper(env, PROMPT, tasks)(list(trajs))
    records, stripped = update_rows(trajs), update_rows(update)
    assert len(records) == len(stripped) > len(trajs)
    for a, b in zip(records, stripped):
        start, ids = prompt_span(env, tasks[a.task_id], PROMPT)
        assert b.token_ids.tolist() == a.token_ids[:start].tolist() + a.token_ids[start + len(ids) :].tolist()
    prompted, unprompted = make_batch(trajs, tok.pad_id, "rloo_n"), make_batch(update, tok.pad_id, "rloo_n")
    with torch.no_grad():
        lp_p, lp_u = (sampled_logprobs(model, x, params)[0].double() for x in (prompted, unprompted))
    turns = BUDGET["max_turns"]
    sums, _ = prompt_gap_sums(records, prompted, unprompted, lp_p, lp_u, turns, episode_turns(records))
    # the reference, episode by episode: its turns numbered on over its contexts
    ref, summaries, b = {k: [] for k in range(turns)}, [], 0
    for t, u in zip(trajs, update):
        done = 0
        for r, v in zip(segments(t), segments(u)):
            for (s, e), (s2, _) in zip(r.turn_boundaries, v.turn_boundaries):
                gaps = [float(lp_p[b, j - 1] - lp_u[b, s2 + j - s - 1]) for j in range(s, e) if r.loss_mask[j]]
                if r.segment_kind == "summary":
                    summaries += gaps
                else:
                    ref[done] += gaps
                    done += 1
            b += 1
    assert summaries and any(r.segment > 1 and r.turn_boundaries for r in records)  # a turn after a summary
    for k in range(turns):
        assert sums[turns + k] == len(ref[k])
        if ref[k]:
            assert sums[k] / sums[turns + k] == pytest.approx(np.mean(ref[k]), abs=1e-9)
    everything = [g for k in range(turns) for g in ref[k]] + summaries
    assert sums[2 * turns + 2] == len(everything)
    assert (sums[:turns].sum() + sums[2 * turns + 3]) / sums[2 * turns + 2] == pytest.approx(np.mean(everything), abs=1e-9)


# ---------------------------------------------------------------- refused at load


@pytest.mark.parametrize(
    "over, message",
    [
        ({"env": "single"}, "stages.rl.context.policy: summarise needs a multi-turn env"),
        ({"context_over": {"at_tokens": 160}}, "stages.rl.context.at_tokens: must be between 1 and max_total_tokens - 1 (159)"),
        ({"context_over": {"summariser": "helper:final"}}, "stages.rl.needs: add 'helper' (named in context.summariser)"),
    ],
)
def test_a_context_policy_rl_cannot_run_is_refused_at_load_naming_the_key(inputs, tmp_path, over, message):
    root, at = inputs
    with pytest.raises(UserError) as e:
        make_ctx(root, tmp_path, at, **over)
    assert str(e.value).startswith(message)


# ---------------------------------------------------------------- the stage


def kept(run_dir: Path) -> list[dict]:
    shards = sorted((run_dir / "rl" / "trajectories").glob("step_*.parquet"))
    return [
        row for s in shards for row in pq.read_table(s, columns=["step", "group_id", "attempt", "status", "passed"]).to_pylist()
    ]


@pytest.mark.slow
def test_a_summarised_run_trains_counts_episodes_and_resumes_to_the_uninterrupted_weights(inputs, tmp_path):
    root, at = inputs
    rl.run(make_ctx(root, tmp_path / "a", at))
    rows = [json.loads(line) for line in (tmp_path / "a" / "rl" / "metrics_history.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "reward/mean" in r]
    assert len(updates) == 4
    episodes = kept(tmp_path / "a")
    assert len(episodes) == 4 * 16  # one kept row per episode, however many records it had
    assert any(r["context/summaries_per_episode"] > 0 for r in updates)
    initial = sha256_file(tmp_path / "a" / "rl" / "checkpoints" / "initial" / "model.safetensors")
    assert final_sha(tmp_path / "a") != initial  # the episodes' advantages moved the weights
    for r in updates:
        step = [e for e in episodes if e["step"] == r["step"] - 1]
        scored = [e["passed"] for e in step if e["passed"] >= 0]
        assert r["pass_rate"] == pytest.approx(np.mean(scored))  # per episode
        assert r["exposure/arith"] == len(scored)
        assert r["context/summary_failures"] == 0 and r["tokens"] > 0
    # a preempted and resumed run ends with the uninterrupted run's weights and kept batches
    preempt = make_ctx(root, tmp_path / "b", at)
    polls = iter(range(1000))
    preempt.checkpoint_due = lambda: next(polls) == 3
    with pytest.raises(StageContext.Preempted):
        rl.run(preempt)
    rl.run(make_ctx(root, tmp_path / "b", at))
    assert final_sha(tmp_path / "b") == final_sha(tmp_path / "a")
    assert kept(tmp_path / "b") == episodes


@pytest.mark.slow
def test_a_prompted_summarised_run_logs_the_gap_of_turns_after_a_summary(inputs, tmp_path):
    """The trainer's own path: the prompt removed from every record of the batch it receives, the
    rows split and scored as records, the gap logged under the episodes' turn numbers."""
    root, at = inputs
    rl.run(make_ctx(root, tmp_path, at, rollout_prompt=PROMPT, updates=2, save_every=0))
    rows = [json.loads(line) for line in (tmp_path / "rl" / "metrics_history.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "reward/mean" in r]
    assert len(updates) == 2 and all(r["context/summaries_per_episode"] > 0 for r in updates)
    assert all(np.isfinite(r["prompt_gap/mean"]) and np.isfinite(r["mismatch_prompted/k3_kl"]) for r in updates)
    assert any("prompt_gap/turn_2" in r for r in updates)
