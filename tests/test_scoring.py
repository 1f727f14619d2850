"""The one scoring path (sample, verify, count) on a real tiny model and the real engine."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from snowcat.stages.model import PRESETS, MoEForCausalLM
from snowcat.stages.rollout import SamplingParams, TorchEngine
from snowcat.stages.scoring import pass_rates, sample_attempts, task_prompt
from snowcat.stages.taskgen import Verdict, VerifierError, generate_domain
from snowcat.stages.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(0)
    tasks = generate_domain(rng, "closure", [1, 2], 4) + generate_domain(rng, "arith", [2], 3)
    tok = train_tokenizer([t.prompt + t.answer for t in tasks] * 4, vocab_size=300)
    torch.manual_seed(0)
    return tasks, tok, MoEForCausalLM(PRESETS["test-micro"])


def test_the_prompt_is_what_sft_trains_on(setup):
    tasks, tok, _ = setup
    for task in tasks:
        ids, mask = tok.encode_chat(task.messages())  # an SFT example: prompt, then the trained answer
        assert task_prompt(tok, task) == ids[: mask.index(1)]


def test_attempts_are_verified_and_counted_per_domain(setup):
    tasks, tok, model = setup
    params = SamplingParams(1.0, 0, 1.0, 4, (tok.end_of_turn_id,))
    seen = []

    def verifier(task, text):  # passes closure tasks, crashes once on the first arith task
        seen.append((task.task_id, text))
        if task.domain == "arith" and task.task_id == tasks[-3].task_id and sum(t == task.task_id for t, _ in seen) == 1:
            raise VerifierError("worker died")
        return Verdict(float(task.domain == "closure"), task.domain == "closure", "")

    got = sample_attempts(TorchEngine(model), tok, tasks, params, attempts=2, seed=3, verifier=verifier, retries=1, batch_size=5)
    assert [(r.task.task_id, r.attempt) for r in got] == [(t.task_id, a) for t in tasks for a in range(2)]
    assert all(r.scored and r.status in ("ok", "truncated") for r in got)
    retried = [r for r in got if r.infra_causes]
    assert len(retried) == 1 and retried[0].infra_causes == ["verifier: worker died"]
    assert pass_rates(got) == {"arith": 0.0, "closure": 1.0, "all": 8 / 14}
    for r in got:  # the verifier saw the decoded sample, without the end-of-turn id
        assert r.token_ids and len(r.logprobs) == len(r.token_ids)
        want = r.token_ids[:-1] if r.finish_reason == "stop" else r.token_ids
        assert r.text == tok.decode(want, skip_special_tokens=True)
    again = sample_attempts(
        TorchEngine(model), tok, tasks, params, attempts=2, seed=3, verifier=verifier, retries=1, batch_size=5
    )
    assert [r.token_ids for r in again] == [r.token_ids for r in got]  # seeded


def test_infrastructure_failures_are_unscored_never_failures(setup):
    tasks, tok, _ = setup
    # a context too short for any prompt: every generation fails in the engine
    short = MoEForCausalLM(dataclasses.replace(PRESETS["test-micro"], max_position_embeddings=8))
    params = SamplingParams(1.0, 0, 1.0, 4, (tok.end_of_turn_id,))
    got = sample_attempts(TorchEngine(short), tok, tasks[:2], params, attempts=2, seed=0, verifier=None, retries=2)
    assert all(not r.scored and r.passed == -1 and math.isnan(r.reward) for r in got)
    assert all(len(r.infra_causes) == 3 and r.infra_causes[0].startswith("engine:") for r in got)
    assert pass_rates(got) == {}


def test_closure_partial_credit_never_reaches_a_pass():
    """Probe, select and RL count full credit (reward 1) as a pass: every closer right and then more
    text is not a pass, so its reward stays below 1; a right prefix keeps its fraction."""
    from snowcat.stages.taskgen import closure  # noqa: PLC0415

    prompt, answer = '{"a": [1, {"b": [2', "]}]}"
    assert closure.verify(prompt, answer, answer) == (1.0, True, "closed")
    reward, passed, detail = closure.verify(prompt, answer, answer + "]")
    assert (reward, passed) == (4 / 5, False) and "then ']'" in detail
    assert closure.verify(prompt, answer, answer + " " + answer)[:2] == (4 / 5, False)
    assert closure.verify(prompt, answer, "]}")[:2] == (2 / 4, False)
