"""Evaluation statistics over tasks with several attempts each (pure numpy).

Attempts of one task are not independent, so every uncertainty here is computed over *task*
means: average the attempts within a task first, then SE = sd(task means) / sqrt(N tasks).
Comparisons of two checkpoints on the same tasks are paired: the SE is that of the per-task
differences, and intervals come from a bootstrap that resamples tasks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one task with n attempts, c of them correct (Chen et al. 2021).

    1 - C(n-c, k) / C(n, k), evaluated as the stable product 1 - prod_{i=n-c+1}^{n} (1 - k/i).
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_se(task_values: Sequence[float]) -> tuple[float, float]:
    """Mean of per-task values and its standard error sd(task values, ddof=1) / sqrt(N)."""
    x = np.asarray(task_values, dtype=float)
    if x.size == 0:
        return float("nan"), float("nan")
    se = float(x.std(ddof=1) / np.sqrt(x.size)) if x.size > 1 else float("nan")
    return float(x.mean()), se


def paired_difference(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Mean and SE of per-task differences b - a (same tasks, same order)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired values need the same tasks, got {a.shape} and {b.shape}")
    return mean_se(b - a)


def paired_bootstrap_ci(
    a: Sequence[float],
    b: Sequence[float],
    *,
    seed: int,
    n_boot: int = 2000,
    confidence: float = 0.95,
) -> tuple[float, float]:
    """Percentile interval for mean(b - a), resampling tasks with replacement (pairs stay together).
    Undefined (NaN) below 2 tasks, as the standard error is: one task resamples to itself."""
    d = np.asarray(b, dtype=float) - np.asarray(a, dtype=float)
    if d.size < 2:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(n_boot, d.size))].mean(axis=1)
    tail = (1.0 - confidence) / 2
    lo, hi = np.quantile(means, [tail, 1.0 - tail])
    return float(lo), float(hi)


def mean_outcome_reward(task_rewards: Sequence[float | None]) -> float:
    """Mean per-task reward (partial credit allowed) over the full cohort: a missing grade (None)
    counts 0 and stays in the denominator, so unscored tasks cannot inflate the mean."""
    if len(task_rewards) == 0:
        return float("nan")
    return float(sum(0.0 if r is None else float(r) for r in task_rewards) / len(task_rewards))
