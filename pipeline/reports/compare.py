"""`snowcat compare RUN [RUN ...]`: the checkpoints that evaluate stages scored, compared with paired
statistics, as a Markdown report with plots.

Everything is recomputed from the kept attempts (each evaluate unit's `traces.h5`: one row per
attempt, `passed` 1/0/-1 = not scored), never from summaries, so the report can be audited against
them. Per task first, then over tasks (stages/evalstats.py):
  - each variant's pass@1 ± SE over the tasks it scored;
  - "are these distinguishable at all?": a permutation test over the tasks every variant scored;
  - every pair's paired difference on the tasks both scored, its paired-t p-value and the
    Holm-adjusted one (many pairs: the family-wise error rate is what is controlled);
  - the mean gain over a base (the first variant unless `--base`), with an SE over shared tasks;
  - infrastructure failures: equal rates across variants (chi-square), and whether failing tasks
    differ in outcome from the others (excluding them assumes they do not; Mann-Whitney U);
  - per benchmark (task domain) x variant: pass@1 ± SE over the domain's tasks (the ablation's grid);
  - what reward hacks were worth, from the kept trajectories (`<unit>/trajectories/`, when kept):
    per detector the flagged episodes split by reward (rewarded: reward > 0) and by pass, and the
    pass@1 and mean reward recomputed with every flagged-and-rewarded episode counted as a failure
    (reward 0), beside the reported ones, with the paired SE over tasks of the difference;
  - with `--grep PATTERN`: per variant, the kept attempts whose model turns (reasoning and actions,
    not the prompt or tool output) match the regular expression: count, rate per task then mean ± SE
    over tasks, the pass rate of matching attempts and of the others, up to 3 examples.
compare.json ends with `per_task`: per variant and task, [scored attempts, passes, infra failures].
"""

from __future__ import annotations

import itertools
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np
import pyarrow.parquet as pq

from snowcat.pipeline.dag import build
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_figure, atomic_write_json, atomic_write_text, nan_to_null
from snowcat.pipeline.rundir import RunDir
from snowcat.stages import evalstats
from snowcat.stages.agent import dataset, detectors

ALPHA = 0.05


@dataclass
class Variant:
    """One scored checkpoint: per task, scored attempts, passes and infrastructure failures."""

    label: str
    source: str  # run dir / stage unit / checkpoint reference
    scored: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    passed: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    infra: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    domain: dict[str, str] = field(default_factory=dict)  # task -> its domain (the benchmark)
    checkpoint: str = ""  # the reference the evaluate unit scored
    kept: Path | None = None  # the unit's kept trajectories (trajectories/), when it has them

    def add(self, task: str, outcome: int, domain: str | None = None) -> None:
        if domain is not None:
            self.domain[task] = domain
        if outcome < 0:
            self.infra[task] += 1
            self.scored.setdefault(task, 0)
        else:
            self.scored[task] += 1
            self.passed[task] += outcome

    def pass1(self, task: str) -> float:
        return self.passed[task] / self.scored[task]

    @property
    def tasks(self) -> list[str]:
        return sorted(t for t, n in self.scored.items() if n)


def load_variants(run_dirs: list[Path], stage: str | None = None) -> list[Variant]:
    """Every checkpoint that a done evaluate unit of these runs scored (`stage`: only that stage)."""
    found: list[tuple[str, str, Path]] = []  # (run name, stage/unit, traces.h5)
    for run_dir in run_dirs:
        run = RunDir.open(run_dir)
        for node in build(run.config()):
            if node.kind != "evaluate" or (stage is not None and node.name != stage):
                continue
            for unit in node.units:
                if run.is_done(unit) and (run.unit_dir(unit) / "traces.h5").is_file():
                    found.append((run.path.name, unit.key, run.unit_dir(unit) / "traces.h5"))
    if not found:
        raise UserError(f"{', '.join(map(str, run_dirs))}: no done evaluate stage{f' {stage!r}' if stage else ''} with traces.h5")
    variants: dict[tuple, Variant] = {}
    for run_name, unit_key, path in found:
        with h5py.File(path, "r") as f:
            refs = [s.decode() for s in f["checkpoint"][:]]
            tasks = [s.decode() for s in f["task_id"][:]]
            domains = [s.decode() for s in f["domain"][:]] if "domain" in f else [None] * len(tasks)
            outcomes = f["passed"][:].astype(int)
        kept = path.parent / dataset.DIRNAME
        for ref, task, domain, outcome in zip(refs, tasks, domains, outcomes, strict=True):
            key = (run_name, unit_key, ref)
            if key not in variants:
                variants[key] = Variant(
                    label="",
                    source=f"{run_name}/{unit_key}/{ref}",
                    checkpoint=ref,
                    kept=kept if dataset.read_manifest(kept) is not None else None,
                )
            variants[key].add(task, int(outcome), domain)
    keys = list(variants)
    for key in keys:  # the shortest label that still tells variants apart
        for width in (1, 2, 3):
            short = [k[-width:] for k in keys]
            if len(set(short)) == len(short):
                variants[key].label = " / ".join(key[-width:])
                break
    return [variants[k] for k in keys]


