"""`snowcat plot`: the run's curves as PNGs drawn with matplotlib from what the units recorded per
step; the card links them, `status` points to them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from snowcat.pipeline import cli, config
from snowcat.pipeline.dag import Unit
from snowcat.pipeline.reports import plot
from snowcat.pipeline.reports.card import build_card
from snowcat.pipeline.rundir import RunDir

CONFIG = """\
name: plt
executor: {kind: local, max_parallel: 1}
stages:
  tasks: {kind: tasks}
  sft: {kind: sft, needs: [tasks], model: test-micro, steps: 8}
  rl:
    kind: rl
    needs: [tasks, sft]
    init_from: sft:final
    fan_out: {replica: [0, 1]}
"""


def make_run(tmp_path: Path) -> RunDir:
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    return RunDir.create(config.load(path), tmp_path / "run")


def write_history(run: RunDir, unit: Unit, rows: list[dict]) -> None:
    out = run.unit_dir(unit)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "metrics_history.jsonl").open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def sft_rows(n: int = 8) -> list[dict]:
    """Keys as the SFT trainer records them (stages/sft.py record, stages/train StepStats.record)."""
    return [
        {"step": s, "loss": 3.0 / (s + 1), "loss/arith": 3.5 / (s + 1), "lr": 1e-3, "entropy": 2.0 - 0.1 * s}
        | {"tokens_per_s": 1000.0 + s, "step_time_s": 0.1, "epoch": 0}
        for s in range(1, n + 1)
    ]


def rl_rows(shift: float, n: int = 12) -> list[dict]:
    """Keys as the RL loop records them (stages/rlcore/trainer.py record): a held-out evaluation every 4 updates."""
    rows = []
    for s in range(1, n + 1):
        row = {
            "step": s,
            "reward/mean": 0.3 + shift + 0.02 * s,
            "entropy": 1.5 - 0.05 * s,
            "mismatch/k3_kl": 1e-4 * s,
            "mismatch/mean_abs_dlogp": 1e-3 * s,
            "policy_lag/mean": 1.0,
            "staleness/mean_abs_dlogp": 0.01 * s,
            "throughput/sampled_tokens_per_s": 500.0 + s,
            "tokens_per_s": 800.0 + s,
            "loss/pg_loss": -0.01 * s,
            "time/step_s": 0.5,
            "status": "ok",  # not a number: never drawn
        }
        if s % 4 == 0:
            row |= {"dev/pass@1": 0.5 + shift + 0.01 * s, "dev/pass@1_se": 0.05, "dev/tasks": 40}
        rows.append(row)
    return rows


def test_one_png_per_concern_with_labelled_axes_and_the_recorded_values(tmp_path, capsys):
    run = make_run(tmp_path)
    sft = sft_rows()
    rl0, rl1 = rl_rows(0.0), rl_rows(0.1)
    write_history(run, Unit("sft"), sft)
    write_history(run, Unit("rl", 0), rl0)
    write_history(run, Unit("rl", 1), rl1)

    assert cli.main(["plot", str(run.path)]) == 0
    printed = capsys.readouterr().out
    names = [c.name for c in plot.CONCERNS]
    assert [line.split(":")[0] for line in printed.splitlines()] == names  # every concern had data
    for name in names:
        image = matplotlib.image.imread(run.path / "plots" / f"{name}.png")
        assert image.shape[1] == 700 and image.shape[0] >= 300  # 7 inches at 100 dpi, a panel or two high
        assert image[..., :3].std() > 0.05  # drawn on, not blank
    index = json.loads((run.path / "plots" / "plots.json").read_text())
    (reward,) = index["figures"]["reward"]["panels"]
    assert [(s["unit"], s["metric"], s["points"], s["last_step"]) for s in reward["series"]] == [
        ("rl[0]", "reward/mean", 12, 12),
        ("rl[1]", "reward/mean", 12, 12),
    ]
    (passes,) = index["figures"]["pass_at_1"]["panels"]
    assert [s["points"] for s in passes["series"]] == [3, 3]  # evaluated at steps 4, 8, 12 only
    loss = index["figures"]["loss"]["panels"]
    assert [p["ylabel"] for p in loss] == ["cross-entropy (nats per token)", "policy-gradient loss (surrogate, unitless)"]
    assert {s["metric"] for s in loss[0]["series"]} == {"loss", "loss/arith"}  # SFT's, not RL's pg loss
    assert {s["unit"] for s in index["figures"]["entropy"]["panels"][0]["series"]} == {"sft", "rl[0]", "rl[1]"}


def test_the_figure_holds_the_history_and_a_95_percent_band(tmp_path):
    run = make_run(tmp_path)
    rows = rl_rows(0.0)
    write_history(run, Unit("rl", 0), rows)
    found = plot.figures(run)
    by_name = {c.name: (c, panels) for c, panels in found.items()}
    assert set(by_name) == {"reward", "pass_at_1", "entropy", "mismatch", "staleness", "throughput", "loss"}
    concern, panels = by_name["pass_at_1"]
    fig = plot.render(concern, panels, run.run_id)
    (ax,) = fig.axes
    evaluated = [r for r in rows if "dev/pass@1" in r]
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [r["step"] for r in evaluated]
    assert list(line.get_ydata()) == pytest.approx([r["dev/pass@1"] for r in evaluated])
    (band,) = ax.collections
    ys = band.get_paths()[0].vertices[:, 1]
    assert ys.max() == pytest.approx(max(r["dev/pass@1"] for r in evaluated) + 1.96 * 0.05)
    assert ys.min() == pytest.approx(min(r["dev/pass@1"] for r in evaluated) - 1.96 * 0.05)
    assert ax.get_ylabel() == "pass@1 (fraction of tasks)" and ax.get_xlabel() == plot.X_LABEL

    concern, panels = by_name["staleness"]
    fig = plot.render(concern, panels, run.run_id)
    assert [a.get_ylabel() for a in fig.axes] == ["policy lag (updates)", "mean |log p − log p_old| (nats per token)"]
    for a in fig.axes:  # every panel's unit is on its axis
        assert "(" in a.get_ylabel()
    assert fig.axes[-1].get_xlabel() == plot.X_LABEL


def test_a_torn_last_line_and_missing_values_are_left_out(tmp_path):
    run = make_run(tmp_path)
    rows = sft_rows(4)
    rows[2]["entropy"] = math.nan
    write_history(run, Unit("sft"), rows)
    with (run.unit_dir(Unit("sft")) / "metrics_history.jsonl").open("a") as f:
        f.write('{"step": 5, "loss": 0.')  # a writer killed mid-line
    found = {c.name: panels for c, panels in plot.figures(run).items()}
    assert "reward" not in found and "mismatch" not in found  # an SFT-only run has no RL curves
    (entropy,) = found["entropy"][0]
    assert entropy.steps == [1, 2, 4]
    loss = {s.metric: s for s in found["loss"][0]}
    assert loss["loss"].steps == [1, 2, 3, 4] and np.allclose(loss["loss"].values, [r["loss"] for r in rows])


def test_nothing_recorded_is_one_line_exit_2_and_status_points_to_the_curves(tmp_path, capsys):
    run = make_run(tmp_path)
    assert plot.status_line(run) is None
    assert cli.main(["plot", str(run.path)]) == 2
    err = capsys.readouterr().err
    assert "no unit recorded a per-step history" in err and len(err.strip().splitlines()) == 1
    assert cli.main(["plot", str(run.path), "--stage", "nope"]) == 2
    assert "--stage: no stage 'nope'" in capsys.readouterr().err

    write_history(run, Unit("sft"), sft_rows(3))
    assert "`snowcat plot" in plot.status_line(run) and "draws them" in plot.status_line(run)
    plot.draw(run)
    line = plot.status_line(run)
    assert line.startswith(f"curves: {run.path / 'plots'}/ (entropy, throughput, loss; drawn ")


def test_the_card_links_the_figures_relative_to_where_it_is_written(tmp_path):
    run = make_run(tmp_path)
    write_history(run, Unit("rl", 1), rl_rows(0.0))
    text = build_card(run)  # the card stage's place: <run>/stages/card/card.md
    curves = text.split("## Curves")[1].split("\n## ")[0]
    assert "![Reward: rl[1]](../../plots/reward.png)" in curves
    assert "![Held-out pass@1 (band: 95% CI over tasks): rl[1]](../../plots/pass_at_1.png)" in curves
    elsewhere = tmp_path / "out" / "cards"
    text = build_card(run, elsewhere)
    assert "![Reward: rl[1]](../../run/plots/reward.png)" in text
    assert (elsewhere / "../../run/plots").resolve() == run.path / "plots"
