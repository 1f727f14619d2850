"""The provenance card: a Markdown model card (with Hugging Face model-card YAML) from recorded facts only.

Every statement comes from a file of the run directory: run.json, config.yaml, the stages' outputs
(tasks parquet files, checkpoint manifests, retention ledgers, evaluate results.json, export.json)
and provenance records. A fact that is not recorded is written as "not recorded", never guessed.
`snowcat card RUN [-o FILE]` prints or writes it; the `card` stage writes `card.md` into the run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from snowcat.pipeline.fsio import atomic_write_text
from snowcat.pipeline.plan import compare as plan_compare
from snowcat.pipeline.rundir import RunDir
from snowcat.pipeline.scrub import scrub_text

from .. import plot
from .checklist import checklist_rows
from .facts import NR, Facts, license_meta, license_text, shown
from .hardware import credential_scan, software, stages_section, tags
from .results import evaluations, export, retention, reward_hacks
from .training import data, initializer, recipe


def _curves(f: Facts, where: Path | None) -> list[str]:
    """The figures `snowcat plot` draws from the units' per-step histories (the card stage draws
    them into <run>/plots/), linked relative to where the card is written (None: the card stage's
    directory). Listed from the histories, not from the files, so the text repeats exactly."""
    found = plot.figures(f.run)
    if not found:
        return [f"Curves: {NR} (no unit recorded a per-step history)."]
    root = f.run.path / plot.PLOTS_DIR
    rel = Path("../..") / plot.PLOTS_DIR if where is None else Path(os.path.relpath(root, where))
    lines = [
        f"Drawn by `snowcat plot {f.run.path}` into `{plot.PLOTS_DIR}/` from each unit's `metrics_history.jsonl` "
        f"(x: {plot.X_LABEL}); the pictures are not hashed (throughput is a timing).",
        "",
    ]
    for concern, panels in found.items():
        units = sorted({s.unit for series in panels for s in series})
        lines += [f"![{concern.title}: {', '.join(units)}]({(rel / f'{concern.name}.png').as_posix()})", ""]
    return lines


def build_card(run: RunDir, where: Path | None = None) -> str:
    """The card's text; `where`: the directory it is written to (the figures are linked relative to
    it; None: the card stage's directory, <run>/stages/<name>/)."""
    f = Facts(run)
    init_lines, init_meta = initializer(f)
    export_lines, export_record, export_limits = export(f)
    exported_ref = export_record["source"]["ref"] if export_record else None
    eval_lines, eval_limits, eval_index, eval_versus = evaluations(f, export_record)
    soft_lines, soft_meta = software(f)
    origin = f.info.get("origin") or {}

    limits = [f"{text} (stated in the config)" for text in f.cfg.card.limitations] + list(eval_limits)
    if f.nodes("evaluate"):
        limits.append(
            "Mean reward is the verifiers' reward, which may give partial credit: it is not the fraction of "
            "tasks solved. pass@1 counts only explicit verifier passes."
        )
    for node in f.nodes("sft"):
        checked = [label for label, c, _ in f.units(node) if c.eval_tasks]  # each unit's own setting
        if checked:
            who = f"`{node.name}`'s" if len(checked) == len(node.units) else ", ".join(f"`{x}`'s" for x in checked)
            limits.append(
                f"The validation split also served {who} end-of-stage greedy check: it is a "
                "development set, not an independent final evaluation."
            )
    after_card = {n for c in f.nodes("card") for n in f.dag.downstream(c.name)} | {c.name for c in f.nodes("card")}
    undone = [n.name for n in f.dag if not f.done(n.name) and n.name not in after_card]
    if undone:
        limits.append(f"Stages not completed when this card was written: {', '.join(undone)}.")
    if export_limits:
        limits += export_limits
    elif export_record is None:
        limits.append("No verified export: the inference-equivalence of any published weights is not established.")

    base_model = init_meta.pop("base_model", None)
    meta: dict[str, Any] = {
        **({"base_model": base_model} if base_model else {}),  # the Hugging Face model-card field for lineage
        **license_meta(f.cfg.card),
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": tags(f, export_record),
    }
    if eval_index:  # scores of the exported weights only: the model-index describes what is published
        meta["model-index"] = [
            {
                "name": f"{f.info.get('run_id')} ({exported_ref})",
                "results": [
                    {
                        "task": {"type": "text-generation"},
                        "dataset": {"name": f"{e['stage']} ({e['group']})", "type": "snowcat-tasks"},
                        "metrics": [{"type": "pass@1", "name": f"pass@1 {e['checkpoint']}", "value": e["pass@1"]}],
                    }
                    for e in eval_index
                    if e["pass@1"] is not None
                ],
            }
        ]
    meta["snowcat"] = {
        "run_id": f.info.get("run_id"),
        "created": f.info.get("created"),
        "config_sha256": f.config_sha256,
        "code_revision": soft_meta.get("code_revision"),
        "exported_checkpoint": exported_ref,
        "model_manifest_sha256": export_record.get("model_manifest_sha256") if export_record else None,
        **init_meta,
        "intended_use": f.cfg.card.intended_use or None,
        "limitations": list(f.cfg.card.limitations),
    }
    stage_lines, totals = stages_section(f)
    scan_lines, scan_summary, scan_limits = credential_scan(f)
    limits += scan_limits
    checklist = checklist_rows(f, export_record, eval_versus, limits, totals, scan_summary)
    overrides = " ".join(origin.get("overrides") or [])
    parts = [
        "---",
        yaml.safe_dump(meta, sort_keys=False).rstrip(),
        "---",
        "",
        f"# {f.cfg.name}: {f.info.get('run_id')}",
        "",
        f"{f.cfg.description or 'Description: ' + NR}",
        "",
        "Research artifact, produced by the snowcat pipeline. Every statement below is read from the run "
        f'directory; "{NR}" marks facts the run did not record.',
        "",
        "## Initializer",
        "",
        *init_lines,
        "",
        "## Training data",
        "",
        *data(f),
        "",
        "## Recipe",
        "",
        f"- Run seed {f.cfg.seed}; resolved config `config.yaml` sha256 `{f.config_sha256}`",
        *recipe(f),
        "",
        "## Evaluation",
        "",
        *eval_lines,
        "",
        "## Reward hacking",
        "",
        *reward_hacks(f),
        "",
        "## Curves",
        "",
        *_curves(f, where),
        "## Exported model",
        "",
        *export_lines,
        "",
        "## Deleted checkpoints (retention)",
        "",
        *retention(f),
        "",
        "## Intended use and license",
        "",
        f"- Intended use: {f.cfg.card.intended_use or NR}",
        f"- License: {license_text(f.cfg.card) or NR}",
        "",
        "## Known limitations",
        "",
        *[f"- {x}" for x in limits],
        "",
        "## Reproduction",
        "",
        f"- Same code, config and seed: `snowcat reproduce {f.run.path}` (a new run from the archived "
        "resolved config, compared stage by stage with this one)",
        f"- Original command: `snowcat run {shown(origin.get('config'))}{' ' + overrides if overrides else ''}"
        f"{' --site ' + origin['site'] if origin.get('site') else ''}`",
        "",
        "## Software and containers",
        "",
        *soft_lines,
        "",
        "## Stages",
        "",
        *stage_lines,
        "",
        *(["## Plan against measurement", "", *plan_lines, ""] if (plan_lines := plan_compare.card_lines(f.run.path)) else []),
        "## Credential scan",
        "",
        *scan_lines,
        "",
        "## Record checklist",
        "",
        "Every field of a published post-training card, with the value this run recorded.",
        "",
        *checklist,
        "",
    ]

    return scrub_text("\n".join(parts))  # e.g. an override holding a token must not reach a published card


def add_card_arguments(parser) -> None:
    parser.add_argument("run", help="run directory")
    parser.add_argument("-o", "--output", help="write the card here (default: print it)")


def cmd_card(args) -> int:
    text = build_card(RunDir.open(args.run), Path(args.output).resolve().parent if args.output else Path.cwd())
    if args.output:
        atomic_write_text(args.output, text)
    else:
        print(text, end="")
    return 0
