"""`snowcat traces RUN [--stage S] [--checkpoint C] [--json]`: what the agents of a run did, from the
kept trajectories (`<unit>/trajectories/`, stages/agent/dataset.py), the reward-hack detectors with
example episodes, the weight drift of training stages, and the alarms `snowcat status` shows for RL.

Episodes are analysed per probe unit, per evaluate unit and checkpoint, and per RL unit (every
kept update). Rules: stages/agent/detectors.py and docs/analysis.md.

Alarms over an RL unit (its `metrics_history.jsonl`, and its kept batches when there are any):
  - entropy collapse: the mean `entropy` of the last `WINDOW` updates is below `ENTROPY_FRACTION`
    of the mean of the first `WINDOW` (needs 2 x WINDOW updates);
  - reward hack: reward/mean rose by more than `REWARD_RISE` (last WINDOW vs first WINDOW updates)
    while the held-out pass@1 fell from its first evaluation to its last by more than
    max(`HELD_OUT_DROP`, 2 SE of the last); or a reward-hack detector flagged more than
    `HACK_RATE` of the episodes of the last WINDOW kept updates.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from snowcat.pipeline import config as config_mod
from snowcat.pipeline import sweep
from snowcat.pipeline.dag import build
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import checkpoint_dir, nan_to_null
from snowcat.pipeline.rundir import RunDir
from snowcat.stages.agent import dataset, detectors

from .drift import weight_drift

WINDOW = 5
ENTROPY_FRACTION = 0.5
REWARD_RISE = 0.05
HELD_OUT_DROP = 0.05
HACK_RATE = 0.05
_HACK_COLUMNS = [
    "id",
    "task_id",
    "domain",
    "passed",
    "reward",
    "turns",
    "tool_names",
    "tool_args",
    "tool_errors",
    "tool_results",
    "answer_key",
    "test_paths",
]

KEEPING = ("probe", "evaluate", "rl", "teacher")  # the stage kinds that keep their episodes in trajectories/


def _units(run: RunDir, stage: str | None, kinds: tuple[str, ...]):
    nodes = [n for n in build(run.config()) if n.kind in kinds and (stage is None or n.name == stage)]
    return [(node, unit) for node in nodes for unit in node.units]


def _drift_unit(run: RunDir, checkpoint: str | None) -> tuple[str, int | None, str] | None:
    """(stage, unit index or None for every unit, checkpoint name) that `--checkpoint` names for the
    drift: `rl:final`, `rl[1]:final`, `rl[estimator=grpo,tis_cap=1.0]:final`; None for a bare name
    (`final`: every training unit's) or none."""
    if checkpoint is None or ":" not in checkpoint:
        return None
    stage_part, _, name = checkpoint.rpartition(":")
    stages = config_mod.typed(run.config()).stages
    try:
        stage, selector = sweep.parse_unit_selector(stage_part)
        if stage not in stages:
            return stage, None, name  # no such training stage: no drift, the groups may still match
        items = sweep.fan_out_items(stages[stage].fan_out, f"stages.{stage}")
        return stage, None if selector is None else sweep.select_unit(stage, items, selector), name
    except ValueError as e:
        raise UserError(f"--checkpoint {checkpoint!r}: {e}") from None


def analyse_run(run_dir: str | Path, stage: str | None = None, checkpoint: str | None = None) -> dict:
    """The report's numbers: per group of kept episodes `detectors.analyse`, per training unit the drift."""
    run = RunDir.open(run_dir)
    if stage is not None and stage not in run.config().stages:
        raise UserError(f"--stage {stage!r}: no such stage in {run.path}")
    groups = {}
    for node, unit in _units(run, stage, KEEPING):
        root = run.unit_dir(unit) / dataset.DIRNAME
        manifest = dataset.read_manifest(root)
        if manifest is None:
            continue
        rows = dataset.read_rows(root)
        by_ckpt: dict[str, list] = {}
        for r in rows:
            if checkpoint is None or r["checkpoint"] == checkpoint:
                by_ckpt.setdefault(r["checkpoint"] if node.kind == "evaluate" else "", []).append(r)
        for ref, rs in by_ckpt.items():
            groups[" ".join(filter(None, (unit.key, ref)))] = {
                "kind": node.kind,
                "keep": manifest.get("keep"),
                **detectors.analyse(rs),
                **({"by_step": by_step(rs)} if node.kind == "rl" else {}),
            }
    drift = {}
    wanted = _drift_unit(run, checkpoint)  # None: every training unit
    for node, unit in _units(run, stage, ("sft", "rl")):
        if wanted is not None and wanted[:2] not in ((node.name, None), (node.name, unit.index)):
            continue
        name = wanted[2] if wanted else (checkpoint or "final")
        udir = run.unit_dir(unit)
        try:
            after = checkpoint_dir(udir, name)
            initial = checkpoint_dir(udir, "initial")
        except UserError:
            continue  # not trained yet, or initialised from another stage's checkpoint
        drift[unit.key] = {"checkpoint": f"{unit.key}:{name}", "initial": f"{unit.key}:initial", **weight_drift(after, initial)}
    if not groups and not drift:
        raise UserError(f"{run.path}: no kept trajectories (trajectories/) and no trained checkpoint to analyse")
    return {"run": str(run.path), "groups": groups, "drift": drift}


def hack_worth(rows: list[dict]) -> dict:
    """What the reward hacks were worth over scored episodes: per detector, the episodes it flagged
    and how many of those passed; the pass rate, and the pass rate with every flagged episode that
    passed counted as a failure (what it would be had no hack paid)."""
    flags = [{name for name, (detect, _) in detectors.DETECTORS.items() if detect(r) is not None} for r in rows]
    passed = [r["passed"] == 1 for r in rows]
    out: dict = {"episodes": len(rows)}
    for name in detectors.DETECTORS:
        out[name] = sum(name in f for f in flags)
        out[f"{name}/passed"] = sum(name in f and p for f, p in zip(flags, passed, strict=True))
    n = len(rows)
    out["pass_rate"] = sum(passed) / n if n else None
    out["pass_rate_unflagged"] = sum(p and not f for f, p in zip(flags, passed, strict=True)) / n if n else None
    return out


def reward_hack_counts(run: RunDir) -> list[dict]:
    """Per group of kept episodes (a probe, teacher or RL unit; an evaluate unit per checkpoint): `hack_worth`
    of its scored episodes (the card's table)."""
    out = []
    for node, unit in _units(run, None, KEEPING):
        root = run.unit_dir(unit) / dataset.DIRNAME
        if dataset.read_manifest(root) is None:
            continue
        groups: dict[str, list] = {}
        for r in dataset.read_rows(root):
            if r["status"] != "infra_error":
                groups.setdefault(r["checkpoint"] if node.kind == "evaluate" else "", []).append(r)
        for ref, rs in groups.items():
            out.append({"group": " ".join(filter(None, (unit.key, ref))), **hack_worth(rs)})
    return out


def by_step(rows: list[dict]) -> list[dict]:
    """Per kept RL update: scored episodes, pass rate and each reward-hack detector's count (when a hack appears)."""
    steps: dict[int, list] = {}
    for r in rows:
        if r["status"] != "infra_error":
            steps.setdefault(r["step"], []).append(r)
    return [
        {"step": k, "episodes": len(rs), "pass_rate": float(np.mean([r["passed"] == 1 for r in rs]))}
        | {name: sum(detect(r) is not None for r in rs) for name, (detect, _) in detectors.DETECTORS.items()}
        for k, rs in sorted(steps.items())
    ]


# ---------------------------------------------------------------- alarms (snowcat status)


def _mean(values: list[float]) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.mean(values)) if values else math.nan


