"""The record checklist: every field of a published post-training card (the Snowball RL model card's,
in its order), each with the value this run recorded or "not recorded"."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from snowcat.pipeline.dag import Unit
from snowcat.pipeline.fsio import read_json, sha256_file
from snowcat.pipeline.sweep import input_units

from .facts import NR, TRAINING_KINDS, Facts, license_text, one_or_each, shown
from .hardware import gpu_hours, role_hardware
from .results import selection
from .training import domain_counts, exposure_text, unit_exposure

# The fields of the Snowball RL model card (shared/seeds/snowball-smartie-rl-model-card.txt), in its
# order; docs/provenance.md lists them. Each gets a row: the recorded value, or "not recorded".
CHECKLIST = (
    "model and run name",
    "research-artifact disclaimer",
    "exported checkpoint",
    "why this checkpoint",
    "historical best checkpoint and retention",
    "initializer",
    "initializer revision",
    "initializer parents (merge lineage)",
    "optimizer state at start",
    "RL estimator and importance-sampling correction",
    "learning rate",
    "prompt groups per update and responses per group",
    "updates completed",
    "policy parallelism layout",
    "rollout (inference) hardware",
    "training hardware",
    "GPU-hours",
    "wall-clock per stage",
    "training set size",
    "training set per domain",
    "data order rule",
    "per-cohort exposure through the exported step",
    "validation set size and per domain",
    "pass@1 scoring rule",
    "development vs independent evaluation",
    "initializer vs exported score",
    "sampling and token limits",
    "external benchmarks",
    "data file hashes",
    "data screening for credentials",
    "resolved config identity",
    "source revisions and patch",
    "launch command",
    "reproduction recipe",
    "credentials",
    "metrics history archive",
    "retained traces",
    "final state of the run",
    "resume and requeue history",
    "export source",
    "weight shards and optimizer state",
    "converter manifest",
    "architecture and tokenizer",
    "inference-equivalence test",
    "license",
    "intended use",
)


def _exposure(f: Facts, source: dict) -> str | None:
    """Trajectories per domain that entered the loss up to the exported step (RL's `exposure/<d>`);
    without an export, each RL unit's through its last update."""
    if not source:
        each = [
            f"{n.name}: {text}" if n.items is None else text
            for n in f.nodes("rl")
            if (text := one_or_each([(label, exposure_text(unit_exposure(f, u))) for label, _, u in f.units(n)]))
        ]
        return f"no export; through each RL unit's last update: {'; '.join(each)}" if each else None
    step = source.get("step")
    if step is None and source.get("path"):  # exported by name (e.g. rl:final): its meta says the step
        step = (read_json(f.run.path / source["path"] / "meta.json") or {}).get("step")
    unit = f.ref_unit(source.get("ref"))
    if step is None or unit is None:
        return None
    return exposure_text(unit_exposure(f, unit, through=step), step)


def _external_benchmarks(f: Facts) -> str:
    """Which external benchmarks the run's evaluations scored: the tasks an evaluate stage scored
    that its tasks stage imported from files (SWE-bench / Harbor format), else "none run"."""
    evals = f.nodes("evaluate")
    if not evals:
        return "none run (the run has no evaluate stage)"
    out, generated = [], []
    stages = {n: node.config for n, node in f.dag.nodes.items()}
    for node in evals:
        for label, config, unit in f.units(node):
            results = read_json(f.unit_dir(unit) / "results.json") if f.run.is_done(unit) else None
            if results is None:
                out.append(f"{label}: {NR} (the stage did not complete)")
                continue
            first = next(iter(results.get("checkpoints", {}).values()), {})
            scored = sorted(g for g in first.get("groups", {}) if "/" not in g and g != "all")
            try:  # the tasks unit(s) this one read (`tasks`, or one unit of a fanned-out tasks stage)
                stage, indices = input_units(config.tasks, stages)
            except ValueError:
                stage, indices = None, []
            imports = [
                i for index in indices if stage in f.dag.nodes for i in getattr(f.unit_config(Unit(stage, index)), "imports", [])
            ]
            external = [i for i in imports if i.domain in scored]
            if external:
                named = ", ".join(f"`{i.format}` tasks from `{i.path}` (domain {i.domain})" for i in external)
                out.append(
                    f"{label}: imported {named} on this run's `{results.get('split')}` split, scored by the stage's "
                    f"verifier `{config.verifier}`, not by the benchmark's own harness"
                )
            else:
                generated.append(f"{label} ({', '.join(scored) or 'no domain'} of the `{results.get('split')}` split)")
    if generated:
        out.insert(0, f"none run: {', '.join(generated)} scored tasks this run generated")
    return "; ".join(out)


def checklist_rows(f: Facts, export: dict | None, versus: list[str], limits: list[str], totals: dict, scan: str) -> list[str]:
    src = (export or {}).get("source") or {}
    fmt = (export or {}).get("format") or {}
    eq = (export or {}).get("equivalence") or {}
    rl = f.nodes("rl")
    trainers = f.nodes(*TRAINING_KINDS)
    # the run's initializer: each unit's of the first training stage (`initializer`)
    starts = [
        (label, c, (read_json(f.unit_dir(u) / "checkpoints" / "initial" / "meta.json") or {}).get("lineage") or {})
        for label, c, u in (f.units(trainers[0]) if trainers else [])
    ]
    tasks = f.nodes("tasks")
    evals = [(label, u) for n in f.nodes("evaluate") if f.done(n.name) for label, _, u in f.units(n)]
    results = [read_json(f.unit_dir(u) / "results.json") or {} for _, u in evals]

    def per_stage(fn, kinds=TRAINING_KINDS) -> str | None:
        """fn(config, unit) per training unit, labelled (a sweep's units each with their own config)."""
        vals = [f"{label}: {v}" for n in trainers if n.kind in kinds for label, c, u in f.units(n) if (v := fn(c, u)) is not None]
        return "; ".join(vals) or None

    def initializer(fn) -> Any:
        return one_or_each([(label, fn(c, lineage)) for label, c, lineage in starts]) if starts else None

    def rows(split: str) -> tuple[Any, Any]:
        """(size, size and per domain) of the first tasks stage that wrote `split`, per unit."""
        for n in tasks:
            found = []
            for label, _, u in f.units(n):
                path = f.unit_dir(u) / f"{split}.parquet"
                if counts := (domain_counts(path) if path.is_file() else None):
                    found.append((label, sum(counts.values()), ", ".join(f"{d} {c}" for d, c in counts.items())))
            if found:
                return (
                    one_or_each([(label, size) for label, size, _ in found]),
                    one_or_each([(label, f"{size} ({per})") for label, size, per in found]),
                )
        return None, None

    h5 = f.run.path / "history.h5"
    traces = sorted(str(p.relative_to(f.run.path)) for p in (f.run.path / "stages").rglob("traces*.h5"))
    state_counts = Counter(f.run.stage_status(f.dag, node.name, verify=False)[0] for node in f.dag)
    train_size, train_rows = rows("train")
    values = {
        "model and run name": f"{f.cfg.name}: {f.info.get('run_id')}",
        "research-artifact disclaimer": "stated above",
        "exported checkpoint": src.get("ref"),
        "why this checkpoint": src.get("reason"),
        "historical best checkpoint and retention": (
            f"historical best step {src['historical_best_step']}; exported step {src.get('step')}"
            + (" (the same)" if src["historical_best_step"] == src.get("step") else " (the best was deleted by retention)")
        )
        if src.get("historical_best_step") is not None
        else None,
        "initializer": initializer(lambda c, lineage: lineage.get("source") or f"`{c.init_from or c.model}`"),
        "initializer revision": initializer(lambda c, lineage: lineage.get("revision")),
        "initializer parents (merge lineage)": initializer(
            lambda c, lineage: (
                (
                    f"{', '.join(lineage['parents'])} ({lineage.get('parents_relation') or 'relation not stated'}; "
                    "as its model card names them, not pinned by revision or hash)"
                )
                if lineage.get("parents")
                else None
            )
        ),
        "optimizer state at start": per_stage(lambda c, u: "fresh (a stage loads model weights only)"),
        "RL estimator and importance-sampling correction": per_stage(
            lambda c, u: f"{c.estimator}, TIS cap {c.tis_cap}", kinds=("rl",)
        ),
        "learning rate": per_stage(lambda c, u: c.lr),
        "prompt groups per update and responses per group": per_stage(
            lambda c, u: f"{c.tasks_per_update} × {c.attempts}", kinds=("rl",)
        ),
        "updates completed": per_stage(
            lambda c, u: (m := f.run.metrics(u)).get("updates", m.get("steps")) if f.run.is_done(u) else None
        ),
        "policy parallelism layout": "see Recipe (layout)" if trainers else None,
        "rollout (inference) hardware": "; ".join(role_hardware(f, n, "rollout") for n in rl) or None,
        "training hardware": "see Stages and Software (rank 0 hosts)" if trainers else None,
        "GPU-hours": gpu_hours(totals),
        "wall-clock per stage": "see Stages",
        "training set size": train_size,
        "training set per domain": train_rows,
        "data order rule": "see Training data" if rl else None,
        "per-cohort exposure through the exported step": _exposure(f, src),
        "validation set size and per domain": rows("val")[1],
        "pass@1 scoring rule": "explicit verifier pass per attempt; infrastructure failures excluded from denominators"
        if evals
        else None,
        "development vs independent evaluation": "; ".join(
            [x.rstrip(".") for x in limits if "development set" in x or "SCORING SPLIT" in x] + selection(f, src, results)
        )
        or ("no selection on an evaluated split recorded" if evals else None),
        "initializer vs exported score": "; ".join(versus) or None,
        "sampling and token limits": "; ".join(
            f"{label}: {json.dumps(r.get('sampling'))}" for (label, _), r in zip(evals, results)
        )
        or None,
        "external benchmarks": _external_benchmarks(f),
        "data file hashes": "see Training data" if tasks else None,
        "data screening for credentials": scan,
        "resolved config identity": f"sha256 {f.config_sha256}",
        "source revisions and patch": "see Software",
        "launch command": "see Reproduction",
        "reproduction recipe": "see Reproduction",
        "credentials": "none recorded (configs that hold credentials are refused; environment captures are scrubbed)",
        "metrics history archive": f"history.h5 sha256 {sha256_file(h5)}" if h5.is_file() else None,
        "retained traces": ", ".join(traces) or None,
        "final state of the run": ", ".join(f"{n} {k}" for k, n in sorted(state_counts.items())),
        "resume and requeue history": (
            f"{totals['attempts']} attempt(s) over {len(f.dag.nodes)} stages"
            + (f"; retried: {', '.join(totals['retried'])}" if totals["retried"] else "; no stage retried")
        ),
        "export source": src.get("path"),
        "weight shards and optimizer state": "see Exported model" if export else None,
        "converter manifest": (export or {}).get("model_manifest_sha256"),
        "architecture and tokenizer": f"{fmt.get('architecture')}, tokenizer files in the export" if fmt else None,
        "inference-equivalence test": (
            f"max abs Δlogit {eq.get('max_abs_dlogit')}, greedy {'match' if eq.get('greedy_match') else 'DIFFER'}" if eq else None
        ),
        "license": license_text(f.cfg.card) or None,
        "intended use": f.cfg.card.intended_use or None,
    }
    return ["| field | value |", "|---|---|"] + [f"| {k} | {shown(values[k])} |" for k in CHECKLIST]
