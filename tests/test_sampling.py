"""Sampling distribution: truncation semantics, ties, and exact probability accounting."""

import math

import pytest
import torch

from snowcat.stages.rollout.sampling import SamplingParams, processed_logprobs, sample, support_mask


def test_full_distribution_is_plain_log_softmax():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    p = SamplingParams()
    assert p.is_full_distribution
    torch.testing.assert_close(processed_logprobs(logits, p), torch.log_softmax(logits, -1))


def test_temperature_scales_logits():
    logits = torch.randn(11, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(processed_logprobs(logits, SamplingParams(temperature=0.5)), torch.log_softmax(logits / 0.5, -1))


def test_top_k_keeps_k_largest_and_renormalises():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])
    lp = processed_logprobs(logits, SamplingParams(top_k=2))
    assert support_mask(logits, SamplingParams(top_k=2)).tolist() == [False, True, False, True, False]
    expected = torch.log_softmax(torch.tensor([3.0, 2.0]), -1)
    torch.testing.assert_close(lp[[1, 3]], expected)
    assert torch.isinf(lp[[0, 2, 4]]).all()
    assert lp.exp().sum().item() == pytest.approx(1.0, abs=1e-6)


def test_top_k_ties_at_boundary_are_all_kept():
    logits = torch.tensor([2.0, 1.0, 1.0, 0.0])
    assert support_mask(logits, SamplingParams(top_k=2)).tolist() == [True, True, True, False]


def test_top_p_keeps_shortest_prefix_reaching_mass():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    # 0.5 < 0.7 so the second token is needed; 0.5 + 0.3 >= 0.7 so the third is not
    assert support_mask(logits, SamplingParams(top_p=0.7)).tolist() == [True, True, False, False]
    assert support_mask(logits, SamplingParams(top_p=0.5)).tolist() == [True, False, False, False]
    assert support_mask(logits, SamplingParams(top_p=0.81)).tolist() == [True, True, True, False]
    lp = processed_logprobs(logits, SamplingParams(top_p=0.7))
    torch.testing.assert_close(lp[:2].exp(), torch.tensor([0.5, 0.3]) / 0.8)


def test_top_p_ties_at_boundary_are_all_kept_regardless_of_order():
    probs = torch.tensor([0.4, 0.2, 0.2, 0.2])
    for perm in ([0, 1, 2, 3], [3, 2, 0, 1]):
        logits = probs[perm].log()
        keep = support_mask(logits, SamplingParams(top_p=0.5))
        assert keep.sum().item() == 4  # the boundary token ties with two others: all kept


def test_top_k_then_top_p_on_the_renormalised_distribution():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    # after top-k=2: [4/7, 3/7]; top_p=0.5 keeps only the first
    assert support_mask(logits, SamplingParams(top_k=2, top_p=0.5)).tolist() == [True, False, False, False]


def test_greedy():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0]])
    lp = processed_logprobs(logits, SamplingParams(temperature=0.0))
    assert lp[0].tolist() == [-math.inf, 0.0, -math.inf, -math.inf]
    tok, logp = sample(logits, SamplingParams(temperature=0.0), torch.Generator().manual_seed(0))
    assert tok.tolist() == [1] and logp.tolist() == [0.0]


def test_sample_never_draws_outside_support_and_reports_processed_logprob():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(temperature=0.8, top_k=10, top_p=0.7)
    gens = [torch.Generator().manual_seed(i) for i in range(64)]
    tok, logp = sample(logits, p, gens)
    keep = support_mask(logits, p)
    assert keep.gather(-1, tok[:, None]).all()
    torch.testing.assert_close(logp, processed_logprobs(logits, p).gather(-1, tok[:, None]).squeeze(-1))


def test_a_rows_draw_does_not_depend_on_other_rows():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(4))
    p = SamplingParams(top_p=0.9)
    batch_tok, _ = sample(logits, p, [torch.Generator().manual_seed(100 + i) for i in range(4)])
    alone = [sample(logits[i], p, torch.Generator().manual_seed(100 + i))[0].item() for i in range(4)]
    assert batch_tok.tolist() == alone


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0), dict(max_tokens=0)])
def test_bad_params_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
