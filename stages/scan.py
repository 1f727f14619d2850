"""`scan` stage: search the finished run directory for credentials; fail the run if one slipped through.

Every file under the run directory (logs, provenance, outputs, hidden and binary files, strings inside
HDF5) is searched for this environment's secret values and for credential-shaped strings
(`pipeline.scrub.scan_report`). The stage must come after every other stage: it `needs` all stages
that do not need it, else it refuses to run (a scan before a stage finishes vouches for nothing).
Findings name the file, line and kind, never the secret; they go to `scan.json` and fail the stage.

The card stage runs the same scan before it, over everything but its own outputs, so the card states a
recorded verdict on every artefact it describes; this stage then scans the card too (docs/audit.md).
"""

from __future__ import annotations

from pathlib import Path

from snowcat.pipeline.dag import build
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_json
from snowcat.pipeline.scrub import scan_report


def _upstream(dag, name: str) -> set[str]:
    out: set[str] = set()
    frontier = [name]
    while frontier:
        for need in dag[frontier.pop()].needs:
            if need not in out:
                out.add(need)
                frontier.append(need)
    return out


def run(ctx) -> dict:
    dag = build(ctx.run_config)
    covered = _upstream(dag, ctx.name) | dag.downstream(ctx.name) | {ctx.name}
    missing = [n for n in dag.order if n not in covered]
    if missing:
        raise UserError(f"stages.{ctx.name}.needs: add {', '.join(missing)} — the scan must run after every other stage")
    report = scan_report(ctx.run_dir, high_entropy=ctx.config.high_entropy)
    report["stages_scanned"] = sorted(covered - {ctx.name} - dag.downstream(ctx.name))
    atomic_write_json(Path(ctx.out_dir) / "scan.json", report)
    if report["findings"]:
        shown = "; ".join(f"{r['file']}:{r['line']} {r['kind']}" for r in report["findings"][:10])
        raise RuntimeError(f"scan: {len(report['findings'])} credential finding(s) in the run directory: {shown}")
    return {"findings": 0}
