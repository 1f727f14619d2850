"""`card` stage: write the run's provenance card, `card.md` (see `pipeline.reports.card`), from recorded facts.

It should need the stages it describes (training, evaluate, export); facts of stages that have not
finished are reported as "not recorded", never guessed.

Before writing the card it scans the run directory for credentials as the scan stage does, leaving
out only its own outputs and the stages that come after it (they have not run), and records the
report as `scan.json`: the card states that verdict on every artefact it describes. The scan stage,
after the card, scans the card too.
"""

from __future__ import annotations

from pathlib import Path

from snowcat.pipeline.dag import build
from snowcat.pipeline.fsio import atomic_write_json, atomic_write_text
from snowcat.pipeline.reports import plot
from snowcat.pipeline.reports.card import build_card
from snowcat.pipeline.rundir import RunDir
from snowcat.pipeline.scrub import scan_report

SCAN_FILE = "scan.json"  # pipeline.reports.card reads it from the card stage's directory


def run(ctx) -> dict:
    run = RunDir(ctx.run_dir)
    dag = build(ctx.run_config)
    later = sorted({ctx.name} | dag.downstream(ctx.name))
    exclude = [str(run.stage_dir(n).relative_to(run.path)) for n in later]
    high_entropy = next((n.config.high_entropy for n in dag if n.kind == "scan"), False)  # as the run's scan stage searches
    report = scan_report(run.path, exclude, high_entropy) | {"stages_after": [n for n in later if n != ctx.name]}
    atomic_write_json(Path(ctx.out_dir) / SCAN_FILE, report)
    try:  # the curves the card links, into <run>/plots/ (not outputs of this stage: redrawn any time)
        plot.draw(run)
    except Exception as e:  # noqa: BLE001 (pictures never fail the card; `snowcat plot RUN` draws them)
        print(f"[snowcat] {ctx.name}: curves not drawn: {type(e).__name__}: {e}", flush=True)
    text = build_card(run)
    atomic_write_text(Path(ctx.out_dir) / ctx.config.filename, text)
    return {"not_recorded": text.count("not recorded"), "scan_findings": len(report["findings"])}
