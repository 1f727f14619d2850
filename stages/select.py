"""`select` stage: keep the training tasks a checkpoint solves sometimes, but not always.

Tasks solved between `min_pass` and `max_pass` times (out of the probe's n attempts) carry a
learning signal for group-relative RL; always- and never-solved ones give every attempt the same
reward and no gradient. Only train tasks are ever selected: a held-out id here is a bug, and
stops the stage.

A probe fanned out over `replica` alone (the same probe repeated with other seeds) is pooled: a
task's passes and scored attempts are summed over the units, and the band is out of all their
attempts (`probe: probe` names them all). Of another fan-out, `probe` names one unit
(`probe[temperature=0.5]`); naming it whole is refused when the config loads.

Outputs in the stage dir: `band.parquet` (the selected tasks, same columns as the tasks tables)
and `select.json` (counts per domain). Read the band back with `load_band(stage_dir)`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_json
from snowcat.stages.taskgen import Task, load_tasks, save_tasks

BAND = "band.parquet"


def select(rows: list[dict], train, val, min_pass: int, max_pass: int, min_scored: int) -> list:
    """The train tasks (in train order) whose probe row is in the band."""
    held_out = {t.task_id for t in val}
    by_id = {r["task_id"]: r for r in rows}
    unknown = sorted(set(by_id) - {t.task_id for t in train})
    assert not set(by_id) & held_out, f"probe results include held-out tasks, e.g. {sorted(set(by_id) & held_out)[0]}"
    if unknown:
        raise UserError(f"probe results name tasks not in the train split, e.g. {unknown[0]}")
    band = [
        t
        for t in train
        if t.task_id in by_id and by_id[t.task_id]["n"] >= min_scored and min_pass <= by_id[t.task_id]["passes"] <= max_pass
    ]
    assert not {t.task_id for t in band} & held_out, "a held-out task was selected"
    return band


def pooled_probe(dirs: list[Path]) -> tuple[list[dict], int]:
    """The probe rows of one or more probe units (replicas of one probe) and their attempts: a task's
    counts summed over the units, in the first unit's row order."""
    if len(dirs) == 1:
        return pq.read_table(dirs[0] / "probe.parquet").to_pylist(), json.loads((dirs[0] / "probe.json").read_text())["attempts"]
    rows: dict[str, dict] = {}
    attempts = 0
    for d in dirs:
        attempts += json.loads((d / "probe.json").read_text())["attempts"]
        for r in pq.read_table(d / "probe.parquet").to_pylist():
            pooled = rows.setdefault(r["task_id"], {**r, "n": 0, "passes": 0, "infra_failures": 0, "reward_sum": 0.0})
            for k in ("n", "passes", "infra_failures"):
                pooled[k] += r[k]
            pooled["reward_sum"] += r["mean_reward"] * r["n"] if r["n"] else 0.0
    for r in rows.values():
        r["mean_reward"] = r.pop("reward_sum") / r["n"] if r["n"] else float("nan")
    return list(rows.values()), attempts


def load_band(stage_dir) -> list:
    rows = pq.read_table(Path(stage_dir) / BAND).to_pylist()
    return [Task(**(r | {"meta": json.loads(r["meta"])})) for r in rows]


def run(ctx) -> dict:
    cfg = ctx.config
    key = f"stages.{ctx.name}"
    for need in (cfg.probe, cfg.tasks):
        if need not in ctx.inputs:
            raise UserError(f"{key}: stage {need!r} is not in needs")
    probes = ctx.inputs.unit_dirs(cfg.probe)
    rows, attempts = pooled_probe(probes)
    if cfg.max_pass > attempts:
        raise UserError(f"{key}.max_pass: {cfg.max_pass} exceeds the probe's attempts ({attempts})")
    train = load_tasks(ctx.inputs[cfg.tasks], "train")
    val = load_tasks(ctx.inputs[cfg.tasks], "val")
    band = select(rows, train, val, cfg.min_pass, cfg.max_pass, cfg.min_scored or attempts)

    out = Path(ctx.out_dir)
    save_tasks(out, "band", band)  # writes band.parquet with the tasks tables' schema
    domains = sorted({r["domain"] for r in rows})
    counts = {d: {"probed": sum(r["domain"] == d for r in rows), "selected": sum(t.domain == d for t in band)} for d in domains}
    atomic_write_json(
        out / "select.json",
        {
            "band": [cfg.min_pass, cfg.max_pass],
            "attempts": attempts,
            "probe_units": len(probes),
            "probed": len(rows),
            "selected": len(band),
            "domains": counts,
        },
    )
    metrics = {"probed": len(rows), "selected": len(band), "selected_fraction": len(band) / max(1, len(rows))}
    metrics.update({f"{d}/selected": c["selected"] for d, c in counts.items()})
    return metrics
