"""The seeds' recipes as RL options (docs/recipes.md): rehearsal (`rl.domain_weights`: every batch
mixes domains by weight, every named domain held out) and prompted rollouts with unprompted updates
(`rl.rollout_prompt`: the prompt's ids removed token-exactly from the update's context, the
prompted-vs-unprompted likelihood gap logged per turn)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from test_agent import tiny_model, tiny_tasks, tiny_tokenizer

import snowcat.stages.rl as rl
from snowcat.pipeline import config as config_mod
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.reports import card as card_mod
from snowcat.stages.agent import Budget, CalculatorEnv, EpisodeJob, RepoEnv, SingleTurnEnv, Trajectory, run_episodes
from snowcat.stages.agent.prompting import PromptedEnv, PromptError, prompt_span, strip_prompt
from snowcat.stages.config import RlConfig
from snowcat.stages.model.tiny_hf import hf_chat_tokenizer
from snowcat.stages.rlcore.objective import make_batch, sampled_logprobs
from snowcat.stages.rlcore.trainer import prompt_gap_sums
from snowcat.stages.rollout import SamplingParams, TorchEngine
from snowcat.stages.taskgen import generate_domain, load_tasks, save_tasks
from tests.conftest import write_config
from tests.qwen3_template import qwen3_tokenizer
from tests.test_rl import build_inputs, make_ctx

PROMPT = "Check each step; answer only when sure."

# ---------------------------------------------------------------- rehearsal: domain_weights


@pytest.mark.parametrize(
    "weights, per_batch",
    [({"a": 0.7, "b": 0.3}, 16), ({"a": 1, "b": 1, "c": 1}, 4), ({"a": 2, "b": 1, "c": 1}, 5), ({"x": 2, "y": 1}, 1)],
)
def test_every_batch_holds_the_floor_or_ceiling_of_each_share_and_totals_stay_within_one_task(weights, per_batch):
    total = sum(weights.values())
    counts = Counter()
    for k in range(240):
        quota = rl.domain_quotas(weights, per_batch, k)
        assert sum(quota.values()) == per_batch and list(quota) == sorted(weights)
        for d, n in quota.items():
            share = weights[d] / total * per_batch
            assert n in (int(np.floor(share)), int(np.ceil(share))), (k, d, n)
            counts[d] += n
            assert abs(counts[d] - share * (k + 1)) < 1, (k, d)
    assert [rl.domain_quotas(weights, per_batch, k) for k in (7, 3, 7)] == [
        rl.domain_quotas(weights, per_batch, k) for k in (7, 3, 7)
    ]


def test_weighted_batches_read_each_domain_from_its_own_seeded_permutations(inputs):
    pool = load_tasks(inputs / "tasks", "train")
    weights = {"closure": 3, "arith": 1, "ignored": 0}
    by_domain = {d: [t.task_id for t in pool if t.domain == d] for d in ("arith", "closure")}
    batches = [rl.weighted_batch_tasks(pool, weights, 8, 5, k) for k in range(60)]
    for k, batch in enumerate(batches):
        assert Counter(t.domain for t in batch) == Counter(rl.domain_quotas(weights, 8, k))  # 6 closure, 2 arith
    assert batches[:5] == [rl.weighted_batch_tasks(pool, weights, 8, 5, k) for k in range(5)]  # pure in (seed, k)
    # a domain's first epoch: every one of its tasks once, whatever the other domain drew
    drawn = {d: [t.task_id for b in batches for t in b if t.domain == d] for d in by_domain}
    for d, ids in by_domain.items():
        assert sorted(drawn[d][: len(ids)]) == sorted(ids)
    assert rl.weighted_batch_tasks(pool, weights, 8, 6, 0) != batches[0]  # the seed decides the order


def test_weight_zero_domains_are_held_out_not_trained(inputs, tmp_path):
    ctx = make_ctx(inputs, tmp_path, domain_weights={"closure": 1, "arith": 0})
    pool, held_out = rl.load_pool(ctx, ctx.config)
    assert {t.domain for t in pool} == {"closure"}
    assert Counter(t.domain for t in held_out) == {"closure": 4, "arith": 4}  # eval_tasks 8 over both domains


def test_domain_weights_problems_name_the_key(inputs, tmp_path):
    for over, key in (
        ({"domain_weights": {"closure": -1}}, r"domain_weights\.closure: must be >= 0"),
        ({"domain_weights": {"closure": 0}}, r"domain_weights: at least one domain needs a weight > 0"),
        ({"domain_weights": {"closure": 1}, "domains": ["closure"]}, r"domain_weights: give domains .* or domain_weights"),
        ({"rollout_prompt": "x", "router_replay": True}, r"rollout_prompt: cannot go with router_replay"),
    ):
        with pytest.raises(UserError, match=rf"^stages\.rl\.{key}"):
            make_ctx(inputs, tmp_path, **over)
    # a band (select) without tasks of a weighted domain
    save_tasks(tmp_path / "select", "band", [t for t in load_tasks(inputs / "tasks", "train") if t.domain == "closure"])
    ctx = make_ctx(inputs, tmp_path, domain_weights={"closure": 1, "arith": 1})
    ctx.inputs["select"] = tmp_path / "select"
    with pytest.raises(UserError, match=r"^stages\.rl\.domain_weights\.arith: no training task of domain 'arith'"):
        rl.load_pool(ctx, ctx.config)


def test_a_weight_on_a_domain_the_tasks_stage_does_not_make_is_refused_at_load(tmp_path):
    path = write_config(
        tmp_path / "mix.yaml",
        "name: x\nstages:\n  tasks: {kind: tasks}\n  sft: {kind: sft, needs: [tasks]}\n"
        "  rl: {kind: rl, needs: [tasks, sft], domain_weights: {closure: 1, arithmetic: 1}}\n",
    )
    with pytest.raises(UserError) as e:
        config_mod.load(path)
    assert str(e.value) == (
        f"{path}: stages.rl.domain_weights.arithmetic: stage 'tasks' makes no such domain (its domains: arith, closure)"
    )


def test_the_card_records_the_mix_and_the_prompt():
    cfg = RlConfig(domain_weights={"closure": 3, "arith": 1, "swe_mini": 0}, rollout_prompt=PROMPT)
    mix, prompt = card_mod.training._rl_recipe_lines(cfg)
    assert "every batch arith 0.25, closure 0.75 of its tasks" in mix and "held out, not trained: swe_mini" in mix
    assert f"{len(PROMPT)} characters" in prompt and "removed from the update's context" in prompt
    assert card_mod.training._rl_recipe_lines(RlConfig()) == ["  - task mix: the task pool as it comes (no `domain_weights`)"]


# ---------------------------------------------------------------- prompted rollouts, unprompted updates


@pytest.fixture(scope="module")
def episodes():
    """Prompted episodes of an untrained model (calculator env: several turns where it calls the tool)."""
    arith, closure = tiny_tasks()
    tok = tiny_tokenizer(arith + closure)
    model = tiny_model(tok, seed=2)
    env = CalculatorEnv(tok, require_tool=False)
    jobs = [EpisodeJob(t, group_id=g, attempt=a) for g, t in enumerate(arith[:3] + closure[:3]) for a in range(3)]
    params = SamplingParams(temperature=1.0, top_k=30)
    trajs = run_episodes(
        TorchEngine(model), tok, jobs, PromptedEnv(env, PROMPT), params, Budget(160, 8, 2), seed=4, policy_version=0
    )
    return tok, model, env, jobs, trajs, params


def test_the_update_context_is_the_rollout_minus_exactly_the_prompt_ids(episodes):
    tok, _, env, jobs, trajs, _ = episodes
    system = tok.encode_chat([{"role": "system", "content": PROMPT}])[0]
    for t, job in zip(trajs, jobs):
        start, ids = prompt_span(env, job.task, PROMPT)
        assert (start, ids) == (0, system)  # snowcat's template: the system message opens the conversation
        u = strip_prompt(t, start, ids)
        assert u.token_ids.tolist() == t.token_ids[:start].tolist() + t.token_ids[start + len(ids) :].tolist()
        assert u.token_ids[: u.prompt_len].tolist() == env.prompt(job.task)  # what remains: the unprompted opening
        n = len(ids)
        assert u.prompt_len == t.prompt_len - n and u.turn_boundaries == [(s - n, e - n) for s, e in t.turn_boundaries]
        for name in ("loss_mask", "rollout_logprobs", "support_lengths"):
            assert np.array_equal(getattr(u, name), getattr(t, name)[n:]), name
        assert np.array_equal(u.support_ids, t.support_ids)  # the opening has no kept supports
        for (s, e), (s2, e2) in zip(t.turn_boundaries, u.turn_boundaries):
            assert u.token_ids[s2:e2].tolist() == t.token_ids[s:e].tolist()  # every action as sampled
    assert max(len(t.turn_boundaries) for t in trajs) == 2  # tool calls: observations moved along too
    with pytest.raises(PromptError, match="not at"):
        strip_prompt(trajs[0], 1, system)


@pytest.mark.parametrize("kind", ["hf", "qwen3"])
def test_chat_templates_insert_the_prompt_as_one_run_of_ids(kind, tmp_path):
    """A checkpoint's template (HF style, and the real Qwen3 one with RepoEnv's tool schemas in its
    system turn): the prompt is one contiguous run, so removing it leaves the unprompted opening."""
    tasks = generate_domain(np.random.default_rng(1), "arith", [2], 4)
    make = hf_chat_tokenizer if kind == "hf" else qwen3_tokenizer
    tok = make([t.prompt for t in tasks] + [PROMPT], tmp_path, vocab_size=300)
    envs = [SingleTurnEnv(tok)] + ([RepoEnv(tok)] if kind == "qwen3" else [])
    for env in envs:
        for task in tasks:
            start, ids = prompt_span(env, task, PROMPT)
            prompted = PromptedEnv(env, PROMPT).prompt(task)
            assert prompted[:start] + prompted[start + len(ids) :] == env.prompt(task)
            assert PROMPT in tok.decode(ids)


def test_prompt_gap_per_turn_is_the_prompted_minus_unprompted_logprob_of_each_action(episodes):
    tok, model, env, jobs, trajs, params = episodes
    spans = {j.task.task_id: prompt_span(env, j.task, PROMPT) for j in jobs}
    update = [strip_prompt(t, *spans[t.task_id]) for t in trajs]
    prompted, stripped = make_batch(trajs, tok.pad_id, "rloo_n"), make_batch(update, tok.pad_id, "rloo_n")
    with torch.no_grad():
        lp_p = sampled_logprobs(model, prompted, params)[0]
        lp_u = sampled_logprobs(model, stripped, params)[0]
    sums, peak = prompt_gap_sums(trajs, prompted, stripped, lp_p, lp_u, turns=2)
    # the reference: each action scored alone in each context, token by token
    ref = {0: [], 1: []}
    engine_gap = []
    for b, (t, u) in enumerate(zip(trajs, update)):
        for turn, ((s, e), (s2, _)) in enumerate(zip(t.turn_boundaries, u.turn_boundaries)):
            for j in range(s, e):
                if t.loss_mask[j]:
                    ref[turn].append(float(lp_p[b, j - 1] - lp_u[b, s2 + j - s - 1]))
                    engine_gap.append(abs(float(lp_p[b, j - 1]) - float(t.rollout_logprobs[j])))
    assert ref[1], "no second turn: the test needs multi-turn episodes"
    for turn in (0, 1):
        assert sums[2 + turn] == len(ref[turn])
        assert sums[turn] / sums[2 + turn] == pytest.approx(np.mean(ref[turn]), abs=1e-9)
    assert np.mean(np.abs(ref[0])) > 1e-3  # the prompt does move the first action's likelihood
    # the engine's own prompted logprobs agree with the trainer's (same weights, fp32)
    assert sums[4] / sums[6] == pytest.approx(np.mean(engine_gap), abs=1e-9) and peak[0] < 1e-4


def test_rl_with_a_rollout_prompt_and_domain_weights(inputs, tmp_path):
    """One run of both recipes: batches mixed by weight (exposure per update = quota × attempts), the
    kept trajectories hold the prompt, the update does not, and the gap is logged each step."""
    weights = {"closure": 3, "arith": 1}
    ctx = make_ctx(inputs, tmp_path, updates=3, eval_every=3, rollout_prompt=PROMPT, domain_weights=weights)
    metrics = rl.run(ctx)
    rows = [json.loads(line) for line in (tmp_path / "rl" / "metrics_history.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "reward/mean" in r]
    assert len(updates) == 3
    for k, row in enumerate(updates):
        quota = rl.domain_quotas(weights, 4, k)
        assert {d: row[f"exposure/{d}"] for d in quota} == {d: n * 4 for d, n in quota.items()}
        assert np.isfinite(row["prompt_gap/turn_1"]) and row["prompt_gap/mean"] == row["prompt_gap/turn_1"]
        # mismatch/* compares the engine's prompted logprobs with the trainer's unprompted ones: the
        # prompt's effect (what TIS corrects), while the engine itself agrees with the trainer
        assert row["mismatch/log_ppl_diff"] == pytest.approx(-row["prompt_gap/mean"], abs=1e-5)
        assert row["mismatch_prompted/max_abs_dlogp"] < 1e-4 < row["mismatch/max_abs_dlogp"]
    assert {"val/pass@1/closure", "val/pass@1/arith"} <= set(metrics)  # held out per domain
    kept = pq.read_table(tmp_path / "rl" / "trajectories" / "step_000000.parquet").to_pylist()
    assert len(kept) == 16 and all(r["prompt"].startswith(f"<|system|>{PROMPT}<|end|><|user|>") for r in kept)  # as sampled


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("recipes_inputs")
    build_inputs(root)
    return root


def test_a_trajectory_whose_opening_lacks_the_prompt_is_refused():
    t = Trajectory("t", 0, 0, 0, [1, 2, 3, 4], [0, 0, 1, 1], [0, 0, -1, -1], 1.0, "ok", [(2, 4)], prompt_len=2)
    with pytest.raises(PromptError, match="not at 0..1"):
        strip_prompt(t, 0, [9])
    with pytest.raises(PromptError, match="not at 1..3"):
        strip_prompt(t, 1, [2, 3])  # beyond the opening: an action, never the prompt
    assert strip_prompt(t, 0, [1]).token_ids.tolist() == [2, 3, 4]
