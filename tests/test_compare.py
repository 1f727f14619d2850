"""`snowcat compare`: paired statistics over scored checkpoints, recomputed from kept attempts."""

from __future__ import annotations

import math
from collections import defaultdict

import h5py
import numpy as np
import pytest
from scipy import stats

from snowcat.pipeline.fsio import read_json
from snowcat.pipeline.reports.compare import Variant, compare, render
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


def test_variants_with_no_task_in_common_are_compared_pair_by_pair():
    """Runs on other benchmarks (a recipe on repository tasks beside ones on arith): the pairs that share
    tasks are compared, the tests over the tasks every variant scored have none and say so."""
    arith = {f"a{i}": [i % 2, 1] for i in range(10)}
    variants = [_variant("x", arith), _variant("y", {t: [1, 1] for t in arith}), _variant("repo", {"r0": [0], "r1": [1]})]
    result = compare(variants, seed=1, n_perm=100)
    by_pair = {(p["a"], p["b"]): p for p in result["pairs"]}
    assert by_pair[("x", "y")]["tasks"] == 10 and by_pair[("x", "y")]["diff"] == pytest.approx(0.25)
    assert by_pair[("x", "repo")]["tasks"] == 0 and math.isnan(by_pair[("x", "repo")]["diff"])
    assert result["homogeneity"]["tasks"] == 0 and math.isnan(result["homogeneity"]["p"])
    assert result["gain_over_base"]["tasks"] == 0 and math.isnan(result["gain_over_base"]["gain"])
    assert "cannot be tested (fewer than 2 shared tasks)" in render(result, ["run"])


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


# --- a run's evaluate unit with kept trajectories: the grid and what reward hacks were worth ---------

EVAL_CONFIG = """\
name: cmp
stages:
  tasks: {kind: tasks}
  sft: {kind: sft, needs: [tasks], model: test-micro}
  eval: {kind: evaluate, needs: [tasks, sft], checkpoints: ["sft:initial", "sft:final"]}
"""


def _episodes(final: bool, arith, closure) -> list[tuple]:
    """(task, response text, reward, passed) per attempt. sft:final answers one arith task with the bare
    key (passed: the answer-key detector flags it) and one closure task with the key's closers then more
    (reward 1 from partial credit, not passed: flagged too); sft:initial works every answer out."""
    (a1, a2), (c1, c2) = arith, closure
    return [
        (a1, a1.answer if final else work(a1), 1.0, 1),
        (a1, work(a1), 1.0, 1),
        (a2, work(a2), 1.0, 1),
        (a2, work(a2), 1.0, 1),
        (c1, c1.answer + "]]" if final else c1.answer, 1.0, 0 if final else 1),
        (c1, c1.answer, 1.0, 1),
        (c2, "x", 0.0, 0),
        (c2, "y", 0.0, 0),
    ]


def work(task) -> str:
    """The column-by-column work of a 2-digit addition, then the answer (stages/taskgen/arith.py's
    demonstrations: `6+7=13,8+6+1=15;153`)."""
    a, b = task.meta["a"], task.meta["b"]
    low = a % 10 + b % 10
    high = a // 10 + b // 10 + (low >= 10)
    return f"{a % 10}+{b % 10}={low},{a // 10}+{b // 10}{'+1' if low >= 10 else ''}={high};{task.answer}"


