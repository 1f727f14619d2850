"""Layout search: the trainer layouts (TP/PP/EP/DP, backend) and rollout:trainer GPU splits that fit,
sorted by estimated node-hours. Each candidate is the config with its layout keys changed and
planned like any other; one that does not divide or does not fit is left out (counted)."""

from __future__ import annotations

import dataclasses

from snowcat.pipeline.errors import UserError

from .core import plan_stage


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers(limit: int) -> list[int]:
    out, x = [], 1
    while x <= limit:
        out.append(x)
        x *= 2
    return out


def candidates(stage, gpus_per_node: int, max_nodes: int, experts: int) -> list[dict]:
    """Layouts to try for a trainer stage: node counts up to `max_nodes` (powers of two), each with
    TP within a node, PP over the rest, EP dividing the experts; backends as configured plus fsdp."""
    per_node = max(1, gpus_per_node)
    backends = sorted({stage.backend, "fsdp", "megatron"})
    out = []
    for nodes in _powers(max_nodes):
        ranks = nodes * per_node
        for backend in backends:
            tps = _powers(per_node) if backend == "megatron" else [1]
            pps = [p for p in _powers(8) if p <= ranks] if backend == "megatron" else [1]
            for tp in tps:
                for pp in pps:
                    if ranks % (tp * pp):
                        continue
                    for ep in [e for e in _powers(ranks) if experts % e == 0]:
                        out.append(
                            {
                                "nodes": nodes,
                                "tasks_per_node": per_node,
                                "backend": backend,
                                "tensor_parallel": tp,
                                "pipeline_parallel": pp,
                                "expert_parallel": ep,
                            }
                        )
    return out


def search(run, name: str, model_configs: dict, max_nodes: int | None = None, top: int = 20) -> dict:
    """The layouts of stage `name` that fit, cheapest first."""
    if name not in run.stages:
        raise UserError(f"--search {name}: no such stage (stages: {', '.join(run.stages)})")
    stage = run.stages[name]
    if stage.kind not in ("sft", "rl"):
        raise UserError(f"--search {name}: searches trainer layouts; stage {name} is a {stage.kind} stage")
    site = run.site
    res = stage.resources
    comps = list(res.components.items())
    part_name = (comps[0][1].partition if comps else res.partition) or site.default_partition
    part = site.partitions[part_name]
    from .model import stage_arch  # noqa: PLC0415 (a cycle otherwise)

    arch = stage_arch(run, name, model_configs)
    limit = min(max_nodes or part.max_nodes, part.max_nodes)
    rollout_nodes = [0]
    if comps and len(comps) > 1:
        rollout_nodes = [n for n in _powers(limit) if n < limit] or [1]
    rows, refused = [], 0
    for cand in candidates(stage, part.gpus_per_node, limit, arch.cfg.num_experts):
        for r_nodes in rollout_nodes:
            layout = {k: v for k, v in cand.items() if k not in ("nodes", "tasks_per_node")}
            trial_stage = dataclasses.replace(stage, **layout)
            if comps:
                t_name, t_comp = comps[0]
                new_comps = {t_name: dataclasses.replace(t_comp, nodes=cand["nodes"], tasks_per_node=cand["tasks_per_node"])}
                for r_name, r_comp in comps[1:]:
                    new_comps[r_name] = dataclasses.replace(r_comp, nodes=r_nodes or r_comp.nodes)
                trial_stage = dataclasses.replace(trial_stage, resources=dataclasses.replace(res, components=new_comps))
            else:
                trial_stage = dataclasses.replace(
                    trial_stage, resources=dataclasses.replace(res, nodes=cand["nodes"], tasks_per_node=cand["tasks_per_node"])
                )
            trial = dataclasses.replace(run, stages={**run.stages, name: trial_stage})
            try:
                rec = plan_stage(trial, name, model_configs)
            except UserError:
                refused += 1
                continue
            if any(not role["memory"]["fits"] for role in rec["roles"]) or rec["jobs"]["problem"]:
                refused += 1
                continue
            trainer = rec["roles"][0]
            rows.append(
                {
                    **layout,
                    "trainer_nodes": cand["nodes"],
                    "rollout_nodes": r_nodes if comps and len(comps) > 1 else 0,
                    "dp": trainer["dp"],
                    "trainer_peak_gib": trainer["memory"]["peak_gib"],
                    "usable_gib": trainer["memory"]["usable_gib"],
                    "hours": rec["hours"],
                    "node_hours": rec["node_hours"],
                    "charge": rec["charge"],
                }
            )
    rows.sort(key=lambda r: (r["node_hours"], r["hours"]))
    return {
        "stage": name,
        "partition": part_name,
        "tried": len(rows) + refused,
        "refused": refused,
        "fits": rows[:top],
        "charge_unit": site.planner.charge_unit,
    }


def text(result: dict) -> str:
    unit = result["charge_unit"]
    lines = [
        f"layouts of stage {result['stage']} on {result['partition']} that fit, cheapest first "
        f"({len(result['fits'])} shown; {result['tried']} tried, {result['refused']} do not divide or do not fit):",
        f"{'backend':<9} {'nodes':>5} {'roll':>4} {'TP':>3} {'PP':>3} {'EP':>4} {'DP':>4} {'GiB/GPU':>12} {'hours':>8} {'node-h':>9} {unit:>10}",
    ]
    for r in result["fits"]:
        lines.append(
            f"{r['backend']:<9} {r['trainer_nodes']:>5} {r['rollout_nodes']:>4} {r['tensor_parallel']:>3} {r['pipeline_parallel']:>3} "
            f"{r['expert_parallel']:>4} {r['dp']:>4} {r['trainer_peak_gib']:>5.1f}/{r['usable_gib']:<6.1f} {r['hours']:>8.2f} "
            f"{r['node_hours']:>9.2f} {r['charge']:>10.1f}"
        )
    return "\n".join(lines)
