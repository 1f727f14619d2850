"""TorchEngine on a tiny random MoE model: determinism, batching, and exact probability accounting."""

import math
from collections import Counter

import pytest
import torch

from snowcat.kernels import linear_logprob_entropy
from snowcat.stages.model import PRESETS, MoEForCausalLM, save_model_dir
from snowcat.stages.rollout import Completion, EngineError, SamplingParams, TorchEngine
from snowcat.stages.rollout.sampling import processed_logprobs, support_ids, support_mask

PROMPTS = [[5, 17, 3], [9, 2, 44, 8, 1, 30, 7], [100], [12, 13, 14, 15]]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = MoEForCausalLM(PRESETS["test-micro"]).eval()
    with torch.no_grad():  # a peaked next-token distribution, so top-p truncation actually bites
        m.lm_head.weight.mul_(10.0)
    return m


def teacher_forced_logits(model, prompt, completion):
    """Logits predicting each completion token from a single no-cache forward over the whole sequence."""
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        hidden = model(ids).hidden[0, len(prompt) - 1 : -1]
    return hidden, model.logits(hidden).float()


def test_same_seed_same_completions_and_batching_does_not_matter(model):
    p = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=8)
    batched = TorchEngine(model, max_batch=8).generate(PROMPTS, p, seed=3)
    again = TorchEngine(model, max_batch=8).generate(PROMPTS, p, seed=3)
    assert [c.token_ids for c in batched] == [c.token_ids for c in again]
    # request i draws from its own generator seeded by (seed, i): split batches give the same result
    split = TorchEngine(model, max_batch=2).generate(PROMPTS, p, seed=3)
    assert [c.token_ids for c in split] == [c.token_ids for c in batched]
    for a, b in zip(split, batched):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    other = TorchEngine(model).generate(PROMPTS, p, seed=4)
    assert [c.token_ids for c in other] != [c.token_ids for c in batched]


def test_stop_and_length(model):
    p = SamplingParams(max_tokens=5)
    first = TorchEngine(model).generate(PROMPTS, p, seed=0)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 5 for c in first)
    # stopping on the third token each row sampled (same seed, so the same draws up to there)
    stop_ids = tuple({c.token_ids[2] for c in first})
    stopped = TorchEngine(model).generate(PROMPTS, SamplingParams(max_tokens=5, stop_ids=stop_ids), seed=0)
    for full, c in zip(first, stopped):
        assert c.finish_reason == "stop"
        assert c.token_ids[-1] in stop_ids and len(c.token_ids) <= 3  # stop id kept, rows end early
        assert c.token_ids == full.token_ids[: len(c.token_ids)]


def test_cached_decoding_matches_a_full_forward(model):
    p = SamplingParams(temperature=0.8, top_k=20, top_p=0.85, max_tokens=6)
    for prompt, c in zip(PROMPTS, TorchEngine(model).generate(PROMPTS, p, seed=1)):
        _, logits = teacher_forced_logits(model, prompt, c)
        lp = processed_logprobs(logits, p).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs), lp, atol=1e-4, rtol=0)


def chi_square_critical(df: int, z: float = 3.719) -> float:
    """Upper quantile of chi-square(df) (z = 3.719: p = 1e-4), scipy if present, else Wilson-Hilferty."""
    try:
        from scipy.stats import chi2  # noqa: PLC0415 (optional)

        return float(chi2.ppf(1 - 1e-4, df))
    except ImportError:
        return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_empirical_frequencies_match_reported_probabilities(model):
    p = SamplingParams(temperature=0.7, top_k=12, top_p=0.9, max_tokens=1)
    prompt = PROMPTS[0]
    n = 6000
    comps = TorchEngine(model, max_batch=1000).generate([prompt] * n, p, seed=11)
    counts = Counter(c.token_ids[0] for c in comps)
    reported: dict[int, float] = {}
    for c in comps:
        t, lp = c.token_ids[0], c.logprobs[0]
        assert reported.setdefault(t, lp) == pytest.approx(lp, abs=1e-5)  # one distribution, one value per token

    _, logits = teacher_forced_logits(model, prompt, Completion([0], [0.0], "length"))
    kept = support_mask(logits[0], p).nonzero()[:, 0].tolist()
    assert 2 <= len(kept) < 12  # top-p really truncated the top-k set
    assert set(counts) <= set(kept)  # nothing drawn outside the support
    assert set(counts) == set(kept)  # and with this many draws every kept token was seen
    probs = {t: math.exp(lp) for t, lp in reported.items()}
    assert sum(probs.values()) == pytest.approx(1.0, abs=1e-5)  # renormalised over the kept support

    stat = sum((counts[t] - n * probs[t]) ** 2 / (n * probs[t]) for t in kept)
    assert stat < chi_square_critical(len(kept) - 1)
    # the test has power: the distribution before top-p (top-k only, renormalised) is rejected
    top_k_only = processed_logprobs(logits[0], SamplingParams(temperature=0.7, top_k=12)).exp()
    alt = top_k_only.nonzero()[:, 0].tolist()
    alt_stat = sum((counts[t] - n * top_k_only[t].item()) ** 2 / (n * top_k_only[t].item()) for t in alt)
    assert alt_stat > chi_square_critical(len(alt) - 1)


