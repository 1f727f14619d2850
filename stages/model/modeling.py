"""Decoder-only MoE transformer (Qwen3-MoE / OLMoE style), parameter names as in HF transformers 5.

RMSNorm pre-norm blocks; attention with grouped KV heads, per-head q/k RMSNorm and rotary
embeddings (HF's rotate-half layout); SwiGLU experts chosen by a softmax top-k router with Switch
load-balancing and z losses; optional Qwen2-MoE style shared expert with a sigmoid gate.

Routed experts are stored fused, as transformers 5 stores them (`mlp.experts.gate_up_proj [E, 2I, H]`,
`mlp.experts.down_proj [E, H, I]`), so a step does one sort/gather, one matmul per expert (grouped
GEMM on GPU) and one scatter-add. `stages.model.io.hf_state_dict` gives the per-expert names of HF
hub checkpoints (`mlp.experts.{e}.{gate,up,down}_proj.weight`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from snowcat.kernels import linear_logprob_entropy

from .attention import Documents, document_attention
from .config import ModelConfig
from .kv_cache import KVCache


@dataclass
class ModelOutput:
    hidden: torch.Tensor  # [B, T, H], after the final norm: the LM head's input
    # router losses, means over MoE layers (unscaled by their coefficients); under
    # balance_router_over, this rank's token-weighted share of the data-parallel batch's losses
    aux_loss: torch.Tensor  # load balancing
    z_loss: torch.Tensor
    router_stats: dict = field(default_factory=dict)
    logprobs: torch.Tensor | None = None  # [B, T] fp32, when forward got `targets`
    entropy: torch.Tensor | None = None  # [B, T] fp32, when forward got `targets`
    # [B, T, moe layers, k] experts the router chose for each token (its own choice, also where
    # `routes` forced others); None for a dense model
    routes: torch.Tensor | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (bf16 variance is too coarse), scale in the input dtype, as HF does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, D
        self.q_proj = nn.Linear(H, cfg.num_heads * D, bias=False)
        self.k_proj = nn.Linear(H, cfg.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, cfg.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * D, H, bias=False)
        # per head (Qwen3) or over the whole projection (OLMoE): the norm's width says which
        self.full_qk_norm = cfg.qk_norm == "full"
        self.q_norm = RMSNorm(cfg.num_heads * D if self.full_qk_norm else D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.num_kv_heads * D if self.full_qk_norm else D, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache: tuple | None = None, docs: Documents | None = None):
        B, T, _ = x.shape
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        # [B, T, heads, D] until the attention call: the packed path wants tokens first, SDPA heads first
        if self.full_qk_norm:
            q = self.q_norm(self.q_proj(x)).view(B, T, Hq, D)
            k = self.k_norm(self.k_proj(x)).view(B, T, Hkv, D)
        else:
            q = self.q_norm(self.q_proj(x).view(B, T, Hq, D))
            k = self.k_norm(self.k_proj(x).view(B, T, Hkv, D))
        v = self.v_proj(x).view(B, T, Hkv, D)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if docs is not None:  # packed rows: causal attention within each document
            out = document_attention(q.reshape(B * T, Hq, D), k.reshape(B * T, Hkv, D), v.reshape(B * T, Hkv, D), docs)
            return self.o_proj(out.view(B, T, -1))
        q = q.transpose(1, 2)
        if cache is not None:  # write this step's keys/values at each row's slots, attend over the prefix
            k_buf, v_buf, slots, span = cache
            rows = torch.arange(B, device=x.device)[:, None]
            k_buf[rows, :, slots] = k.to(k_buf.dtype)
            v_buf[rows, :, slots] = v.to(v_buf.dtype)
            k, v = k_buf[:, :, :span].to(q.dtype), v_buf[:, :, :span].to(q.dtype)
        else:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        is_causal = mask is None and cache is None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward (dense layers and the shared expert)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """E SwiGLU experts as two 3-D tensors (transformers 5 layout)."""

    def __init__(self, cfg: ModelConfig, num_experts: int | None = None):
        # `num_experts`: fewer than the config's when this module holds a shard (expert_parallel.py)
        super().__init__()
        E = cfg.num_experts if num_experts is None else num_experts
        H, I = cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts, self.intermediate = E, I
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: [M, H] token copies already sorted by expert; counts: [E] rows per expert."""
        if x.is_cuda:  # one grouped GEMM per projection, no host sync
            offs = counts.cumsum(0).to(torch.int32)
            gate, up = F.grouped_mm(x, self.gate_up_proj.transpose(1, 2), offs=offs).chunk(2, dim=-1)
            return F.grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offs)
        # CPU: grouped_mm has no fast CPU kernel; contiguous per-expert slices of the sorted rows
        # are plain GEMMs (measured ~3x faster here).
        outs = []
        for e, chunk in enumerate(x.split(counts.tolist())):
            if chunk.shape[0]:
                gate, up = F.linear(chunk, self.gate_up_proj[e]).chunk(2, dim=-1)
                outs.append(F.linear(F.silu(gate) * up, self.down_proj[e]))
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[1])


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = Experts(cfg)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, hidden: torch.Tensor, forced: torch.Tensor | None = None):
        """`forced` [..., k] expert ids per token (router replay; a row with any -1 routes itself).
        Returns (output, copies routed per expert [E], mean router probability per expert [E],
        z loss, dropped share, the router's own top-k ids [N, k])."""
        cfg = self.cfg
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        N, E, k = x.shape[0], cfg.num_experts, cfg.experts_per_token
        logits = self.gate(x).float()
        probs = logits.softmax(dim=-1)
        top_w, top_i = probs.topk(k, dim=-1)
        own = top_i
        if forced is not None:
            forced = forced.reshape(-1, k).to(top_i.device, top_i.dtype)
            top_i = torch.where((forced >= 0).all(dim=-1, keepdim=True), forced, top_i)
            top_w = probs.gather(-1, top_i)  # the gate still learns: its probabilities of the replayed experts
        if cfg.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)

        flat_e = top_i.reshape(-1)
        order = flat_e.argsort(stable=True)  # token copies grouped by expert
        counts = torch.bincount(flat_e, minlength=E)
        dropped = x.new_zeros((), dtype=torch.float32)
        if cfg.expert_capacity_factor > 0:
            capacity = max(1, math.ceil(cfg.expert_capacity_factor * N * k / E))
            starts = counts.cumsum(0) - counts
            rank = torch.arange(N * k, device=x.device) - starts[flat_e[order]]
            keep = rank < capacity  # first-come (token order) within each expert
            order = order[keep]
            dropped = 1.0 - keep.float().mean()
            counts = counts.clamp(max=capacity)
        token = order // k
        y = self.experts(x.index_select(0, token), counts) * top_w.reshape(-1).index_select(0, order)[:, None].to(x.dtype)
        out = torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))
        if cfg.shared_expert_intermediate_size:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

        # The router losses' parts (MoEForCausalLM.forward combines them, over every data-parallel
        # rank where it is asked to): copies routed to each expert (before any capacity drop), the
        # mean router probability per expert, and the z loss (ST-MoE: it penalises large logits).
        routed = torch.bincount(flat_e, minlength=E).float()
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        return out.view(shape), routed, probs.mean(dim=0), z, dropped.detach(), own


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.is_moe = cfg.is_moe_layer(index)
        self.mlp = SparseMoeBlock(cfg) if self.is_moe else MLP(cfg.hidden_size, cfg.dense_intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache=None, forced=None, docs=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, docs)
        h = self.post_attention_layernorm(x)
        if self.is_moe:
            out, *moe = self.mlp(h, forced)
            return x + out, moe
        return x + self.mlp(h), None


class MoEModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # On the meta device (a skeleton that weights are loaded into) nothing is initialised: meta
        # normal_ and arange import torch._dynamo, 0.5 s of CPU in processes that never train
        skeleton = torch.empty(0).is_meta
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size) if skeleton else None
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        inv_freq = torch.empty((cfg.head_dim + 1) // 2) if skeleton else rope_inv_freq(cfg)  # computed at materialize
        self.register_buffer("inv_freq", inv_freq, persistent=False)


def rope_inv_freq(cfg: ModelConfig, device=None) -> torch.Tensor:
    """RoPE's inverse frequencies (float32): a buffer no checkpoint holds, so a model whose weights
    were loaded into memory allocated empty computes it again."""
    return 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device=device) / cfg.head_dim)


def positions_from_segments(segment_ids: torch.Tensor) -> torch.Tensor:
    """Positions restarting at 0 where each packed example (run of equal segment ids) starts."""
    T = segment_ids.shape[1]
    idx = torch.arange(T, device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return idx - torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values


class MoEForCausalLM(nn.Module):
    packs_documents = True  # forward takes segment_ids: packed rows attend within each document

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = MoEModel(cfg)
        self._checkpoint_layers = False
        self._router_group = None  # see balance_router_over
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.reset_parameters()
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.config.initializer_range
        # Residual-branch outputs scaled by 1/sqrt(2L) so the residual stream's variance stays
        # flat with depth (GPT-2); everything else N(0, std); norms 1.
        out_std = std / math.sqrt(2 * self.config.num_layers)
        for name, p in self.named_parameters():
            if p.is_meta:  # a skeleton's: no values (see MoEModel)
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.normal_(0.0, out_std)
            else:
                p.normal_(0.0, std)

    def materialize(self, device) -> MoEForCausalLM:
        """Allocate a model built on the meta device on `device`, uninitialised (weights are loaded
        into it next), with the RoPE buffer, which no checkpoint holds, computed. A tied head stays
        tied (to_empty gives every parameter new memory of its own: the head, never loaded, kept it)."""
        self.to_empty(device=device)
        if self.config.tie_word_embeddings and self.lm_head.weight is not self.model.embed_tokens.weight:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.model.inv_freq = rope_inv_freq(self.config, device)
        return self

    def set_activation_checkpointing(self, on: bool) -> None:
        """Recompute each decoder layer in backward instead of keeping its activations (only the
        layer inputs stay alive). Applies to forwards under autograd; results are unchanged."""
        self._checkpoint_layers = on

    def balance_router_over(self, group) -> None:
        """Global-batch load balancing (as Qwen3 is trained): in each forward under autograd, the
        load-balancing loss uses the fraction of tokens routed to each expert over every rank of
        `group` (the data-parallel ranks), not over this rank's rows alone, and each rank's share of
        both router losses is weighted by its share of the batch's tokens. W ranks of R/W rows then
        train as one rank of R rows. One all-reduce of [MoE layers, experts] counts per forward;
        forwards without autograd (evaluation, sampling: maybe on one rank only) never communicate."""
        self._router_group = group

    def _router_losses(self, routed: list, mean_probs: list, z: list):
        """(aux loss, z loss, routed fraction [layers, E]), means over the MoE layers: the Switch
        loss E * sum_e f_e * P_e (f: routed fraction, P: mean router probability) and the z loss."""
        counts, share = torch.stack(routed), 1.0
        group = self._router_group
        if group is not None and torch.is_grad_enabled() and torch.distributed.get_world_size(group) > 1:
            total = counts.clone()
            torch.distributed.all_reduce(total, group=group)
            # DDP averages the ranks' gradients: weighting by W * (own tokens / all tokens) makes
            # that average the whole batch's token mean, also where ranks hold unequal rows
            share = torch.distributed.get_world_size(group) * counts[0].sum() / total[0].sum()
            counts = total
        load = counts / counts.sum(dim=1, keepdim=True)
        aux = (self.config.num_experts * (load * torch.stack(mean_probs)).sum(dim=1)).mean()
        return aux * share, torch.stack(z).mean() * share, load, aux.detach()

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        input_ids,
        position_ids=None,
        segment_ids=None,
        kv_cache: KVCache | None = None,
        targets: torch.Tensor | None = None,
        temperature: float = 1.0,
        routes: torch.Tensor | None = None,
        kept_support: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> ModelOutput:
        """With `targets` [B, T] (next-token ids, -1 = none) the output also carries the per-token
        logprob/entropy from `kernels.linear_logprob_entropy` (no [B*T, V] logits kept). It runs
        inside forward so that wrappers which gather parameters around forward (ZeRO-3) see the
        LM head used; only tokens with a target go through it (logprob and entropy 0 elsewhere).
        `kept_support(hidden [N, H], lm_head weight [V, H]) -> int64 [N, K]` gives the N target
        tokens' kept ids (top-k/top-p sampling; -1 pads): the distribution is renormalised over them,
        and the callable runs here for the same reason. `routes` [B, T, moe layers * k] replays
        recorded expert choices (-1: the token routes itself)."""
        B, T = input_ids.shape
        device = input_ids.device
        mask, docs, cache_slots, span = None, None, None, None
        if kv_cache is not None:
            if segment_ids is not None:
                raise ValueError("segment_ids (packing) and kv_cache (generation) cannot be combined")
            cache_slots = kv_cache.lengths[:, None] + torch.arange(T, device=device)  # [B, T]
            span = int(kv_cache.lengths.max()) + T
            if span > kv_cache.max_len:
                raise ValueError(f"KV cache full: need {span} slots, allocated {kv_cache.max_len}")
            if position_ids is None:
                position_ids = cache_slots
            # key slot s is visible to the query in slot t iff s <= t (per row)
            mask = (torch.arange(span, device=device)[None, None, :] <= cache_slots[:, :, None]).unsqueeze(1)
        elif segment_ids is not None:
            if position_ids is None:
                position_ids = positions_from_segments(segment_ids)
            docs = Documents.from_segments(segment_ids)  # no [T, T] mask: see stages/model/attention.py
        if position_ids is None:
            position_ids = torch.arange(T, device=device).expand(B, T)

        m = self.model
        x = m.embed_tokens(input_ids)
        freqs = position_ids[..., None].float() * m.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)

        routed, mean_probs, z, dropped, chosen = [], [], [], [], []
        k = self.config.experts_per_token
        forced = routes.reshape(B, T, -1, k) if routes is not None else None
        recompute = self._checkpoint_layers and torch.is_grad_enabled()
        for i, layer in enumerate(m.layers):
            cache = None
            if kv_cache is not None:
                cache = (kv_cache.k[i], kv_cache.v[i], cache_slots, span)
            args = (x, cos, sin, mask, cache, forced[:, :, len(chosen)] if forced is not None and layer.is_moe else None, docs)
            # the router's outputs (losses, loads, routes) come out of the checkpointed call as usual
            x, moe = checkpoint(layer, *args, use_reentrant=False) if recompute else layer(*args)
            if moe is not None:
                for parts, part in zip((routed, mean_probs, z, dropped, chosen), moe, strict=True):
                    parts.append(part)
        if kv_cache is not None:
            kv_cache.lengths += T
        hidden = m.norm(x)

        zero = hidden.new_zeros((), dtype=torch.float32)
        aux_loss, z_loss, stats = zero, zero, {}
        if routed:
            aux_loss, z_loss, load, aux_value = self._router_losses(routed, mean_probs, z)
            stats = {
                "expert_load": load,  # [moe_layers, E], fraction of routed copies per expert
                "load_max_over_mean": (load.max(dim=1).values * load.shape[1]).mean(),
                "dropped_fraction": torch.stack(dropped).mean(),
                "aux_loss": aux_value,
                "z_loss": torch.stack(z).mean().detach(),
            }
        out = ModelOutput(hidden=hidden, aux_loss=aux_loss, z_loss=z_loss, router_stats=stats)
        if chosen:
            out.routes = torch.stack([c.view(B, T, k) for c in chosen], dim=2)
        if targets is not None:
            sel = targets >= 0
            h, head = hidden[sel], self.lm_head.weight.to(hidden.dtype)
            support = None
            if kept_support is not None:
                with torch.no_grad():  # the kept set is a constant of the loss, as it is for the engine
                    support = kept_support(h, head)
            logp, ent = linear_logprob_entropy(h, head, targets[sel], temperature=temperature, support=support)
            out.logprobs = logp.new_zeros(B, T).masked_scatter(sel, logp)
            out.entropy = ent.new_zeros(B, T).masked_scatter(sel, ent)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits for small (generation) batches; training uses the fused kernel."""
        return F.linear(hidden, self.lm_head.weight)
