"""Token-in-token-out: the training sequence holds exactly the sampled ids, though re-tokenising
the sampled text would change them (this repo's BPE merges 'h'+'e' -> 'he' and so on). Every test
runs with snowcat's local tokenizer, with a checkpoint-style HF tokenizer and chat template and with
the real Qwen3 chat template (tests/fixtures) on the torch engine, and with that HF checkpoint served
by vLLM (CPU); RepoEnv episodes (tool schemas in the prompt, tool results as observations) with the
real Qwen3 template in both thinking modes."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
import torch
from test_agent import overfit, tiny_model, tiny_tasks, tiny_tokenizer

from snowcat.stages.agent import Budget, CalculatorEnv, EpisodeJob, RepoEnv, episode_seed, run_episodes, teacher_messages
from snowcat.stages.agent.envs import tool_message_ids
from snowcat.stages.agent.loop import TRUNCATION_NOTE
from snowcat.stages.agent.repo_env import TOOL_SCHEMAS
from snowcat.stages.config import VllmConfig
from snowcat.stages.model import PRESETS, MoEForCausalLM, load_model_dir
from snowcat.stages.model.tiny_hf import hf_chat_tokenizer, tiny_checkpoint
from snowcat.stages.rollout import SamplingParams, TorchEngine, serve_model_dir
from snowcat.stages.taskgen import generate_domain
from snowcat.stages.tokenizer import message_text
from tests.conftest import masked_runs
from tests.qwen3_template import EMPTY_THINK, qwen3_tokenizer

SEED = 5
BUDGET = Budget(max_context=160, max_turn_tokens=6, max_turns=4, recover_long_turns=True)
PARAMS = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module", params=["local", "hf", "hf-qwen3", pytest.param("hf-vllm", marks=pytest.mark.slow)])
def rollout(request, tmp_path_factory):
    arith, closure = tiny_tasks()
    texts = [t.prompt for t in arith + closure] + [t.answer for t in arith + closure] + ["turn cut at tokens; answer briefly"]
    # untrained models: they sample arbitrary token sequences, the worst case for TITO
    if request.param == "local":
        tok = tiny_tokenizer(arith + closure)
        model = tiny_model(tok, seed=1)
        engine = TorchEngine(model, max_batch=16)
    elif request.param in ("hf", "hf-qwen3"):
        make = hf_chat_tokenizer if request.param == "hf" else qwen3_tokenizer
        tok = make(texts, tmp_path_factory.mktemp("tokenizer"), vocab_size=300)
        model = tiny_model(tok, seed=1)
        engine = TorchEngine(model, max_batch=16)
    else:
        path = tmp_path_factory.mktemp("checkpoint")
        tiny_checkpoint(path, texts, seed=1)
        model = load_model_dir(path)[0]  # the trainer's side: rescores what vLLM sampled
        engine, tok, _ = serve_model_dir(path, "vllm", vllm=VllmConfig())
    jobs = [EpisodeJob(t, group_id=g, attempt=a) for g, t in enumerate(arith[:2] + closure[:2]) for a in range(2)]
    trajs = run_episodes(engine, tok, jobs, CalculatorEnv(tok), PARAMS, BUDGET, seed=SEED, policy_version=0)
    return tok, model, engine, trajs


@pytest.mark.slow
def test_the_hazard_exists_sampled_turns_do_not_survive_decode_encode(rollout):
    tok, _, _, trajs = rollout
    changed = [
        (tr.task_id, k)
        for tr in trajs
        for k, (s, e) in enumerate(tr.turn_boundaries)
        if tok.encode(tok.decode(tr.token_ids[s:e])) != tr.token_ids[s:e].tolist()
    ]
    assert len(changed) >= 3, "no turn changes under decode -> encode: the hazard is not exercised"
    assert any(k > 0 for _, k in changed), "no later-turn (post-recovery) turn exercises the hazard"


def test_every_turn_is_exactly_what_the_engine_sampled_from_the_exact_prefix(rollout):
    """Regenerate each turn alone from the trajectory's own prefix with that turn's seed: the same
    ids come back. So the turn is stored verbatim, and the model was conditioned on the stored ids
    (earlier turns, recovery tokens and observations), never on a re-rendered history."""
    tok, _, engine, trajs = rollout
    turns_checked = 0
    for tr in trajs:
        for k, (s, e) in enumerate(tr.turn_boundaries):
            params = dataclasses.replace(PARAMS, max_tokens=e - s, stop_ids=(tok.end_of_turn_id,))
            seed = episode_seed(SEED, tr.group_id, tr.attempt, k)
            again = engine.generate([tr.token_ids[:s].tolist()], params, seed=seed)[0]
            assert again.token_ids == tr.token_ids[s:e].tolist()
            np.testing.assert_allclose(again.logprobs, tr.rollout_logprobs[s:e], atol=1e-4)
            turns_checked += 1
    assert turns_checked > len(trajs)  # multi-turn episodes were checked


def test_trainer_rescoring_matches_rollout_logprobs_on_model_tokens_only(rollout):
    tok, model, _, trajs = rollout
    for tr in trajs:
        ids = torch.as_tensor(tr.token_ids, dtype=torch.long)[None]
        with torch.no_grad():
            logp = torch.log_softmax(model.logits(model(ids).hidden).float()[0], -1)
        scored = logp[:-1].gather(-1, ids[0, 1:, None])[:, 0].numpy()
        mask = tr.loss_mask[1:].astype(bool)
        np.testing.assert_allclose(scored[mask], tr.rollout_logprobs[1:][mask], atol=1e-4)
        assert np.all(tr.rollout_logprobs[tr.loss_mask == 0] == 0)


def test_truncated_turn_recovery_appends_untrained_tokens_and_keeps_the_cut_turn(rollout):
    tok, _, _, trajs = rollout
    recoveries = 0
    for tr in trajs:
        spans = tr.turn_boundaries
        for (s, e), (next_s, _) in zip(spans, spans[1:]):
            cut = e - s == BUDGET.max_turn_tokens and tr.token_ids[e - 1] != tok.end_of_turn_id
            if not cut:
                continue
            recoveries += 1
            between = tr.token_ids[e:next_s].tolist()
            # an <|end|> the model did not sample, then the environment's note: all context (mask 0)
            assert between == [tok.end_of_turn_id] + tool_message_ids(tok, TRUNCATION_NOTE.format(n=e - s))
            assert not tr.loss_mask[e:next_s].any() and not tr.rollout_logprobs[e:next_s].any()
            assert tr.loss_mask[s:e].all()  # the cut turn itself is kept, as sampled, and trained
    assert recoveries >= 3
    # an episode ends `truncated` when its turns run out: the budget is respected
    assert all(len(tr.turn_boundaries) <= BUDGET.max_turns and len(tr) <= BUDGET.max_context for tr in trajs)
    assert "truncated" in {tr.status for tr in trajs}


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("git"), reason="RepoEnv runs tools in LocalSandbox"
)
@pytest.mark.parametrize(
    "enable_thinking", [None, pytest.param(False, marks=pytest.mark.slow)], ids=["template default", "thinking off"]
)
@pytest.mark.slow
def test_repo_episodes_with_the_qwen3_template_and_its_tools_keep_token_in_token_out(tmp_path, enable_thinking):
    """RepoEnv with the real Qwen3 template: the prompt carries every tool's schema, the model's turns
    are kept as sampled (each regenerates from its stored prefix), every observation is the template's
    rendering of a tool message with the episode's template arguments, and an episode that replays the
    teacher (a model that learnt one demonstration by heart) is exactly the demonstration SFT encodes."""
    tasks = generate_domain(np.random.default_rng(3), "swe_mini", [1], 2)
    options = {"enable_thinking": enable_thinking, "observation_chars": 200}  # short episodes: the model learns one fast
    demos = [teacher_messages(t, "repo", **options) for t in tasks]
    texts = [message_text(m) for d in demos for m in d] + [json.dumps(s) for s in TOOL_SCHEMAS] + [TRUNCATION_NOTE]
    tok = qwen3_tokenizer(texts, tmp_path, vocab_size=1000)
    env = RepoEnv(tok, **options)
    teacher_ids, teacher_mask = tok.encode_chat(demos[0])
    torch.manual_seed(1)
    cfg = dataclasses.replace(PRESETS["test-micro"], vocab_size=tok.vocab_size, max_position_embeddings=4096)
    model = overfit(MoEForCausalLM(cfg).eval(), tok, demos[:1])  # tasks[0] by heart; tasks[1] unseen
    longest = max(e - s for s, e in masked_runs(teacher_mask))
    budget = Budget(max_context=len(teacher_ids) + 64, max_turn_tokens=longest, max_turns=6)
    params = SamplingParams(temperature=0.0)
    engine = TorchEngine(model, max_batch=8)
    jobs = [EpisodeJob(t, group_id=g, attempt=a) for g, t in enumerate(tasks) for a in range(2)]
    trajs = run_episodes(engine, tok, jobs, env, params, budget, seed=SEED, policy_version=0)
    for tr, job in zip(trajs, jobs):
        prompt = env.prompt(job.task)
        assert tr.prompt_len == len(prompt) and tr.token_ids[: len(prompt)].tolist() == prompt
        assert all(json.dumps(schema) in tok.decode(prompt) for schema in TOOL_SCHEMAS)
        spans = tr.turn_boundaries
        assert len(spans) > 1, (tr.status, tr.detail)  # multi-turn
        for k, (s, e) in enumerate(spans):
            again = engine.generate(
                [tr.token_ids[:s].tolist()],
                dataclasses.replace(params, max_tokens=e - s, stop_ids=(tok.end_of_turn_id,)),
                seed=episode_seed(SEED, tr.group_id, tr.attempt, k),
            )[0]
            assert again.token_ids == tr.token_ids[s:e].tolist()
            if k + 1 < len(spans):  # what the env appended: a tool message as the template renders it
                between = tr.token_ids[e : spans[k + 1][0]].tolist()
                cut = int(tr.token_ids[e - 1] != tok.end_of_turn_id)  # closed by the loop (untrained), then a note
                text = tok.decode(between[cut:])
                content = text[text.index("<tool_response>\n") + 16 : text.rindex("\n</tool_response>")]
                assert between == [tok.end_of_turn_id] * cut + tok.observation_ids("tool", content, template=env.template)
                assert text.endswith("<|im_start|>assistant\n" + (EMPTY_THINK if enable_thinking is False else ""))
                assert not tr.loss_mask[e : spans[k + 1][0]].any()
    replayed = [tr for tr, job in zip(trajs, jobs) if job.task is tasks[0]]
    for tr in replayed:  # the memorised task: the teacher's episode, verified by the real tests
        assert tr.status == "ok" and tr.reward == 1.0, (tr.status, tr.detail)
        assert tr.token_ids.tolist() == teacher_ids[: len(tr)] and tok.decode(teacher_ids[len(tr) :]) == "\n"
        assert tr.loss_mask.tolist() == teacher_mask[: len(tr)]
