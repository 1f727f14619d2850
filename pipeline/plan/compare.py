"""Plan against measurement, after a run: the plan computed from the run's frozen config (and the
site profile frozen in it) beside what the run recorded — step time (SFT: train_seconds / steps;
RL: the mean of `time/step_s`), peak memory (the largest of the training loop's per-step
`memory/peak_*_gib`: GPU memory allocated, or on the CPU the process's peak resident set), and
node-hours (on Slurm what sacct says each unit's jobs were allocated, ElapsedRaw x NNodes, the
figure a site charges: `allocations`; else, or where sacct does not answer, each unit's job from
start to end x the stage's nodes: `unit_seconds`, said so), per stage and for the run. The plan of stage X reads only what X's finished inputs recorded (`finished`,
`lengths.inputs_of`). Written to `<run>/plan/compare.json`, which `snowcat card` includes."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
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


RUNNER = "the runner's stamps, start to end (a Slurm job's start before the runner stamps `started` is not in them)"
SACCT = "sacct's allocation: ElapsedRaw x NNodes of the unit's jobs (what the site charges)"


def _unit_jobs(run, unit) -> list[str]:
    """The Slurm jobs that ran a unit (its attempts and continuations); [] for another executor."""
    record = run.record(unit.key)
    if record.get("executor") != "slurm":
        return []
    return [str(j) for j in record.get("own_job_ids") or [] if not str(j).startswith("local:")]


def allocations(run, dag) -> tuple[dict[str, tuple[float, float]], str | None]:
    """Per unit run on Slurm, (seconds, node-seconds) its jobs were allocated, from one sacct call:
    a job's seconds are its longest component's (hetjob components run together), node-seconds
    every component's ElapsedRaw x NNodes. ({}, why) when sacct does not answer."""
    jobs = {u.key: ids for node in dag for u in node.units if (ids := _unit_jobs(run, u))}
    if not jobs:
        return {}, None
    every = sorted({j for ids in jobs.values() for j in ids})
    cmd = ["sacct", "-n", "-P", "-X", "--duplicates", "-j", ",".join(every), "-o", "JobID,ElapsedRaw,NNodes"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {}, f"sacct did not run ({e.__class__.__name__}: {e})"
    if proc.returncode != 0:
        said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        return {}, f"sacct failed: {said[-1] if said else f'exit {proc.returncode}'}"
    rows: dict[str, list[tuple[int, int]]] = {}  # job id (array task kept, hetjob component dropped) -> components
    for line in proc.stdout.splitlines():
        parts = line.split("|")
        if len(parts) != 3 or "." in parts[0] or not parts[1].isdigit() or not parts[2].isdigit():
            continue
        rows.setdefault(parts[0].split("+")[0], []).append((int(parts[1]), int(parts[2])))
    out = {}
    for key, ids in jobs.items():
        found = [rows[j] for j in ids if j in rows]
        if len(found) == len(ids):
            out[key] = (
                float(sum(max(e for e, _ in comps) for comps in found)),
                float(sum(e * n for comps in found for e, n in comps)),
            )
    missing = len(jobs) - len(out)
    return out, (f"sacct gave no allocation for {missing} of {len(jobs)} unit(s)" if missing else None)


def finished(run, dag):
    """`done_dir(stage)` for `lengths.inputs_of`: a stage's directory once its one unit is done
    (None: not done, or fanned out over several units)."""

    def done_dir(name: str) -> Path | None:
        units = dag[name].units if name in dag.nodes else []
        return run.unit_dir(units[0]) if len(units) == 1 and run.is_done(units[0]) else None

    return done_dir


def measured(run, dag, name: str, allocated: dict[str, tuple[float, float]] | None = None) -> dict:
    """What the run recorded of stage `name` (None where it recorded nothing). `allocated`: per unit
    on Slurm, (seconds, node-seconds) sacct reports (`allocations`)."""
    node = dag[name]
    out: dict = {
        "step_s": None,
        "peak_memory_gib": None,
        "memory_measure": None,
        "hours": None,
        "node_hours": None,
        "done": False,
        "lengths": {},
        "time_measure": None,
    }
    units = node.units
    out["done"] = all(run.is_done(u) for u in units)
    res = node.config.resources
    nodes = sum(c.nodes for c in res.components.values()) if res.components else res.nodes
    allocated = allocated or {}
    if units and all(u.key in allocated for u in units):
        out["hours"] = max(allocated[u.key][0] for u in units) / 3600
        out["node_hours"] = sum(allocated[u.key][1] for u in units) / 3600
        out["time_measure"] = SACCT
    elif secs := [s for u in units if (s := unit_seconds(run, u)) is not None]:
        out["hours"] = max(secs) / 3600
        out["node_hours"] = sum(secs) / 3600 * nodes
        out["time_measure"] = RUNNER
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
    allocated, why = allocations(run, dag)
    rows = []
    for rec in plan["stages"]:
        m = measured(run, dag, rec["name"], allocated)
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
                "time_measure": m["time_measure"],
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
        "time_measure": _time_note(rows, why),
    }


def _time_note(rows: list[dict], why: str | None) -> str:
    """What the measured node-hours are: sacct's allocation, or the runner's stamps and why."""
    used = {r["time_measure"] for r in rows if r["time_measure"]}
    if used == {SACCT}:
        return SACCT
    if SACCT in used:
        return f"{SACCT}; the other stages: {RUNNER}" + (f" ({why})" if why else "")
    return RUNNER + (f"; fell back from sacct: {why}" if why else "")


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
    if result.get("time_measure"):
        lines.append(f"node-hours measured: {result['time_measure']}")
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
    notes = [f"Memory measured as {m}." for m in measures]
    if result.get("time_measure"):
        notes.append(f"Node-hours measured as {result['time_measure']}.")
    return lines + ([""] + notes if notes else [])