def compare(
    variants: list[Variant], *, base: str | None = None, seed: int = 0, n_perm: int = 10000, grep: str | None = None
) -> dict:
    """The report's numbers (see the module docstring)."""
    pattern = compile_pattern(grep) if grep is not None else None
    if len(variants) < 2:
        raise UserError(f"compare needs at least 2 scored checkpoints, found {len(variants)}")
    by_label = {v.label: v for v in variants}
    if base is not None and base not in by_label:
        raise UserError(f"--base {base!r}: not one of the variants ({', '.join(by_label)})")
    base_v = by_label[base] if base else variants[0]
    out: dict = {"variants": [], "pairs": [], "base": base_v.label}
    for v in variants:
        mean, se = evalstats.mean_se([v.pass1(t) for t in v.tasks])
        attempts = sum(v.scored.values()) + sum(v.infra.values())
        out["variants"].append(
            {
                "label": v.label,
                "source": v.source,
                "tasks": len(v.tasks),
                "pass@1": mean,
                "pass@1_se": se,
                "attempts": attempts,
                "infra_failures": sum(v.infra.values()),
                "infra_rate": sum(v.infra.values()) / attempts if attempts else math.nan,
            }
        )
    common = sorted(set.intersection(*(set(v.tasks) for v in variants)))
    scores = np.array([[v.pass1(t) for v in variants] for t in common]).reshape(len(common), len(variants))
    stat, p = evalstats.permutation_homogeneity(scores, seed=seed, n_perm=n_perm)
    out["homogeneity"] = {"tasks": len(common), "statistic": stat, "p": p, "permutations": n_perm}

    for a, b in itertools.combinations(variants, 2):
        shared = sorted(set(a.tasks) & set(b.tasks))
        x, y = [a.pass1(t) for t in shared], [b.pass1(t) for t in shared]
        diff, se = evalstats.paired_difference(x, y)
        out["pairs"].append(
            {"a": a.label, "b": b.label, "tasks": len(shared), "diff": diff, "se": se, "p": evalstats.paired_p_value(x, y)}
        )
    for pair, adjusted in zip(out["pairs"], evalstats.holm([p["p"] for p in out["pairs"]]), strict=True):
        pair["p_holm"] = adjusted
        pair["significant"] = bool(adjusted < ALPHA)  # NaN compares False

    others = [v for v in variants if v is not base_v]
    shared = sorted(set(base_v.tasks).intersection(*(set(v.tasks) for v in others)))
    gain, gain_se = evalstats.gain_over_base(
        [base_v.pass1(t) for t in shared],
        np.array([[v.pass1(t) for v in others] for t in shared]).reshape(len(shared), len(others)),  # none: NaN
    )
    out["gain_over_base"] = {"tasks": len(shared), "gain": gain, "se": gain_se, "variants": [v.label for v in others]}
    out["infra"] = infra_checks(variants)
    out["grid"] = domain_grid(variants)
    out["reward_hacks"] = [h for v in variants if (h := hack_worth(v)) is not None]
    if pattern is not None:
        out["grep"] = {"pattern": grep, "variants": [grep_attempts(v, pattern) for v in variants]}
    # what every number above is computed from, so the report can be checked on its own
    out["per_task"] = {
        v.label: {t: [v.scored[t], v.passed.get(t, 0), v.infra.get(t, 0)] for t in sorted(v.scored)} for v in variants
    }
    return out


