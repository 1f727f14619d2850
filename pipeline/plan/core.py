"""The plan of a run: per stage and role, memory per device, time per step, stage time, node-hours
and charge, and the site's checks. Everything is a function of the resolved config and its site
profile; nothing is submitted or written."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from snowcat.pipeline.errors import UserError
from snowcat.stages.registry import KINDS
from snowcat.stages.taskgen import REPO_DOMAINS

from . import agent as agent_mod
from . import lengths as lengths_mod
from . import sitecheck
from .lengths import Inputs, Lengths
from .memory import GIB, gib, make_layout, parts_gib, rollout_memory, trainer_memory
from .model import Arch, stage_arch
from .timing import Hardware, Waves, decode, handoff, train_step, transport

# how each kind's time is counted, from the registry (stages/registry.py `plan`): modelled (steps,
# sampling, episodes); short beside a job's start (the site's job_start_s plus the kind's
# stage_work_s, or a size term below); the rest (validate: every imported task's verifier; prompts)
# keep their walltime, an upper bound
MODELLED = tuple(name for name, k in KINDS.items() if k.plan == "model")
SHORT = tuple(name for name, k in KINDS.items() if k.plan == "short")
REPO_FORMATS = ("swebench", "swegym", "r2egym", "swesmith", "harbor")  # imports whose tasks are repositories
QUICK_EVAL_BATCH = 128  # stages/rlcore/trainer.py: RL's quick eval samples at quick_eval's default batch


def hardware(site, partition: str | None, ranks_per_node: int = 1, backend: str | None = None) -> Hardware:
    """The planner's view of a partition (facts from `planner.partitions`, assumptions from `planner`).
    `backend`: a trainer's, whose own efficiency (`planner.backend_mfu`) replaces `mfu` where the site
    gives one."""
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
    mfu = pl.mfu
    if backend and pl.backend_mfu.get(backend):
        mfu = float(pl.backend_mfu[backend])
        if not 0 < mfu <= 1:
            raise UserError(f"site {site.name}: key planner.backend_mfu.{backend}: {mfu:g} is not in (0, 1]")
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
        mfu=mfu,
        mfu_of=f"backend {backend}" if mfu != pl.mfu or (backend and backend in pl.backend_mfu) else "",
        bandwidth_efficiency=pl.bandwidth_efficiency,
        memory_margin=pl.memory_margin,
        filesystem_gbps=pl.filesystem_gbps,
        ranks_per_node=ranks_per_node,
        decode_step_s=pl.decode_step_s,
        decode_token_s=pl.decode_token_s,
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


def _task_count(run, tasks_stage: str, split: str, inputs: Inputs | None = None, *, repo_only: bool = False) -> int | None:
    """Tasks of a split: the rows the tasks stage wrote when it is among the finished inputs, else as
    its config generates them (None: imported, not known before it runs). `repo_only`: repository
    tasks alone (what SFT's scripted expert plays)."""
    done = inputs.get(tasks_stage) if inputs is not None else None
    if done is not None and (done / f"{split}.parquet").is_file():
        import pyarrow.parquet as pq  # noqa: PLC0415 (only where a run is read)

        path = done / f"{split}.parquet"
        if not repo_only:
            return pq.ParquetFile(path).metadata.num_rows
        table = pq.read_table(path, columns=["verifier"]) if "verifier" in pq.read_schema(path).names else None
        return sum(v == "repo" for v in table.column("verifier").to_pylist()) if table is not None else None
    stage = run.stages.get(tasks_stage)
    if stage is None or stage.kind != "tasks":
        return None
    imports = [i for i in stage.imports if not repo_only or i.format in REPO_FORMATS]
    domains = {k: d for k, d in stage.generated().items() if not repo_only or k in REPO_DOMAINS}
    if split == "val":
        if imports and not any(i.val_count for i in imports) and not domains:
            return None
        # imports hold out by count (an upper bound: validation drops rows)
        return sum(i.val_count for i in imports) + sum(d.val_count for d in domains.values())
    imported = 0
    for imp in imports:  # the rows of the import files here, less those held out (an upper bound too)
        rows = import_rows(imp)
        if rows is None:
            return None
        imported += max(0, rows - imp.val_count)
    return imported + sum(d.count - d.val_count - d.dev_count for d in domains.values())


def import_rows(imp) -> int | None:
    """Rows of an import's file as it lies here (harbor: its task directories), counted without
    parsing them; None where it is not readable from here (the plan then says so)."""
    path = Path(imp.path)
    try:
        if imp.format == "harbor":
            return sum(1 for _ in path.glob("**/task.toml")) if path.is_dir() else None
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq  # noqa: PLC0415 (only where an import is planned)

            return pq.ParquetFile(path).metadata.num_rows
        if path.suffix == ".jsonl":
            with path.open("rb") as f:
                return sum(1 for line in f if line.strip())
        rows = json.loads(path.read_text())
        return len(rows) if isinstance(rows, list) else None
    except (OSError, ValueError):
        return None


def _extra_forwards(stage) -> int:
    """Forwards an RL update runs beside its step: the behaviour policy's logprobs under the
    weights that sampled the batch when they lag the trained ones (stages/rlcore/trainer.py
    `_add_behaviour_logprobs`), and a reference model's for a KL penalty."""
    return int(getattr(stage, "lag", 0) >= 1) + int(getattr(stage, "kl_coef", 0) > 0)


def _trainer(
    run,
    name: str,
    stage,
    arch: Arch,
    hw: Hardware,
    ranks: int,
    *,
    tokens: float,
    seq_len: int,
    micro: int,
    rows: int,
    step_seq_len: float | None = None,
) -> dict:
    """Memory at `seq_len` tokens a row (the limit: whether it fits), time for `tokens` at
    `step_seq_len` a row (RL: the padded length its batches are expected to have)."""
    where = f"stages.{name}"
    lay = make_layout(stage, ranks, where, arch, hw.on_gpu)
    rows_rank = math.ceil(rows / lay.dp / micro)
    mem = trainer_memory(arch, lay, rows_rank * seq_len, micro, hw.on_gpu, frozen_copies=_extra_forwards(stage), seq_len=seq_len)
    step_len = round(step_seq_len) if step_seq_len else seq_len
    step = train_step(arch, lay, hw, tokens=tokens, seq_len=step_len, micro_batches=micro, extra_forwards=_extra_forwards(stage))
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
    arch: Arch,
    hw: Hardware,
    where: str,
    *,
    engine: str,
    vllm,
    ranks: int,
    seqs: int,
    prompt: int,
    generate: int,
    batch: int,
    waves: Callable[[int], Waves],
) -> dict:
    """Memory at the limits (`prompt` + `generate` tokens for `batch` sequences); sampling time for
    the `waves(batch)` the engine's batch gives."""
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
    d = decode(arch, hw, waves(mem["batch"]), engines=max(1, ranks // tp), tp=tp)
    return {"role": "rollout", "ranks": ranks, "engine": engine, "memory": {"parts_gib": parts_gib(mem), **fit}, "decode": d}


def _nodes(stage) -> int:
    comps = stage.resources.components
    return sum(c.nodes for c in comps.values()) if comps else stage.resources.nodes


def plan_stage(run, name: str, model_configs: dict, inputs: Inputs | None = None) -> dict:
    """One stage's plan. `inputs`: what a run recorded before the stage started (None: a plan of
    the config, nothing has run)."""
    stage = run.stages[name]
    kind = stage.kind
    site = run.site
    res = stage.resources
    units = _units(stage)
    rec: dict = {"name": name, "kind": kind, "units": units, "roles": [], "notes": []}
    comps = list(res.components.items())
    nodes = _nodes(stage)
    rec["nodes"] = nodes
    rec["partition"] = (comps[0][1].partition if comps else res.partition) or site.default_partition
    seconds = _work_seconds(run, name, stage, model_configs, inputs, rec)
    basis, hours = ("model", seconds / 3600) if seconds is not None else ("walltime", res.time_min / 60)
    if basis == "model":
        hours = _with_job_starts(stage, site, name, kind, seconds, rec)
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


def _work_seconds(run, name: str, stage, model_configs: dict, inputs: Inputs | None, rec: dict) -> float | None:
    """Seconds of the stage's own work (None: not modelled, its walltime stands in)."""
    kind = stage.kind
    if kind == "teacher" and stage.endpoint.url:
        rec["notes"].append(
            "teacher: an endpoint samples it (at the service's speed, not this site's): its walltime stands in, an upper bound"
        )
        return None
    if kind in MODELLED:
        arch = stage_arch(run, name, model_configs)
        rec["model"] = arch.describe()
        if kind == "sft":
            seconds = _plan_sft(run, name, stage, arch, rec, inputs)
        elif kind == "rl":
            seconds = _plan_rl(run, name, stage, arch, rec, inputs)
        elif kind == "teacher":
            seconds = _plan_teacher(run, name, stage, arch, rec, inputs)
        else:
            seconds = _plan_sampling(run, name, stage, arch, rec, inputs)
        if seconds is None:
            rec["notes"].append("time not modelled (task count not known before the tasks stage runs): the walltime stands in")
        return seconds
    if kind in SHORT:
        return _plan_short(run, name, stage, rec, model_configs)
    what = "its verifier runs are" if kind == "validate" else "its time is"
    rec["notes"].append(f"{kind}: {what} not modelled: its walltime ({stage.resources.time_min} min) stands in, an upper bound")
    return None


def _with_job_starts(stage, site, name: str, kind: str, seconds: float, rec: dict) -> float:
    """Hours of the stage's work plus the site's start cost for each of its jobs (a walltime
    continuation starts again)."""
    start = site.planner.job_start_s
    jobs = sitecheck.jobs_for(stage, site, name, kind, (seconds + start) / 3600)["jobs"]
    rec["job_start"] = {"jobs": jobs, "each_s": start, "assumes": f"job_start_s {start:g} s (site {site.name})"}
    return (seconds + jobs * start) / 3600


def _plan_sft(run, name: str, stage, arch: Arch, rec: dict, inputs: Inputs | None) -> float:
    site = run.site
    res = stage.resources
    hw = hardware(site, res.partition, res.tasks_per_node, backend=stage.backend)
    ranks = res.nodes * res.tasks_per_node
    tokens = stage.batch_rows * stage.seq_len
    role = _trainer(
        run, name, stage, arch, hw, ranks, tokens=tokens, seq_len=stage.seq_len, micro=stage.micro_batches, rows=stage.batch_rows
    )
    lay = role.pop("_layout")
    saves = (stage.steps // stage.save_every if stage.save_every else 0) + 1
    state = arch.total * lay.master_bytes * 3
    save_s = state / (hw.filesystem_gbps * 1e9)
    rec["roles"].append(role)
    rec["steps"] = stage.steps
    rec["step_s"] = role["step"]["step_s"]
    rec["checkpoints"] = {"count": saves, "each_s": save_s, "assumes": hw.assumption(compute=False, fs=True)}
    rec["notes"].append("the end-of-stage greedy check (eval_tasks) is not modelled")
    return stage.steps * role["step"]["step_s"] + saves * save_s + _expert_seconds(run, stage, rec, inputs)


def _expert_seconds(run, stage, rec: dict, inputs: Inputs | None) -> float:
    """SFT demonstrates each repository task of its train split by the scripted expert before it
    trains (stages/sft.py `teacher_demos`): real tool calls and a verification in sandboxes, side
    by side over the job's cores, with no engine beside them."""
    tasks = _task_count(run, stage.tasks_input, "train", inputs, repo_only=True)
    if tasks:
        _note_imported(run, stage.tasks_input, "train", tasks, inputs, rec)
    if tasks is None:
        rec["notes"].append("imported repository tasks, not counted yet: the scripted expert's demonstrations are left out")
        return 0.0
    if not tasks:
        return 0.0
    site = run.site
    env = agent_mod.expert_seconds(site, tasks, agent_mod.workers(site, stage.resources.partition))
    rec["expert"] = env
    return env["env_s"]


def _plan_short(run, name: str, stage, rec: dict, model_configs: dict) -> float:
    """A short stage: the kind's own work as the site measured it (`stage_work_s`), plus for an
    export the model's bytes through the filesystem (written, then read back by the check)."""
    pl = run.site.planner
    work = float(pl.stage_work_s.get(stage.kind, 0.0))
    parts = {"work_s": work}
    if stage.kind == "export":
        try:
            arch = stage_arch(run, name, model_configs)
        except UserError as e:  # the model's size is not known here: the export's bytes are left out
            rec["notes"].append(f"the exported bytes are not counted: {e}")
        else:
            rec["model"] = arch.describe()
            size = arch.total * (2 if stage.dtype in ("bfloat16", "float16") else 4)
            parts["bytes_s"] = 2 * size / (pl.filesystem_gbps * 1e9)
    rec["work"] = parts | {"assumes": f"stage_work_s.{stage.kind} {work:g} s (site {run.site.name})"}
    if stage.kind not in pl.stage_work_s:
        rec["notes"].append(
            f"site {run.site.name} gives no stage_work_s.{stage.kind}: its work counts as nothing beside the job's start"
        )
    if stage.kind == "tasks" and stage.imports:
        rec["notes"].append("imported tasks: their download and conversion are not modelled")
    if stage.kind == "prestage":
        rec["notes"].append("the artefacts' downloads are not modelled (their sizes are not known before)")
    return sum(parts.values())


def _dev_split(run, tasks_stage: str) -> str:
    """The split RL's quick eval samples (stages/taskgen selection_split): dev when the tasks stage
    holds one out."""
    stage = run.stages.get(tasks_stage)
    generated = stage.generated() if stage is not None and stage.kind == "tasks" else {}
    return "dev" if any(d.dev_count for d in generated.values()) else "val"


def _quick_evals(stage) -> int:
    """RL's quick evals: the initial model's, every eval_every updates and the last (stages/train/loop.py)."""
    if not (stage.eval_every and stage.eval_tasks):
        return 0
    return 1 + stage.updates // stage.eval_every + int(stage.updates % stage.eval_every != 0)


def _quick_eval_lengths(run, stage, inputs: Inputs | None, domains: int) -> Lengths:
    """The held-out tasks RL's quick eval samples: eval_tasks over the domains, the first of each
    (stages/rl.py load_pool), through the evaluate stage's reader."""
    split = _dev_split(run, stage.tasks_input)
    per = max(1, stage.eval_tasks // max(1, domains))
    view = _EvalView(stage.max_tokens, stage.max_turns, stage.max_total_tokens, stage.env, stage.tasks_input, split, 0)
    return lengths_mod.eval_lengths(
        run, view, stage.init_from, inputs, stage.eval_tasks, pick=lambda ts: _first_per_domain(ts, per)
    )


def _first_per_domain(tasks: list, per: int) -> list:
    by: dict[str, list] = {}
    for t in tasks:
        by.setdefault(t.domain, []).append(t)
    return [t for d in sorted(by) for t in by[d][:per]]


@dataclass(frozen=True)
class _EvalView:
    """The keys `lengths.eval_lengths` reads, for RL's quick eval."""

    max_tokens: int
    max_turns: int
    max_context: int
    env: str
    tasks: str
    split: str
    limit: int


def _plan_rl(run, name: str, stage, arch: Arch, rec: dict, inputs: Inputs | None) -> float:
    res = stage.resources
    comps = list(res.components.items())
    where = f"stages.{name}"
    if comps:
        t_name, t_comp = comps[0]
        t_ranks = t_comp.nodes * t_comp.tasks_per_node
        r_comps = comps[1:]
        r_ranks = sum(c.nodes * c.tasks_per_node for _, c in r_comps)
        hw_t = hardware(run.site, t_comp.partition, t_comp.tasks_per_node, backend=stage.backend)
        r_part = r_comps[0][1].partition if r_comps else t_comp.partition
        hw_r = hardware(run.site, r_part, r_comps[0][1].tasks_per_node if r_comps else t_comp.tasks_per_node)
    else:
        world = res.nodes * res.tasks_per_node
        t_ranks, r_ranks = (1, 1) if world == 1 else (1, world - 1)
        hw_t = hardware(run.site, res.partition, res.tasks_per_node, backend=stage.backend)
        hw_r = hardware(run.site, res.partition, res.tasks_per_node)
        r_part = res.partition
        if world == 1:
            rec["notes"].append("one process alternates both roles: its memory is the trainer's plus the engine's")
    seqs = stage.tasks_per_update * stage.attempts
    generate = min(stage.max_tokens * stage.max_turns, stage.max_total_tokens)
    prompt = max(1, stage.max_total_tokens - generate)
    episodes = lengths_mod.rl_lengths(run, stage, inputs)
    padded = lengths_mod.padded_length(episodes, stage.tasks_per_update, stage.attempts)
    tokens = seqs * padded  # every row padded to the batch's longest episode
    trainer = _trainer(
        run,
        name,
        stage,
        arch,
        hw_t,
        t_ranks,
        tokens=tokens,
        seq_len=stage.max_total_tokens,
        micro=1,
        rows=seqs,
        step_seq_len=padded,
    )
    lay = trainer.pop("_layout")
    rec["roles"].append(trainer)
    engine = _engine(run, stage)
    batch = stage.vllm.max_num_seqs if engine == "vllm" else stage.rollout_batch
    multi = stage.env != "single"
    profile = _profile(run, stage, stage.init_from, inputs, stage.max_turns, stage.max_tokens) if multi else None
    rollout = _rollout(
        arch,
        hw_r,
        where,
        engine=engine,
        vllm=stage.vllm,
        ranks=r_ranks,
        seqs=seqs,
        prompt=prompt,
        generate=generate,
        batch=batch,
        waves=(
            (lambda b: _agent_waves(profile, seqs, min(b, stage.rollout_batch), prompt))
            if multi
            else (lambda b: lengths_mod.drawn_waves(episodes, stage.tasks_per_update, stage.attempts, b))
        ),
    )
    rec["roles"].append(rollout)
    env_s = 0.0
    if multi:  # the rollout's episodes: tool calls and verifications between its decode steps (per batch)
        engines_ = rollout["decode"]["engines"]
        per_engine = math.ceil(seqs / engines_)
        env_s = _agent_time(
            run,
            rec,
            [(stage.init_from, profile, per_engine)],
            batch=min(batch, stage.rollout_batch, per_engine),
            partition=r_part,
        )
    reload_s = run.site.planner.engine_reload_s  # each weight version the rollout serves after its first
    storage = 2 if hw_t.on_gpu else 4
    engines = rollout["decode"]["engines"]
    ho = handoff(arch, hw_t, storage_bytes=storage, readers=engines)
    tr = transport(hw_t, seqs=seqs, tokens=padded)
    train_s, roll_s = trainer["step"]["step_s"], rollout["decode"]["rollout_s"] + env_s + reload_s
    ho_s = ho["write_s"] + ho["read_s"]
    overlap = stage.lag >= 1
    update = (max(train_s, roll_s) if overlap else train_s + roll_s) + ho_s + tr["transport_s"]
    evals = _quick_evals(stage)
    eval_s, held_out = 0.0, None
    if evals:
        domains = len({t.domain for t in episodes.tasks}) if not episodes.upper_bound else 1
        held_out = _quick_eval_lengths(run, stage, inputs, domains)
        waves = lengths_mod.ordered_waves(held_out, stage.eval_attempts, QUICK_EVAL_BATCH)
        eval_s = evals * decode(arch, hw_t, waves, engines=1, tp=1)["rollout_s"]  # rank 0 samples with the trained model
    rec["steps"] = stage.updates
    rec["step_s"] = update
    rec["update"] = {
        "train_s": train_s,
        "rollout_s": roll_s,
        "env_s": env_s,
        "engine_reload_s": reload_s,
        "overlapped": overlap,
        "handoff": ho,
        "transport": tr,
        "update_s": update,
        "evals": evals,
        "eval_s": eval_s,
        "padded_tokens_per_row": round(padded, 1),
        "tokens": round(tokens),
    }
    rec["lengths"] = [episodes.describe() | {"for": "updates"}]
    if held_out is not None:
        rec["lengths"].append(held_out.describe() | {"for": "quick eval"})
    _length_notes(rec)
    rec["_trainer_layout"] = lay
    # the first batch is sampled by a started engine, every later one after a weight version's load;
    # with lag the last batch's training follows its sampling, overlapped with nothing
    tail = train_s if overlap and stage.updates else 0.0
    start = run.site.planner.rl_start_s
    rec["start"] = {"each_s": start, "assumes": f"rl_start_s {start:g} s (site {run.site.name})"}
    if not start:
        rec["notes"].append(f"site {run.site.name} gives no rl_start_s: the MPI world's and trainer's start count as nothing")
    updates = stage.updates * update + eval_s + _engine_starts(run, rec, 1) - (reload_s if stage.updates else 0.0)
    return start + updates + tail


def _length_notes(rec: dict) -> None:
    """One note per distinct source of the stage's lengths, naming what it is for."""
    by_source: dict[str, list[str]] = {}
    for item in rec.get("lengths", []):
        by_source.setdefault(item["source"], []).append(item["for"])
    for source, what in by_source.items():
        rec["notes"].append(f"lengths ({', '.join(what)}): {source}")


def _sampling_refs(stage) -> list[str]:
    if stage.kind == "probe":
        return [stage.checkpoint]
    return [str(r) for r in stage.checkpoints] or [str(c) for c in stage.fan_out.get("checkpoint", [])][:1]


def _sampled_tasks(run, stage, split: str, inputs: Inputs | None, rec: dict) -> int | None:
    """How many tasks a sampling stage plays: its split's (from the finished tasks stage, else the
    generated config, or for imported tasks the import files' rows, val: their `val_count`), at most
    `limit`; imported tasks whose files are not readable here: `limit` as an upper bound where there
    is one (None: not known)."""
    n = _task_count(run, stage.tasks, split, inputs)
    if n is not None:
        _note_imported(run, stage.tasks, split, n, inputs, rec)
    if n is None and stage.limit:
        rec["notes"].append(f"imported tasks, not counted yet: limit {stage.limit} stands in for their count (an upper bound)")
        return stage.limit
    return min(n, stage.limit) if n is not None and stage.limit else n


def _note_imported(run, tasks_stage: str, split: str, n: int, inputs: Inputs | None, rec: dict) -> None:
    """Say where a count of imported tasks came from before the tasks stage ran (an upper bound)."""
    tasks = run.stages.get(tasks_stage)
    if tasks is None or not tasks.imports or (inputs is not None and inputs.get(tasks_stage) is not None):
        return
    where = "the imports' val_count" if split == "val" else "the import files' rows less val_count"
    rec["notes"].append(f"imported tasks, not counted yet: {where} ({n}) stands in (an upper bound: validation drops rows)")


def _engine(run, stage) -> str:
    return run.site.rollout_engine if stage.engine == "auto" else stage.engine


def _engine_starts(run, rec: dict, builds: int) -> float:
    """Seconds of `builds` sampling engines built one after another in a stage's process: the first
    the site's engine_start_s (the engine's imports too), each later one engine_reload_s (a build
    with everything imported, as a weight version's rebuild is)."""
    pl = run.site.planner
    rec["engine"] = {
        "builds": builds,
        "first_s": pl.engine_start_s,
        "later_s": pl.engine_reload_s,
        "assumes": f"engine_start_s {pl.engine_start_s:g} s, engine_reload_s {pl.engine_reload_s:g} s (site {run.site.name})",
    }
    return (pl.engine_start_s + (builds - 1) * pl.engine_reload_s) if builds else 0.0


def _profile(run, stage, ref: str, inputs: Inputs | None, max_turns: int, max_turn_tokens: int) -> agent_mod.Profile:
    """What an episode of `stage` (a multi-turn env) played by checkpoint `ref` does: as a finished
    input played the same env, else as the demonstrations `ref` was trained on, else the upper bound."""
    if inputs is None:
        return agent_mod.upper_bound(max_turns, max_turn_tokens, "a plan of the config (nothing has run)")
    for kind in ("rl", "evaluate", "probe"):
        for other in inputs.of_kind(kind):
            where = inputs.get(other) / "trajectories"
            if run.stages[other].env == stage.env and where.is_dir():
                if found := agent_mod.from_episodes(where, max_turns, max_turn_tokens):
                    return found
    sft = lengths_mod._trained_on_demonstrations(run, ref)
    if sft is not None and inputs.get(sft) is not None:
        tok = lengths_mod.tokenizer(lengths_mod.checkpoint_dir(inputs, ref))
        if found := agent_mod.from_demonstrations(inputs.get(sft) / "teacher_demos.json", tok, max_turns, max_turn_tokens):
            return found
    return agent_mod.upper_bound(
        max_turns,
        max_turn_tokens,
        f"no finished input played env {stage.env}, and {ref} was not trained on the expert's episodes",
    )


def _agent_waves(profile: agent_mod.Profile, episodes: int, batch: int, prompt: int) -> Waves:
    """The waves of `episodes` multi-turn episodes, `batch` at a time: each wave decodes the longest
    turn of its episodes, turn after turn (the profile's `wave_steps`)."""
    batch = max(1, min(batch, episodes))
    count = math.ceil(episodes / batch)
    return Waves(
        sequences=episodes,
        batch=batch,
        count=count,
        prefill_tokens=episodes * prompt,
        steps=count * profile.wave_steps,
        sampled=episodes * profile.response,
        context=prompt + profile.response / 2,
    )


def _agent_time(run, rec: dict, profiles: list[tuple[str, agent_mod.Profile, int]], *, batch: int, partition) -> float:
    """The environment's seconds for `profiles` ((checkpoint, profile, episodes) each), recorded."""
    site = run.site
    workers = agent_mod.workers(site, partition)
    out, total = [], 0.0
    for ref, prof, episodes in profiles:
        env = agent_mod.env_seconds(site, prof, episodes=episodes, wave=batch, workers_=workers)
        total += env["env_s"]
        out.append(env | {"for": ref, "profile": prof.describe()})
    rec["agent"] = out
    sources = {p.source for _, p, _ in profiles}
    rec["notes"] += [f"agent episodes: {src}" for src in sorted(sources)]
    if not agent_mod.known(site):
        rec["notes"].append(
            f"site {site.name} gives no tool-call, verification or sandbox costs: the environment counts as nothing"
        )
    return total


def _plan_sampling(run, name: str, stage, arch: Arch, rec: dict, inputs: Inputs | None) -> float | None:
    res = stage.resources
    hw = hardware(run.site, res.partition, res.tasks_per_node)
    ranks = res.nodes * res.tasks_per_node
    probe = stage.kind == "probe"
    n = _sampled_tasks(run, stage, "train" if probe else stage.split, inputs, rec)
    per_turn = stage.max_turn_tokens if probe else stage.max_tokens
    generate = min(per_turn * stage.max_turns, stage.max_context)
    prompt = max(1, stage.max_context - generate)
    engine = _engine(run, stage)
    batch = stage.vllm.max_num_seqs if engine == "vllm" else stage.batch_size
    refs = _sampling_refs(stage)
    if stage.env != "single" and n is not None:
        return _plan_episodes(
            run,
            name,
            stage,
            arch,
            rec,
            inputs,
            hw=hw,
            ranks=ranks,
            refs=refs,
            tasks=n,
            per_turn=per_turn,
            prompt=prompt,
            batch=min(batch, stage.batch_size),  # the agent loop plays batch_size episodes at a time (stages/scoring.py)
        )
    if probe:
        per_ref = [lengths_mod.probe_lengths(run, stage, inputs, n or 1)]
    else:
        per_ref = [lengths_mod.eval_lengths(run, stage, ref, inputs, n or 1) for ref in refs]
    known = n is not None or all(e.counted for e in per_ref)  # the tasks it samples, or at least how many
    role = _rollout(
        arch,
        hw,
        f"stages.{name}",
        engine=stage.engine,
        vllm=stage.vllm,
        ranks=ranks,
        seqs=max(1, (n or 0) * stage.attempts * len(refs)),
        prompt=prompt,
        generate=generate,
        batch=batch,
        waves=lambda b: _combined([lengths_mod.ordered_waves(e, stage.attempts, b) for e in per_ref]),
    )
    rec["roles"].append(role)
    if not known:
        return None
    rec["lengths"] = [e.describe() | {"for": ref} for e, ref in zip(per_ref, refs)]
    _length_notes(rec)
    rec["steps"] = 1
    rec["step_s"] = role["decode"]["rollout_s"]
    return role["decode"]["rollout_s"] + _engine_starts(run, rec, len(refs))


def _plan_episodes(
    run,
    name: str,
    stage,
    arch: Arch,
    rec: dict,
    inputs: Inputs | None,
    *,
    hw: Hardware,
    ranks: int,
    refs: list[str],
    tasks: int,
    per_turn: int,
    prompt: int,
    batch: int,
) -> float:
    """A sampling stage in a multi-turn env (evaluate, probe, teacher): per checkpoint an engine's
    start, its waves' decode steps, and the environment's tool calls and verifications."""
    engine = _engine(run, stage)
    episodes = max(1, tasks * stage.attempts)
    profiles = [(ref, _profile(run, stage, ref, inputs, stage.max_turns, per_turn), episodes) for ref in refs]
    generate = min(per_turn * stage.max_turns, stage.max_context)
    role = _rollout(
        arch,
        hw,
        f"stages.{name}",
        engine=engine,
        vllm=stage.vllm,
        ranks=ranks,
        seqs=episodes * len(refs),
        prompt=prompt,
        generate=generate,
        batch=batch,
        waves=lambda b: _combined([_agent_waves(p, e, b, prompt) for _, p, e in profiles]),
    )
    rec["roles"].append(role)
    env_s = _agent_time(run, rec, profiles, batch=min(batch, episodes), partition=stage.resources.partition)
    rec["steps"] = 1
    rec["step_s"] = role["decode"]["rollout_s"] + env_s
    rec["tasks"] = tasks
    return rec["step_s"] + _engine_starts(run, rec, len(refs))


def _plan_teacher(run, name: str, stage, arch: Arch, rec: dict, inputs: Inputs | None) -> float | None:
    """A teacher stage: its checkpoint plays its share of the training tasks (`shard` of the
    fan-out), `attempts` episodes each, as a sampling stage does."""
    res = stage.resources
    hw = hardware(run.site, res.partition, res.tasks_per_node)
    n = _sampled_tasks(run, stage, "train", inputs, rec)
    if n is None:
        return None
    shards = len(stage.fan_out.get("shard", [])) or 1
    share = math.ceil(n / shards)
    if shards > 1:
        rec["notes"].append(f"each of the {shards} shards plays {share} of the {n} tasks")
    prompt = max(1, stage.max_context - min(stage.max_turn_tokens * stage.max_turns, stage.max_context))
    engine = _engine(run, stage)
    batch = stage.vllm.max_num_seqs if engine == "vllm" else stage.batch_size
    if stage.student:
        rec["notes"].append("Relay: the student's turns are counted as the teacher's (one engine)")
    return _plan_episodes(
        run,
        name,
        stage,
        arch,
        rec,
        inputs,
        hw=hw,
        ranks=res.nodes * res.tasks_per_node,
        refs=[str(stage.teacher)],
        tasks=share,
        per_turn=stage.max_turn_tokens,
        prompt=prompt,
        batch=min(batch, stage.batch_size),
    )


def _combined(waves: list[Waves]) -> Waves:
    """Several checkpoints' waves, one after the other."""
    seqs = sum(w.sequences for w in waves)
    return Waves(
        sequences=seqs,
        batch=max(w.batch for w in waves),
        count=sum(w.count for w in waves),
        prefill_tokens=sum(w.prefill_tokens for w in waves),
        steps=sum(w.steps for w in waves),
        sampled=sum(w.sampled for w in waves),
        context=sum(w.context * w.sequences for w in waves) / seqs if seqs else 0.0,
    )


def _expand(run) -> list[str]:
    return list(run.stages)


def make_plan(
    run,
    model_configs: dict | None = None,
    budget: float | None = None,
    inputs: Callable[[str], Inputs] | None = None,
) -> dict:
    """The plan of a typed run config (RunConfig with a site). `inputs(stage)`: what a run had
    recorded before that stage started (`lengths.inputs_of`); None: a plan of the config alone.
    UserError for bad input (exit 2)."""
    if run.site is None:
        raise UserError("snowcat plan needs a site profile: --site NAME (or $SNOWCAT_SITE); its planner fields hold the hardware")
    site = run.site
    model_configs = model_configs or {}
    stages = []
    for name in _expand(run):
        rec = plan_stage(run, name, model_configs, inputs(name) if inputs else None)
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
            "job_start_s": pl.job_start_s,
            "decode_step_s": pl.decode_step_s,
            "decode_token_s": pl.decode_token_s,
            "stage_work_s": dict(pl.stage_work_s),
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
            "lengths": "read from the run's finished inputs" if inputs else "upper bound: a plan of the config, nothing has run",
        },
        "checks": checks,
        "problems": problems,
        "fits": not problems,
    }
