"""`snowcat behaviour RUN A B [--stage S] [--grep PATTERN] [--out FILE] [--json]`: two checkpoints that
an evaluate stage scored, compared by what their agents did rather than by their scores.

Read from the behaviour records beside the kept trajectories (`<unit>/behaviour/`,
stages/agent/behaviour_records.py); a unit kept before the records existed has them computed here
from its trajectories, with the stage's `procedure`. Infrastructure failures are left out. Every
number is over tasks, as evaluate's (stages/evalstats.py): a behaviour's rate is per task the share of
its attempts that show it, then the mean over tasks, with a 95% percentile bootstrap interval
resampling tasks; B − A is paired over the tasks both scored (mean ± SE) and tested by flipping the
sign of each task's difference (exact up to 16 differing tasks: McNemar's exact test for one
attempt per task). The report also holds:
  - how they worked: turns, tool calls, test runs, edits, tokens by kind, the reasoning share of the
    model's characters (all attempts, and passed attempts only);
  - winners and losers: on each task one checkpoint passed at least once and the other never, whether
    the loser opened or edited the files the winner's passing attempts edited (the seed's "reached
    the same file");
  - wall time: each episode's seconds from the start of play to its end (batch-mates' turns
    included: the agent loop advances a batch together) and its own environment and verifier
    seconds, from the timings beside the records (stages/agent/behaviour_records.py), as measures;
    each checkpoint's sampling seconds (evaluate's `<checkpoint>/sample_s`) beside them;
  - with `--grep PATTERN`: per checkpoint the attempts whose reasoning or actions (the model's turns,
    not the prompt or tool output) match the regular expression, as a behaviour, with examples.
The Markdown and the figures are pipeline/reports/behaviour_report.py's.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from snowcat.pipeline.dag import build
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_json, atomic_write_text, nan_to_null
from snowcat.pipeline.rundir import RunDir
from snowcat.stages import evalstats
from snowcat.stages.agent import behaviour_records, dataset
from snowcat.stages.procedure import DEFAULT_PROCEDURE

from .behaviour_report import plot, render
from .compare import compile_pattern

EXAMPLES = 3


@dataclass
class Side:
    """One checkpoint's scored episodes: their behaviour records, where they came from."""

    ref: str
    unit: str  # the evaluate unit(s) that kept it
    records: list[dict] = field(default_factory=list)
    computed: bool = False  # computed here from the trajectories (the unit has no behaviour/)
    procedure: list[str] = field(default_factory=list)
    sample_s: float | None = None  # evaluate's seconds for sampling and verifying every episode
    shards: list[Path] = field(default_factory=list)  # the kept trajectories, for --grep


# Per episode: a behaviour (True/False; None: not defined for the episode, left out)
BEHAVIOURS: dict[str, tuple[str, object]] = {
    "passed": ("passed the verifier", lambda r: r["passed"] == 1),
    "opened_relevant": ("opened a relevant file (one the gold patch changes)", lambda r: r["opened_relevant"]),
    "edited_relevant": ("edited a relevant file", lambda r: r["edited_relevant"]),
    # a repository episode never judged (no submission) did not leave them passing, as far as anyone knows
    "target_tests": (
        "left the target (FAIL_TO_PASS) tests passing",
        lambda r: r["target_tests"] == 1 if r["env"] == "repo" else None,
    ),
    "claimed": ("claimed completion (submit, or said it is done)", lambda r: r["claimed"]),
    "claimed_untested": ("claimed completion with no test run before", lambda r: r["claimed_untested"]),
    "claimed_without_edit": ("claimed completion without any edit", lambda r: r["claimed_without_edit"]),
    "broke_procedure": ("broke the procedure (a rule that applied)", lambda r: bool(r["procedure_broken"])),
}
# Per episode: a measure (its mean)
MEASURES: dict[str, tuple[str, object]] = {
    "turns": ("turns", lambda r: r["turns"]),
    "tool_calls": ("valid tool calls", lambda r: r["tool_calls"]),
    "test_runs": ("test runs", lambda r: r["test_runs"]),
    "edits": ("edits", lambda r: r["edits"]),
    "model_tokens": ("model tokens", lambda r: r["model_tokens"]),
    # records stored by earlier versions name the character-based split `*_tokens_est`
    "reasoning_tokens": ("reasoning tokens", lambda r: r.get("reasoning_tokens", r.get("reasoning_tokens_est"))),
    "action_tokens": ("action tokens", lambda r: r.get("action_tokens", r.get("action_tokens_est"))),
    "tool_output_tokens": ("tool output tokens", lambda r: r["tool_output_tokens"]),
    "reasoning_share": ("reasoning share of the model's characters", lambda r: _share(r)),
    # from the timings beside the records (None where a shard has none: kept before they were written)
    "wall_s": ("wall seconds to the episode's end (batch-mates' turns included)", lambda r: r.get("wall_s")),
    "env_s": ("its own tool and verifier seconds", lambda r: r.get("env_s")),
}