def infra_checks(variants: list[Variant]) -> dict:
    """Equal infrastructure-failure rates across variants, and per variant whether tasks that had a
    failure score differently on their other attempts (if so, dropping failures biases the score)."""
    from scipy import stats  # noqa: PLC0415 (loaded by the report only)

    table = np.array([[sum(v.infra.values()), sum(v.scored.values())] for v in variants])
    equal_rates = math.nan
    if table[:, 0].sum() and table[:, 1].sum():
        equal_rates = float(stats.chi2_contingency(table)[1])
    outcome = []
    for v in variants:
        hit = [v.pass1(t) for t in v.tasks if v.infra.get(t)]
        clean = [v.pass1(t) for t in v.tasks if not v.infra.get(t)]
        p = float(stats.mannwhitneyu(hit, clean).pvalue) if len(hit) >= 2 and len(clean) >= 2 else math.nan
        outcome.append(
            {
                "label": v.label,
                "tasks_with_failures": len(hit),
                "pass@1_with_failures": float(np.mean(hit)) if hit else math.nan,
                "pass@1_without": float(np.mean(clean)) if clean else math.nan,
                "p": p,
                "related": bool(p < ALPHA),
            }
        )
    return {"equal_rates_p": equal_rates, "outcome_vs_failure": outcome}


def domain_grid(variants: list[Variant]) -> dict:
    """Per benchmark (task domain) x variant: pass@1 ± SE over the domain's tasks the variant scored."""
    domains = sorted({v.domain.get(t, UNKNOWN) for v in variants for t in v.tasks})
    cells: dict = {}
    for v in variants:
        row = cells[v.label] = {}
        for d in domains:
            values = [v.pass1(t) for t in v.tasks if v.domain.get(t, UNKNOWN) == d]
            mean, se = evalstats.mean_se(values)
            row[d] = {"tasks": len(values), "pass@1": mean, "se": se}
    return {"domains": domains, "cells": cells}


UNKNOWN = "(no domain)"


def kept_rows(v: Variant) -> list[dict]:
    """The variant's kept, scored episodes (what the detectors read), [] when none were kept."""
    manifest = dataset.read_manifest(v.kept) if v.kept is not None else None
    if manifest is None:
        return []
    columns = sorted({*_DETECTOR_COLUMNS, "checkpoint", "status"})
    rows = []
    for shard in manifest["shards"].values():
        if shard.get("checkpoint") in (None, v.checkpoint):
            rows += pq.read_table(v.kept / shard["file"], columns=columns).to_pylist()
    return [r for r in rows if r["checkpoint"] == v.checkpoint and r["status"] != "infra_error"]


# what the detectors read of a row (stages/agent/detectors.py)
_DETECTOR_COLUMNS = ("id", "task_id", "domain", "passed", "reward", "detail", "turns", "tool_names", "tool_args")
_DETECTOR_COLUMNS += ("tool_errors", "tool_results", "answer_key", "test_paths")


def compile_pattern(text: str) -> re.Pattern:
    try:
        return re.compile(text)
    except re.error as e:
        raise UserError(f"--grep {text!r}: not a valid regular expression: {e}") from None


def grep_attempts(v: Variant, pattern: re.Pattern) -> dict:
    """The variant's kept attempts whose model turns match `pattern` (see the module docstring)."""
    rows = kept_rows(v)
    out: dict = {"label": v.label, "episodes": len(rows)}
    if not rows:
        return out | {"matched": None}
    hits = [next(((turn, m) for turn in r["turns"] if (m := pattern.search(turn))), None) for r in rows]
    by_task: dict[str, list[bool]] = defaultdict(list)
    for r, hit in zip(rows, hits, strict=True):
        by_task[r["task_id"]].append(hit is not None)
    rate, se = evalstats.mean_se([float(np.mean(x)) for x in by_task.values()])
    matched = [r for r, hit in zip(rows, hits, strict=True) if hit is not None]
    others = [r for r, hit in zip(rows, hits, strict=True) if hit is None]
    examples = [
        {"id": r["id"], "task_id": r["task_id"], "excerpt": _excerpt(hit[0], hit[1].start(), hit[1].end())}
        for r, hit in zip(rows, hits, strict=True)
        if hit is not None
    ][:3]
    return out | {
        "matched": len(matched),
        "tasks": len(by_task),
        "tasks_matched": sum(any(x) for x in by_task.values()),
        "rate": rate,
        "rate_se": se,
        "pass_rate_matched": float(np.mean([r["passed"] == 1 for r in matched])) if matched else None,
        "pass_rate_others": float(np.mean([r["passed"] == 1 for r in others])) if others else None,
        "examples": examples,
    }


