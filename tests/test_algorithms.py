"""Estimators and losses against values computed by hand (see the comments)."""

import math

import pytest
import torch

from snowcat.pipeline.errors import UserError
from snowcat.stages.agent import Trajectory
from snowcat.stages.algorithms import (
    K3_MAX,
    PolicyLossConfig,
    aggregate,
    compute_advantages,
    dr_grpo_advantages,
    group_advantages,
    grpo_advantages,
    mismatch_stats,
    policy_loss,
    rloo_advantages,
    rloo_n_advantages,
    valid_from_status,
)
from snowcat.stages.rlcore.objective import trajectory_advantages

T = torch.tensor


def close(a, b, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol, rtol=0)


def test_grpo_population_and_sample_std():
    # mean 0.5, population std 0.5 -> +-1; sample std sqrt(1/3) -> +-0.5*sqrt(3)
    close(grpo_advantages(T([[1.0, 0, 0, 1]])), [[1, -1, -1, 1]])
    close(grpo_advantages(T([[1.0, 0, 0, 1]]), unbiased=True), [[s * 0.5 * math.sqrt(3) for s in (1, -1, -1, 1)]])
    # 0,1,2: population std sqrt(2/3)
    close(grpo_advantages(T([[0.0, 1, 2]])), [[-1 / math.sqrt(2 / 3), 0, 1 / math.sqrt(2 / 3)]])
    # all equal: no signal, no division blow-up
    close(grpo_advantages(T([[2.0, 2, 2]])), [[0, 0, 0]])


def test_dr_grpo_drops_std():
    close(dr_grpo_advantages(T([[0.0, 1, 2], [1.0, 0, 0]])), [[-1, 0, 1], [2 / 3, -1 / 3, -1 / 3]])


def test_rloo_leave_one_out():
    # 1 - mean(0,0,0) = 1 ; 0 - mean(1,0,0) = -1/3
    close(rloo_advantages(T([[1.0, 0, 0, 0]])), [[1, -1 / 3, -1 / 3, -1 / 3]])
    close(rloo_advantages(T([[0.0, 1, 2]])), [[-1.5, 0, 1.5]])
    close(rloo_advantages(T([[5.0]])), [[0]])


def test_rloo_n_infra_errors_are_neutral_and_outside_baselines():
    status = [
        ["ok", "ok", "truncated", "infra_error"],
        ["ok", "infra_error", "infra_error", "ok"],
        ["infra_error", "ok", "infra_error", "infra_error"],
    ]
    valid = valid_from_status(status)
    assert valid.tolist() == [[True, True, True, False], [True, False, False, True], [False, True, False, False]]
    rewards = T([[1.0, 0, 0, 1], [1.0, 1, 1, 0], [1.0, 1, 0, 0]])
    adv = rloo_n_advantages(rewards, valid)
    # group 0: valid rewards 1,0,0 -> 1 - 0, 0 - 1/2, 0 - 1/2; infra attempt 0
    # group 1: valid 1,0 -> +1, -1 ; group 2: one valid attempt -> zeros
    close(adv, [[1, -0.5, -0.5, 0], [1, 0, 0, -1], [0, 0, 0, 0]])
    # the reward recorded for an infra failure must not move anyone's advantage
    rewards2 = rewards.clone()
    rewards2[0, 3] = 100.0
    rewards2[1, 1] = -7.0
    close(rloo_n_advantages(rewards2, valid), adv)
    # no failures: RLOO-N == RLOO
    close(rloo_n_advantages(rewards, torch.ones_like(valid)), rloo_advantages(rewards))
    close(compute_advantages("rloo_n", rewards, valid), adv)
    with pytest.raises(UserError, match="estimator"):
        compute_advantages("ppo", rewards)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "rloo_n"])
