"""The card's result sections: evaluations (paired comparisons, the exported checkpoint's scores),
reward hacking, selection of the exported checkpoint, the export itself, retention."""

from __future__ import annotations

import json
from pathlib import Path

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import checkpoint_dir, read_json
from snowcat.pipeline.sweep import ref_unit, unit_path
from snowcat.stages.agent.detectors import DETECTORS

from .. import compare
from ..traces import reward_hack_counts
from .facts import NR, TRAINING_KINDS, Facts, history, pct, percent, shown

AGENT_ROWS = (  # results.json `behaviour` keys shown on the card (stages.agent.behaviour)
    ("turns_mean", "turns per episode", lambda v: shown(v, "{:.2f}")),
    ("calls/edit", "edits per episode", lambda v: shown(v, "{:.2f}")),
    ("invalid_actions_per_episode", "invalid actions per episode", lambda v: shown(v, "{:.2f}")),
    ("wrong_path_frac", "episodes that named a file not there", pct),
    ("no_submission_frac", "episodes without a submission", pct),
    ("submitted_untested_frac", "submissions without a test run", pct),
    ("claim_precision", "claim precision (passed / submitted)", pct),
)


def _diff(d: dict | None) -> str:
    if not d or d.get("diff") is None:
        return NR
    lo, hi = d.get("ci95") or (None, None)
    ci = f" [{100 * lo:+.1f}, {100 * hi:+.1f}]" if lo is not None and hi is not None and lo == lo and hi == hi else ""
    return f"{100 * d['diff']:+.1f} ± {shown(d.get('se') and 100 * d['se'], '{:.1f}')}{ci}"


def reward_hacks(f: Facts) -> list[str]:
    """The reward-hack detectors' counts over every group of kept episodes (stages/agent/detectors.py)."""
    counts = reward_hack_counts(f.run)
    if not counts:
        return [f"Reward-hack detectors: {NR} (no kept trajectories; `keep_trajectories` keeps them)."]
    lines = [
        "Episodes the reward-hack detectors flagged in the kept trajectories, each as flagged (of them "
        "passed); the pass rate beside the one with every flagged pass counted as a failure is what the "
        "hacks were worth (`snowcat traces` cites the episodes):",
        "",
        "| episodes | scored | pass rate % | without flagged passes % | " + " | ".join(DETECTORS) + " |",
        "|---|---|---|---|" + "---|" * len(DETECTORS),
    ]
    lines += [
        f"| {c['group']} | {c['episodes']} | {pct(c['pass_rate'])} | {pct(c['pass_rate_unflagged'])} | "
        + " | ".join(f"{c[name]} ({c[name + '/passed']})" for name in DETECTORS)
        + " |"
        for c in counts
    ]
    lines += ["", *[f"- `{name}`: {rule}" for name, (_, rule) in DETECTORS.items()]]
    return lines


def _resolve(f: Facts, ref: str) -> Path | None:
    """The directory a checkpoint reference names now (`rl:best` is a file naming a step)."""
    try:
        stage, index, name = ref_unit(ref, {n: node.config for n, node in f.dag.nodes.items()})
        return checkpoint_dir(unit_path(f.stage_dir(stage), index), name).resolve()
    except (ValueError, UserError):
        return None


def evaluations(f: Facts, export: dict | None) -> tuple[list[str], list[str], list[dict], list[str]]:
    """Tables per evaluate unit; limitations; the model-index entries (the exported weights only);
    per evaluation, the exported weights' score beside their initializer's (the checklist's)."""
    lines, limits, index, versus = [], [], [], []
    source = (export or {}).get("source") or {}
    exported_dir = (f.run.path / source["path"]).resolve() if source.get("path") else None
    for node in f.nodes("evaluate"):
        pairs = compare.card_section(f.run, node.name)  # over every unit's traces: pairs across units too
        units = f.units(node)
        missed = []  # units that did not score the exported checkpoint (a fan-out over `checkpoint`: all but one)
        for label, config, unit in units:
            if not f.run.is_done(unit):
                status = f.run.state()["stages"].get(unit.key, {}).get("status", "not run")
                limits.append(f"Evaluation `{label}` did not complete ({status}); it reports nothing.")
                continue
            results = read_json(f.unit_dir(unit) / "results.json")
            if results is None:
                lines += [f"**{label}**: results.json {NR}.", ""]
                limits.append(f"Evaluation `{label}`: its results are {NR}.")
                continue
            block, found = _evaluation(f, label, config, results, source, exported_dir, bool(pairs))
            lines += block + (pairs if len(units) == 1 else []) + [""]
            if source.get("ref") and not found["versus"]:
                missed.append(label)
                if len(units) == 1:
                    limits.append(f"Evaluation `{label}` did not evaluate the exported checkpoint `{source['ref']}`.")
            limits += found["limits"]
            index += found["index"]
            versus += found["versus"]
        if len(units) > 1 and pairs:
            lines += pairs[1:] + [""]  # (its first line is blank)
        if len(units) > 1 and missed and len(missed) == sum(f.run.is_done(u) for _, _, u in units):
            limits.append(
                f"Evaluation `{node.name}` (none of its units) did not evaluate the exported checkpoint `{source['ref']}`."
            )
    if not lines:
        lines = [f"Evaluation: {NR} (no completed evaluate stage)."]
    return lines, limits, index, versus


