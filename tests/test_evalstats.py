"""Evaluation statistics against hand-computed cases and direct formulas."""

import math

import numpy as np
import pytest

from snowcat.stages import evalstats
from snowcat.stages.evaluate import summarize
from snowcat.stages.scoring import Attempt
from snowcat.stages.taskgen import Task


def test_pass_at_k_hand_cases():
    assert evalstats.pass_at_k(1, 1, 1) == 1.0
    assert evalstats.pass_at_k(1, 0, 1) == 0.0
    assert evalstats.pass_at_k(4, 1, 1) == pytest.approx(0.25)
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert evalstats.pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n - c < k: every k-subset contains a correct attempt
    assert evalstats.pass_at_k(5, 4, 2) == 1.0


@pytest.mark.parametrize("n", [1, 2, 5, 8, 16, 40])
def test_pass_at_k_matches_comb_formula(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            direct = 1.0 - math.comb(n - c, k) / math.comb(n, k)
            assert evalstats.pass_at_k(n, c, k) == pytest.approx(direct, abs=1e-12)


def test_pass_at_1_is_fraction_correct():
    assert evalstats.pass_at_k(8, 3, 1) == pytest.approx(3 / 8)


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError):
        evalstats.pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        evalstats.pass_at_k(4, 1, 5)


def test_se_is_over_task_means_not_attempts():
    # 3 tasks x 4 attempts: the SE comes from the 3 task means, not 12 independent attempts
    attempts = np.array([[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 1, 0]], dtype=float)
    task_means = attempts.mean(axis=1)  # 0.75, 0, 0.5
    mean, se = evalstats.mean_se(task_means)
    m = sum(task_means) / 3
    direct = math.sqrt(sum((t - m) ** 2 for t in task_means) / 2) / math.sqrt(3)
    assert mean == pytest.approx(m)
    assert se == pytest.approx(direct)
    naive = attempts.std(ddof=1) / math.sqrt(attempts.size)
    assert se > naive  # treating attempts as independent understates the SE here


def test_paired_difference_uses_per_task_differences():
    a = [0.5, 0.2, 0.9, 0.4]
    b = [0.6, 0.3, 1.0, 0.5]  # b is a + 0.1 on every task: the paired SE is zero
    diff, se = evalstats.paired_difference(a, b)
    assert diff == pytest.approx(0.1)
    assert se == pytest.approx(0.0, abs=1e-12)
    unpaired_se = math.sqrt(evalstats.mean_se(a)[1] ** 2 + evalstats.mean_se(b)[1] ** 2)
    assert unpaired_se > 0.1


def test_paired_bootstrap_ci_is_seeded_and_covers_the_difference():
    rng = np.random.default_rng(0)
    a = rng.uniform(size=50)
    b = a + 0.1 + rng.normal(scale=0.05, size=50)
    ci1 = evalstats.paired_bootstrap_ci(a, b, seed=7)
    ci2 = evalstats.paired_bootstrap_ci(a, b, seed=7)
    assert ci1 == ci2
    diff, se = evalstats.paired_difference(a, b)
    lo, hi = ci1
    assert lo < diff < hi
    # a 95 % percentile interval is about +-1.96 SE wide for a near-normal mean
    assert (hi - lo) == pytest.approx(2 * 1.96 * se, rel=0.2)


def test_mean_outcome_reward_counts_missing_as_zero_in_fixed_denominator():
    assert evalstats.mean_outcome_reward([1.0, 0.5, None, 0.25]) == pytest.approx(1.75 / 4)
    assert math.isnan(evalstats.mean_outcome_reward([]))


def test_paired_bootstrap_ci_needs_two_tasks():
    # one task resamples to itself: a zero-width interval would claim certainty the SE cannot give
    assert all(math.isnan(x) for x in evalstats.paired_bootstrap_ci([0.0], [1.0], seed=0))
    assert all(math.isnan(x) for x in evalstats.paired_bootstrap_ci([], [], seed=0))
    lo, hi = evalstats.paired_bootstrap_ci([0.0, 0.0], [1.0, 0.0], seed=0, n_boot=500)
    assert lo < hi


def test_pass_at_k_common_task_set():
    """Each k over its own task set by default; `common` restricts every k to the tasks with >= max(k)
    scored attempts (hand-computed)."""

    def attempts(task_id, outcomes):  # None: infra failure (not scored)
        task = Task(task_id, "d", 1, "p", "a", "d")
        out = []
        for i, o in enumerate(outcomes):
            a = Attempt(task, i)
            if o is not None:
                a.status, a.passed, a.reward = "ok", int(o), float(o)
            out.append(a)
        return out

    # t1 has 2 scored attempts (1 pass), t2 only 1 scored (a pass) after an infra failure
    records = attempts("t1", [1, 0]) + attempts("t2", [1, None])
    each = summarize(records, [1, 2])
    assert (each["pass@1"], each["pass@1_tasks"]) == (0.75, 2)  # mean(0.5, 1.0)
    assert (each["pass@2"], each["pass@2_tasks"]) == (1.0, 1)  # t1 only
    common = summarize(records, [1, 2], common=True)
    assert (common["pass@1"], common["pass@1_tasks"]) == (0.5, 1) and (common["pass@2"], common["pass@2_tasks"]) == (1.0, 1)
