"""Transcript summarisation as an agent context policy (stages/agent/context.py, docs/agents.md,
docs/recipes.md): past a threshold older turns are replaced by a summary written by the policy or a
helper model; every trained token is one the engine sampled, in the very context it was sampled in;
a summary that cannot be written makes the attempt infra (exactly the episodes that needed one), and
evaluate leaves those out of its pass rates, counts them per checkpoint, and `snowcat compare`'s
equal-rates test sees them. A tiny untrained model: its turns are cut by the turn budget and the
loop goes on, so its episodes grow long."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from test_agent import assert_same_episodes, overfit, tiny_model, tiny_tasks

import snowcat.stages.evaluate as evaluate
from snowcat.pipeline import config as config_mod
from snowcat.pipeline.context import StageContext
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.reports import compare as compare_mod
from snowcat.stages.agent import Budget, CalculatorEnv, EpisodeJob, decode, encode, pack, run_episodes, teacher_messages
from snowcat.stages.agent import context as ctxmod
from snowcat.stages.agent.prompting import PromptedEnv, prompt_span, strip_prompt
from snowcat.stages.agent.trajectory import flatten, regroup, segments, unpack
from snowcat.stages.model import save_model_dir
from snowcat.stages.model.tiny_hf import hf_chat_tokenizer
from snowcat.stages.rlcore.objective import make_batch, sampled_logprobs
from snowcat.stages.rollout import SamplingParams, TorchEngine
from snowcat.stages.taskgen import save_tasks
from snowcat.stages.tokenizer import train_tokenizer
from tests.conftest import write_config

# one worker builds the module's model and runs once (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("recipes_context")

REQUEST = "Summarise the work so far."
PARAMS = SamplingParams(temperature=1.0)
BUDGET = Budget(max_context=200, max_turn_tokens=6, max_turns=6)
SEED = 5


def corpus(arith, closure) -> list[str]:
    """The tasks, the loop's note and the summary texts (so that a request fits a tiny model's context)."""
    texts = [t.prompt for t in arith + closure] + [t.answer for t in arith + closure] + ["turn cut at tokens; answer briefly"]
    words = [REQUEST, ctxmod.SUMMARY_MESSAGE, ctxmod.PREVIOUS, ctxmod.OMITTED, "[assistant]\n", "[result]\n"]
    return texts + words * 8


class Recording:
    """The real engine, with every request it served and what it returned kept (an observer)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate_seeded(self, prompts, params, seeds):
        out = self.engine.generate_seeded(prompts, params, seeds)
        self.calls += [(list(p), c) for p, c in zip(prompts, out)]
        return out


@pytest.fixture(scope="module")
def world():
    torch.set_num_threads(1)
    arith, closure = tiny_tasks()
    tok = train_tokenizer(corpus(arith, closure) * 2, vocab_size=400)
    jobs = [EpisodeJob(t, group_id=g, attempt=a) for g, t in enumerate(arith[:2] + closure[:2]) for a in range(2)]
    return arith, closure, tok, tiny_model(tok, seed=1), jobs


def summarise(**over) -> ctxmod.Summarise:
    return ctxmod.Summarise(**{"at_tokens": 40, "keep_turns": 1, "max_tokens": 8, "request": REQUEST, **over})


@pytest.fixture(scope="module")
def summarised(world):
    """Episodes whose summaries the policy wrote, with every engine call kept."""
    _, _, tok, model, jobs = world
    engine = Recording(TorchEngine(model, max_batch=16))
    env = ctxmod.with_context(CalculatorEnv(tok, require_tool=False), summarise())
    trajs = run_episodes(engine, tok, jobs, env, PARAMS, BUDGET, seed=SEED, policy_version=3)
    return trajs, engine.calls