def test_an_infra_failure_enters_no_estimators_group_statistics(estimator):
    # group 7: two valid attempts and an infrastructure failure recorded with reward 0 (a harness
    # time-out); group 3: one valid attempt left beside two failures has no baseline
    group_ids, rewards = [7, 7, 7, 3, 3, 3], [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    valid = [True, True, False, True, False, False]
    adv, trainable = group_advantages(group_ids, rewards, valid, estimator)
    alone = compute_advantages(estimator, T([[1.0, 0.0]]), torch.ones(1, 2, dtype=torch.bool))[0]
    close(adv[:2], alone)  # as if the failure had never been in the group
    close(adv[2:], [0, 0, 0, 0])
    assert trainable.tolist() == valid
    # whatever reward the failure carries moves nobody's advantage
    moved, _ = group_advantages(group_ids, [1.0, 0.0, 100.0, 1.0, -5.0, 3.0], valid, estimator)
    close(moved, adv)


# Batch used by the aggregation tests: 2 sequences x 2 tokens, last token of seq 1 masked out.
LOGP = [[-1.0, -2.0], [-0.5, -0.5]]
ROLLOUT = [[-1.0, -2.5], [-0.5, -0.5]]  # token (0,1): exp(0.5) = 1.6487 -> capped at 1.5
ADV = [1.0, -2.0]
MASK = [[1.0, 1.0], [1.0, 0.0]]


def _tis_loss(aggregation, **kw):
    logp = T(LOGP, requires_grad=True)
    cfg = PolicyLossConfig(aggregation=aggregation, tis_cap=1.5, **kw)
    loss, stats = policy_loss(logp, logp.detach(), T(ROLLOUT), T(ADV), T(MASK), cfg)
    loss.backward()
    return loss, stats, logp.grad


def test_tis_token_mean_value_and_gradient():
    # per-token w * (-A): [[-1, -1.5], [2, (masked)]] -> (-1 - 1.5 + 2) / 3
    loss, stats, grad = _tis_loss("token_mean")
    close(loss, -0.5 / 3)
    close(grad, [[-1 / 3, -1.5 / 3], [2 / 3, 0]])  # weight is detached: d/dlogp = -A w / 3
    close(stats["tis_weight_mean"], (1 + 1.5 + 1) / 3)


def test_seq_mean_token_mean():
    # seq 0: (-1 - 1.5)/2 = -1.25 ; seq 1: 2/1 -> mean 0.375
    loss, _, grad = _tis_loss("seq_mean_token_mean")
    close(loss, 0.375)
    close(grad, [[-0.25, -0.375], [1.0, 0]])


def test_seq_sum_over_const():
    # token sums -2.5 and 2 -> (-0.5) / (4 * 2)
    loss, _, _ = _tis_loss("seq_sum_over_const", length_const=4)
    close(loss, -0.0625)
    with pytest.raises(UserError, match="length_const"):
        _tis_loss("seq_sum_over_const")


def test_fully_masked_sequence_is_not_counted():
    per_token = T([[1.0, 3.0], [100.0, 100.0]])
    mask = T([[1.0, 1.0], [0.0, 0.0]])  # e.g. an infra failure: no loss at all
    close(aggregate(per_token, mask, "token_mean"), 2.0)
    close(aggregate(per_token, mask, "seq_mean_token_mean"), 2.0)
    close(aggregate(per_token, mask, "seq_sum_over_const", length_const=2), 4 / (2 * 2))
    with pytest.raises(UserError, match="aggregation"):
        aggregate(per_token, mask, "sum")


def test_ppo_clipping_on_top_of_ratio():
    # four one-token sequences; ratio exp(logp - old) = 1.5, 1.5, 0.5, 0.5; eps 0.2
    ratios = T([1.5, 1.5, 0.5, 0.5])
    adv = T([1.0, -1.0, 1.0, -1.0])
    logp = torch.zeros(4, 1, requires_grad=True)
    old = -torch.log(ratios).unsqueeze(-1)
    cfg = PolicyLossConfig(clip_low=0.2, tis_cap=None)
    loss, stats = policy_loss(logp, old, old, adv, torch.ones(4, 1), cfg)
    loss.backward()
    # A=+1,r=1.5: max(-1.5,-1.2) = -1.2 (clipped) ; A=-1,r=1.5: max(1.5,1.2) = 1.5
    # A=+1,r=0.5: max(-0.5,-0.8) = -0.5           ; A=-1,r=0.5: max(0.5,0.8) = 0.8 (clipped)
    close(loss, (-1.2 + 1.5 - 0.5 + 0.8) / 4)
    close(stats["ppo_clip_frac"], 0.5)
    close(logp.grad.squeeze(-1), [0, 1.5 / 4, -0.5 / 4, 0])  # clipped tokens carry no gradient


def test_tis_weight_multiplies_clipped_term():
    # ratio to current policy 1.5 (A=-1, unclipped), behaviour/rollout ratio exp(1) capped to 2
    logp = torch.zeros(1, 1, requires_grad=True)
    old = T([[-math.log(1.5)]])
    rollout = old - 1.0
    loss, stats = policy_loss(logp, old, rollout, T([-1.0]), torch.ones(1, 1), PolicyLossConfig(clip_low=0.2, tis_cap=2.0))
    close(loss, 2.0 * 1.5)
    close(stats["tis_weight_mean"], 2.0)


def test_kl_k3_and_entropy_bonus():
    logp = T([[-1.0]], requires_grad=True)
    ref = T([[-1.5]])
    ent = T([[2.0]])
    cfg = PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01, tis_cap=None)
    loss, stats = policy_loss(logp, logp.detach(), logp.detach(), T([0.0]), torch.ones(1, 1), cfg, logp_ref=ref, entropy=ent)
    k3 = math.exp(-0.5) + 0.5 - 1  # exp(d) - d - 1, d = ref - logp = -0.5
    close(stats["kl"], k3)
    close(loss, 0.1 * k3 - 0.01 * 2.0)
    with pytest.raises(UserError, match="logp_ref"):
        policy_loss(logp, logp.detach(), logp.detach(), T([0.0]), torch.ones(1, 1), cfg)


