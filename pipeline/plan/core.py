"""The plan of a run: per stage and role, memory per device, time per step, stage time, node-hours
and charge, and the site's checks. Everything is a function of the resolved config and its site
profile; nothing is submitted or written."""

from __future__ import annotations

import math

from snowcat.pipeline.errors import UserError
from snowcat.stages.config import GPU_KINDS

from . import sitecheck
from .memory import GIB, gib, make_layout, parts_gib, rollout_memory, trainer_memory
from .model import Arch, stage_arch
from .timing import Hardware, decode, handoff, train_step, transport

MODELLED = ("sft", "rl", "probe", "evaluate")


def hardware(site, partition: str | None, ranks_per_node: int = 1) -> Hardware:
    """The planner's view of a partition (facts from `planner.partitions`, assumptions from `planner`)."""
    name = partition or site.default_partition
    part = site.partitions.get(name)
    if part is None:
        raise UserError(f"site {site.name}: unknown partition {name!r}")
    pl = site.planner
    cost = pl.partitions.get(name)
    if cost is None:
        raise UserError(
            f"site {site.name}: key planner.partitions.{name} is not set; the plan needs the partition's "
            "charge rate and hardware (docs/planning.md, 'Site fields')"
        )
    memory = cost.device_memory_gib
    if memory is None and not part.gpus_per_node and part.mem_gb:
        memory = part.mem_gb / max(1, ranks_per_node)  # CPU nodes: the node's memory over its ranks
    return Hardware(
        site=site.name,
        partition=name,
        gpus_per_node=part.gpus_per_node,
        device_memory_gib=memory,
        peak_tflops=cost.peak_tflops,
        memory_gbps=cost.memory_gbps,
        intra_node_gbps=cost.intra_node_gbps,
        inter_node_gbps=cost.inter_node_gbps,
        charge_per_node_hour=cost.charge_per_node_hour,
        charge_unit=pl.charge_unit,
        mfu=pl.mfu,
        bandwidth_efficiency=pl.bandwidth_efficiency,
        memory_margin=pl.memory_margin,
        filesystem_gbps=pl.filesystem_gbps,
        ranks_per_node=ranks_per_node,
    )


def _units(stage) -> int:
    return math.prod(len(v) for v in stage.fan_out.values()) if stage.fan_out else 1


def _fit(peak: float, hw: Hardware, where: str, role: str) -> dict:
    capacity = hw.need("device_memory_gib") * GIB
    usable = capacity * (1 - hw.memory_margin)
    ok = peak <= usable
    out = {
        "peak_gib": gib(peak),
        "device_gib": gib(capacity),
        "usable_gib": gib(usable),
        "fits": ok,
        "margin": hw.memory_margin,
    }
    if not ok:
        out["problem"] = (
            f"{where}: the {role} needs {gib(peak):.1f} GiB per {'GPU' if hw.on_gpu else 'rank'}, "
            f"{gib(usable):.1f} GiB usable ({gib(capacity):.1f} GiB less the margin {hw.memory_margin:.0%})"
        )
    return out


def _task_count(run, tasks_stage: str, split: str) -> int | None:
    """Tasks of a split as the tasks stage's config generates them (None: imported, not known yet)."""
    stage = run.stages.get(tasks_stage)
    if stage is None or stage.kind != "tasks" or stage.imports:
        return None
    domains = stage.generated()
    if split == "val":
        return sum(d.val_count for d in domains.values())
    return sum(d.count - d.val_count - d.dev_count for d in domains.values())


def _extra_forwards(stage) -> int:
    """Forwards an RL update runs beside its step: the behaviour policy's logprobs under the
    weights that sampled the batch when they lag the trained ones (stages/rlcore/loop.py
    `_add_behaviour_logprobs`), and a reference model's for a KL penalty."""
    return int(getattr(stage, "lag", 0) >= 1) + int(getattr(stage, "kl_coef", 0) > 0)


def _trainer(
    run, name: str, stage, arch: Arch, hw: Hardware, ranks: int, *, tokens: int, seq_len: int, micro: int, rows: int
) -> dict:
    where = f"stages.{name}"
    lay = make_layout(stage, ranks, where, arch, hw.on_gpu)
    rows_rank = math.ceil(rows / lay.dp / micro)
    mem = trainer_memory(arch, lay, rows_rank * seq_len, micro, hw.on_gpu, frozen_copies=_extra_forwards(stage), seq_len=seq_len)
    step = train_step(arch, lay, hw, tokens=tokens, seq_len=seq_len, micro_batches=micro, extra_forwards=_extra_forwards(stage))
    return {
        "role": "trainer",
        "ranks": ranks,
        "layout": lay.describe(),
        "dp": lay.dp,
        "memory": {"parts_gib": parts_gib(mem), "peak_phase": mem["peak_phase"], **_fit(mem["peak"], hw, where, "trainer")},
        "step": step,
        "_layout": lay,
    }


