"""Plan against measurement, after a run: the plan computed from the run's frozen config (and the
site profile frozen in it) beside what the run recorded — step time (SFT: train_seconds / steps;
RL: the mean of `time/step_s`), peak memory (the largest of the training loop's per-step
`memory/peak_*_gib`: GPU memory allocated, or on the CPU the process's peak resident set), and
node-hours (each unit's wall-clock from its provenance x the stage's nodes). Written to
`<run>/plan/compare.json`, which `snowcat card` includes."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from snowcat.pipeline.fsio import atomic_write_json, read_json
from snowcat.pipeline.provenance import record_path

COMPARE = Path("plan") / "compare.json"
# what the training loop records per step (stages/train/loop.py `peak_memory`), by what it counts
MEMORY_KEYS = {
    "memory/peak_gpu_allocated_gib": "GPU memory torch allocated at most (the largest rank)",
    "memory/peak_rss_gib": "peak resident set of the process, interpreter and libraries included (the largest rank)",
}


def _seconds(times: dict) -> float | None:
    try:
        return (dt.datetime.fromisoformat(times["ended"]) - dt.datetime.fromisoformat(times["started"])).total_seconds()
    except (KeyError, TypeError, ValueError):
        return None


def _history(path: Path, key: str) -> list[float]:
    if not path.is_file():
        return []
    values = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row.get(key), (int, float)):
            values.append(float(row[key]))
    return values


def _history_mean(path: Path, key: str) -> float | None:
    values = _history(path, key)
    return sum(values) / len(values) if values else None


def measured(run, dag, name: str) -> dict:
    """What the run recorded of stage `name` (None where it recorded nothing)."""
    node = dag[name]
    out: dict = {
        "step_s": None,
        "peak_memory_gib": None,
        "memory_measure": None,
        "hours": None,
        "node_hours": None,
        "done": False,
    }
    units = node.units
    out["done"] = all(run.is_done(u) for u in units)
    secs = [
        s
        for u in units
        if (s := _seconds((read_json(record_path(run.path, u.stage, u.index)) or {}).get("times") or {})) is not None
    ]
    res = node.config.resources
    nodes = sum(c.nodes for c in res.components.values()) if res.components else res.nodes
    if secs:
        out["hours"] = max(secs) / 3600
        out["node_hours"] = sum(secs) / 3600 * nodes
    metrics = run.metrics(units[0]) if units else {}
    if node.kind == "sft" and metrics.get("train_seconds"):
        out["step_s"] = metrics["train_seconds"] / max(1, node.config.steps)
    elif node.kind == "rl":
        out["step_s"] = _history_mean(run.unit_dir(units[0]) / "metrics_history.jsonl", "time/step_s")
    if node.kind in ("sft", "rl"):  # the largest of the per-step peaks the training loop logged
        for key, what in MEMORY_KEYS.items():
            if values := _history(run.unit_dir(units[0]) / "metrics_history.jsonl", key):
                out["peak_memory_gib"], out["memory_measure"] = max(values), f"{key}: {what}"
                break
    return out


def _ratio(pred, meas):
    return round(pred / meas, 3) if pred is not None and meas else None


def compare(run, dag, plan: dict) -> dict:
    rows = []
    for rec in plan["stages"]:
        m = measured(run, dag, rec["name"])
        peak = max((role["memory"]["peak_gib"] for role in rec["roles"]), default=None)
        rows.append(
            {
                "stage": rec["name"],
                "kind": rec["kind"],
                "done": m["done"],
                "step_s": {"plan": rec.get("step_s"), "measured": m["step_s"], "ratio": _ratio(rec.get("step_s"), m["step_s"])},
                "peak_memory_gib": {
                    "plan": peak,
                    "measured": m["peak_memory_gib"],
                    "ratio": _ratio(peak, m["peak_memory_gib"]),
                    "measure": m["memory_measure"],
                },
                "node_hours": {
                    "plan": rec["node_hours"],
                    "measured": m["node_hours"],
                    "ratio": _ratio(rec["node_hours"], m["node_hours"]),
                },
                "plan_basis": rec["hours_basis"],
            }
        )
    return {
        "run_id": run.run_id,
        "site": plan["site"],
        "assumptions": plan["assumptions"],
        "stages": rows,
        "total_plan": plan["total"],
    }


def write(run, result: dict) -> Path:
    path = run.path / COMPARE
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, result)
    return path


def _v(x, fmt: str) -> str:
    return "not recorded" if x is None else fmt.format(x)


def text(result: dict) -> str:
    a = result["assumptions"]
    lines = [
        f"plan against measurement: run {result['run_id']} on site {result['site']} "
        f"[plan assumes MFU {a['mfu']:.0%}, bandwidth {a['bandwidth_efficiency']:.0%}]",
        f"{'stage':<16} {'step s plan':>12} {'measured':>12} {'GiB plan':>9} {'measured':>12} {'node-h plan':>12} {'measured':>12}",
    ]
    for r in result["stages"]:
        lines.append(
            f"{r['stage']:<16} {_v(r['step_s']['plan'], '{:.3g}'):>12} {_v(r['step_s']['measured'], '{:.3g}'):>12} "
            f"{_v(r['peak_memory_gib']['plan'], '{:.2f}'):>9} {_v(r['peak_memory_gib']['measured'], '{:.2f}'):>12} "
            f"{_v(r['node_hours']['plan'], '{:.3f}'):>12} {_v(r['node_hours']['measured'], '{:.3f}'):>12}"
        )
    measures = sorted({m for r in result["stages"] if (m := r["peak_memory_gib"].get("measure"))})
    lines += [f"memory measured: {m}" for m in measures]
    return "\n".join(lines)


def card_lines(run_path: Path) -> list[str]:
    """The card's section: the comparison `snowcat plan --compare` recorded, or nothing."""
    result = read_json(Path(run_path) / COMPARE)
    if not result:
        return []
    a = result.get("assumptions", {})
    lines = [
        f"Predicted by `snowcat plan` from this run's config and site profile (MFU {a.get('mfu', 0):.0%}, "
        f"bandwidth {a.get('bandwidth_efficiency', 0):.0%} of peak), beside what the run recorded:",
        "",
        "| stage | step s (plan / measured) | peak GiB per device (plan / measured) | node-hours (plan / measured) |",
        "|---|---|---|---|",
    ]
    for r in result.get("stages", []):
        lines.append(
            f"| {r['stage']} | {_v(r['step_s']['plan'], '{:.3g}')} / {_v(r['step_s']['measured'], '{:.3g}')} | "
            f"{_v(r['peak_memory_gib']['plan'], '{:.2f}')} / {_v(r['peak_memory_gib']['measured'], '{:.2f}')} | "
            f"{_v(r['node_hours']['plan'], '{:.3f}')} / {_v(r['node_hours']['measured'], '{:.3f}')} |"
        )
    measures = sorted({m for r in result.get("stages", []) if (m := r["peak_memory_gib"].get("measure"))})
    return lines + ([""] + [f"Memory measured as {m}." for m in measures] if measures else [])
