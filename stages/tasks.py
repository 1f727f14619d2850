"""`tasks` stage: generate verifiable task sets, seeded, with a held-out validation split.

Outputs `train.parquet` and `val.parquet` (see `stages.taskgen` for the columns and verifiers);
validation tasks never appear in training (checked by prompt; for repository tasks by prompt, code
and gold patch).
"""

from __future__ import annotations

import numpy as np

from snowcat.pipeline.context import StageContext
from snowcat.stages.taskgen import generate_domain, save_tasks, split_tasks, task_key


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
    leaked = {task_key(t) for t in train} & {task_key(t) for t in val}
    if leaked:
        raise RuntimeError(f"{len(leaked)} validation tasks also occur in train")
    save_tasks(ctx.out_dir, "train", train)
    save_tasks(ctx.out_dir, "val", val)
    metrics.update(train=len(train), val=len(val))
    return metrics
