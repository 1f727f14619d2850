"""Plan against measurement, after a run: the plan computed from the run's frozen config (and the
site profile frozen in it) beside what the run recorded — step time (SFT: train_seconds / steps;
RL: the mean of `time/step_s`), peak memory (the largest of the training loop's per-step
`memory/peak_*_gib`: GPU memory allocated, or on the CPU the process's peak resident set), and
node-hours (each unit's job, start to end, x the stage's nodes: `unit_seconds`), per stage and for
the run. The plan of stage X reads only what X's finished inputs recorded (`finished`,
`lengths.inputs_of`). Written to `<run>/plan/compare.json`, which `snowcat card` includes."""

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


def unit_seconds(run, unit) -> float | None:
    """A unit's job, start to end: from the process's start where the local executor started it
    (its `submitted`; a Slurm job's queue wait is not the job's), else from the unit's `started`,
    to its `ended`; to the ns the state records stamp them with, else the provenance's seconds."""
    record = run.record(unit.key)
    stamps = run.record_stamps(unit.key)
    if "started" in stamps and "ended" in stamps and stamps["ended"] >= stamps["started"]:
        start = stamps["started"]
        if record.get("executor") == "local" and 0 <= stamps["started"] - stamps.get("submitted", -1) < 60e9:
            start = stamps["submitted"]
        return (stamps["ended"] - start) / 1e9
    return _seconds((read_json(record_path(run.path, unit.stage, unit.index)) or {}).get("times") or {})


def finished(run, dag):
    """`done_dir(stage)` for `lengths.inputs_of`: a stage's directory once its one unit is done
    (None: not done, or fanned out over several units)."""

    def done_dir(name: str) -> Path | None:
        units = dag[name].units if name in dag.nodes else []
        return run.unit_dir(units[0]) if len(units) == 1 and run.is_done(units[0]) else None

    return done_dir


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
        "lengths": {},
    }
    units = node.units
    out["done"] = all(run.is_done(u) for u in units)
    secs = [s for u in units if (s := unit_seconds(run, u)) is not None]
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
    if node.kind in ("probe", "rl", "evaluate"):
        out["lengths"] = sampled_lengths(run.unit_dir(units[0]) / "trajectories")
    if node.kind in ("sft", "rl"):  # the largest of the per-step peaks the training loop logged
        for key, what in MEMORY_KEYS.items():
            if values := _history(run.unit_dir(units[0]) / "metrics_history.jsonl", key):
                out["peak_memory_gib"], out["memory_measure"] = max(values), f"{key}: {what}"
                break
    return out


def sampled_lengths(directory: Path) -> dict[str, dict]:
    """Per trajectories file the stage kept (by its stem: `sft_final`, `step_000003`), the mean
    prompt and response tokens of its episodes; {} where none were kept or the columns are absent."""
    import pyarrow.parquet as pq  # noqa: PLC0415 (only where a run's episodes are read)

    out = {}
    for path in sorted(Path(directory).glob("*.parquet")):
        if not {"prompt_len", "response_tokens"} <= set(pq.read_schema(path).names):
            continue
        table = pq.read_table(path, columns=["prompt_len", "response_tokens"])
        if table.num_rows:
            prompts, responses = table["prompt_len"].to_pylist(), table["response_tokens"].to_pylist()
            out[path.stem] = {"episodes": len(prompts), "prompt": sum(prompts), "response": sum(responses)}
    return out


def _means(files: list[dict]) -> dict | None:
    n = sum(f["episodes"] for f in files)
    if not n:
        return None
    return {
        "prompt_mean": round(sum(f["prompt"] for f in files) / n, 2),
        "response_mean": round(sum(f["response"] for f in files) / n, 2),
    }


def _lengths_beside(rec: dict, sampled: dict[str, dict]) -> list[dict]:
    """Each of the plan's length sources beside what the stage then sampled (a checkpoint's file,
    `sft:final` -> `sft_final`; RL's updates: every `step_*` file)."""
    out = []
    for item in rec.get("lengths", []):
        what = item["for"]
        files = (
            [v for k, v in sampled.items() if k.startswith("step_")]
            if what == "updates"
            else [sampled.get(what.replace(":", "_"))]
        )
        out.append(
            {
                "for": what,
                "source": item["source"],
                "upper_bound": item["upper_bound"],
                "plan": {"prompt_mean": item["prompt_mean"], "response_mean": item["response_mean"]},
                "measured": _means([f for f in files if f]),
            }
        )
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
                "lengths": _lengths_beside(rec, m["lengths"]),
            }
        )
    return {
        "run_id": run.run_id,
        "site": plan["site"],
        "assumptions": plan["assumptions"],
        "stages": rows,
        "total_plan": plan["total"],
        "total": _total(rows),
    }


def _total(rows: list[dict]) -> dict:
    """The run's node-hours, planned and measured (None unless every stage measured some)."""
    plan = sum(r["node_hours"]["plan"] for r in rows)
    each = [r["node_hours"]["measured"] for r in rows]
    meas = sum(each) if each and all(m is not None for m in each) else None
    return {"node_hours": {"plan": plan, "measured": meas, "ratio": _ratio(plan, meas)}}


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
            f"{_v(r['node_hours']['plan'], '{:.3g}'):>12} {_v(r['node_hours']['measured'], '{:.3g}'):>12}"
        )
    t = result["total"]["node_hours"]
    lines.append(
        f"{'run':<16} {'':>12} {'':>12} {'':>9} {'':>12} {_v(t['plan'], '{:.3g}'):>12} {_v(t['measured'], '{:.3g}'):>12}"
    )
    measures = sorted({m for r in result["stages"] if (m := r["peak_memory_gib"].get("measure"))})
    lines += [f"memory measured: {m}" for m in measures]
    for r in result["stages"]:
        for item in r.get("lengths", []):
            plan, meas = item["plan"], item["measured"]
            sampled = f"; sampled {meas['prompt_mean']:.1f} + {meas['response_mean']:.1f}" if meas else ""
            lines.append(
                f"lengths of {r['stage']} ({item['for']}): planned prompt {plan['prompt_mean']:.1f} + response "
                f"{plan['response_mean']:.1f} tokens{sampled} [{item['source']}]"
            )
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
            f"{_v(r['node_hours']['plan'], '{:.3g}')} / {_v(r['node_hours']['measured'], '{:.3g}')} |"
        )
    if total := result.get("total", {}).get("node_hours"):
        lines.append(f"| the run | | | {_v(total['plan'], '{:.3g}')} / {_v(total['measured'], '{:.3g}')} |")
    measures = sorted({m for r in result.get("stages", []) if (m := r["peak_memory_gib"].get("measure"))})
    return lines + ([""] + [f"Memory measured as {m}." for m in measures] if measures else [])
