"""Next-token loss on packed batches through the fused linear -> logprob kernel.

A batch is a dict of [B, T] tensors: `input_ids`, `targets` (next token id, -1 where no loss),
`segment_ids`, `position_ids`, optionally `domain_ids` (per-token domain index, -1 = none).
The per-token log-probability comes from `kernels.linear_logprob_entropy`, so no [B*T, V] fp32
logits are kept for the backward.
"""

from __future__ import annotations

import torch


def token_logprobs(model, batch: dict, temperature: float = 1.0):
    """(logprob [B, T], entropy [B, T], model output); positions with target -1 give logprob 0."""
    out = model(
        batch["input_ids"],
        position_ids=batch.get("position_ids"),
        segment_ids=batch.get("segment_ids"),
        targets=batch["targets"],
        temperature=temperature,
    )
    return out.logprobs, out.entropy, out


def _unwrap(model):
    return getattr(model, "module", model)


def sft_loss(model, batch: dict, num_tokens_total: int, num_micro: int, num_domains: int = 0):
    """Loss whose gradient, summed over micro-batches (and averaged over DP ranks), is the token-mean
    NLL of the whole optimizer step, plus the router losses. Returns (loss, stats)."""
    cfg = _unwrap(model).config
    logp, ent, out = token_logprobs(model, batch)
    valid = batch["targets"] >= 0
    nll_sum = -(logp * valid).sum()
    loss = nll_sum / num_tokens_total
    loss = loss + (cfg.router_aux_loss_coef * out.aux_loss + cfg.router_z_loss_coef * out.z_loss) / num_micro
    stats = {
        "nll_sum": nll_sum.detach(),
        "tokens": valid.sum(),
        "input_tokens": (batch["segment_ids"] >= 0).sum() if "segment_ids" in batch else valid.new_tensor(valid.numel()),
        "entropy_sum": (ent * valid).sum().detach(),
        "router": {k: v for k, v in out.router_stats.items() if k != "expert_load"},
        "expert_load": out.router_stats.get("expert_load"),
    }
    if num_domains and "domain_ids" in batch:
        dom = torch.where(valid, batch["domain_ids"], num_domains).reshape(-1)
        stats["domain_nll"] = logp.new_zeros(num_domains + 1).index_add_(0, dom, -logp.detach().reshape(-1).float())[:-1]
        stats["domain_tokens"] = torch.bincount(dom, minlength=num_domains + 1)[:-1]
    return loss, stats
