"""Optimizer and learning-rate schedule (warm-up, then cosine / linear / constant)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio
    warmup_steps: int = 20
    total_steps: int = 1000
    schedule: str = "cosine"  # cosine | linear | constant
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 = off

    def __post_init__(self) -> None:
        if self.schedule not in ("cosine", "linear", "constant"):
            raise ValueError(f"schedule must be cosine, linear or constant, got {self.schedule!r}")


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Multiplier of cfg.lr at optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def param_groups(model, weight_decay: float) -> list[dict]:
    """No weight decay on norms and embeddings-as-vectors (1-D parameters)."""
    decay, no_decay = [], []
    seen = set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model, cfg: OptimConfig):
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, cfg))
    return opt, sched
