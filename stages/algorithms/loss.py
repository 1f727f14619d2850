"""Policy loss for off-policy (asynchronous) RL with truncated importance sampling.

Per token t of sequence i, with A_i its advantage:
    ratio  = exp(logp - logp_old)                       # current policy vs. behaviour weights
    pg     = max(-A ratio, -A clip(ratio, 1-eps_low, 1+eps_high))   # PPO clip, optional
    w      = min(exp(logp_old - logp_rollout), C)       # TIS weight, detached
    loss   = w * pg + kl_coef * k3(logp, logp_ref) - entropy_coef * entropy   # k3 clamped per token
`logp_old` is the trainer's own recomputation under the weights that generated the rollout; the
engine's `logp_rollout` differs from it by numerics (bf16 kernels) and by any sampling mismatch,
which TIS corrects for and `mismatch_stats` reports. With one update per batch, pass
`logp_old = logp.detach()`: ratio == 1 and the gradient is w * -A * grad(logp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import torch

from snowcat.pipeline.errors import UserError
from snowcat.stages.config import Aggregation

AGGREGATIONS = get_args(Aggregation)


@dataclass
class PolicyLossConfig:
    aggregation: str = "token_mean"
    clip_low: float | None = None  # PPO clip of ratio to 1 - clip_low; None: no clipping
    clip_high: float | None = None  # 1 + clip_high; None: same as clip_low
    tis_cap: float | None = 2.0  # C in min(ratio, C); None: no importance weighting
    length_const: float | None = None  # divisor of seq_sum_over_const (e.g. max response length)
    kl_coef: float = 0.0  # needs logp_ref
    entropy_coef: float = 0.0  # needs entropy


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, length_const: float | None = None) -> torch.Tensor:
    """Reduce a [batch, tokens] loss to a scalar over the tokens where mask is 1.

    token_mean:          sum(l m) / sum(m) over the whole batch (long sequences weigh more).
    seq_mean_token_mean: mean over sequences that have any masked-in token of their token mean
                         (a fully masked sequence, e.g. an infra failure, is not counted).
    seq_sum_over_const:  sum(l m) / (length_const * batch): every sequence's token sum divided by
                         one constant, so the normaliser does not depend on the data (Dr. GRPO).
    """
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if mode == "token_mean":
        return masked.sum() / mask.sum().clamp(min=1)
    if mode == "seq_mean_token_mean":
        tokens = mask.sum(dim=-1)
        has = tokens > 0
        seq = masked.sum(dim=-1) / tokens.clamp(min=1)
        return (seq * has).sum() / has.sum().clamp(min=1)
    if mode == "seq_sum_over_const":
        if not length_const or length_const <= 0:
            raise UserError("loss aggregation seq_sum_over_const needs a positive length_const (e.g. max response length)")
        return masked.sum() / (length_const * per_token.shape[0])
    raise UserError(f"unknown loss aggregation {mode!r}; expected one of {', '.join(AGGREGATIONS)}")


K3_MAX = 10.0  # per token (reached at d = 2.6: the reference 13.6 times likelier); beyond it no KL gradient


def k3_kl(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || pi_ref) per sampled token: exp(d) - d - 1 with d = logp_ref - logp,
    clamped at `K3_MAX`.

    Non-negative, unbiased for tokens drawn from pi, lower variance than -d (k1), but exponential in
    d: one sampled token the policy now finds far less likely than the reference (d = 9: k3 ~8,000)
    outweighs every other token's loss, and after clipping its gradient is the whole update (the agent
    demo at RL lr 1e-4: one update's mean KL 0.66 where the other 19 stayed under 0.05, its gradient
    norm 6.4 against a median of 0.08). Clamped, as verl's `low_var_kl` is, such a token adds nothing;
    d itself is clamped first so that exp stays finite (0 * inf would make that nothing a NaN).
    """
    d = (logp_ref - logp).clamp(max=20.0)
    return (torch.exp(d) - d - 1).clamp(max=K3_MAX)


