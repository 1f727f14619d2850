"""`tasks` stage: generate verifiable task sets, seeded, with a held-out validation split.

Outputs `train.parquet` and `val.parquet` (see `stages.taskgen` for the columns and verifiers);
validation tasks never appear in training (checked by prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from snowcat.pipeline.config import bounded
from snowcat.pipeline.context import StageContext
from snowcat.pipeline.errors import UserError
from snowcat.stages.taskgen import DOMAINS, generate_domain, save_tasks, split_tasks


@dataclass
class DomainSpec:
    count: int = bounded(1000, ge=2)  # train + val tasks of this domain
    val_count: int = bounded(200, ge=1)
    difficulties: list[int] = field(default_factory=lambda: [1])


@dataclass
class Config:
    domains: dict[str, DomainSpec] = field(
        default_factory=lambda: {
            "closure": DomainSpec(count=2400, val_count=240, difficulties=[1, 2, 3, 4, 5, 6]),
            "arith": DomainSpec(count=2400, val_count=200, difficulties=[2, 3]),
        }
    )


def validate(section, key: str) -> None:
    """Called when the config is loaded: errors surface before anything runs."""
    for domain, spec in section.domains.items():
        if domain not in DOMAINS:
            raise UserError(f"{key}.domains.{domain}: unknown domain (known: {', '.join(DOMAINS)})")
        if not 0 < spec.val_count < spec.count:
            raise UserError(f"{key}.domains.{domain}.val_count: must be between 1 and count - 1")
        if not spec.difficulties:
            raise UserError(f"{key}.domains.{domain}.difficulties: must not be empty")


def run(ctx: StageContext) -> dict:
    rng = np.random.default_rng(ctx.seed)
    train, val = [], []
    metrics: dict[str, float] = {}
    for domain, spec in ctx.config.domains.items():
        tasks = generate_domain(rng, domain, list(spec.difficulties), spec.count)
        d_train, d_val = split_tasks(tasks, spec.val_count, rng)
        train += d_train
        val += d_val
        metrics[f"{domain}/train"] = len(d_train)
        metrics[f"{domain}/val"] = len(d_val)
    leaked = {t.prompt for t in train} & {t.prompt for t in val}
    if leaked:
        raise RuntimeError(f"{len(leaked)} validation prompts also occur in train")
    save_tasks(ctx.out_dir, "train", train)
    save_tasks(ctx.out_dir, "val", val)
    metrics.update(train=len(train), val=len(val))
    return metrics