def test_grid_and_what_reward_hacks_were_worth_from_the_kept_trajectories(tmp_path, capsys):
    from snowcat.pipeline import cli, config  # noqa: PLC0415
    from snowcat.pipeline.dag import Unit  # noqa: PLC0415
    from snowcat.pipeline.rundir import RunDir  # noqa: PLC0415
    from snowcat.stages.agent import Trajectory  # noqa: PLC0415
    from snowcat.stages.agent.dataset import DIRNAME, TrajectoryWriter  # noqa: PLC0415
    from snowcat.stages.taskgen import generate_domain  # noqa: PLC0415
    from snowcat.stages.tokenizer import train_tokenizer  # noqa: PLC0415

    rng = np.random.default_rng(4)
    arith = [t for t in generate_domain(rng, "arith", [2], 12) if t.meta["op"] == "+"][:2]
    closure = generate_domain(rng, "closure", [1], 2)
    tok = train_tokenizer([t.prompt + t.answer for t in arith + closure] * 3 + ["0123456789+-=,;xy]}"], vocab_size=300)
    (tmp_path / "c.yaml").write_text(EVAL_CONFIG)
    run = RunDir.create(config.load(tmp_path / "c.yaml"), tmp_path / "run")
    out = run.unit_dir(Unit("eval"))
    writer = TrajectoryWriter(out / DIRNAME, stage="eval", env="single", keep=None, seed=0)
    columns = {"checkpoint": [], "task_id": [], "domain": [], "passed": []}
    expected = {}
    for ref in ("sft:initial", "sft:final"):
        episodes = _episodes(ref == "sft:final", arith, closure)
        trajs = []
        for i, (task, text, reward, passed) in enumerate(episodes):
            prompt, answer = tok.encode(task.prompt), tok.encode(text) + [tok.end_of_turn_id]
            n = len(answer)
            trajs.append(
                Trajectory(
                    task_id=task.task_id,
                    group_id=i // 2,
                    attempt=i % 2,
                    policy_version=0,
                    token_ids=np.array(prompt + answer, np.int32),
                    loss_mask=np.array([0] * len(prompt) + [1] * n, np.uint8),
                    rollout_logprobs=np.zeros(len(prompt) + n, np.float32),
                    reward=reward,
                    status="ok",
                    turn_boundaries=[(len(prompt), len(prompt) + n)],
                    domain=task.domain,
                    prompt_len=len(prompt),
                )
            )
            for key, value in (("checkpoint", ref), ("task_id", task.task_id), ("domain", task.domain), ("passed", passed)):
                columns[key].append(value)
        writer.write(
            ref, trajs, tok, checkpoint=ref, tasks={t.task_id: t for t in arith + closure}, passed=[e[3] for e in episodes]
        )
        expected[ref] = episodes
    with h5py.File(out / "traces.h5", "w") as f:  # the columns of evaluate's traces.h5 that compare reads
        for key, values in columns.items():
            f.create_dataset(key, data=values, dtype=np.int8 if key == "passed" else h5py.string_dtype())
    run.mark_done(Unit("eval"), {"duration_s": 1.0}, {})

    assert cli.main(["compare", str(run.path), "-o", str(tmp_path / "cmp")]) == 0
    result = read_json(tmp_path / "cmp" / "compare.json")
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "## Per benchmark × variant" in md and "## What reward hacks were worth" in md

    # the grid by hand: per domain, per task the pass rate, then the mean and SE over the domain's tasks
    assert result["grid"]["domains"] == ["arith", "closure"]
    for ref, episodes in expected.items():
        for domain in ("arith", "closure"):
            per_task = defaultdict(list)
            for task, _, _, passed in episodes:
                if task.domain == domain:
                    per_task[task.task_id].append(passed)
            rates = [np.mean(v) for v in per_task.values()]
            cell = result["grid"]["cells"][ref][domain]
            assert cell["tasks"] == 2 and cell["pass@1"] == pytest.approx(np.mean(rates))
            assert cell["se"] == pytest.approx(np.std(rates, ddof=1) / math.sqrt(2))

    hacks = {h["label"]: h for h in result["reward_hacks"]}
    clean, gamed = hacks["sft:initial"], hacks["sft:final"]
    assert clean["worth"] == 0 and clean["pass@1"] == clean["pass@1_without_hacks"] == pytest.approx(0.75)
    assert all(d["flagged"] == 0 for d in clean["detectors"].values())
    key = gamed["detectors"]["answer_key_match"]
    assert (key["flagged"], key["rewarded"], key["unrewarded"], key["passed"]) == (2, 2, 0, 1)
    assert sum(d["flagged"] for d in gamed["detectors"].values()) == 2  # no other detector fires
    # by hand, per task (a1, a2, c1, c2): reported pass rates 1, 1, 0.5, 0; without the flagged-and-rewarded
    # episodes: 0.5 (a1's bare key), 1, 0.5 (c1's flagged episode had not passed), 0
    reported, without = np.array([1, 1, 0.5, 0]), np.array([0.5, 1, 0.5, 0])
    assert gamed["pass@1"] == pytest.approx(reported.mean()) and gamed["pass@1_without_hacks"] == pytest.approx(without.mean())
    d = reported - without
    assert gamed["worth"] == pytest.approx(d.mean()) and gamed["worth_se"] == pytest.approx(d.std(ddof=1) / 2)
    rewards, rewards_without = np.array([1, 1, 1, 0]), np.array([0.5, 1, 0.5, 0])  # c1's partial credit paid in full
    assert gamed["reward_worth"] == pytest.approx((rewards - rewards_without).mean())
    assert gamed["episodes"] == 8 and gamed["pass@1"] == pytest.approx(
        next(v["pass@1"] for v in result["variants"] if v["label"] == "sft:final")
    )
    row = next(line for line in md.splitlines() if line.startswith("| sft:final | 8 |"))
    assert "+0.125" in row and "2 (2/0)" in row

    # --grep: which attempts' model turns show column-by-column work (`d+d=`), per variant
    assert cli.main(["compare", str(run.path), "-o", str(tmp_path / "g"), "--grep", r"\d\+\d="]) == 0
    found = {g["label"]: g for g in read_json(tmp_path / "g" / "compare.json")["grep"]["variants"]}
    initial, final = found["sft:initial"], found["sft:final"]
    assert (initial["matched"], initial["episodes"], initial["tasks_matched"]) == (4, 8, 2)
    assert (final["matched"], final["tasks_matched"]) == (3, 2)  # a1's bare answer shows none
    assert initial["rate"] == pytest.approx(np.mean([1, 1, 0, 0])) and final["rate"] == pytest.approx(np.mean([0.5, 1, 0, 0]))
    assert final["rate_se"] == pytest.approx(np.std([0.5, 1, 0, 0], ddof=1) / 2)
    assert (final["pass_rate_matched"], final["pass_rate_others"]) == (1.0, pytest.approx(2 / 5))
    assert final["examples"][0]["excerpt"] == work(arith[0]) and len(final["examples"]) == 3
    assert "## Attempts whose model turns match `\\d\\+\\d=`" in (tmp_path / "g" / "compare.md").read_text()
    capsys.readouterr()
    assert cli.main(["compare", str(run.path), "-o", str(tmp_path / "bad"), "--grep", "(unclosed"]) == 2
    err = capsys.readouterr().err
    assert "--grep '(unclosed': not a valid regular expression" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists()