def _further_scores(group: dict) -> dict[str, str]:
    """A group's further verifier scores (IFEval's loose accuracy: stages/evaluate.py) as the card shows
    them, those that cover every scored task of the group (not `all` where one domain has them)."""
    scores = group.get("scores") or {}
    names = [n for n in scores if not n.endswith(("_se", "_tasks")) and scores.get(f"{n}_tasks") == group.get("tasks_scored")]
    return {n: pct(scores[n], scores.get(f"{n}_se")) for n in names}


def _evaluation(f: Facts, label: str, config, results: dict, source: dict, exported_dir, paired: bool):
    """One evaluate unit's table: its first checkpoint (the baseline) and the exported one, or every
    one when nothing exported was scored; the others named in a line (the paired tables hold them)."""
    lines, found = [], {"limits": [], "index": [], "versus": []}
    exported_ref = source.get("ref")
    exported_unit = f.ref_unit(exported_ref)
    # the evaluate stage's first checkpoint is its baseline (results.json keys are sorted on disk)
    refs = [r for r in getattr(config, "checkpoints", []) if r in results["checkpoints"]]
    refs += sorted(r for r in results["checkpoints"] if r not in refs)
    initial = refs[0]
    exported = next((r for r in refs if exported_dir is not None and _resolve(f, r) == exported_dir), None)
    cols = [initial] + ([exported] if exported and exported != initial else [r for r in refs[1:]])
    # "initializer" only where it is one: a checkpoint named `initial`, or what the exported unit started from
    init_refs = {r for r in refs if r.endswith(":initial")}
    if exported_unit is not None:
        init_refs.add(f.unit_config(exported_unit).init_from)
    labels = [
        ("initializer" if r in init_refs else "baseline") if r == initial else ("exported" if r == exported else "") for r in cols
    ]
    lines.append(
        f"**{label}**: split `{results.get('split')}`, {results.get('tasks')} tasks × "
        f"{results.get('attempts')} attempts, sampling {json.dumps(results.get('sampling'))}. "
        "Values in %, ± one standard error over tasks."
    )
    lines.append("")
    head = " | ".join(f"{r}{' (' + lab + ')' if lab else ''}" for r, lab in zip(cols, labels))
    lines.append(f"| group | metric | {head} |")
    lines.append("|---|---|" + "---|" * len(cols))
    groups = [g for g in results["checkpoints"][initial]["groups"] if "/" not in g]
    for g in sorted(groups, key=lambda g: (g != "all", g)):
        for metric, fmt in (
            ("pass@1", lambda s: pct(s.get("pass@1"), s.get("pass@1_se"))),
            ("mean reward", lambda s: pct(s.get("reward"), s.get("reward_se"))),
            ("infra failure rate", lambda s: pct(s.get("infra_rate"))),
        ):
            vals = [fmt(results["checkpoints"][r]["groups"].get(g) or {}) for r in cols]
            lines.append(f"| {g} | {metric} | " + " | ".join(vals) + " |")
            if metric == "pass@1" and exported is not None:
                s = results["checkpoints"][exported]["groups"].get(g) or {}
                found["index"].append({"stage": label, "checkpoint": exported, "group": g, "pass@1": s.get("pass@1")})
        for name in sorted({n for r in cols for n in _further_scores(results["checkpoints"][r]["groups"].get(g) or {})}):
            vals = [_further_scores(results["checkpoints"][r]["groups"].get(g) or {}).get(name, "—") for r in cols]
            lines.append(f"| {g} | {name} | " + " | ".join(vals) + " |")
    for key, name, fmt in AGENT_ROWS:  # multi-turn evaluations: what the agent did
        if any(key in results["checkpoints"][r].get("behaviour", {}) for r in cols):
            vals = [fmt(results["checkpoints"][r].get("behaviour", {}).get(key)) for r in cols]
            lines.append(f"| agent | {name} | " + " | ".join(vals) + " |")
    comparisons = results.get("comparisons") or {}
    overall = {r: (results["checkpoints"][r]["groups"].get("all") or {}) for r in refs}
    extras = [r for r in refs if r not in cols]
    if extras:  # a reader sees that more was scored, and where each stands
        lines += [
            "",
            f"Also scored by `{label}`{', compared in the paired tables below' if comparisons or paired else ''}: "
            + ", ".join(f"`{r}` {pct(overall[r].get('pass@1'), overall[r].get('pass@1_se'))}" for r in extras)
            + " (pass@1 in %, all tasks).",
        ]
    if comparisons:  # paired over the same tasks: the honest way to say one checkpoint beats another
        lines += ["", "Paired differences (same tasks and attempt seeds), in points, ± SE, [95% bootstrap CI]:", ""]
        lines += ["| comparison | group | tasks | Δ pass@1 | Δ mean reward |", "|---|---|---|---|---|"]
        for pair, by_group in sorted(comparisons.items()):
            for g in sorted((g for g in by_group if "/" not in g), key=lambda g: (g != "all", g)):
                c = by_group[g]
                lines.append(f"| {pair} | {g} | {shown(c.get('tasks'))} | {_diff(c.get('pass@1'))} | {_diff(c.get('reward'))} |")
    if exported is not None:
        found["versus"].append(_versus(f, label, exported, exported_unit, refs, overall, comparisons))
    selected_on = source.get("metric", "").partition("/")[0]
    if exported is not None and selected_on and selected_on == results.get("split"):
        found["limits"].append(
            f"SELECTION ON THE SCORING SPLIT: the exported checkpoint `{exported_ref}` was chosen by "
            f"{source['metric']} = {shown(source.get('value'), '{:.4f}')}{_selection_se(f, source)} on the "
            f"`{selected_on}` split, the split `{label}` scores it on: its score there is biased upward."
        )
    for r in cols:
        infra = (results["checkpoints"][r]["groups"].get("all") or {}).get("infra_rate")
        if infra:
            found["limits"].append(
                f"`{label}` on `{r}`: {100 * infra:.1f}% of attempts were infrastructure failures "
                "(excluded from the denominators)."
            )
    return lines, found