def policy_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: PolicyLossConfig,
    logp_ref: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar loss (to minimise) and its diagnostics. Tensors are [batch, tokens]; advantages [batch]."""
    # A masked-out token (padding, a teacher's row, an infra failure) may carry any logprob, -inf
    # included: zeroed first, it puts no NaN into the loss nor, through exp, into the gradient.
    keep = mask > 0
    logp, logp_old, logp_rollout, logp_ref, entropy = (
        None if x is None else torch.where(keep, x, torch.zeros_like(x))
        for x in (logp, logp_old, logp_rollout, logp_ref, entropy)
    )
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype).unsqueeze(-1)
    ratio = torch.exp(logp - logp_old)
    pg = -adv * ratio
    clipped_frac = torch.zeros(())
    if cfg.clip_low is not None:
        high = cfg.clip_high if cfg.clip_high is not None else cfg.clip_low
        pg_clipped = -adv * ratio.clamp(1 - cfg.clip_low, 1 + high)
        clipped_frac = masked_mean((pg_clipped > pg).to(logp.dtype), mask)
        pg = torch.maximum(pg, pg_clipped)
    weight = torch.ones_like(logp)
    if cfg.tis_cap is not None:
        weight = torch.exp(logp_old - logp_rollout).clamp(max=cfg.tis_cap).detach()
    per_token = weight * pg
    stats = {"pg_loss": aggregate(per_token, mask, cfg.aggregation, cfg.length_const).item()}
    if cfg.kl_coef:
        if logp_ref is None:
            raise UserError("kl_coef > 0 needs reference-model logprobs (logp_ref)")
        kl = k3_kl(logp, logp_ref)
        per_token = per_token + cfg.kl_coef * kl
        stats["kl"] = masked_mean(kl, mask).item()
    if cfg.entropy_coef:
        if entropy is None:
            raise UserError("entropy_coef > 0 needs per-token entropy")
        per_token = per_token - cfg.entropy_coef * entropy
        stats["entropy"] = masked_mean(entropy, mask).item()
    loss = aggregate(per_token, mask, cfg.aggregation, cfg.length_const)
    stats.update(loss=loss.item(), ppo_clip_frac=float(clipped_frac), tis_weight_mean=masked_mean(weight, mask).item())
    return loss, stats


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of `x` over the tokens `mask` keeps, detached: a statistic, never a loss term."""
    return (x.detach() * mask).sum() / mask.sum().clamp(min=1)


def mismatch_stats(
    logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor, tis_cap: float | None = None
) -> dict[str, float]:
    """Engine-vs-trainer agreement on the sampled tokens (log it every step).

    ratio = exp(logp_train - logp_rollout) over masked-in tokens; quantiles use linear
    interpolation (torch.quantile). `tis_clip_frac` is the share of tokens whose ratio exceeds the
    TIS cap, i.e. whose weight was truncated. `k3_kl` is the mean of ratio - log(ratio) - 1 (a
    non-negative estimate of KL(engine || trainer) on the engine's tokens); `log_ppl_diff` is the log
    perplexity of the response tokens under the engine minus under the trainer. An empty mask gives
    NaN statistics.
    """
    sel = mask.to(torch.bool)
    delta = (logp_train.detach() - logp_rollout.detach())[sel].double()
    if delta.numel() == 0:
        nan = float("nan")
        return dict.fromkeys(
            (
                "mean_abs_dlogp",
                "max_abs_dlogp",
                "k3_kl",
                "log_ppl_diff",
                "ratio_p1",
                "ratio_p50",
                "ratio_p99",
                "frac_ratio_off_0.1",
                "tis_clip_frac",
            ),
            nan,
        ) | {"tokens": 0}
    ratio = torch.exp(delta)
    q = torch.quantile(ratio, torch.tensor([0.01, 0.5, 0.99], dtype=ratio.dtype))
    return {
        "tokens": int(delta.numel()),
        "mean_abs_dlogp": delta.abs().mean().item(),
        "max_abs_dlogp": delta.abs().max().item(),
        "k3_kl": (ratio - delta - 1).mean().item(),
        "log_ppl_diff": delta.mean().item(),  # mean(-logp_rollout) - mean(-logp_train)
        "ratio_p1": q[0].item(),
        "ratio_p50": q[1].item(),
        "ratio_p99": q[2].item(),
        "frac_ratio_off_0.1": ((ratio - 1).abs() > 0.1).double().mean().item(),
        "tis_clip_frac": (ratio > tis_cap).double().mean().item() if tis_cap is not None else 0.0,
    }