def test_trainer_recomputation_with_the_support_matches_and_full_vocab_does_not(model):
    p = SamplingParams(temperature=0.8, top_p=0.7, max_tokens=6)
    hs, targets, engine_lp, supports = [], [], [], []
    for prompt, c in zip(PROMPTS, TorchEngine(model).generate(PROMPTS, p, seed=5)):
        h, logits = teacher_forced_logits(model, prompt, c)
        hs.append(h)
        targets += c.token_ids
        engine_lp += c.logprobs
        supports.append(support_ids(logits, p))
    h = torch.cat(hs)
    targets, engine_lp = torch.tensor(targets), torch.tensor(engine_lp)
    width = max(s.shape[1] for s in supports)
    support = torch.cat([torch.nn.functional.pad(s, (0, width - s.shape[1]), value=-1) for s in supports])
    w = model.lm_head.weight.detach()

    same, _ = linear_logprob_entropy(h, w, targets, temperature=p.temperature, support=support)
    torch.testing.assert_close(same, engine_lp, atol=1e-4, rtol=0)
    full, _ = linear_logprob_entropy(h, w, targets, temperature=p.temperature)
    ratio = torch.exp(full - engine_lp)  # pi_full / pi_engine = kept mass <= 1 per token
    assert (ratio <= 1 + 1e-5).all()
    assert ratio.mean() < 0.99


def test_engine_errors_are_engine_errors(model):
    too_long = SamplingParams(max_tokens=model.config.max_position_embeddings)
    with pytest.raises(EngineError):
        TorchEngine(model).generate(PROMPTS, too_long, seed=0)
    with pytest.raises(EngineError):
        TorchEngine(model).generate([[]], SamplingParams(), seed=0)


def test_load_weights_from_a_model_dir(model, tmp_path):
    p = SamplingParams(max_tokens=4)
    reference = TorchEngine(model).generate(PROMPTS, p, seed=2)
    torch.manual_seed(1)
    engine = TorchEngine(MoEForCausalLM(PRESETS["test-micro"]))
    assert [c.token_ids for c in engine.generate(PROMPTS, p, seed=2)] != [c.token_ids for c in reference]
    engine.load_weights(save_model_dir(tmp_path / "ckpt", model))
    assert [c.token_ids for c in engine.generate(PROMPTS, p, seed=2)] == [c.token_ids for c in reference]
    with pytest.raises(EngineError):
        engine.load_weights(tmp_path / "missing")


def test_completions_carry_the_kept_support_of_every_token(model):
    p = SamplingParams(temperature=0.8, top_k=20, top_p=0.85, max_tokens=6)
    for prompt, c in zip(PROMPTS, TorchEngine(model).generate(PROMPTS, p, seed=1)):
        _, logits = teacher_forced_logits(model, prompt, c)
        assert len(c.support) == len(c.token_ids)
        for t, kept, row in zip(c.token_ids, c.support, logits):
            assert kept == support_mask(row, p).nonzero()[:, 0].tolist()
            assert t in kept
    assert all(c.support is None for c in TorchEngine(model).generate(PROMPTS, SamplingParams(max_tokens=3), seed=1))


def test_generate_seeded_samples_each_request_as_alone(model):
    p = SamplingParams(temperature=1.0, max_tokens=5)
    seeds = [41, 7, 99, 3]
    together = TorchEngine(model, max_batch=3).generate_seeded(PROMPTS, p, seeds)
    for prompt, seed, c in zip(PROMPTS, seeds, together):
        alone = TorchEngine(model).generate([prompt], p, seed=seed)[0]
        assert c.token_ids == alone.token_ids  # logprobs agree to the batched kernels' rounding
        assert c.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
