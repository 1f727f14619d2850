"""Sampling with exact probability accounting.

The logprob an engine reports for a token is its log-probability under the distribution the token
was actually drawn from: log-softmax after temperature, top-k and top-p, renormalised over the kept
tokens, -inf elsewhere (vLLM's `logprobs_mode="processed_logprobs"`). The trainer recomputes the
same distribution from its own logits with `processed_logprobs` / `support_mask` and the same
`SamplingParams`, so importance ratios compare like with like.

Ties at a truncation boundary are resolved by value, never by sort order, so the kept set does not
depend on which sort kernel ran: top-k keeps every token whose logit is >= the k-th largest logit
(ties may keep more than k tokens); top-p keeps every token whose probability is >= the smallest
probability in the shortest descending prefix that reaches mass `top_p` (ties at that boundary are
all kept). Temperature 0 means greedy: the support is the argmax (lowest token id among ties),
with logprob 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_tokens: int = 256
    stop_ids: tuple[int, ...] = field(default_factory=tuple)  # a sampled stop id ends the completion (kept)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))

    @property
    def is_full_distribution(self) -> bool:
        """True when no truncation applies: the trainer may use a plain full-vocabulary log-softmax."""
        return self.temperature > 0 and self.top_k == 0 and self.top_p >= 1.0


def support_mask(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Bool mask [..., V] of the tokens that can be drawn under `params` (the kept support)."""
    x = logits.float()
    if params.temperature == 0:
        first_max = torch.zeros_like(x, dtype=torch.bool)
        return first_max.scatter_(-1, x.argmax(-1, keepdim=True), True)
    x = x / params.temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        keep = x >= kth
    if params.top_p < 1.0:
        probs = torch.softmax(x.masked_fill(~keep, float("-inf")), dim=-1)
        sorted_probs = probs.sort(dim=-1, descending=True).values
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly higher-ranked tokens
        in_prefix = mass_before < params.top_p
        # smallest probability inside the prefix; the first token is always in it
        threshold = sorted_probs.masked_fill(~in_prefix, float("inf")).amin(-1, keepdim=True)
        keep = keep & (probs >= threshold)
    return keep


def processed_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 log-probs [..., V] of the sampling distribution: renormalised over the support, -inf off it."""
    keep = support_mask(logits, params)
    if params.temperature == 0:
        return torch.zeros_like(logits, dtype=torch.float32).masked_fill(~keep, float("-inf"))
    x = logits.float() / params.temperature
    return torch.log_softmax(x.masked_fill(~keep, float("-inf")), dim=-1)


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | list[torch.Generator],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of `logits` [..., V]; returns (token ids [...], their processed logprobs [...]).

    Inverse-CDF sampling with one uniform per row drawn from that row's own CPU generator (a list
    gives one generator per row): a row's draw depends only on its own logits and generator, never
    on which other rows share the batch.
    """
    logp = processed_logprobs(logits, params)
    flat = logp.reshape(-1, logp.shape[-1])
    generators = generator if isinstance(generator, list) else [generator] * flat.shape[0]
    if len(generators) != flat.shape[0]:
        raise ValueError(f"{len(generators)} generators for {flat.shape[0]} rows")
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators]).to(flat.device)
    cdf = flat.double().exp().cumsum(-1)
    # first index whose cdf exceeds u*total: zero-probability tokens can never be chosen
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    tokens = tokens.clamp_max(flat.shape[-1] - 1)
    token_logp = flat.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens.reshape(logp.shape[:-1]), token_logp.reshape(logp.shape[:-1])


def support_ids(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """The kept support as int64 token ids [N, K] padded with -1 (the format of
    `kernels.linear_logprob_entropy(..., support=)`); None when sampling the full distribution."""
    if params.is_full_distribution:
        return None
    mask = support_mask(logits, params).reshape(-1, logits.shape[-1])
    vocab = mask.shape[-1]
    ids = torch.where(mask, torch.arange(vocab, device=mask.device), vocab).sort(dim=-1).values
    ids = ids[:, : int(mask.sum(-1).max())]
    return ids.masked_fill(ids == vocab, -1)
