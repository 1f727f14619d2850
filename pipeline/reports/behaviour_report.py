"""`snowcat behaviour`'s Markdown report and figures, from the numbers pipeline/reports/behaviour.py computes."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from snowcat.pipeline.fsio import atomic_write_figure

WINNER_ROWS = 20  # tasks listed in the Markdown (the JSON has them all)


def _f(x, spec: str = "{:.3f}") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else spec.format(x)


def _interval(side: dict, spec: str = "{:.3f}") -> str:
    lo, hi = side["ci95"]
    return f"{_f(side['mean'], spec)} [{_f(lo, spec)}, {_f(hi, spec)}]"


def _paired(p: dict, spec: str = "{:+.3f}") -> tuple[str, str]:
    return f"{_f(p['diff'], spec)} ± {_f(p['se'], spec.replace('+', ''))} ({p['tasks']})", _f(p["p"], "{:.4f}")


def render(report: dict, figures: list[str] = ()) -> str:
    a, b = report["a"], report["b"]
    A, B = a["checkpoint"], b["checkpoint"]
    lines = [
        f"# Behaviour: `{A}` (A) vs `{B}` (B)",
        "",
        f"Run `{report['run']}`, evaluate stage `{report['stage']}`. Scored attempts only (infrastructure failures left out).",
        "",
        "| checkpoint | unit | attempts | tasks | records |",
        "|---|---|---|---|---|",
        *(f"| {s['checkpoint']} | {s['unit']} | {s['episodes']} | {s['tasks']} | {s['records']} |" for s in (a, b)),
        "",
        "Rate: per task the share of its attempts that show the behaviour, then the mean over tasks, with a 95% "
        "bootstrap interval over tasks; count: attempts that show it / attempts where it is defined (a file "
        "behaviour needs a gold patch). B − A: paired over the tasks both scored (their number in brackets), "
        "± SE; p: sign-flip permutation test over those tasks (exact up to 16 differing tasks).",
        "",
        f"Procedure: {', '.join(f'`{r}`' for r in report['procedure']) or 'none'} (evaluate's `procedure`).",
        "",
        "## What they did",
        "",
        "| behaviour | A count | A rate [95% CI] | B count | B rate [95% CI] | B − A ± SE (tasks) | p |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["behaviours"].values():
        diff, p = _paired(row["paired"])
        lines.append(
            f"| {row['label']} | {row['a']['count']:.0f}/{row['a']['episodes']} | {_interval(row['a'])} | "
            f"{row['b']['count']:.0f}/{row['b']['episodes']} | {_interval(row['b'])} | {diff} | {p} |"
        )
    lines += [
        "",
        "## How they worked",
        "",
        "Means per attempt (per task, then over tasks), and over passed attempts only. Action tokens spell the "
        "tool calls, reasoning tokens are the model's others"
        + ("" if report["tokens_exact"] else " (some shards predate the count: their turns split by characters)")
        + ".",
        "",
        "| measure | A mean [95% CI] | A, passed | B mean [95% CI] | B, passed | B − A ± SE (tasks) | p |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, row in report["measures"].items():
        precise = key == "reasoning_share" or key.endswith("_s")
        spec = "{:.3f}" if precise else "{:.1f}"
        diff, p = _paired(row["paired"], "{:+.3f}" if precise else "{:+.1f}")
        lines.append(
            f"| {row['label']} | {_interval(row['a'], spec)} | {_f(row['a']['mean_passed'], spec)} | "
            f"{_interval(row['b'], spec)} | {_f(row['b']['mean_passed'], spec)} | {diff} | {p} |"
        )
    lines += ["", *winners_table(report["winners_and_losers"]), "", "## Wall time", ""]
    lines.append(
        "Per attempt in the table above (wall seconds to the episode's end count its batch-mates' turns: the agent "
        "loop advances a batch together; where a shard was kept without timings those rows are empty). Sampling and "
        "verifying every episode took "
        + "; ".join(f"{s['checkpoint']}: {_f(s['sample_s'], '{:.1f} s')}" for s in (a, b))
        + " (evaluate's `<checkpoint>/sample_s`, with the attempts a sample kept or not)."
    )
    if "grep" in report:
        lines += ["", *grep_table(report["grep"], A, B)]
    lines += ["", *(f"![{name}]({name})" for name in figures)]
    return "\n".join(lines) + "\n"


def winners_table(found: dict) -> list[str]:
    lines = [
        "## Winners and losers: did both reach the same files?",
        "",
        "Tasks one checkpoint passed at least once and the other never. Reached: a losing attempt opened or "
        "edited a file the winner's passing attempts edited.",
        "",
        "| winner | tasks | loser reached the winner's file | loser edited it | loser opened a gold file | winner edited nothing |",
        "|---|---|---|---|---|---|",
    ]
    for ref, s in found["by_winner"].items():
        lines.append(
            f"| {ref} | {s['tasks']} | {s['loser_reached']} | {s['loser_edited']} | {s['loser_opened_gold']} | {s['winner_edited_nothing']} |"
        )
    tasks = found["tasks"]
    if tasks:
        lines += [
            "",
            "| task | winner | winner's files | loser reached | loser edited | loser attempts |",
            "|---|---|---|---|---|---|",
        ]
        yes = {True: "yes", False: "no", None: "-"}
        for t in tasks[:WINNER_ROWS]:
            lines.append(
                f"| {t['task_id']} | {t['winner']} | {', '.join(t['winner_files']) or '-'} | {yes[t['loser_reached']]} | "
                f"{yes[t['loser_edited']]} | {t['loser_attempts']} |"
            )
        if len(tasks) > WINNER_ROWS:
            lines.append(f"\n({len(tasks) - WINNER_ROWS} more tasks in the JSON.)")
    return lines


def grep_table(found: dict, A: str, B: str) -> list[str]:
    diff, p = _paired(found["paired"])
    lines = [
        f"## Attempts whose reasoning or actions match `{found['pattern']}`",
        "",
        "| checkpoint | matched / attempts | tasks with a match | rate [95% CI] | pass rate, matched | pass rate, others |",
        "|---|---|---|---|---|---|",
    ]
    examples = []
    for name, ref in (("a", A), ("b", B)):
        g = found[name]
        lines.append(
            f"| {ref} | {g['count']:.0f} / {g['episodes']} | {g['tasks_matched']} / {g['tasks']} | {_interval(g)} | "
            f"{_f(g['pass_rate_matched'])} | {_f(g['pass_rate_others'])} |"
        )
        examples += [f"- {ref} `{e['id']}` ({e['task_id']}): {e['excerpt']}" for e in g["examples"]]
    lines += ["", f"B − A (rate, paired over tasks): {diff}, p = {p}."]
    return lines + (["", "Examples:", "", *examples] if examples else [])


def plot(out: Path, report: dict) -> list[str]:
    """Two figures beside the report: behaviour rates with their intervals; tokens by kind. Their names."""
    import matplotlib  # noqa: PLC0415 (loaded by the report only)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    A, B = report["a"]["checkpoint"], report["b"]["checkpoint"]
    rows = list(report["behaviours"].values())
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    y = np.arange(len(rows))
    for k, (name, ref) in enumerate((("a", A), ("b", B))):
        means = np.array([r[name]["mean"] for r in rows], dtype=float)
        lo = np.array([r[name]["ci95"][0] for r in rows], dtype=float)
        hi = np.array([r[name]["ci95"][1] for r in rows], dtype=float)
        err = np.nan_to_num(np.vstack([means - lo, hi - means]))
        ax.barh(y + (0.2 if k else -0.2), np.nan_to_num(means), height=0.4, xerr=err, capsize=3, label=ref)
    ax.set_yticks(y, [r["label"] for r in rows], fontsize="small")
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("rate over tasks (95% bootstrap CI)")
    ax.legend(fontsize="small")
    rates = f"{out.stem}-rates.png"
    atomic_write_figure(out.parent / rates, fig)

    kinds = ("reasoning_tokens", "action_tokens", "tool_output_tokens")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bottom = np.zeros(2)
    for kind in kinds:
        m = report["measures"][kind]
        values = np.nan_to_num([m["a"]["mean"], m["b"]["mean"]])
        ax.bar([A, B], values, bottom=bottom, label=m["label"])
        bottom += values
    ax.set_ylabel("tokens per attempt (mean over tasks)")
    ax.set_ylim(0, max(float(bottom.max()), 1.0) * 1.3)  # room for the legend above the bars
    ax.legend(fontsize="small", loc="upper center", ncols=len(kinds))
    tokens = f"{out.stem}-tokens.png"
    atomic_write_figure(out.parent / tokens, fig)
    return [rates, tokens]