def history_alarms(history: list[dict]) -> list[str]:
    """Entropy-collapse and reward-vs-held-out alarms over an RL unit's history (module docstring)."""
    out = []
    entropy = [r["entropy"] for r in history if isinstance(r.get("entropy"), (int, float))]
    if len(entropy) >= 2 * WINDOW:
        start, now = _mean(entropy[:WINDOW]), _mean(entropy[-WINDOW:])
        if start > 0 and now < ENTROPY_FRACTION * start:
            out.append(
                f"entropy collapse: {now:.3g} over the last {WINDOW} updates, below {ENTROPY_FRACTION:g} x the first {WINDOW} ({start:.3g})"
            )
    reward = [r.get("reward/mean") for r in history]
    evals = [
        (r[k], r.get(f"{k}_se")) for r in history for k in ("dev/pass@1", "val/pass@1") if isinstance(r.get(k), (int, float))
    ]
    if len(reward) >= 2 * WINDOW and len(evals) >= 2:
        rise = _mean(reward[-WINDOW:]) - _mean(reward[:WINDOW])
        (first, _), (last, se) = evals[0], evals[-1]
        drop = first - last
        if rise > REWARD_RISE and drop > max(HELD_OUT_DROP, 2 * (se or 0.0)):
            out.append(f"reward hack? reward rose {rise:+.3f} while held-out pass@1 fell {first:.3f} -> {last:.3f}")
    return out


