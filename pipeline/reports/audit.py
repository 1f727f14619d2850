"""`snowcat audit RUN [--json]`: is this run exactly what its records say it is?

Checks, each naming the file at fault:
  outputs     every unit is done and every file hashes as its manifest says (`RunDir.verify_unit`,
              full: `status` compares only sizes and mtimes, so a file changed in place with its
              size kept and mtime set back is found here, not there)
  provenance  every unit's provenance record is complete and still matches the files (`check_complete`)
  lineage     the inputs each unit recorded in provenance are the inputs' current outputs (not stale)
  history     the metrics history has no torn rows or gaps and reaches the recorded step count
              (`history.h5` via `check_gaps`; each unit's `metrics_history.jsonl`)
  export      each exported model dir matches its own manifest and the hash export.json recorded,
              and its recorded inference-equivalence check passed
  secrets     no credential anywhere under the run dir (`scan_tree`: this environment's secret
              values and credential-shaped strings)
Exit code 0 when everything passes, 1 on any problem, 2 on a user error (not a run dir).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from snowcat.pipeline import provenance
from snowcat.pipeline.dag import build
from snowcat.pipeline.fsio import read_json, sha256_file, verify_manifest
from snowcat.pipeline.history import FILENAME, History, check_gaps
from snowcat.pipeline.rundir import RunDir
from snowcat.pipeline.scrub import env_secrets, scan_tree

STEP_KEYS = ("steps", "updates")  # metrics.json keys that say how far a unit's history must reach


@dataclass
class Check:
    check: str
    subject: str
    problems: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems


def jsonl_history_problems(path: Path, last: int | None) -> list[str]:
    """A per-unit metrics_history.jsonl: parseable lines, contiguous steps, reaching `last`."""
    steps = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            return [f"{path}:{i}: not a history row (torn or edited)"]
    problems = [f"{path}: step {a} followed by {b} (not contiguous)" for a, b in zip(steps, steps[1:]) if b != a + 1]
    if last is not None and (not steps or steps[-1] < last):
        problems.append(
            f"{path}: {'ends at step ' + str(steps[-1]) if steps else 'has no rows'}, expected step {last} (truncated)"
        )
    return problems


def _expected_last(metrics: dict) -> int | None:
    for key in STEP_KEYS:
        if isinstance(metrics.get(key), int):
            return metrics[key]
    return None


def audit(run: RunDir, known_secrets=None) -> list[Check]:
    cfg = run.config()
    dag = build(cfg)
    checks: list[Check] = []
    expected_last: dict[str, int] = {}
    for node in dag:
        for unit in node.units:
            out = Check("outputs", unit.key)
            if not run.is_done(unit):
                status = run.state()["stages"].get(unit.key, {}).get("status", "pending")
                out.problems.append(f"{run.unit_dir(unit)}: stage not done ({status}); nothing to vouch for")
                checks.append(out)
                continue
            out.problems += run.verify_unit(unit, full=True)
            checks.append(out)

            prov = Check("provenance", unit.key)
            path = provenance.record_path(run.path, unit.stage, unit.index)
            record = read_json(path)
            prov.problems += (
                [f"{path}: missing"] if record is None else [f"{path}: {p}" for p in provenance.check_complete(record, run.path)]
            )
            checks.append(prov)
            if record is not None:
                checks.append(_lineage_check(run, dag, unit, path, record))

            metrics = run.metrics(unit)
            last = _expected_last(metrics)
            if last is not None and unit.index is None:
                expected_last[unit.stage] = last
            hist = run.unit_dir(unit) / "metrics_history.jsonl"
            if hist.is_file():
                checks.append(Check("history", unit.key, jsonl_history_problems(hist, last)))

            if node.kind == "export":
                checks.append(_export_check(run, unit))

    h5 = run.path / FILENAME
    if h5.exists():
        present = set(History(h5).stages())
        checks.append(Check("history", FILENAME, check_gaps(h5, {s: n for s, n in expected_last.items() if s in present})))

    known = env_secrets() if known_secrets is None else known_secrets
    findings = scan_tree(run.path, known)
    checks.append(
        Check(
            "secrets",
            "run directory",
            [str(f) for f in findings],
            note=f"{len(known)} secret value(s) of this environment + credential shapes",
        )
    )
    return checks


def _lineage_check(run: RunDir, dag, unit, path: Path, record: dict) -> Check:
    """The inputs this unit was computed from (its provenance record) are the inputs there now."""
    check = Check("lineage", unit.key)
    current = run.input_digests(dag, unit.stage)
    recorded = record.get("inputs") or {}
    for need, digest in current.items():
        was = (recorded.get(need) or {}).get("sha256")
        if was != digest:
            now = "not done" if digest is None else f"{digest[:12]}"
            check.problems.append(
                f"{path}: input {need} was {str(was)[:12]} when this unit ran, is {now} now (stale: snowcat resume re-runs it)"
            )
    check.note = ", ".join(current) or "no inputs"
    return check


def _export_check(run: RunDir, unit) -> Check:
    out_dir = run.unit_dir(unit)
    check = Check("export", unit.key)
    model = out_dir / "model"
    record = read_json(out_dir / "export.json")
    if not model.is_dir() or record is None:
        check.problems.append(f"{model if not model.is_dir() else out_dir / 'export.json'}: missing")
        return check
    check.problems += verify_manifest(model)
    manifest = model / "manifest.json"
    if manifest.is_file() and sha256_file(manifest) != record.get("model_manifest_sha256"):
        check.problems.append(f"{manifest}: differs from the hash recorded in {out_dir / 'export.json'}")
    eq = record.get("equivalence") or {}
    if not (eq.get("logits_match") and eq.get("greedy_match") and eq.get("chat_template_match")):
        check.problems.append(f"{out_dir / 'export.json'}: the recorded inference-equivalence check did not pass")
    check.note = f"max |Δlogit| {eq.get('max_abs_dlogit')}"
    return check


# --- CLI ------------------------------------------------------------------------------------------


def add_audit_arguments(parser) -> None:
    parser.add_argument("run", help="run directory")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")


def cmd_audit(args) -> int:
    run = RunDir.open(args.run)
    checks = audit(run)
    ok = all(c.ok for c in checks)
    if args.json:
        print(
            json.dumps(
                {"run_id": run.run_id, "run_dir": str(run.path), "ok": ok, "checks": [asdict(c) | {"ok": c.ok} for c in checks]},
                indent=2,
            )
        )
        return 0 if ok else 1
    table = Table(title=f"audit {run.run_id}")
    for col in ("check", "subject", "verdict", "detail"):
        table.add_column(col, overflow="fold")
    for c in checks:
        detail = c.problems[0] + (f" (+{len(c.problems) - 1} more)" if len(c.problems) > 1 else "") if c.problems else c.note
        table.add_row(c.check, c.subject, "[green]pass[/]" if c.ok else "[red]FAIL[/]", escape(detail))
    console = Console(highlight=False, width=200)
    console.print(table)
    for c in checks:
        for p in c.problems:
            console.print(f"[red]{c.check}[/] {escape(p)}", soft_wrap=True)
    console.print("[green]audit passed[/]" if ok else f"[red]audit failed[/]: {sum(len(c.problems) for c in checks)} problem(s)")
    return 0 if ok else 1