def test_a_token_far_below_the_reference_adds_no_kl_gradient():
    """k3 is exponential in logp_ref - logp: a sampled token at e^-12 under the policy and e^-1 under
    the reference would otherwise carry a KL gradient of ~1,500 where the others' are ~0.005 and,
    clipped, be the whole update; one far enough below overflows exp and makes the gradient NaN.
    Clamped, neither adds anything; the other tokens keep their exact k3 gradient."""
    logp = T([[-1.0, -12.0, -0.5, -200.0]], requires_grad=True)  # the last: exp(d) overflows float32
    ref = T([[-1.2, -1.0, -0.4, -1.0]])
    cfg = PolicyLossConfig(kl_coef=0.1, tis_cap=None)
    loss, stats = policy_loss(logp, logp.detach(), logp.detach(), T([0.0]), torch.ones(1, 4), cfg, logp_ref=ref)
    loss.backward()
    d = [-0.2, 11.0, 0.1]  # ref - logp
    assert logp.grad[0, 1] == 0 and logp.grad[0, 3] == 0
    for i in (0, 2):  # d/dlogp of exp(d) - d - 1 is 1 - exp(d); token_mean over 4 tokens
        close(logp.grad[0, i], 0.1 / 4 * (1 - math.exp(d[i])))
    close(stats["kl"], (math.exp(d[0]) - d[0] - 1 + K3_MAX + math.exp(d[2]) - d[2] - 1 + K3_MAX) / 4)

    # a log-ratio beyond any float either way (the policy at -1e30; a token the reference gives no mass)
    logp = T([[-1e30, -1.0]], requires_grad=True)
    ref = T([[-1.0, float("-inf")]])
    loss, stats = policy_loss(logp, logp.detach(), logp.detach(), T([0.0]), torch.ones(1, 2), cfg, logp_ref=ref)
    loss.backward()
    assert stats["kl"] == K3_MAX and torch.equal(logp.grad, torch.zeros(1, 2))