def _excerpt(text: str, start: int, end: int, margin: int = 60) -> str:
    left, right = max(0, start - margin), min(len(text), end + margin)
    return ("…" if left else "") + " ".join(text[left:right].split()) + ("…" if right < len(text) else "")


def hack_worth(v: Variant) -> dict | None:
    """What the reward hacks were worth to one variant, over its kept scored episodes (None: none
    kept). Per detector: flagged episodes, of them rewarded (reward > 0) and not, and passed. Then,
    with every episode that a detector flagged and that was rewarded counted as a failure with
    reward 0: pass@1 (per task, then over tasks, as above) and mean reward beside the reported
    ones, and the difference (what the hacks were worth) with its paired SE over tasks."""
    rows = kept_rows(v)
    if not rows:
        return None
    flags = [{name for name, (detect, _) in detectors.DETECTORS.items() if detect(r) is not None} for r in rows]
    rewarded = [r["reward"] > 0 for r in rows]
    hacked = [bool(f) and paid for f, paid in zip(flags, rewarded, strict=True)]
    by_task: dict[str, list] = defaultdict(list)
    for r, h in zip(rows, hacked, strict=True):
        by_task[r["task_id"]].append((r["passed"] == 1, r["reward"], h))
    tasks = sorted(by_task)
    reported = [float(np.mean([p for p, _, _ in by_task[t]])) for t in tasks]
    without = [float(np.mean([p and not h for p, _, h in by_task[t]])) for t in tasks]
    reward = [float(np.mean([w for _, w, _ in by_task[t]])) for t in tasks]
    reward_without = [float(np.mean([0.0 if h else w for _, w, h in by_task[t]])) for t in tasks]
    worth, worth_se = evalstats.paired_difference(without, reported)
    reward_worth, reward_worth_se = evalstats.paired_difference(reward_without, reward)
    out = {
        "label": v.label,
        "episodes": len(rows),
        "attempts": sum(v.scored.values()),
        "tasks": len(tasks),
        "pass@1": float(np.mean(reported)),
        "pass@1_without_hacks": float(np.mean(without)),
        "worth": worth,
        "worth_se": worth_se,
        "reward": float(np.mean(reward)),
        "reward_without_hacks": float(np.mean(reward_without)),
        "reward_worth": reward_worth,
        "reward_worth_se": reward_worth_se,
        "detectors": {},
    }
    for name in detectors.DETECTORS:
        hit = [i for i, f in enumerate(flags) if name in f]
        out["detectors"][name] = {
            "flagged": len(hit),
            "rewarded": sum(rewarded[i] for i in hit),
            "unrewarded": sum(not rewarded[i] for i in hit),
            "passed": sum(rows[i]["passed"] == 1 for i in hit),
            "examples": [rows[i]["id"] for i in hit if rewarded[i]][:3],
        }
    return out


# ---------------------------------------------------------------- the report


def _f(x: float, spec: str = "{:.3f}") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else spec.format(x)