def _versus(f: Facts, label: str, exported: str, unit, refs: list[str], overall: dict, comparisons: dict) -> str:
    """The exported weights' pass@1 beside their initializer's, where the evaluation scored it: the
    checkpoint their training unit started from (`init_from`, or its own `checkpoints/initial`)."""
    config = f.unit_config(unit) if unit is not None else None
    start = getattr(config, "init_from", "") or (f"{f.label(unit)}:initial" if unit is not None else "")
    targets = {d for d in (_resolve(f, start), unit and (f.unit_dir(unit) / "checkpoints" / "initial").resolve()) if d}
    inits = [r for r in refs if r != exported and _resolve(f, r) in targets]
    text = f"{label}: exported `{exported}` pass@1 {percent(overall[exported].get('pass@1'))}"
    if not inits:
        return text + f", initializer {NR} (`{label}` did not score {f'`{start}`' if start else 'it'})"
    parts = []
    for r in inits:
        d = (comparisons.get(f"{exported} - {r}") or {}).get("all", {}).get("pass@1")
        parts.append(f"`{r}` {percent(overall[r].get('pass@1'))}" + (f" (paired Δ {_diff(d)} points)" if d else ""))
    return text + ", initializer " + ", ".join(parts)


def _selection_se(f: Facts, source: dict) -> str:
    """The selection value's standard error over tasks, from the stage's history row at that step."""
    row = next((r for r in history(f, source) if r.get("step") == source.get("step")), {})
    se, n = row.get(f"{source.get('metric')}_se"), row.get(f"{source.get('metric', '').partition('/')[0]}/tasks")
    return f" ± {se:.4f} (SE over {n} tasks)" if isinstance(se, (int, float)) else " (SE not recorded)"


