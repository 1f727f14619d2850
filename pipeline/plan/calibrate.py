"""The planner's agent, engine and backend terms, measured on a finished run (docs/planning.md,
"The north star on the local Slurm cluster"): what a site profile's `planner:` block then says.

    python -m snowcat.pipeline.plan.calibrate RUN [--site S]

Each term is a physical cost read from what the run recorded, never a factor fitted to a stage's
total:

- `sandbox_call_s`, `verify_s`: the multi-turn evaluate episodes' own environment seconds
  (`behaviour/<shard>.timing.jsonl` `env_s`: each call's wall as it ran beside the others of its
  turn) by least squares on their sandboxed calls and verified submits.
- `tool_call_s`, `sandbox_start_s`: evaluate episodes with no sandboxed call and no verification:
  their env seconds over (their in-process calls + one sandbox start), the same figure for both
  (0 where every episode ran a sandboxed call).
- `decode_step_s`: the evaluate waves' generate seconds over their decode steps (per turn, the
  longest turn of the wave's live episodes).
- `engine_reload_s`: the reload seconds of each RL weight version after the first (a rebuild where
  the in-place reload is refused); `engine_start_s`: an evaluate stage's duration less its
  checkpoints' sampling seconds and the later checkpoints' builds (the first engine of a process,
  vLLM's imports with it; the stage's own reading and writing too: an upper bound).
- `backend_mfu`: per trainer backend, an SFT stage's FLOPs per step over (ranks x peak x (its
  measured step less the plan's communication)).
- `job_start_s`: on Slurm, the median over the run's stage jobs of what sacct says the job was
  allocated (ElapsedRaw, whole seconds) less the stage's own `duration_s`: batch script, srun, the
  interpreter and imports before the runner starts the stage, its records after.
- `stage_work_s`: the short stages' own `duration_s` (their kind's mean where several ran).
- `expert_episode_s`: SFT's scripted expert, its seconds (the checks' `expert`) over its rounds of
  `workers` episodes side by side.
- `rl_start_s`: an RL stage's duration less the seconds of its updates (`time/step_s`).

Checks beside them, not fits (`checks`): SFT's scripted expert (the unit's start to its
`teacher_demos.json`, the stage's own start included) and each evaluate wave's tool phase (its wall
less its generate seconds) as the model then gives them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

from snowcat.pipeline.errors import UserError
from snowcat.stages.registry import KINDS

from . import agent as agent_mod
from . import compare


def _lstsq(rows: list[tuple[list[float], float]]) -> list[float]:
    import numpy as np  # noqa: PLC0415

    a = np.array([x for x, _ in rows], float)
    y = np.array([v for _, v in rows], float)
    return [float(c) for c in np.linalg.lstsq(a, y, rcond=None)[0]]


def episode_points(run, dag, typed) -> list[dict]:
    """Per multi-turn evaluate shard: its episodes (calls, env seconds) and its wave's wall, generate
    seconds and decode steps."""
    import pyarrow.parquet as pq  # noqa: PLC0415

    out = []
    for name, stage in typed.stages.items():
        if stage.kind != "evaluate" or stage.env == "single":
            continue
        base = run.unit_dir(dag[name].units[0])
        for timing in sorted((base / "behaviour").glob("*.timing.jsonl")):
            shard = timing.name.removesuffix(".timing.jsonl")
            times = [json.loads(line) for line in timing.read_text().splitlines() if line.strip()]
            cols = ["id", *agent_mod.PROFILE_COLUMNS]
            episodes = {e["id"]: e for e in pq.read_table(base / "trajectories" / f"{shard}.parquet", columns=cols).to_pylist()}
            rows = []
            for t in times:
                e = episodes[t["id"]]
                names = e["tool_names"] or []
                rows.append(
                    {
                        "sandboxed": sum(n in agent_mod.SANDBOXED for n in names),
                        "in_process": sum(n not in agent_mod.SANDBOXED and n != "submit" for n in names),
                        "verified": int(e["status"] == "ok"),
                        "env_s": t["env_s"],
                        "turns": [b - a for a, b in zip(e["turn_starts"], e["turn_ends"])],
                        "sandboxed_at": [int(n in agent_mod.SANDBOXED) for n in names]
                        + [0] * (len(e["turn_starts"]) - len(names)),
                    }
                )
            out.append(
                {
                    "stage": name,
                    "shard": shard,
                    "episodes": rows,
                    "wall_s": max(t["wall_s"] for t in times),
                    "generate_s": max(t["generate_s"] for t in times),
                    "decode_steps": agent_mod._wave_steps([r["turns"] for r in rows], stage.max_tokens),
                }
            )
    return out


def expert_points(run, dag, typed) -> list[dict]:
    """Per SFT stage that ran the scripted expert: its tasks and seconds (unit start to demos written)."""
    out = []
    for name, stage in typed.stages.items():
        unit = dag[name].units[0]
        demos = run.unit_dir(unit) / "teacher_demos.json"
        stamps = run.record_stamps(unit.key)
        if stage.kind != "sft" or not demos.is_file() or "started" not in stamps:
            continue
        tasks = len(json.loads(demos.read_text()).get("demos") or {})
        if tasks:
            seconds = (os.stat(demos).st_mtime_ns - stamps["started"]) / 1e9
            out.append({"stage": name, "tasks": tasks, "seconds": round(seconds, 3)})
    return out


def engine_points(run, dag, typed) -> dict:
    """RL's engine counters per update (stages/rollout/vllm_engine.py): the reload seconds of each
    weight version after the first (rebuilds here); and per multi-checkpoint evaluate stage, its
    duration less its checkpoints' sampling seconds (the engines' builds, the first with vLLM's
    imports)."""
    out: dict = {"later_reload_s": [], "evaluate": []}
    for name, stage in typed.stages.items():
        unit = dag[name].units[0]
        if stage.kind == "rl":
            history = run.unit_dir(unit) / "metrics_history.jsonl"
            rows = [json.loads(line) for line in history.read_text().splitlines() if line.strip()] if history.is_file() else []
            reloads = [r["engine/reload_s"] for r in rows if "engine/reload_s" in r]
            out["later_reload_s"] += [round(b - a, 3) for a, b in zip(reloads, reloads[1:]) if b > a]
        elif stage.kind == "evaluate":
            metrics = run.metrics(unit)
            sampled = [v for k, v in metrics.items() if k.endswith("/sample_s")]
            if metrics.get("duration_s") and sampled:
                out["evaluate"].append({"stage": name, "duration_s": metrics["duration_s"], "sample_s": sampled})
    return out


def backend_points(run, dag, typed) -> list[dict]:
    """Per SFT stage: its backend, planned FLOPs and communication per step, measured step."""
    from . import core  # noqa: PLC0415

    out = []
    for name, stage in typed.stages.items():
        metrics = run.metrics(dag[name].units[0])
        if stage.kind != "sft" or not metrics.get("train_seconds"):
            continue
        rec = core.plan_stage(typed, name, {})
        step = rec["roles"][0]["step"]
        res = stage.resources
        hw = core.hardware(typed.site, res.partition, res.tasks_per_node)
        out.append(
            {
                "stage": name,
                "backend": stage.backend,
                "ranks": res.nodes * res.tasks_per_node,
                "flops_per_step": step["flops"],
                "comm_s": round(sum(step["comm_s"].values()), 6),
                "pipeline_bubble": step["pipeline_bubble"],
                "rank_peak_flops": hw.rank_flops(),
                "measured_step_s": metrics["train_seconds"] / stage.steps,
            }
        )
    return out


def rl_start_points(run, dag, typed) -> list[float]:
    """Per RL stage: its duration less its updates' seconds (`time/step_s`): what it spent before
    the first update and after the last."""
    out = []
    for name, stage in typed.stages.items():
        if stage.kind != "rl":
            continue
        unit = dag[name].units[0]
        steps = compare._history(run.unit_dir(unit) / "metrics_history.jsonl", "time/step_s")
        duration = run.metrics(unit).get("duration_s")
        if steps and duration:
            out.append(round(duration - sum(steps), 3))
    return out


def job_points(run, dag, typed) -> list[dict]:
    """Per stage run as one Slurm job: sacct's allocated seconds beside the stage's `duration_s`
    (continued or retried units, and units sacct does not answer for, are left out)."""
    allocated, _ = compare.allocations(run, dag)
    out = []
    for name, stage in typed.stages.items():
        units = dag[name].units
        record = run.record(units[0].key) if len(units) == 1 else {}
        duration = run.metrics(units[0]).get("duration_s") if record else None
        if duration is None or units[0].key not in allocated or len(record.get("own_job_ids") or []) != 1:
            continue
        seconds = allocated[units[0].key][0]
        out.append({"stage": name, "kind": stage.kind, "allocated_s": seconds, "duration_s": duration})
    return out


def fit(points: dict, workers: int) -> dict:
    """The planner fields from `points` (see the module docstring), and the checks beside them."""
    episodes = [e for p in points["episodes"] for e in p["episodes"]]
    bare = [e for e in episodes if not e["sandboxed"] and not e["verified"]]
    tool_call = sum(e["env_s"] for e in bare) / sum(e["in_process"] + 1 for e in bare) if bare else 0.0
    sandboxed, verify = _lstsq(
        [
            ([e["sandboxed"], e["verified"]], e["env_s"] - tool_call * (e["in_process"] + 1))
            for e in episodes
            if e["sandboxed"] or e["verified"]
        ]
    )
    training = {}
    for b in points["backends"]:
        compute = (b["measured_step_s"] - b["comm_s"]) * (1 - b["pipeline_bubble"])
        training.setdefault(b["backend"], []).append(b["flops_per_step"] / (b["ranks"] * b["rank_peak_flops"] * compute))
    engine = points["engine"]
    reload = statistics.mean(engine["later_reload_s"]) if engine["later_reload_s"] else 0.0
    fitted = {
        "sandbox_call_s": round(sandboxed, 4),
        "verify_s": round(verify, 4),
        "tool_call_s": round(tool_call, 5),
        "sandbox_start_s": round(tool_call, 5),
        "decode_step_s": round(
            sum(w["generate_s"] for w in points["episodes"]) / sum(w["decode_steps"] for w in points["episodes"]), 5
        )
        if points["episodes"]
        else 0.0,
        "engine_start_s": round(
            statistics.mean(e["duration_s"] - sum(e["sample_s"]) - (len(e["sample_s"]) - 1) * reload for e in engine["evaluate"]),
            2,
        )
        if engine["evaluate"]
        else 0.0,
        "engine_reload_s": round(reload, 2),
        "backend_mfu": {k: round(statistics.mean(v), 4) for k, v in training.items()},
    }
    if points["expert"]:
        fitted["expert_episode_s"] = round(
            statistics.mean(p["seconds"] / math.ceil(p["tasks"] / workers) for p in points["expert"]), 3
        )
    if points.get("rl_starts"):
        fitted["rl_start_s"] = round(statistics.mean(points["rl_starts"]), 2)
    jobs = points.get("jobs") or []
    if jobs:
        fitted["job_start_s"] = round(statistics.median(j["allocated_s"] - j["duration_s"] for j in jobs), 2)
    short = {}
    for j in jobs:
        if KINDS[j["kind"]].plan == "short":
            short.setdefault(j["kind"], []).append(j["duration_s"])
    if short:
        fitted["stage_work_s"] = {k: round(statistics.mean(v), 2) for k, v in sorted(short.items())}
    # checks, not fits: the expert's seconds and each wave's tool phase as the model then gives them
    expert = [
        {
            "stage": p["stage"],
            "measured_s": p["seconds"],
            "model_s": round(math.ceil(p["tasks"] / workers) * (2 * sandboxed + verify + 3 * tool_call), 2),
        }
        for p in points["expert"]
    ]
    waves = []
    for w in points["episodes"]:
        turns = max(len(e["turns"]) for e in w["episodes"])
        calls = [
            (
                sum(e["sandboxed_at"][t] for e in w["episodes"] if t < len(e["sandboxed_at"])),
                sum(e["verified"] and len(e["turns"]) == t + 1 for e in w["episodes"]),
            )
            for t in range(turns)
        ]
        model = sum(math.ceil((s + v) / workers) * (s * sandboxed + v * verify) / (s + v) for s, v in calls if s + v)
        waves.append(
            {"shard": w["shard"], "measured_tool_phase_s": round(w["wall_s"] - w["generate_s"], 2), "model_s": round(model, 2)}
        )
    return fitted | {"checks": {"workers": workers, "expert": expert, "evaluate_waves": waves}}


def calibrate(run_path: str, site: str | None) -> dict:
    from .command import open_run  # noqa: PLC0415

    run, typed, dag, _ = open_run(run_path, site)
    points = {
        "episodes": episode_points(run, dag, typed),
        "expert": expert_points(run, dag, typed),
        "engine": engine_points(run, dag, typed),
        "backends": backend_points(run, dag, typed),
        "jobs": job_points(run, dag, typed),
        "rl_starts": rl_start_points(run, dag, typed),
    }
    brief = {
        **points,
        "episodes": [{k: v for k, v in p.items() if k != "episodes"} | {"n": len(p["episodes"])} for p in points["episodes"]],
    }
    workers = agent_mod.workers(typed.site, None)
    return {"run": str(Path(run_path)), "fitted": fit(points, workers), "points": brief}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m snowcat.pipeline.plan.calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("run")
    p.add_argument("--site", help="the profile to plan the run's SFT steps on (default: the run's own)")
    args = p.parse_args(argv)
    try:
        fitted = calibrate(args.run, args.site)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(fitted, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
