"""Model configuration, named presets and an allocation-free parameter count."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    num_experts: int = 8
    experts_per_token: int = 2
    moe_intermediate_size: int = 128
    shared_expert_intermediate_size: int = 0  # 0 = no shared expert
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.001
    tie_word_embeddings: bool = False
    # Beyond the shared interface, with HF Qwen3-MoE meanings:
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities to sum to 1
    expert_capacity_factor: float = 0.0  # 0 = dropless; else capacity = factor * tokens * k / experts
    initializer_range: float = 0.02
    mlp_only_layers: list[int] = field(default_factory=list)  # dense SwiGLU layers (HF `mlp_only_layers`)
    dense_intermediate_size: int = 0  # width of those dense layers (HF `intermediate_size`)
    qk_norm: str = "head"  # RMSNorm of q and k per head (Qwen3) or over all heads at once ("full", OLMoE)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token={self.experts_per_token} must be in 1..num_experts={self.num_experts}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary embedding)")
        if self.mlp_only_layers and self.dense_intermediate_size <= 0:
            raise ValueError("mlp_only_layers needs dense_intermediate_size > 0")
        if self.qk_norm not in ("head", "full"):
            raise ValueError(f"qk_norm={self.qk_norm!r} must be 'head' or 'full'")

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**d)


def count_params(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active-per-token) parameter counts, computed from the config alone (no allocation).

    Active = everything a token touches: embeddings, attention, norms, router, shared expert and
    `experts_per_token` routed experts (the usual "A2B" convention, embeddings included)."""
    H, D = cfg.hidden_size, cfg.head_dim
    qk_norms = (cfg.num_heads + cfg.num_kv_heads) * D if cfg.qk_norm == "full" else 2 * D
    attn = H * cfg.num_heads * D * 2 + H * cfg.num_kv_heads * D * 2 + qk_norms  # q,o + k,v + q/k norms
    norms = 2 * H
    expert = 3 * H * cfg.moe_intermediate_size
    shared = 3 * H * cfg.shared_expert_intermediate_size + (H if cfg.shared_expert_intermediate_size else 0)
    total = active = 0
    for i in range(cfg.num_layers):
        base = attn + norms
        if cfg.is_moe_layer(i):
            router = cfg.num_experts * H
            total += base + router + shared + cfg.num_experts * expert
            active += base + router + shared + cfg.experts_per_token * expert
        else:
            dense = 3 * H * cfg.dense_intermediate_size
            total += base + dense
            active += base + dense
    embed = cfg.vocab_size * H
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * H
    outer = embed + head + H  # + final norm
    return total + outer, active + outer


PRESETS: dict[str, ModelConfig] = {
    # Trains in minutes on 2 CPU cores (the embedded demo); ~2 M parameters.
    "demo-tiny": ModelConfig(
        vocab_size=512,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        num_experts=8,
        experts_per_token=2,
        moe_intermediate_size=128,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    ),
    # Unit tests: smallest model that still exercises GQA, top-k routing and a shared expert.
    "test-micro": ModelConfig(
        vocab_size=384,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        num_experts=4,
        experts_per_token=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=16,
        max_position_embeddings=256,
    ),
    # A few hundred million parameters: a single-GPU smoke test of the real code path.
    "snowball-mini": ModelConfig(
        vocab_size=32768,
        hidden_size=1024,
        num_layers=8,
        num_heads=16,
        num_kv_heads=4,
        head_dim=64,
        num_experts=32,
        experts_per_token=4,
        moe_intermediate_size=512,
        max_position_embeddings=8192,
    ),
    # The production shape (a config only): ~67 B total, ~2 B active per token.
    "snowball-67b-a2b": ModelConfig(
        vocab_size=128256,
        hidden_size=2048,
        num_layers=28,
        num_heads=16,
        num_kv_heads=4,
        head_dim=128,
        num_experts=376,
        experts_per_token=8,
        moe_intermediate_size=1024,
        rope_theta=1_000_000.0,
        max_position_embeddings=65536,
        router_aux_loss_coef=0.001,
        router_z_loss_coef=0.0001,
    ),
}