def render(result: dict, sources: list[str]) -> str:
    lines = ["# Comparison", "", "Runs: " + ", ".join(f"`{s}`" for s in sources), ""]
    lines += ["| variant | tasks | pass@1 ± SE | infra rate | source |", "|---|---|---|---|---|"]
    for v in result["variants"]:
        lines.append(
            f"| {v['label']} | {v['tasks']} | {_f(v['pass@1'])} ± {_f(v['pass@1_se'])} | {_f(v['infra_rate'])} | `{v['source']}` |"
        )
    h = result["homogeneity"]
    verdict = (
        "cannot be tested (fewer than 2 shared tasks)"
        if math.isnan(h["p"])
        else (f"{'distinguishable' if h['p'] < ALPHA else 'not distinguishable'} at {ALPHA}")
    )
    lines += [
        "",
        "## Are these distinguishable at all?",
        "",
        f"Permutation test over the {h['tasks']} tasks every variant scored (variants' values permuted within "
        f"each task, {h['permutations']} permutations): p = {_f(h['p'], '{:.4f}')} — {verdict}.",
        "",
        "## Paired differences (b − a, pass@1, tasks both scored)",
        "",
        *pairs_table(result),
    ]
    g = result["gain_over_base"]
    lines += [
        "",
        f"## Gain over the base ({result['base']})",
        "",
        f"Mean over {', '.join(g['variants'])} of (variant − base) on the {g['tasks']} tasks all scored: "
        f"{_f(g['gain'], '{:+.3f}')} ± {_f(g['se'])} (SE over tasks of the per-task mean gain: the base and the tasks "
        "are shared, so the variants' gains are not independent).",
        "",
        "## Infrastructure failures",
        "",
        f"Equal failure rates across variants (chi-square): p = {_f(result['infra']['equal_rates_p'], '{:.4f}')}.",
        "Failed attempts are left out of every score above; that is fair only if failures are unrelated to outcome:",
        "",
        "| variant | tasks with failures | pass@1 there | elsewhere | p (Mann-Whitney) | |",
        "|---|---|---|---|---|---|",
    ]
    for o in result["infra"]["outcome_vs_failure"]:
        mark = "RELATED: scores are biased by excluding failures" if o["related"] else ""
        lines.append(
            f"| {o['label']} | {o['tasks_with_failures']} | {_f(o['pass@1_with_failures'])} | {_f(o['pass@1_without'])} | "
            f"{_f(o['p'], '{:.4f}')} | {mark} |"
        )
    lines += ["", *grid_table(result), "", *hacks_table(result)]
    if "grep" in result:
        lines += ["", *grep_table(result["grep"])]
    lines += ["", "![pass@1 and paired differences](compare.png)", ""]
    return "\n".join(lines)


def grid_table(result: dict) -> list[str]:
    grid = result["grid"]
    lines = [
        "## Per benchmark × variant",
        "",
        "pass@1 ± SE over each benchmark's (task domain's) tasks; its task count in brackets.",
        "",
        "| variant | " + " | ".join(grid["domains"]) + " |",
        "|---|" + "---|" * len(grid["domains"]),
    ]
    for label, row in grid["cells"].items():
        cells = [f"{_f(c['pass@1'])} ± {_f(c['se'])} ({c['tasks']})" if c["tasks"] else "-" for c in row.values()]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def grep_table(found: dict) -> list[str]:
    lines = [
        f"## Attempts whose model turns match `{found['pattern']}`",
        "",
        "Over the kept scored attempts (reasoning and actions; not the prompt or tool output). Rate: per task "
        "the fraction of its attempts that match, then mean ± SE over tasks.",
        "",
        "| variant | matched / episodes | tasks with a match | rate ± SE | pass rate, matched | pass rate, others |",
        "|---|---|---|---|---|---|",
    ]
    examples = []
    for g in found["variants"]:
        if g["matched"] is None:
            lines.append(f"| {g['label']} | not recorded (no kept trajectories) | | | | |")
            continue
        lines.append(
            f"| {g['label']} | {g['matched']} / {g['episodes']} | {g['tasks_matched']} / {g['tasks']} | "
            f"{_f(g['rate'])} ± {_f(g['rate_se'])} | {_f(g['pass_rate_matched'])} | {_f(g['pass_rate_others'])} |"
        )
        examples += [f"- {g['label']} `{e['id']}` ({e['task_id']}): {e['excerpt']}" for e in g["examples"]]
    return lines + (["", "Examples:", "", *examples] if examples else [])


def hacks_table(result: dict) -> list[str]:
    hacks = result["reward_hacks"]
    lines = ["## What reward hacks were worth", ""]
    if not hacks:
        return lines + ["Not recorded: no variant's evaluate unit kept its trajectories (`keep_trajectories`)."]
    names = list(detectors.DETECTORS)
    lines += [
        "Over the kept scored episodes (all of them unless `keep_trajectories` kept a sample). Per detector: "
        "flagged episodes (rewarded / not rewarded; rewarded: reward > 0). *Without hacks*: every flagged "
        "and rewarded episode counted as a failure with reward 0; *worth*: reported − without, ± its paired SE "
        "over tasks. A flag is a lead to read (`snowcat traces`), not a verdict.",
        "",
        "| variant | episodes | pass@1 | without hacks | worth ± SE | reward | without hacks | " + " | ".join(names) + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(names),
    ]
    for h in hacks:
        per = [f"{d['flagged']} ({d['rewarded']}/{d['unrewarded']})" for d in h["detectors"].values()]
        lines.append(
            f"| {h['label']} | {h['episodes']} | {_f(h['pass@1'])} | {_f(h['pass@1_without_hacks'])} | "
            f"{_f(h['worth'], '{:+.3f}')} ± {_f(h['worth_se'])} | {_f(h['reward'])} | {_f(h['reward_without_hacks'])} | "
            + " | ".join(per)
            + " |"
        )
    return lines