def _share(r: dict) -> float | None:
    total = r["reasoning_chars"] + r["action_chars"]
    return r["reasoning_chars"] / total if total else None


# ---------------------------------------------------------------- loading


def _kept_shards(run: RunDir, node) -> dict[str, list[tuple]]:
    """checkpoint -> [(unit, its trajectories dir, the shard's manifest entry)] of an evaluate stage
    (a fan-out over checkpoints keeps each in a unit of its own)."""
    out: dict[str, list] = defaultdict(list)
    for unit in node.units:
        root = run.unit_dir(unit) / dataset.DIRNAME
        manifest = dataset.read_manifest(root)
        for entry in (manifest or {}).get("shards", {}).values():
            out[entry["checkpoint"]].append((unit, root, entry))
    return out


def load_sides(run_dir: str | Path, refs: list[str], stage: str | None = None) -> tuple[str, list[Side]]:
    """(the evaluate stage, a Side per checkpoint of `refs`); UserError naming what is missing."""
    run = RunDir.open(run_dir)
    dag = build(run.config())
    nodes = dag.of_kind("evaluate", stage, run.path, "behaviour compares what an evaluate stage kept")
    held = {n.name: _kept_shards(run, n) for n in nodes}
    if not any(held.values()):
        where = f"stage {stage!r} kept no" if stage is not None else "no evaluate stage kept"
        raise UserError(f"{run.path}: {where} trajectories (not run yet, or keep_trajectories: none)")
    kept = "; ".join(f"{name}: {', '.join(sorted(h))}" for name, h in held.items() if h)
    for ref in refs:
        if not any(ref in h for h in held.values()):
            where = f"stage {stage!r} of {run.path} kept no" if stage is not None else f"no evaluate stage of {run.path} kept"
            raise UserError(f"checkpoint {ref!r}: {where} episodes of it (kept: {kept})")
    chosen = next((name for name, h in held.items() if all(ref in h for ref in refs)), None)
    if chosen is None:
        raise UserError(
            f"checkpoints {', '.join(map(repr, refs))}: no evaluate stage kept both (kept: {kept}); name one with --stage"
        )
    node = dag[chosen]
    procedure = list(getattr(node.config, "procedure", DEFAULT_PROCEDURE))
    sides = []
    for ref in refs:
        side = Side(ref=ref, unit=", ".join(dict.fromkeys(u.key for u, _, _ in held[chosen][ref])))
        for unit, root, entry in held[chosen][ref]:
            shard = root / entry["file"]
            path = behaviour_records.records_path(root, entry["file"])
            if path.is_file():
                records, side.procedure = behaviour_records.read_records(path)
                timings = behaviour_records.read_timings(path) or {}
                records = [r | {k: v for k, v in timings.get(r["id"], {}).items() if k != "id"} for r in records]
            else:  # kept before behaviour records were written: the same function, here
                rows = behaviour_records.read_rows(shard)
                records, side.procedure, side.computed = [behaviour_records.record(r, procedure) for r in rows], procedure, True
            side.records += [r for r in records if r["checkpoint"] == ref and r["status"] != "infra_error"]
            side.shards.append(shard)
            seconds = run.metrics(unit).get(f"{ref}/sample_s")
            if isinstance(seconds, (int, float)):
                side.sample_s = (side.sample_s or 0.0) + seconds
        sides.append(side)
    return chosen, sides


# ---------------------------------------------------------------- statistics


def per_task(records: list[dict], value) -> dict[str, float]:
    """task -> mean of `value` over its episodes where it is defined (tasks with none left out)."""
    by_task: dict[str, list[float]] = defaultdict(list)
    for r in records:
        v = value(r)
        if v is not None:
            by_task[r["task_id"]].append(float(v))
    return {t: float(np.mean(vs)) for t, vs in sorted(by_task.items())}


