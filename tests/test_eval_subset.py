"""`evaluate.limit`: a seeded random N tasks of the split, stratified by domain, recorded in
results.json; not the first N of a split file grouped by domain. The stage end to end (its record
in results.json, the tasks it scored): tests/test_evaluate.py::test_real_verifier_and_bad_config."""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter

import numpy as np
import pytest

from snowcat.stages.evaluate import sample_tasks
from snowcat.stages.taskgen import generate_domain


def split(sizes: dict[str, int]) -> list:
    """A split as the tasks stage writes it: grouped by domain."""
    rng = np.random.default_rng(0)
    out = []
    for domain, n in sizes.items():
        out += generate_domain(rng, domain, [1, 2], n)
    return out


def test_the_subset_is_stratified_seeded_and_in_the_splits_order():
    tasks = split({"closure": 60, "arith": 30})
    picked, record = sample_tasks(tasks, 30, seed=5)
    assert Counter(t.domain for t in picked) == {"closure": 20, "arith": 10}  # not the first 30: all closure
    ids = [t.task_id for t in tasks]
    assert len({t.task_id for t in picked}) == 30 and [ids.index(t.task_id) for t in picked] == sorted(
        ids.index(t.task_id) for t in picked
    )
    assert picked != tasks[:20] + tasks[60:70]  # random within each domain, not its first tasks
    assert record == {
        "limit": 30,
        "of": 90,
        "seed": 5,
        "method": "stratified by domain, proportional (largest remainder); per domain a seeded permutation's first k",
        "per_domain": {"arith": [10, 30], "closure": [20, 60]},
        "task_ids_sha256": hashlib.sha256("\n".join(t.task_id for t in picked).encode()).hexdigest(),
    }
    assert sample_tasks(tasks, 30, seed=5)[0] == picked  # the same seed: the same tasks
    assert sample_tasks(tasks, 30, seed=6)[0] != picked
    smaller, _ = sample_tasks(tasks, 15, seed=5)  # a smaller N: a subset of the larger one's tasks
    assert {t.task_id for t in smaller} < {t.task_id for t in picked}
    assert sample_tasks(tasks, 0, seed=5) == (tasks, None) and sample_tasks(tasks, 90, seed=5) == (tasks, None)


def test_shares_by_largest_remainder_and_each_task_equally_likely():
    tasks = split({"closure": 7, "arith": 3})
    tasks = tasks[:5] + tasks[7:] + [dataclasses.replace(t, domain="third") for t in tasks[5:7]]  # 5, 3, 2 tasks
    _, record = sample_tasks(tasks, 4, seed=0)  # quotas 2, 1.2, 0.8: the one left goes to the largest remainder
    assert record["per_domain"] == {"arith": [1, 3], "closure": [2, 5], "third": [1, 2]}
    counts = Counter()
    for seed in range(400):
        counts.update(t.task_id for t in sample_tasks(tasks, 4, seed)[0] if t.domain == "closure")
    rates = np.array([counts[t.task_id] / 400 for t in tasks[:5]])
    assert rates == pytest.approx(np.full(5, 2 / 5), abs=0.1)  # 2 of 5 each time: 0.4 each (SE 0.024)
