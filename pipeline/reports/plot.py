"""`snowcat plot RUN`: the curves of a run as PNG pictures, one figure per concern, drawn with
matplotlib from what each unit recorded per step (its `metrics_history.jsonl`, the rows that also
go into `history.h5`). Nothing else is read, so it can be drawn at any time, during the run too
(a login node, any number of times: it only reads the run and writes `<run>/plots/`).

    reward       reward/mean per RL update                                (reward per episode)
    pass_at_1    dev/ or val/pass@1 at each evaluation, band 1.96 SE     (fraction of held-out tasks)
    entropy      entropy of the policy on the trained tokens              (nats per token)
    mismatch     sampler vs trainer on the sampled tokens: k3 KL, mean |Δ log p|   (nats per token)
    staleness    policy lag of the trained batch; mean |log p − log p_old|  (updates; nats per token)
    throughput   tokens per second: trained (tokens_per_s), sampled (throughput/…)
    loss         SFT cross-entropy (nats per token, per domain too); RL policy-gradient surrogate

One line per unit (`rl`, `rl[1]`) and metric; a concern no unit recorded is not drawn. What each
figure holds (units, metrics, points, last step) is in `<run>/plots/plots.json`. The card links the
figures (pipeline/reports/card/), the card stage draws them, `snowcat status` points to them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from snowcat.pipeline.dag import build
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_figure, atomic_write_json, read_json
from snowcat.pipeline.rundir import RunDir, now
from snowcat.pipeline.tracking import HISTORY_FILE, read_history

PLOTS_DIR = "plots"
INDEX = "plots.json"
X_LABEL = "step (optimizer updates)"


@dataclass(frozen=True)
class Panel:
    ylabel: str  # with its unit
    metrics: tuple[str, ...]  # regular expressions, matched whole against the history's metric names
    kinds: tuple[str, ...] = ()  # only units of these stage kinds (empty: any)
    band_se: bool = False  # a 95% interval from the metric's `<name>_se` at the same step


@dataclass(frozen=True)
class Concern:
    name: str  # the file: <name>.png
    title: str
    panels: tuple[Panel, ...]


CONCERNS: tuple[Concern, ...] = (
    Concern("reward", "Reward", (Panel("reward (mean per episode)", (r"reward/mean",)),)),
    Concern(
        "pass_at_1",
        "Held-out pass@1 (band: 95% CI over tasks)",
        (Panel("pass@1 (fraction of tasks)", (r"(dev|val|test)/pass@1",), band_se=True),),
    ),
    Concern("entropy", "Policy entropy", (Panel("entropy (nats per token)", (r"entropy",)),)),
    Concern(
        "mismatch",
        "Sampler / trainer mismatch",
        (
            Panel("k3 KL, sampler vs trainer (nats per token)", (r"mismatch(_prompted)?/k3_kl",)),
            Panel("mean |Δ log p| (nats per token)", (r"mismatch(_prompted)?/mean_abs_dlogp",)),
        ),
    ),
    Concern(
        "staleness",
        "Staleness",
        (
            Panel("policy lag (updates)", (r"policy_lag/mean",)),
            Panel("mean |log p − log p_old| (nats per token)", (r"staleness/mean_abs_dlogp",)),
        ),
    ),
    Concern("throughput", "Throughput", (Panel("tokens per second", (r"tokens_per_s", r"throughput/\w*tokens_per_s")),)),
    Concern(
        "loss",
        "Loss",
        (
            Panel("cross-entropy (nats per token)", (r"loss", r"loss/[^/]+"), kinds=("sft",)),
            Panel("policy-gradient loss (surrogate, unitless)", (r"loss/pg_loss",), kinds=("rl",)),
        ),
    ),
)


@dataclass
class Series:
    unit: str
    kind: str
    metric: str
    steps: list[int]
    values: list[float]
    se: list[float] | None = None  # 1 SE per point, when the panel draws a band


def _histories(run: RunDir, stage: str | None = None) -> list[tuple[str, str, list[dict]]]:
    """(unit key, stage kind, history rows) of every unit that recorded a per-step history."""
    dag = build(run.config())
    if stage is not None and stage not in dag.nodes:
        raise UserError(f"--stage: no stage {stage!r} in this run")
    out = []
    for node in dag:
        if stage is not None and node.name != stage:
            continue
        for unit in node.units:
            rows = read_history(run.unit_dir(unit) / HISTORY_FILE)
            if rows:
                out.append((unit.key, node.kind, rows))
    return out


def _series(panel: Panel, histories: list[tuple[str, str, list[dict]]]) -> list[Series]:
    patterns = [re.compile(p) for p in panel.metrics]
    out = []
    for key, kind, rows in histories:
        if panel.kinds and kind not in panel.kinds:
            continue
        names = sorted({k for r in rows for k in r if k != "step" and any(p.fullmatch(k) for p in patterns)})
        for name in names:
            points = [r for r in rows if name in r and math.isfinite(r[name])]
            if not points:
                continue
            se = [r.get(f"{name}_se", math.nan) for r in points] if panel.band_se else None
            out.append(Series(key, kind, name, [r["step"] for r in points], [r[name] for r in points], se))
    return out


def figures(run: RunDir, stage: str | None = None) -> dict[Concern, list[list[Series]]]:
    """Per concern with anything to draw, per panel, its series (what `draw` would draw)."""
    histories = _histories(run, stage)
    out = {}
    for concern in CONCERNS:
        panels = [_series(p, histories) for p in concern.panels]
        if any(panels):
            out[concern] = panels
    return out


def _label(s: Series, panel: list[Series]) -> str:
    """The unit alone when it has one line in the panel, else unit: metric."""
    return s.unit if sum(x.unit == s.unit for x in panel) == 1 else f"{s.unit}: {s.metric}"


def render(concern: Concern, panels: list[list[Series]], title: str):
    """The matplotlib figure of one concern: a panel per kind of quantity (its unit on the y axis),
    a line per series, the 95% band where the panel has SEs; steps on the shared x axis."""
    import matplotlib  # noqa: PLC0415 (loaded by the pictures only)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    shown = [(p, s) for p, s in zip(concern.panels, panels, strict=True) if s]
    fig, axes = plt.subplots(len(shown), 1, figsize=(7, 2.8 * len(shown) + 0.6), sharex=True, squeeze=False)
    for ax, (panel, series) in zip(axes[:, 0], shown, strict=True):
        for s in series:
            sparse = len(s.steps) < 30
            (line,) = ax.plot(s.steps, s.values, lw=1.2, marker="o" if sparse else None, ms=3, label=_label(s, series))
            if s.se is not None:
                lo = [v - 1.96 * e if math.isfinite(e) else v for v, e in zip(s.values, s.se, strict=True)]
                hi = [v + 1.96 * e if math.isfinite(e) else v for v, e in zip(s.values, s.se, strict=True)]
                ax.fill_between(s.steps, lo, hi, color=line.get_color(), alpha=0.2, lw=0)
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[-1, 0].set_xlabel(X_LABEL)
    axes[0, 0].set_title(f"{concern.title}: {title}", fontsize="medium")
    return fig


def draw(run: RunDir, out_dir: Path | None = None, stage: str | None = None) -> dict:
    """Draw every concern that has data into `out_dir` (default <run>/plots/) and write its index;
    returns the index. UserError when no unit recorded a history yet."""
    found = figures(run, stage)
    if not found:
        raise UserError(f"{run.path}: no unit recorded a per-step history ({HISTORY_FILE}) yet; nothing to plot")
    out_dir = Path(out_dir) if out_dir is not None else run.path / PLOTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    index: dict = {"run_id": run.run_id, "drawn": now(), "x": X_LABEL, "figures": {}}
    for concern, panels in found.items():
        path = out_dir / f"{concern.name}.png"
        atomic_write_figure(path, render(concern, panels, run.run_id))
        index["figures"][concern.name] = {
            "file": path.name,
            "title": concern.title,
            "panels": [
                {
                    "ylabel": panel.ylabel,
                    "series": [
                        {"unit": s.unit, "metric": s.metric, "points": len(s.steps), "last_step": s.steps[-1]} for s in series
                    ],
                }
                for panel, series in zip(concern.panels, panels, strict=True)
                if series
            ],
        }
    atomic_write_json(out_dir / INDEX, index)
    return index


def drawn(run: RunDir) -> dict | None:
    """The index of the figures `snowcat plot` last drew into <run>/plots/, None if it never did."""
    return read_json(run.path / PLOTS_DIR / INDEX)


def status_line(run: RunDir, cfg=None) -> str | None:
    """Where `snowcat status` points for the curves (None: no unit recorded a history); `cfg`: the
    run's config, when the caller has it loaded."""
    index = drawn(run)
    if index is not None:
        names = [c.name for c in CONCERNS if c.name in index.get("figures", {})]
        return (
            f"curves: {run.path / PLOTS_DIR}/ ({', '.join(names)}; drawn {index['drawn']}); "
            f"`snowcat plot {run.path}` redraws them"
        )
    histories = (run.unit_dir(u) / HISTORY_FILE for node in build(cfg or run.config()) for u in node.units)
    if any(h.is_file() and h.stat().st_size for h in histories):
        return f"curves: `snowcat plot {run.path}` draws them into {run.path / PLOTS_DIR}/"
    return None


def add_plot_arguments(parser) -> None:
    parser.add_argument("run", help="run directory")
    parser.add_argument("-o", "--output", help="directory for the PNGs (default: <run>/plots)")
    parser.add_argument("--stage", help="only this stage's units")


def cmd_plot(args) -> int:
    run = RunDir.open(args.run)
    out_dir = Path(args.output) if args.output else run.path / PLOTS_DIR
    index = draw(run, out_dir, args.stage)
    for name, fig in index["figures"].items():
        lines = [s for p in fig["panels"] for s in p["series"]]
        what = ", ".join(f"{s['unit']} {s['metric']} ({s['points']} points)" for s in lines)
        print(f"{name}: {out_dir / fig['file']}: {what}")
    return 0