def test_every_trained_token_was_sampled_in_the_context_it_is_trained_in(world, summarised):
    """Each record's trained ids are one engine completion, preceded by exactly the ids the engine was
    given; every completion (turns and the policy's summaries) is trained once; and the trainer's own
    rescoring of the flattened records gives the sampling logprobs."""
    tok, model = world[2], world[3]
    trajs, calls = summarised
    records = flatten(trajs)
    assert {r.segment_kind for r in records} == {"context", "summary"}
    assert any(r.segment >= 2 and r.turn_boundaries for r in records), "no turn sampled after a summary"
    assert all(r.status != "infra_error" for r in records)
    used = [False] * len(calls)
    for r in records:
        ids = r.token_ids.tolist()
        covered = np.zeros(len(ids), bool)
        for s, e in r.turn_boundaries:
            hit = next(i for i, (p, c) in enumerate(calls) if not used[i] and p == ids[:s] and c.token_ids[: e - s] == ids[s:e])
            used[hit] = True
            np.testing.assert_array_equal(r.rollout_logprobs[s:e], np.asarray(calls[hit][1].logprobs[: e - s], np.float32))
            covered[s:e] = True
        assert np.array_equal(r.loss_mask.astype(bool), covered)  # nothing trained outside a sampled turn
        assert len(r) <= BUDGET.max_context and r.policy_version == 3
    assert all(used)  # every turn and every summary the engine wrote is in exactly one record
    batch = make_batch(records, tok.pad_id, "rloo_n")
    with torch.no_grad():
        logp = sampled_logprobs(model, batch, PARAMS)[0]
    mask = batch["mask"] > 0
    torch.testing.assert_close(logp[mask], batch["rollout_logprobs"][mask], atol=1e-4, rtol=0)
    for b, r in enumerate(records):
        trained = [int(x) for x, m in zip(r.token_ids[1:], r.loss_mask[1:]) if m]
        assert batch["targets"][b][batch["mask"][b] > 0].tolist() == trained


def test_a_summary_replaces_the_older_turns_and_the_latest_turn_is_copied_id_for_id(world, summarised):
    tok = world[2]
    trajs, _ = summarised
    seen = 0
    for t in trajs:
        recs = segments(t)
        opening = t_opening = [{"role": "user", "content": next(j.task for j in world[4] if j.task.task_id == t.task_id).prompt}]
        assert recs[0].token_ids[: recs[0].prompt_len].tolist() == tok.render_prompt(t_opening)
        for prev, summary, nxt in zip(recs[::2], recs[1::2], recs[2::2]):
            assert (prev.segment_kind, summary.segment_kind, nxt.segment_kind) == ("context", "summary", "context")
            request = tok.decode(summary.token_ids[: summary.prompt_len])
            assert REQUEST in request and "[assistant]" in request
            text = ctxmod.summary_text(tok, summary.token_ids[summary.prompt_len :].tolist())
            start = ctxmod.context_after(tok, opening, text)
            last = prev.turn_boundaries[-1][0]  # keep_turns 1: the latest turn and what followed it
            assert nxt.token_ids.tolist()[: nxt.prompt_len] == start + prev.token_ids[last:].tolist()
            assert not nxt.loss_mask[: nxt.prompt_len].any()  # carried, not trained again
            seen += 1
        assert all(r.reward == t.reward and r.status == t.status and r.detail == t.detail for r in recs)
    assert seen >= 4
    stats = ctxmod.context_behaviour(trajs)  # what evaluate reports per checkpoint
    assert stats["summaries_per_episode"] == seen / len(trajs) and 0 < stats["summarised_frac"] <= 1
    sampled = sum(len(r.turn_boundaries) for r in flatten(trajs) if r.segment_kind == "context")
    assert stats["turns_per_episode"] == sampled / len(trajs) > np.mean([len(t.turn_boundaries) for t in trajs])


def test_segmented_episodes_cross_the_wire_whole(summarised):
    trajs, _ = summarised
    k, back = decode(encode(7, trajs))
    assert k == 7 and back == trajs and len(back) == len(trajs)
    assert len(pack(trajs)["segment"]) == len(flatten(trajs)) > len(trajs)
    assert regroup(flatten(trajs)) == trajs
    shuffled = pack(trajs)
    shuffled["segment"] = shuffled["segment"][::-1].copy()
    with pytest.raises(ValueError, match="segment"):
        unpack(shuffled)


def test_a_rollout_prompt_is_removed_from_every_context_of_a_summarised_episode(world):
    """With a rollout prompt in the opening, every record (each context, each summary request) opens
    with it, so the update's context drops it from each: what remains is the unprompted opening."""
    _, _, tok, model, jobs = world
    env = CalculatorEnv(tok, require_tool=False)
    prompted = ctxmod.with_context(PromptedEnv(env, "Check each step."), summarise())
    trajs = run_episodes(TorchEngine(model), tok, jobs[:2], prompted, PARAMS, BUDGET, seed=SEED, policy_version=0)
    start, ids = prompt_span(env, jobs[0].task, "Check each step.")
    for t, job in zip(trajs, jobs):
        u = strip_prompt(t, *prompt_span(env, job.task, "Check each step."))
        assert len(u.earlier) == len(t.earlier) > 0
        for a, b in zip(segments(t), segments(u)):
            assert b.token_ids.tolist() == a.token_ids[:start].tolist() + a.token_ids[start + len(ids) :].tolist()
            assert np.array_equal(b.loss_mask, np.delete(a.loss_mask, range(start, start + len(ids))))
            assert (b.segment, b.segment_kind) == (a.segment, a.segment_kind)
            assert b.token_ids[: len(env.prompt(job.task)) - 1].tolist() == env.prompt(job.task)[:-1]