def test_a_masked_out_token_at_minus_infinity_changes_neither_loss_nor_gradient():
    """Padding, a teacher's row or an infra failure may carry logp = -inf (a token outside a kept
    support): multiplied by its zero mask, exp(-inf - -inf) made the loss and every gradient NaN."""
    cfg = PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0)
    adv, mask = T([1.0, -0.5]), T([[1.0, 0.0], [1.0, 1.0]])
    results = []
    for masked in (-0.7, float("-inf")):
        logp = T([[-1.0, masked], [-0.5, -2.0]], requires_grad=True)
        rollout, ref, ent = (
            T([[-1.1, masked], [-0.4, -2.0]]),
            T([[-1.2, masked], [-0.6, -1.5]]),
            T([[1.0, float("nan")], [0.5, 0.2]]),
        )
        loss, stats = policy_loss(logp, logp.detach(), rollout, adv, mask, cfg, logp_ref=ref, entropy=ent)
        loss.backward()
        results.append((loss.detach(), logp.grad, stats))
    (loss_a, grad_a, stats_a), (loss_b, grad_b, stats_b) = results
    assert torch.isfinite(loss_b) and torch.isfinite(grad_b).all()
    close(loss_b, loss_a)
    close(grad_b, grad_a)
    assert grad_b[0, 1] == 0 and stats_b == pytest.approx(stats_a)


def test_mismatch_stats_by_hand():
    d = [0.0, 0.05, -0.2, math.log(3.0), 9.0]  # last token masked out
    train = T([d], dtype=torch.float64)
    rollout = torch.zeros_like(train)
    mask = T([[1, 1, 1, 1, 0]])
    s = mismatch_stats(train, rollout, mask, tis_cap=2.0)
    r = sorted([1.0, math.exp(0.05), math.exp(-0.2), 3.0])
    assert s["tokens"] == 4
    close(s["mean_abs_dlogp"], (0 + 0.05 + 0.2 + math.log(3)) / 4)
    close(s["max_abs_dlogp"], math.log(3))
    close(s["ratio_p50"], (r[1] + r[2]) / 2)
    close(s["ratio_p1"], r[0] + 0.03 * (r[1] - r[0]))  # linear interpolation at position 0.03
    close(s["ratio_p99"], r[2] + 0.97 * (r[3] - r[2]))
    close(s["frac_ratio_off_0.1"], 0.5)  # 0.819 and 3.0
    close(s["tis_clip_frac"], 0.25)  # only 3.0 > 2
    kept = d[:4]
    close(s["k3_kl"], sum(math.exp(x) - x - 1 for x in kept) / 4)
    close(s["log_ppl_diff"], sum(kept) / 4)
    empty = mismatch_stats(train, rollout, torch.zeros_like(mask))
    assert empty["tokens"] == 0 and math.isnan(empty["ratio_p50"])


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_ragged_groups_are_not_padded_with_zero_rewards(estimator):
    """A group that lost an attempt gets the advantages it would get alone, not ones skewed by a
    padded reward of 0; a group of one attempt has no baseline (advantage 0)."""

    def traj(group, attempt, reward):
        return Trajectory("t", group, attempt, 0, [1, 2], [0, 1], [0.0, -1.0], reward, "ok", [(1, 2)], "d", 1)

    full = [traj(0, a, r) for a, r in enumerate([1.0, 1.0, 0.0])]
    short = [traj(1, a, r) for a, r in enumerate([1.0, 1.0])]  # lost its third attempt
    single = [traj(2, 0, 1.0)]
    adv, _ = trajectory_advantages(full + short + single, estimator)
    alone_full, _ = trajectory_advantages(full, estimator)
    alone_short, _ = trajectory_advantages(short, estimator)
    assert torch.allclose(adv[:3], alone_full) and torch.allclose(adv[3:5], alone_short)
    assert torch.all(adv[3:5] == 0)  # two equal rewards: nothing to prefer (padding with 0 made them positive)
    assert adv[5] == 0