def _rollout(
    arch: Arch, hw: Hardware, where: str, *, engine: str, vllm, ranks: int, seqs: int, prompt: int, generate: int, batch: int
) -> dict:
    mem = rollout_memory(
        arch,
        engine=engine,
        device_bytes=(hw.device_memory_gib or 0) * GIB,
        seqs=batch,
        context=prompt + generate,
        vllm=vllm,
        on_gpu=hw.on_gpu,
    )
    tp = mem["tp"]
    if ranks % tp:
        raise UserError(f"{where}.vllm.tensor_parallel_size: {tp} does not divide the {ranks} rollout ranks")
    fit = _fit(mem["peak"], hw, where, f"rollout ({engine})")
    if mem.get("budget"):
        fit["fits"] = fit["fits"] and mem["peak"] <= mem["budget"]
        fit["vllm_budget_gib"] = gib(mem["budget"])
        fit["kv_tokens_room"] = mem["kv_tokens_room"]
        if mem["peak"] > mem["budget"] and "problem" not in fit:
            fit["problem"] = (
                f"{where}.vllm.gpu_memory_utilization: vLLM's share ({gib(mem['budget']):.1f} GiB) holds less than the weights, "
                f"KV cache for {mem['batch']} sequences and CUDA graphs ({gib(mem['peak']):.1f} GiB)"
            )
    d = decode(arch, hw, seqs=seqs, prompt=prompt, generate=generate, engines=max(1, ranks // tp), batch=mem["batch"], tp=tp)
    return {"role": "rollout", "ranks": ranks, "engine": engine, "memory": {"parts_gib": parts_gib(mem), **fit}, "decode": d}


def plan_stage(run, name: str, model_configs: dict) -> dict:
    stage = run.stages[name]
    kind = stage.kind
    site = run.site
    res = stage.resources
    units = _units(stage)
    rec: dict = {"name": name, "kind": kind, "units": units, "roles": [], "notes": []}
    comps = list(res.components.items())
    nodes = sum(c.nodes for _, c in comps) if comps else res.nodes
    rec["nodes"] = nodes
    rec["partition"] = (comps[0][1].partition if comps else res.partition) or site.default_partition
    basis = "walltime"
    hours = res.time_min / 60
    if kind in MODELLED:
        arch = stage_arch(run, name, model_configs)
        rec["model"] = arch.describe()
        if kind == "sft":
            hw = hardware(site, res.partition, res.tasks_per_node)
            ranks = res.nodes * res.tasks_per_node
            tokens = stage.batch_rows * stage.seq_len
            role = _trainer(
                run,
                name,
                stage,
                arch,
                hw,
                ranks,
                tokens=tokens,
                seq_len=stage.seq_len,
                micro=stage.micro_batches,
                rows=stage.batch_rows,
            )
            lay = role.pop("_layout")
            saves = (stage.steps // stage.save_every if stage.save_every else 0) + 1
            state = arch.total * lay.master_bytes * 3
            save_s = state / (hw.filesystem_gbps * 1e9)
            rec["roles"].append(role)
            rec["steps"] = stage.steps
            rec["step_s"] = role["step"]["step_s"]
            seconds = stage.steps * role["step"]["step_s"] + saves * save_s
            rec["checkpoints"] = {"count": saves, "each_s": save_s, "assumes": hw.assumption(compute=False, fs=True)}
            rec["notes"].append("the end-of-stage greedy check (eval_tasks) is not modelled")
        elif kind == "rl":
            seconds = _plan_rl(run, name, stage, arch, rec)
        else:
            seconds = _plan_sampling(run, name, stage, arch, rec)
        if seconds is not None:
            hours, basis = seconds / 3600, "model"
        else:
            rec["notes"].append("time not modelled (task count not known before the tasks stage runs): the walltime stands in")
    elif kind in GPU_KINDS:
        rec["notes"].append(f"{kind}: time not modelled: its walltime ({res.time_min} min) stands in, an upper bound")
    else:
        rec["notes"].append(f"CPU stage: its walltime ({res.time_min} min) stands in, an upper bound")
    rec["hours"] = hours
    rec["hours_basis"] = basis
    rec["jobs"] = sitecheck.jobs_for(stage, site, name, kind, hours, modelled=basis == "model")
    rec["queued_jobs"] = sitecheck.queued_jobs(stage, site, kind, units)
    # node-hours: modelled time of every unit (fan-out units each take the stage's time)
    node_hours = hours * nodes * units
    rec["node_hours"] = node_hours
    charges = []
    for part_name, n in [(c.partition or site.default_partition, c.nodes) for _, c in comps] or [(rec["partition"], nodes)]:
        cost = site.planner.partitions.get(part_name)
        if cost is None or cost.charge_per_node_hour is None:
            raise UserError(
                f"site {site.name}: key planner.partitions.{part_name}.charge_per_node_hour is not set; "
                f"stages.{name} runs there (docs/planning.md, 'Site fields')"
            )
        charges.append(hours * n * units * cost.charge_per_node_hour)
    rec["charge"] = sum(charges)
    return rec


def _plan_rl(run, name: str, stage, arch: Arch, rec: dict) -> float:
    res = stage.resources
    comps = list(res.components.items())
    where = f"stages.{name}"
    if comps:
        t_name, t_comp = comps[0]
        t_ranks = t_comp.nodes * t_comp.tasks_per_node
        r_comps = comps[1:]
        r_ranks = sum(c.nodes * c.tasks_per_node for _, c in r_comps)
        hw_t = hardware(run.site, t_comp.partition, t_comp.tasks_per_node)
        hw_r = hardware(run.site, r_comps[0][1].partition, r_comps[0][1].tasks_per_node) if r_comps else hw_t
    else:
        world = res.nodes * res.tasks_per_node
        t_ranks, r_ranks = (1, 1) if world == 1 else (1, world - 1)
        hw_t = hw_r = hardware(run.site, res.partition, res.tasks_per_node)
        if world == 1:
            rec["notes"].append("one process alternates both roles: its memory is the trainer's plus the engine's")
    seqs = stage.tasks_per_update * stage.attempts
    generate = min(stage.max_tokens * stage.max_turns, stage.max_total_tokens)
    prompt = max(1, stage.max_total_tokens - generate)
    tokens = seqs * stage.max_total_tokens  # an upper bound: every episode at max_total_tokens
    trainer = _trainer(run, name, stage, arch, hw_t, t_ranks, tokens=tokens, seq_len=stage.max_total_tokens, micro=1, rows=seqs)
    lay = trainer.pop("_layout")
    rec["roles"].append(trainer)
    batch = stage.vllm.max_num_seqs if stage.engine == "vllm" else stage.rollout_batch
    rollout = _rollout(
        arch,
        hw_r,
        where,
        engine=stage.engine,
        vllm=stage.vllm,
        ranks=r_ranks,
        seqs=seqs,
        prompt=prompt,
        generate=generate,
        batch=batch,
    )
    rec["roles"].append(rollout)
    storage = 2 if hw_t.on_gpu else 4
    engines = rollout["decode"]["engines"]
    tp = int(stage.vllm.tensor_parallel_size) if stage.engine == "vllm" and hw_r.on_gpu else 1
    ho = handoff(arch, hw_t, storage_bytes=storage, readers=engines)
    tr = transport(hw_t, seqs=seqs, tokens=stage.max_total_tokens)
    train_s, roll_s = trainer["step"]["step_s"], rollout["decode"]["rollout_s"]
    ho_s = ho["write_s"] + ho["read_s"]
    overlap = stage.lag >= 1
    update = (max(train_s, roll_s) if overlap else train_s + roll_s) + ho_s + tr["transport_s"]
    evals = (stage.updates // stage.eval_every) if stage.eval_every else 0
    eval_s = 0.0
    if evals and stage.eval_tasks:
        e = decode(
            arch,
            hw_r,
            seqs=stage.eval_tasks * stage.eval_attempts,
            prompt=prompt,
            generate=generate,
            engines=engines,
            batch=batch,
            tp=tp,
        )
        eval_s = evals * e["rollout_s"]
    rec["steps"] = stage.updates
    rec["step_s"] = update
    rec["update"] = {
        "train_s": train_s,
        "rollout_s": roll_s,
        "overlapped": overlap,
        "handoff": ho,
        "transport": tr,
        "update_s": update,
        "evals": evals,
        "eval_s": eval_s,
        "tokens_upper_bound": tokens,
    }
    rec["notes"].append(f"episodes counted at max_total_tokens={stage.max_total_tokens} (an upper bound)")
    rec["_trainer_layout"] = lay
    return stage.updates * update + eval_s


def _plan_sampling(run, name: str, stage, arch: Arch, rec: dict) -> float | None:
    res = stage.resources
    hw = hardware(run.site, res.partition, res.tasks_per_node)
    ranks = res.nodes * res.tasks_per_node
    if stage.kind == "probe":
        n = _task_count(run, stage.tasks, "train")
        if n is not None and stage.limit:
            n = min(n, stage.limit)
        generate, context, checkpoints = stage.max_turn_tokens * stage.max_turns, stage.max_context, 1
        batch = stage.vllm.max_num_seqs if stage.engine == "vllm" else stage.batch_size
    else:
        n = _task_count(run, stage.tasks, stage.split)
        if n is not None and stage.limit:
            n = min(n, stage.limit)
        generate, context = stage.max_tokens * stage.max_turns, stage.max_context
        checkpoints = max(1, len(stage.checkpoints))
        batch = stage.vllm.max_num_seqs if stage.engine == "vllm" else stage.batch_size
    generate = min(generate, context)
    prompt = max(1, context - generate)
    seqs = (n or 0) * stage.attempts * checkpoints
    role = _rollout(
        arch,
        hw,
        f"stages.{name}",
        engine=stage.engine,
        vllm=stage.vllm,
        ranks=ranks,
        seqs=max(1, seqs),
        prompt=prompt,
        generate=generate,
        batch=batch,
    )
    rec["roles"].append(role)
    if n is None:
        return None
    rec["steps"] = 1
    rec["step_s"] = role["decode"]["rollout_s"]
    return role["decode"]["rollout_s"]


def _expand(run) -> list[str]:
    return list(run.stages)


def make_plan(run, model_configs: dict | None = None, budget: float | None = None) -> dict:
    """The plan of a typed run config (RunConfig with a site). UserError for bad input (exit 2)."""
    if run.site is None:
        raise UserError("snowcat plan needs a site profile: --site NAME (or $SNOWCAT_SITE); its planner fields hold the hardware")
    site = run.site
    model_configs = model_configs or {}
    stages = []
    for name in _expand(run):
        rec = plan_stage(run, name, model_configs)
        rec.pop("_trainer_layout", None)
        stages.append(rec)
    problems = []
    for rec in stages:
        for role in rec["roles"]:
            if role["memory"].get("problem"):
                problems.append(role["memory"]["problem"])
        if rec["jobs"]["problem"]:
            problems.append(rec["jobs"]["problem"])
    queued: dict[str, int] = {}
    for rec in stages:
        queued[rec["partition"]] = queued.get(rec["partition"], 0) + rec["queued_jobs"]
    checks = sitecheck.submit_checks(site, queued)
    if site.max_submit_jobs is not None:
        total_q = sum(queued.values())
        checks.append(
            {
                "check": "jobs queued on the site",
                "ok": total_q <= site.max_submit_jobs,
                "detail": f"{total_q} jobs, limit {site.max_submit_jobs} (site profile {site.name}: max_submit_jobs)",
            }
        )
    node_rows = []
    for rec in stages:
        stage = run.stages[rec["name"]]
        comps = stage.resources.components
        if comps:
            for role, c in comps.items():
                node_rows.append((f"{rec['name']}.{role}", c.partition or site.default_partition, c.nodes))
        else:
            node_rows.append((rec["name"], rec["partition"], rec["nodes"]))
    checks += sitecheck.node_checks(site, node_rows)
    total_charge = sum(r["charge"] for r in stages)
    checks.append(sitecheck.budget_check(site, total_charge, budget))
    problems += [f"site {site.name}: {c['check']}: {c['detail']}" for c in checks if not c["ok"]]
    pl = site.planner
    return {
        "config": run.name,
        "site": site.name,
        "charge_unit": pl.charge_unit,
        "assumptions": {
            "mfu": pl.mfu,
            "bandwidth_efficiency": pl.bandwidth_efficiency,
            "memory_margin": pl.memory_margin,
            "filesystem_gbps": pl.filesystem_gbps,
            "communication": "not overlapped with compute",
            "sources": list(pl.sources),
            "unverified": list(pl.unverified),
        },
        "stages": stages,
        "total": {
            "hours": sum(r["hours"] for r in stages),
            "node_hours": sum(r["node_hours"] for r in stages),
            "charge": total_charge,
            "modelled_stages": [r["name"] for r in stages if r["hours_basis"] == "model"],
        },
        "checks": checks,
        "problems": problems,
        "fits": not problems,
    }