def pairs_table(result: dict) -> list[str]:
    lines = [
        f"p from a paired t test over tasks (n/a: the difference is the same on every task); Holm-adjusted over "
        f"the {sum(p['p'] == p['p'] for p in result['pairs'])} pairs with a p.",
        "",
        "| a | b | tasks | b − a ± SE | p | p (Holm) | |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in result["pairs"]:
        mark = "significant" if p["significant"] else ""
        lines.append(
            f"| {p['a']} | {p['b']} | {p['tasks']} | {_f(p['diff'], '{:+.3f}')} ± {_f(p['se'])} | "
            f"{_f(p['p'], '{:.4f}')} | {_f(p['p_holm'], '{:.4f}')} | {mark} |"
        )
    return lines


def card_section(run: RunDir, stage: str) -> list[str]:
    """The card's all-pairs table for one evaluate stage that scored 3 or more checkpoints (with two,
    its paired-differences table already holds the only pair); [] otherwise. Seeded: the card
    regenerates byte for byte."""
    try:
        variants = load_variants([run.path], stage)
    except UserError:  # nothing kept to compare (no traces.h5): the card says what it has
        return []
    if len(variants) < 3:
        return []
    result = compare(variants)
    h = result["homogeneity"]
    return [
        "",
        f"All pairs of `{stage}`'s checkpoints (pass@1 over tasks both scored; as `snowcat compare` reports them). "
        f"Distinguishable at all? Permutation test over the {h['tasks']} tasks every checkpoint scored: "
        f"p = {_f(h['p'], '{:.4f}')}.",
        "",
        *pairs_table(result),
    ]


def plot(path: Path, result: dict) -> None:
    import matplotlib  # noqa: PLC0415 (loaded by the report only)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    labels = [v["label"] for v in result["variants"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    means = [v["pass@1"] for v in result["variants"]]
    errors = [1.96 * (v["pass@1_se"] if v["pass@1_se"] == v["pass@1_se"] else 0) for v in result["variants"]]
    left.bar(range(len(labels)), means, yerr=errors, capsize=4)
    left.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize="small")
    left.set_ylabel("pass@1 (95% CI over tasks)")
    grid = np.full((len(labels), len(labels)), np.nan)
    for p in result["pairs"]:
        i, j = labels.index(p["a"]), labels.index(p["b"])
        grid[i, j], grid[j, i] = p["diff"], -p["diff"]
    image = right.imshow(grid, cmap="RdBu", vmin=-1, vmax=1)
    right.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize="small")
    right.set_yticks(range(len(labels)), labels, fontsize="small")
    right.set_title("column − row, pass@1")
    fig.colorbar(image, ax=right)
    atomic_write_figure(path, fig)


def add_compare_arguments(parser) -> None:
    parser.add_argument("runs", nargs="+", help="run directories")
    parser.add_argument("--stage", help="only this evaluate stage (default: all of them)")
    parser.add_argument("--base", help="the variant gains are measured against (default: the first)")
    parser.add_argument("-o", "--output", default="compare", help="directory for compare.md/.json/.png (default: ./compare)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the permutation test")
    parser.add_argument(
        "--grep", metavar="PATTERN", help="count the kept attempts whose model turns match this regular expression"
    )


def cmd_compare(args) -> int:
    runs = [Path(r) for r in args.runs]
    if args.grep is not None:
        compile_pattern(args.grep)  # refused before anything is read
    result = compare(load_variants(runs, args.stage), base=args.base, seed=args.seed, grep=args.grep)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "compare.json", nan_to_null(result))
    plot(out / "compare.png", result)
    text = render(result, [str(r) for r in runs])
    atomic_write_text(out / "compare.md", text)
    print(text)
    return 0