def compare_values(a: list[dict], b: list[dict], value, *, seed: int, n_boot: int) -> dict:
    """Both sides' mean of `value` over tasks with a bootstrap interval, their paired difference over
    shared tasks with its SE and sign-flip p; for 0/1 values the episode counts too."""
    out: dict = {}
    tasks = {}
    for name, records in (("a", a), ("b", b)):
        tasks[name] = per_task(records, value)
        values = [v for r in records if (v := value(r)) is not None]
        lo, hi = evalstats.bootstrap_ci(list(tasks[name].values()), seed=seed, n_boot=n_boot)
        mean = float(np.mean(list(tasks[name].values()))) if tasks[name] else math.nan
        passed = [v for r in records if r["passed"] == 1 and (v := value(r)) is not None]
        out[name] = {
            "episodes": len(values),
            "count": float(np.sum(values)) if values else 0.0,
            "tasks": len(tasks[name]),
            "mean": mean,
            "ci95": [lo, hi],
            "mean_passed": float(np.mean(passed)) if passed else math.nan,
        }
    shared = sorted(set(tasks["a"]) & set(tasks["b"]))
    x, y = [tasks["a"][t] for t in shared], [tasks["b"][t] for t in shared]
    diff, se = evalstats.paired_difference(x, y) if shared else (math.nan, math.nan)
    out["paired"] = {"tasks": len(shared), "diff": diff, "se": se, "p": evalstats.paired_permutation_p(x, y, seed=seed)}
    return out


def winners_and_losers(a: Side, b: Side) -> dict:
    """Tasks one checkpoint passed at least once and the other never: whether the loser's attempts
    opened or edited the files the winner's passing attempts edited, and a gold file."""
    by_task = {s.ref: defaultdict(list) for s in (a, b)}
    for s in (a, b):
        for r in s.records:
            by_task[s.ref][r["task_id"]].append(r)
    out = []
    for task in sorted(set(by_task[a.ref]) & set(by_task[b.ref])):
        won = {s.ref: any(r["passed"] == 1 for r in by_task[s.ref][task]) for s in (a, b)}
        if won[a.ref] == won[b.ref]:
            continue
        winner, loser = (a, b) if won[a.ref] else (b, a)
        wins, losses = [r for r in by_task[winner.ref][task] if r["passed"] == 1], by_task[loser.ref][task]
        fix = list(dict.fromkeys(p for r in wins for p in r["edited_files"]))
        reached = {p for r in losses for p in r["opened_files"] + r["edited_files"]}
        edited = {p for r in losses for p in r["edited_files"]}
        gold = next((r["gold_files"] for r in wins + losses if r["gold_files"] is not None), None)
        out.append(
            {
                "task_id": task,
                "winner": winner.ref,
                "winner_files": fix,
                "loser_reached": bool(set(fix) & reached) if fix else None,
                "loser_edited": bool(set(fix) & edited) if fix else None,
                "loser_opened_gold": bool(set(gold) & reached) if gold else None,
                "loser_attempts": len(losses),
            }
        )
    summary = {}
    for s in (a, b):
        mine = [t for t in out if t["winner"] == s.ref]
        summary[s.ref] = {
            "tasks": len(mine),
            "loser_reached": sum(t["loser_reached"] is True for t in mine),
            "loser_edited": sum(t["loser_edited"] is True for t in mine),
            "loser_opened_gold": sum(t["loser_opened_gold"] is True for t in mine),
            "winner_edited_nothing": sum(t["loser_reached"] is None for t in mine),
        }
    return {"by_winner": summary, "tasks": out}


def grep_turns(side: Side, pattern: re.Pattern) -> dict[str, tuple[str, re.Match] | None]:
    """episode id -> (the first model turn matching `pattern`, the match), or None."""
    out = {}
    for shard in side.shards:
        for r in pq.read_table(shard, columns=["id", "turns"]).to_pylist():
            out[r["id"]] = next(((turn, m) for turn in r["turns"] if (m := pattern.search(turn))), None)
    return out


def _excerpt(text: str, start: int, end: int, margin: int = 60) -> str:
    left, right = max(0, start - margin), min(len(text), end + margin)
    return ("…" if left else "") + " ".join(text[left:right].split()) + ("…" if right < len(text) else "")