def selection(f: Facts, source: dict, results: list[dict]) -> list[str]:
    """The exported checkpoint's selection when it was made on a split no evaluation scores (the
    opposite case is a limitation, from `evaluations`)."""
    split = source.get("metric", "").partition("/")[0]
    scored = sorted({r.get("split") for r in results if r.get("split")})
    if not split or not scored or split in scored:
        return []
    return [
        f"the exported checkpoint was chosen by {source['metric']} = {shown(source.get('value'), '{:.4f}')}"
        f"{_selection_se(f, source)} on the `{split}` split, which no evaluation scores (they score "
        f"{', '.join(f'`{s}`' for s in scored)})"
    ]


def export(f: Facts) -> tuple[list[str], dict | None, list[str]]:
    """The Exported model section, the export record the rest of the card describes, limitations.
    A card is about one published model: an export stage fanned out into several units lists each
    unit's export here and names none of them as the card's exported weights."""
    nodes = f.nodes("export")
    if not nodes:
        return [f"Export: {NR} (the run has no export stage)."], None, []
    node = nodes[0]
    blocks = [(label, unit, _export_lines(f, label, unit)) for label, _, unit in f.units(node)]
    if node.items is None:
        lines, record = blocks[0][2]
        return lines, record, []
    lines = [f"`{node.name}` fans out into {len(blocks)} units, each its own export:", ""]
    for label, _, (unit_lines, _) in blocks:
        lines += [f"- `{label}`:", *(f"  {line}" for line in unit_lines)]
    limit = (
        f"`{node.name}` exported {len(blocks)} models (one per unit): this card names none of them as its exported "
        "weights (no model-index, no exported score or selection); each unit's export is listed under Exported model."
    )
    return lines, None, [limit]


def _export_lines(f: Facts, label: str, unit) -> tuple[list[str], dict | None]:
    record = read_json(f.unit_dir(unit) / "export.json")
    if record is None or not f.run.is_done(unit):
        return [f"Export `{label}`: {NR} (the stage did not complete)."], None
    src, eq, fmt = record["source"], record.get("equivalence") or {}, record.get("format") or {}
    files = (read_json(f.unit_dir(unit) / "model" / "manifest.json") or {}).get("files", {})
    shards = sum(rel.endswith(".safetensors") for rel in files) if files else None
    lines = [
        f"- Exported checkpoint: `{src.get('ref')}` (`{src.get('path')}`, manifest sha256 `{shown(src.get('manifest_sha256'))}`)",
        f"- Why this one: {src.get('reason')}",
        f"- Format: {fmt.get('architecture')} safetensors, {fmt.get('dtype')}, {shown(shards)} weight shard(s) "
        f"({len(files)} files with config and tokenizer, no optimizer state), {fmt.get('params')} parameters; "
        f"model manifest sha256 `{record.get('model_manifest_sha256')}`",
        f"- Inference equivalence (transformers, offline, local files only): max |Δlogit| "
        f"{shown(eq.get('max_abs_dlogit'), '{:.3g}')} on {eq.get('probe', {}).get('rows')}×{eq.get('probe', {}).get('len')} "
        f"probe tokens (tolerance {shown(eq.get('tolerance'))}); greedy generations "
        f"{'match' if eq.get('greedy_match') else 'DIFFER'} over {eq.get('greedy_tokens_compared')} tokens; chat template ids "
        f"{'match' if eq.get('chat_template_match') else 'DIFFER'}",
    ]
    return lines, record


def retention(f: Facts) -> list[str]:
    lines = []
    for node in f.nodes(*TRAINING_KINDS):
        for label, _, unit in f.units(node):  # each unit deletes its own checkpoints (its own ledger)
            ledger = read_json(f.unit_dir(unit) / "checkpoints" / "retention.json")
            if ledger is None:
                lines.append(f"- `{label}`: no retention ledger; what intermediate checkpoints were deleted is {NR}.")
                continue
            deleted = ledger.get("deleted") or []
            lines.append(
                f"- `{label}`: policy {json.dumps(ledger.get('policy'))}; {len(deleted)} checkpoint(s) deleted{':' if deleted else ''}"
            )
            lines += [f"  - step {d.get('step')}: {d.get('reason')}" for d in deleted]
    return lines or ["- No training stage: nothing retained or deleted."]