def hack_alarms(root: Path) -> list[str]:
    """Reward-hack detector rates over the last WINDOW kept updates of an RL unit."""
    manifest = dataset.read_manifest(root)
    if manifest is None:
        return []
    shards = sorted(manifest["shards"].values(), key=lambda s: s["step"])[-WINDOW:]
    rows = [r for s in shards for r in pq.read_table(root / s["file"], columns=_HACK_COLUMNS).to_pylist()]
    out = []
    for name, (detect, _) in detectors.DETECTORS.items():
        hits = [r["id"] for r in rows if detect(r) is not None]
        if rows and len(hits) / len(rows) > HACK_RATE:
            out.append(
                f"reward hack: {name} in {len(hits)}/{len(rows)} episodes of the last {len(shards)} kept updates (e.g. {hits[0]})"
            )
    return out


def alarms(unit_dir: Path) -> list[str]:
    """Every alarm of one RL unit (empty when none)."""
    path = Path(unit_dir) / "metrics_history.jsonl"
    history = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return history_alarms(history) + hack_alarms(Path(unit_dir) / dataset.DIRNAME)


def stage_alarms(run: RunDir, node) -> list[str]:
    """The alarms of an RL stage's units (a fan-out unit's prefixed with its key); none for other kinds."""
    if node.kind != "rl":
        return []
    return [f"{u.key}: {a}" if u.index is not None else a for u in node.units for a in alarms(run.unit_dir(u))]


# ---------------------------------------------------------------- text


def _f(x, spec: str = "{:.3f}") -> str:
    return "-" if x is None else spec.format(x)


def render(report: dict) -> str:
    lines = [f"# traces: {report['run']}", ""]
    for name, g in report["groups"].items():
        c = g["claims"]
        lines += [
            f"## {name} ({g['kind']}, {g['episodes']} episodes kept: {g['keep']})",
            f"pass rate {_f(g['pass_rate'])}, turns {_f(g['turns_mean'], '{:.2f}')}, invalid turns/episode {_f(g['invalid_turns_per_episode'])}, "
            f"cut turns/episode {_f(g['cut_turns_per_episode'])}, "
            f"response tokens mean {_f(g['response_tokens']['mean'], '{:.1f}')} / max {_f(g['response_tokens']['max'], '{:.0f}')}",
            "tool calls: " + (", ".join(f"{k} {v:.0%}" for k, v in g["tool_mix"].items()) or "none"),
            f"claims of success: {c['episodes']} episodes, precision {_f(c['precision'])}; submitted {c['submitted']}, precision {_f(c['submit_precision'])}",
        ]
        profile = g["entropy_by_position"]
        if profile:
            marks = [p for p in profile if p["position"] in (0, 1, 2, 4, 8, 16, 32, 64, 128)]
            lines.append(
                "entropy by position (mean -logprob): " + ", ".join(f"{p['position']}: {p['entropy']:.2f}" for p in marks)
            )
        if g.get("by_step"):
            lines.append(
                "by update (step: pass rate "
                + "/".join(detectors.DETECTORS)
                + "): "
                + ", ".join(
                    f"{s['step']}: {s['pass_rate']:.2f} " + "/".join(str(s[name]) for name in detectors.DETECTORS)
                    for s in g["by_step"]
                )
            )
        for title, section in (("behaviour", g["findings"]), ("reward-hack detectors", g["reward_hacks"])):
            lines.append(f"{title}:")
            for key, f in section.items():
                lines.append(f"  {key}: {f['episodes']} ({_f(f['rate'], '{:.1%}')}) — {f['rule']}")
                lines += [f"    {e['id']} [{e['task_id']}]: {e['excerpt']}" for e in f["examples"]]
        lines.append("")
    for unit, d in report["drift"].items():
        lines.append(
            f"## weight drift {unit}: {d['checkpoint']} vs {d['initial']}: {_f(d['unchanged'], '{:.1%}')} of {d['elements']} weights bit-identical"
        )
        lines += [f"  {layer}: {frac:.1%}" for layer, frac in d["layers"].items()]
        lines.append("")
    return "\n".join(lines)


def add_traces_arguments(parser) -> None:
    parser.add_argument("run", help="run directory")
    parser.add_argument("--stage", help="only this stage")
    parser.add_argument("--checkpoint", help="only episodes of this checkpoint reference (e.g. rl:final); drift of it")
    parser.add_argument("--json", action="store_true", help="the numbers as JSON")


def cmd_traces(args) -> int:
    report = analyse_run(args.run, args.stage, args.checkpoint)
    print(json.dumps(nan_to_null(report), indent=2) if args.json else render(report))
    return 0