def test_a_failed_summary_makes_exactly_the_episodes_that_needed_one_infra(world):
    """With a time-out no summary meets, every episode that reached the threshold (before a turn, with
    more than keep_turns turns in context) ends infra_error naming the summary; every other episode is
    exactly what it is without a context policy."""
    _, _, tok, model, jobs = world
    env, budget = CalculatorEnv(tok, require_tool=False), Budget(200, 6, 4)
    plain = run_episodes(TorchEngine(model), tok, jobs, env, PARAMS, budget, seed=SEED, policy_version=0)
    # the context before each turn after the second: a threshold some episodes reach and others do not
    reach = [max((s for k, (s, _) in enumerate(t.turn_boundaries) if k > 1), default=0) for t in plain]
    at = sorted(reach)[len(reach) // 2]
    policy = summarise(at_tokens=at, timeout_s=1e-9)
    failed = run_episodes(TorchEngine(model), tok, jobs, ctxmod.with_context(env, policy), PARAMS, budget, SEED, 0)
    due = [r >= at for r in reach]
    assert 0 < sum(due) < len(due)
    for f in (f for f, d in zip(failed, due) if d):
        assert f.status == "infra_error" and not f.trainable and f.detail.startswith("summary: took ")
        assert ctxmod.is_failure(f.detail) and f.earlier == ()
    # the others: the same episodes (the batch thins out sooner, so logprobs may differ in the last bits)
    assert_same_episodes([f for f, d in zip(failed, due) if not d], [p for p, d in zip(plain, due) if not d])


def test_a_helper_model_with_its_own_tokenizer_writes_the_summaries_and_none_of_it_is_trained(world, tmp_path):
    arith, closure, tok, model, jobs = world
    helper_tok = hf_chat_tokenizer(corpus(arith, closure), tmp_path, vocab_size=400)
    helper_engine = Recording(TorchEngine(tiny_model(helper_tok, seed=4)))
    helper = ctxmod.Helper(helper_engine, helper_tok, SamplingParams(temperature=0.0), max_context=256)
    engine = Recording(TorchEngine(model, max_batch=16))
    env = ctxmod.with_context(CalculatorEnv(tok, require_tool=False), summarise(helper=helper))
    trajs = run_episodes(engine, tok, jobs, env, PARAMS, BUDGET, seed=SEED, policy_version=0)
    records = flatten(trajs)
    assert {r.segment_kind for r in records} == {"context"} and len(records) > len(trajs)
    assert sum(len(r.turn_boundaries) for r in records) == len(engine.calls)  # the policy's turns only
    summaries = [ctxmod.summary_text(helper_tok, c.token_ids) for _, c in helper_engine.calls]
    assert len(summaries) == len(records) - len(trajs)
    for request, _ in helper_engine.calls:  # rendered by the helper's own template
        assert helper_tok.render_prompt([{"role": "user", "content": "x"}])[:1] == request[:1]
        assert REQUEST in helper_tok.decode(request)
    starts = [r.token_ids[: r.prompt_len].tolist() for r in records if r.segment > 0]
    for t, job in zip(trajs, jobs):
        for r in segments(t)[1:]:
            opening = [{"role": "user", "content": job.task.prompt}]
            assert any(r.token_ids[: len(s)].tolist() == s for s in (ctxmod.context_after(tok, opening, x) for x in summaries))
    assert len(starts) == len(summaries)


# ---------------------------------------------------------------- evaluate: infra, out of the pass rates


@pytest.fixture(scope="module")
def eval_inputs(world, tmp_path_factory) -> tuple[Path, int]:
    """tasks/val and two checkpoints: one that learnt four tasks' calculator episodes by heart (a tool
    call, then the answer), one untrained; and a threshold that the longest of the four reaches before
    its answer and the others do not."""
    arith, closure, tok, model, _ = world
    root = tmp_path_factory.mktemp("context_eval")
    save_tasks(root / "tasks", "val", arith[:4] + closure[:1])
    demos = [teacher_messages(t, "calculator") for t in arith[:4]]
    trained = overfit(tiny_model(tok, seed=2), tok, demos, max_steps=60)
    save_model_dir(root / "sft" / "checkpoints" / "taught", trained, tok)
    save_model_dir(root / "sft" / "checkpoints" / "raw", model, tok)
    before_answer = [len(tok.render_prompt(d[:3])) for d in demos]  # the prompt, the call, the result
    assert min(before_answer) < max(before_answer)
    return root, max(before_answer)


EVAL = {
    "checkpoints": ["sft:taught", "sft:raw"],
    "env": "calculator",
    "attempts": 2,
    "pass_k": [1],
    "keep_trajectories": "none",
    "max_tokens": 10,
    "max_turns": 6,
    "max_context": 200,
    "infra_retries": 0,
    "bootstrap_samples": 50,
}


def context(at: int, **over) -> dict:
    return {"policy": "summarise", "at_tokens": at, "keep_turns": 0, "max_tokens": 8, "request": REQUEST, **over}


def test_evaluate_leaves_failed_summaries_out_of_the_pass_rates_and_counts_them_per_checkpoint(eval_inputs, tmp_path):
    """A summary that cannot be written (a time-out no call meets): the attempts that needed one are
    infra, left out of pass@1's denominators, counted per checkpoint, and what compare's equal-rates
    test reads; a learnt task whose episode needed one leaves the task means instead of scoring 0."""
    root, at = eval_inputs
    inputs = {"tasks": root / "tasks", "sft": root / "sft"}
    values = {**EVAL, "context": context(at, timeout_s=1e-9)}
    metrics = evaluate.run(StageContext.standalone("evaluate", values, run_dir=tmp_path, inputs=inputs, seed=3))
    results = json.loads((tmp_path / "evaluate" / "results.json").read_text())
    assert results["sampling"]["context"]["policy"] == "summarise"
    with h5py.File(tmp_path / "evaluate" / "traces.h5") as f:
        rows = list(zip(*(f[k][:] for k in ("checkpoint", "task_id", "passed", "infra_cause"))))
    variants = []
    for ref in EVAL["checkpoints"]:
        mine = [(t.decode(), int(p), c.decode()) for r, t, p, c in rows if r.decode() == ref]
        failed = [c for _, p, c in mine if p < 0]
        assert failed and len(failed) < len(mine) and all(c.startswith("summary: took ") for c in failed)
        group = results["checkpoints"][ref]["groups"]["all"]
        assert group["summary_failures"] == group["infra_failures"] == len(failed) == metrics[f"{ref}/summary_failures"]
        # pass@1: per task over its scored attempts only, then over the tasks that have any
        per_task: dict[str, list[int]] = {}
        for t, p, _ in mine:
            if p >= 0:
                per_task.setdefault(t, []).append(p)
        assert group["pass@1"] == pytest.approx(np.mean([np.mean(v) for v in per_task.values()]))
        assert group["tasks_scored"] == len(per_task)
        variant = compare_mod.Variant(label=ref, source=ref)
        for t, p, _ in mine:
            variant.add(t, p)
        variants.append(variant)
    taught = results["checkpoints"]["sft:taught"]["groups"]["all"]
    # the learnt task that needed a summary left the means; counted as failures it would lower the score
    assert taught["tasks_scored"] < taught["tasks"] and taught["pass@1"] > 0
    as_failures = sum(p == 1 for r, _, p, _ in rows if r.decode() == "sft:taught") / taught["attempts"]
    assert taught["pass@1"] > as_failures
    checks = compare_mod.infra_checks(variants)  # `snowcat compare`'s test of equal failure rates
    assert 0 <= checks["equal_rates_p"] <= 1


# ---------------------------------------------------------------- bad config


@pytest.mark.parametrize(
    "context, extra, message",
    [
        ({"at_tokens": 30}, {"env": "single"}, "stages.eval.context.policy: summarise needs a multi-turn env"),
        ({"at_tokens": 30}, {"max_turns": 2}, "stages.eval.context.keep_turns: summaries come before a turn"),
        ({"at_tokens": 512}, {}, "stages.eval.context.at_tokens: must be between 1 and max_context - 1 (511)"),
        ({"at_tokens": 30, "summariser": "helper:final"}, {}, "stages.eval.needs: add 'helper' (named in context.summariser)"),
        ({"at_tokens": 30, "summariser": "nonsense"}, {}, "stages.eval.context.summariser: not 'policy'"),
    ],
)
def test_a_context_policy_that_could_never_act_is_refused_at_load_naming_the_key(tmp_path, context, extra, message):
    section = {"kind": "evaluate", "needs": ["tasks", "sft"], "env": "calculator", "max_turns": 4, **extra}
    section["context"] = {"policy": "summarise", **context}
    path = write_config(
        tmp_path / "c.yaml",
        f"name: x\nstages:\n  tasks: {{kind: tasks}}\n  sft: {{kind: sft, needs: [tasks]}}\n  eval: {json.dumps(section)}\n",
    )
    with pytest.raises(UserError) as e:
        config_mod.load(path)
    assert str(e.value).startswith(f"{path}: {message}")
