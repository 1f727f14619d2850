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
    return bootstrap_ci(d, seed=seed, n_boot=n_boot, confidence=confidence)


def mean_outcome_reward(task_rewards: Sequence[float | None]) -> float:
    """Mean per-task reward (partial credit allowed) over the full cohort: a missing grade (None)
    counts 0 and stays in the denominator, so unscored tasks cannot inflate the mean."""
    if len(task_rewards) == 0:
        return float("nan")
    return float(sum(0.0 if r is None else float(r) for r in task_rewards) / len(task_rewards))


def paired_p_value(a: Sequence[float], b: Sequence[float]) -> float:
    """Two-sided p of the paired t test that mean(b - a) = 0 over tasks; NaN below 2 tasks or when
    every task differs by the same amount (no spread to test against)."""
    from scipy import stats  # noqa: PLC0415 (only the comparison report needs scipy)

    d = np.asarray(b, dtype=float) - np.asarray(a, dtype=float)
    if d.size < 2 or np.allclose(d, d[0]):
        return float("nan")
    return float(stats.ttest_rel(b, a).pvalue)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment for a family of tests (controls the family-wise error rate).
    The i-th smallest of the m defined p-values becomes max over j <= i of min(1, (m - j + 1) p_(j));
    NaN (undefined) stays NaN and does not count in m."""
    p = np.asarray(p_values, dtype=float)
    out = np.full(p.shape, np.nan)
    defined = np.flatnonzero(~np.isnan(p))
    order = defined[np.argsort(p[defined], kind="stable")]
    m, running = len(order), 0.0
    for j, i in enumerate(order):
        running = max(running, min(1.0, (m - j) * p[i]))
        out[i] = running
    return out.tolist()


def permutation_homogeneity(scores: np.ndarray, *, seed: int, n_perm: int = 10000) -> tuple[float, float]:
    """(statistic, p) of "the variants are exchangeable": `scores` [tasks, variants] per-task values;
    the statistic is the variance of the variants' means, and its null distribution comes from
    permuting the variants' values within each task (the tasks stay paired). p = (1 + #{null >=
    observed}) / (1 + n_perm). NaN below 2 tasks or 2 variants."""
    x = np.asarray(scores, dtype=float)
    if x.ndim != 2 or x.shape[0] < 2 or x.shape[1] < 2:
        return float("nan"), float("nan")
    observed = float(x.mean(axis=0).var())
    rng = np.random.default_rng(seed)
    null = np.array([rng.permuted(x, axis=1).mean(axis=0).var() for _ in range(n_perm)])
    return observed, float((1 + np.sum(null >= observed - 1e-12)) / (1 + n_perm))


def gain_over_base(base: Sequence[float], others: np.ndarray) -> tuple[float, float]:
    """Mean gain of several variants over a shared base, with an SE that accounts for sharing: per task,
    the variants' mean minus the base, then mean and SE over tasks (the tasks and the base are common
    to every variant, so their gains are not independent). `others` [tasks, variants]."""
    return mean_se(np.asarray(others, dtype=float).mean(axis=1) - np.asarray(base, dtype=float))


def bootstrap_ci(task_values: Sequence[float], *, seed: int, n_boot: int = 2000, confidence: float = 0.95) -> tuple[float, float]:
    """Percentile interval for the mean of per-task values, resampling tasks with replacement (the
    attempts of a task stay together in its value). NaN below 2 tasks, as the standard error is."""
    x = np.asarray(task_values, dtype=float)
    if x.size < 2:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n_boot, x.size))].mean(axis=1)
    tail = (1.0 - confidence) / 2
    lo, hi = np.quantile(means, [tail, 1.0 - tail])
    return float(lo), float(hi)


EXACT_SIGN_FLIPS = 16  # tasks that differ, up to which every sign assignment is enumerated (2^16)


def paired_permutation_p(a: Sequence[float], b: Sequence[float], *, seed: int, n_perm: int = 10000) -> float:
    """Two-sided p of "b and a are exchangeable within each task": the sign of each task's difference
    b - a is flipped at random, and p is the share of flips whose |sum| reaches the observed one.
    Exact (every assignment) when at most `EXACT_SIGN_FLIPS` tasks differ, else `n_perm` seeded draws,
    p = (1 + #{null >= observed}) / (1 + n_perm). With one 0/1 outcome per task this is McNemar's
    exact test on the discordant tasks. 1.0 when no task differs; NaN without tasks."""
    d = np.asarray(b, dtype=float) - np.asarray(a, dtype=float)
    if d.size == 0:
        return float("nan")
    d = d[np.abs(d) > 1e-12]
    if d.size == 0:
        return 1.0
    observed = abs(d.sum()) - 1e-9  # sums that tie with the observed one count as reaching it
    if d.size <= EXACT_SIGN_FLIPS:
        signs = 1 - 2 * ((np.arange(2**d.size)[:, None] >> np.arange(d.size)) & 1)
        return float(np.mean(np.abs(signs @ d) >= observed))
    rng = np.random.default_rng(seed)
    null = np.abs(rng.choice([-1.0, 1.0], size=(n_perm, d.size)) @ d)
    return float((1 + np.sum(null >= observed)) / (1 + n_perm))
