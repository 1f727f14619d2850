"""Chunked torch reference for fused linear -> (logprob, entropy); runs on CPU and GPU.

Per token i with scaled logits z = h_i W^T / T and kept set S_i (whole vocabulary if no support):
    lse = log sum_{j in S} exp z_j,  logprob = z_y - lse,  entropy = lse - E_p[z].
Only a [chunk, V] block of logits ever exists: the forward keeps three fp32 numbers per token
(lse, E_p[z], z_y) and the backward recomputes each chunk's logits.  See docs/kernels.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Aim for about 64 Mi fp32 logits per chunk (256 MiB) when the caller gives no chunk size.
_DEFAULT_CHUNK_ELEMS = 1 << 26


def default_chunk_size(n_tokens: int, vocab: int) -> int:
    return max(1, min(n_tokens, _DEFAULT_CHUNK_ELEMS // max(vocab, 1)))


def vocab_shard(weight: torch.Tensor, tp_group) -> tuple[int, int]:
    """(first global id, rows) of this rank's vocabulary shard: rank r holds [r*V/P, (r+1)*V/P)."""
    rows = weight.shape[0]
    if tp_group is None:
        return 0, rows
    return dist.get_rank(tp_group) * rows, rows


def support_mask(support: torch.Tensor, vocab_start: int, vocab_rows: int) -> torch.Tensor:
    """Bool [n, vocab_rows]: which local ids each token keeps; ids are global, -1 is padding."""
    local = support - vocab_start
    keep = (support >= 0) & (local >= 0) & (local < vocab_rows)
    # An extra dump column takes the padding so that scatter never races a False over a True.
    index = torch.where(keep, local, vocab_rows)
    mask = torch.zeros(support.shape[0], vocab_rows + 1, dtype=torch.bool, device=support.device)
    mask.scatter_(1, index, True)
    return mask[:, :vocab_rows]


def local_targets(targets: torch.Tensor, vocab_start: int, vocab_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(local id clamped into range, whether the target lives on this shard)."""
    local = targets - vocab_start
    here = (targets >= 0) & (local >= 0) & (local < vocab_rows)
    return torch.where(here, local, 0), here


def combine_stats(m, s, a, zy, tp_group):
    """Merge per-shard (max, sum exp(z-max), sum exp(z-max)*z, target logit) -> (lse, E_p[z], z_y).

    m is -inf where a shard keeps no id of a token; those shards then add nothing.
    """
    if tp_group is not None:
        m_all = m.clone()
        dist.all_reduce(m_all, op=dist.ReduceOp.MAX, group=tp_group)
    else:
        m_all = m
    m_safe = torch.where(torch.isfinite(m_all), m_all, torch.zeros_like(m_all))
    scale = torch.exp(m - m_safe)
    sums = torch.stack([s * scale, a * scale, zy])
    if tp_group is not None:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
    s_all, a_all, zy_all = sums
    return m_safe + torch.log(s_all), a_all / s_all, zy_all


def finish_outputs(lse, ez, zy, targets):
    logprob = torch.where(targets >= 0, zy - lse, torch.zeros_like(lse))
    return logprob, lse - ez


def _chunk_logits(h_c, w32, inv_t, mask_c):
    z = (h_c.float() @ w32.T) * inv_t
    if mask_c is not None:
        z = z.masked_fill(~mask_c, float("-inf"))
    return z


class _ReferenceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, support, inv_t, chunk, tp_group):
        start, rows = vocab_shard(weight, tp_group)
        w32 = weight.float()
        y_local, y_here = local_targets(targets, start, rows)
        n = h.shape[0]
        m = torch.empty(n, device=h.device)
        s, a, zy = torch.empty_like(m), torch.empty_like(m), torch.empty_like(m)
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            mask_c = None if support is None else support_mask(support[lo:hi], start, rows)
            z = _chunk_logits(h[lo:hi], w32, inv_t, mask_c)
            m_c = z.max(dim=1).values
            e = torch.exp(z - torch.where(torch.isfinite(m_c), m_c, 0.0)[:, None])
            m[lo:hi] = m_c
            s[lo:hi] = e.sum(1)
            a[lo:hi] = (e * torch.where(e > 0, z, 0.0)).sum(1)
            zt = z.gather(1, y_local[lo:hi, None])[:, 0]
            zy[lo:hi] = torch.where(y_here[lo:hi], zt, 0.0)
        lse, ez, zy = combine_stats(m, s, a, zy, tp_group)
        ctx.save_for_backward(h, weight, targets, support, lse, ez)
        ctx.inv_t, ctx.chunk, ctx.tp_group = inv_t, chunk, tp_group
        return finish_outputs(lse, ez, zy, targets)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, weight, targets, support, lse, ez = ctx.saved_tensors
        inv_t, chunk, tp_group = ctx.inv_t, ctx.chunk, ctx.tp_group
        start, rows = vocab_shard(weight, tp_group)
        y_local, y_here = local_targets(targets, start, rows)
        # logprob is a constant 0 for ignored (negative) targets: no gradient flows from it.
        g_lp = torch.where(targets >= 0, g_lp.float(), 0.0)
        g_ent = g_ent.float()
        w32 = weight.float()
        cols = torch.arange(rows, device=h.device)
        dh = torch.empty(h.shape, dtype=torch.float32, device=h.device)
        dw = torch.zeros_like(w32)
        for lo in range(0, h.shape[0], chunk):
            hi = min(lo + chunk, h.shape[0])
            mask_c = None if support is None else support_mask(support[lo:hi], start, rows)
            z = _chunk_logits(h[lo:hi], w32, inv_t, mask_c)
            p = torch.exp(z - lse[lo:hi, None])  # 0 outside the support
            z0 = torch.where(p > 0, z, 0.0)  # keeps -inf out of the products below
            # d logprob/dz = onehot(y) - p ; d entropy/dz = p * (E_p[z] - z)
            dz = p * (g_ent[lo:hi, None] * (ez[lo:hi, None] - z0) - g_lp[lo:hi, None])
            # + g_lp at the target when it is kept here (a compare, not scatter_add: deterministic on CUDA)
            at_y = (cols == y_local[lo:hi, None]) & y_here[lo:hi, None] & (z > float("-inf"))
            dz += torch.where(at_y, g_lp[lo:hi, None], 0.0)
            dz *= inv_t
            dh[lo:hi] = dz @ w32
            dw.addmm_(dz.T, h[lo:hi].float())
        if tp_group is not None:
            # h is replicated over the TP group; each shard saw only its own vocabulary.
            dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=tp_group)
        return dh.to(h.dtype), dw.to(weight.dtype), None, None, None, None, None


def linear_logprob_entropy_reference(h, weight, targets, temperature=1.0, support=None, chunk_size=None, tp_group=None):
    chunk = chunk_size or default_chunk_size(h.shape[0], weight.shape[0])
    return _ReferenceFn.apply(h, weight, targets, support, 1.0 / temperature, chunk, tp_group)


def materialised_reference(h, weight, targets, temperature=1.0, support=None):
    """Plain fp32 autograd over the full [N, V] logits: the ground truth the tests compare with."""
    z = (h.float() @ weight.float().T) / temperature
    if support is not None:
        z = z.masked_fill(~support_mask(support, 0, weight.shape[0]), float("-inf"))
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    entropy = -(p * torch.where(p > 0, logp, 0.0)).sum(-1)
    lp_y = logp.gather(1, targets.clamp_min(0)[:, None])[:, 0]
    return torch.where(targets >= 0, lp_y, 0.0), entropy