def grep(a: Side, b: Side, pattern: re.Pattern, *, seed: int, n_boot: int) -> dict:
    """The attempts whose model turns match `pattern`, as a behaviour of each side, with examples."""
    hits = {s.ref: grep_turns(s, pattern) for s in (a, b)}
    out = compare_values(a.records, b.records, lambda r: hits[r["checkpoint"]].get(r["id"]) is not None, seed=seed, n_boot=n_boot)
    for name, s in (("a", a), ("b", b)):
        matched = [r for r in s.records if hits[s.ref].get(r["id"]) is not None]
        others = [r for r in s.records if hits[s.ref].get(r["id"]) is None]
        out[name] |= {
            "tasks_matched": len({r["task_id"] for r in matched}),
            "pass_rate_matched": float(np.mean([r["passed"] == 1 for r in matched])) if matched else math.nan,
            "pass_rate_others": float(np.mean([r["passed"] == 1 for r in others])) if others else math.nan,
            "examples": [
                {"id": r["id"], "task_id": r["task_id"], "excerpt": _excerpt(turn, m.start(), m.end())}
                for r in matched[:EXAMPLES]
                for turn, m in [hits[s.ref][r["id"]]]
            ],
        }
    return {"pattern": pattern.pattern} | out


def behaviour_report(
    run_dir: str | Path,
    a: str,
    b: str,
    *,
    stage: str | None = None,
    grep_pattern: str | None = None,
    seed: int = 0,
    n_boot: int = 2000,
) -> dict:
    """The report's numbers (see the module docstring)."""
    pattern = compile_pattern(grep_pattern) if grep_pattern is not None else None  # refused before anything is read
    if a == b:
        raise UserError(f"behaviour compares two checkpoints; both are {a!r}")
    chosen, (side_a, side_b) = load_sides(run_dir, [a, b], stage)
    for s in (side_a, side_b):
        if not s.records:
            raise UserError(f"checkpoint {s.ref!r}: stage {chosen!r} kept no scored episode of it")
    rules = list(dict.fromkeys(side_a.procedure + side_b.procedure))
    behaviours = dict(BEHAVIOURS) | {
        f"broke:{rule}": (f"broke '{rule}'", lambda r, rule=rule: rule in r["procedure_broken"]) for rule in rules
    }
    stats = {"seed": seed, "n_boot": n_boot}
    out = {
        "run": str(Path(run_dir)),
        "stage": chosen,
        "a": _side_info(side_a),
        "b": _side_info(side_b),
        "procedure": rules,
        "behaviours": {
            k: {"label": label} | compare_values(side_a.records, side_b.records, fn, seed=seed, n_boot=n_boot)
            for k, (label, fn) in behaviours.items()
        },
        "measures": {
            k: {"label": label} | compare_values(side_a.records, side_b.records, fn, seed=seed, n_boot=n_boot)
            for k, (label, fn) in MEASURES.items()
        },
        "winners_and_losers": winners_and_losers(side_a, side_b),
        "tokens_exact": all(r.get("tokens_exact", False) for s in (side_a, side_b) for r in s.records),
        "statistics": stats,
    }
    if pattern is not None:
        out["grep"] = grep(side_a, side_b, pattern, seed=seed, n_boot=n_boot)
    return out


def _side_info(s: Side) -> dict:
    return {
        "checkpoint": s.ref,
        "unit": s.unit,
        "episodes": len(s.records),
        "tasks": len({r["task_id"] for r in s.records}),
        "records": "computed from the kept trajectories" if s.computed else "stored",
        "sample_s": s.sample_s,
    }


def add_behaviour_arguments(parser) -> None:
    parser.add_argument("run", help="run directory")
    parser.add_argument("a", metavar="A", help="checkpoint reference, e.g. sft:final")
    parser.add_argument("b", metavar="B", help="checkpoint reference, e.g. rl:final")
    parser.add_argument("--stage", help="the evaluate stage (default: the first that kept both)")
    parser.add_argument(
        "--grep", metavar="PATTERN", help="count the attempts whose reasoning or actions match this regular expression"
    )
    parser.add_argument("--out", metavar="FILE", help="write the Markdown here, its figures and JSON beside it")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    parser.add_argument("--seed", type=int, default=0, help="seed of the bootstrap and permutation draws")


def cmd_behaviour(args) -> int:
    report = behaviour_report(args.run, args.a, args.b, stage=args.stage, grep_pattern=args.grep, seed=args.seed)
    figures = []
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        figures = plot(out, report)
        atomic_write_json(out.with_suffix(".json"), nan_to_null(report))
        atomic_write_text(out, render(report, figures))
    if args.json:
        print(json.dumps(nan_to_null(report), indent=2))
    else:
        print(render(report, figures), end="")
    return 0
