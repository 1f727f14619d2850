"""`snowcat compare`: paired statistics over scored checkpoints, recomputed from kept attempts."""

from __future__ import annotations

import math
from collections import defaultdict

import h5py
import numpy as np
import pytest
from scipy import stats

from snowcat.pipeline.compare import Variant, compare, render
from snowcat.pipeline.fsio import read_json
from snowcat.stages import evalstats


def _variant(label: str, outcomes: dict[str, list[int]]) -> Variant:
    v = Variant(label=label, source=label)
    for task, results in outcomes.items():
        for r in results:
            v.add(task, r)
    return v


def test_holm_matches_a_hand_computation():
    # m = 3 defined p-values: 0.01 * 3 = 0.03; 0.03 * 2 = 0.06; 0.04 * 1 = 0.04 -> raised to 0.06 (monotone)
    adjusted = evalstats.holm([0.01, 0.04, 0.03, float("nan")])
    assert adjusted[:3] == pytest.approx([0.03, 0.06, 0.06])
    assert math.isnan(adjusted[3])
    assert evalstats.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1


def test_pairs_are_paired_on_shared_tasks_and_holm_corrected():
    rng = np.random.default_rng(0)
    tasks = [f"t{i}" for i in range(30)]
    strong = {t: list(rng.binomial(1, 0.8, 4)) for t in tasks}
    weak = {t: list(rng.binomial(1, 0.3, 4)) for t in tasks}
    twin = {t: list(r) for t, r in strong.items()}
    twin["extra"] = [1, 1]  # a task only this variant scored: not in any pair with the others
    variants = [_variant("base", weak), _variant("strong", strong), _variant("twin", twin)]
    result = compare(variants, seed=1, n_perm=2000)

    by_pair = {(p["a"], p["b"]): p for p in result["pairs"]}
    a = [np.mean(weak[t]) for t in tasks]
    b = [np.mean(strong[t]) for t in tasks]
    d = np.array(b) - np.array(a)
    p = by_pair[("base", "strong")]
    assert p["tasks"] == 30
    assert p["diff"] == pytest.approx(d.mean())
    assert p["se"] == pytest.approx(d.std(ddof=1) / math.sqrt(30))
    # the paired t statistic by hand, its p from the t distribution with n - 1 degrees of freedom
    t_stat = d.mean() / (d.std(ddof=1) / math.sqrt(30))
    assert p["p"] == pytest.approx(2 * stats.t.sf(abs(t_stat), 29))
    # identical per-task scores: no spread to test, p undefined and left out of Holm's m
    assert math.isnan(by_pair[("strong", "twin")]["p"])
    raw = [by_pair[("base", "strong")]["p"], by_pair[("base", "twin")]["p"]]
    hand = sorted(raw)
    hand = [min(1, 2 * hand[0]), max(min(1, 2 * hand[0]), min(1, hand[1]))]
    assert sorted([by_pair[("base", "strong")]["p_holm"], by_pair[("base", "twin")]["p_holm"]]) == pytest.approx(hand)
    assert by_pair[("base", "strong")]["significant"]

    assert result["homogeneity"]["tasks"] == 30 and result["homogeneity"]["p"] < 0.01
    # gain of (strong, twin) over base, per task then over tasks
    g = result["gain_over_base"]
    assert g["gain"] == pytest.approx(d.mean()) and g["se"] == pytest.approx(d.std(ddof=1) / math.sqrt(30))
    assert "## Are these distinguishable at all?" in render(result, ["run"])


def test_exchangeable_variants_are_not_called_distinguishable():
    rng = np.random.default_rng(3)
    tasks = {f"t{i}": rng.uniform() for i in range(40)}
    variants = [_variant(name, {t: list(rng.binomial(1, q, 4)) for t, q in tasks.items()}) for name in "abc"]
    result = compare(variants, seed=2, n_perm=2000)
    assert result["homogeneity"]["p"] > 0.05
    assert not any(p["significant"] for p in result["pairs"])


def test_failures_related_to_outcome_are_flagged():
    """Infrastructure failures only on tasks the model otherwise fails: excluding them inflates the
    score, and the report says so; failures spread evenly are not flagged."""
    hard = {f"h{i}": [0, 0, -1, -1] for i in range(10)}
    easy = {f"e{i}": [1, 1, 1, 1] for i in range(10)}
    even = {**{f"h{i}": [0, 0, 0, -1] for i in range(10)}, **{f"e{i}": [1, 1, 1, -1] for i in range(10)}}
    result = compare([_variant("biased", {**hard, **easy}), _variant("even", even)], seed=0, n_perm=200)
    flags = {o["label"]: o for o in result["infra"]["outcome_vs_failure"]}
    assert flags["biased"]["related"] and flags["biased"]["tasks_with_failures"] == 10
    assert not flags["even"]["related"]
    assert result["variants"][0]["infra_rate"] == pytest.approx(20 / 80)


def test_a_base_that_is_not_a_variant_is_refused():
    v = [_variant("a", {"t": [1]}), _variant("b", {"t": [0]})]
    with pytest.raises(Exception, match="--base 'c': not one of the variants"):
        compare(v, base="c")


@pytest.mark.slow
def test_report_numbers_recomputed_from_the_kept_attempts(snowcat, full_run, tmp_path):
    out = tmp_path / "cmp"
    snowcat("compare", full_run, "-o", out, "--seed", "3", check=True)
    result = read_json(out / "compare.json")
    assert (out / "compare.md").read_text().startswith("# Comparison") and (out / "compare.png").stat().st_size
    # independently: per checkpoint, per task, the pass rate of scored attempts
    per = defaultdict(lambda: defaultdict(list))
    with h5py.File(full_run / "stages" / "eval" / "traces.h5", "r") as f:
        for ref, task, passed in zip(f["checkpoint"][:], f["task_id"][:], f["passed"][:], strict=True):
            if passed >= 0:
                per[ref.decode()][task.decode()].append(int(passed))
    labels = {v["label"]: v for v in result["variants"]}
    assert set(labels) == {"sft:initial", "sft:final"}
    for ref, tasks in per.items():
        assert labels[ref]["pass@1"] == pytest.approx(np.mean([np.mean(r) for r in tasks.values()]))
    (pair,) = result["pairs"]
    shared = sorted(set(per[pair["a"]]) & set(per[pair["b"]]))
    diff = np.mean([np.mean(per[pair["b"]][t]) - np.mean(per[pair["a"]][t]) for t in shared])
    assert pair["tasks"] == len(shared) and pair["diff"] == pytest.approx(diff)
