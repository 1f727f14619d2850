"""Token-in-token-out: the training sequence holds exactly the sampled ids, though re-tokenising
the sampled text would change them (this repo's BPE merges 'h'+'e' -> 'he' and so on). Every test
runs with snowcat's local tokenizer, with a checkpoint-style HF tokenizer and chat template and with
the real Qwen3 chat template (tests/fixtures) on the torch engine, and with that HF checkpoint served
by vLLM (CPU)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from test_agent import tiny_model, tiny_tasks, tiny_tokenizer

from snowcat.stages.agent import Budget, CalculatorEnv, EpisodeJob, episode_seed, run_episodes
from snowcat.stages.agent.envs import tool_message_ids
from snowcat.stages.agent.loop import TRUNCATION_NOTE
from snowcat.stages.config import VllmConfig
from snowcat.stages.model import load_model_dir
from snowcat.stages.model.tiny_hf import hf_chat_tokenizer, tiny_checkpoint
from snowcat.stages.rollout import SamplingParams, TorchEngine, serve_model_dir
from tests.qwen3_template import qwen3_tokenizer

SEED = 5
BUDGET = Budget(max_context=160, max_turn_tokens=6, max_turns=4, recover_long_turns=True)
PARAMS = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module", params=["local", "hf", "hf-qwen3", "hf-vllm"])
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
