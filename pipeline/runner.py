"""Run one unit of a stage in this process: `python -m snowcat.stages RUN_DIR STAGE [--item I]`.

Everything comes from the run directory, so the same command runs a stage under the local
executor, inside a Slurm job (or array element, or hetjob step), or by hand. Rank 0 records the
outcome; a done unit whose outputs still verify is skipped, so re-running is always safe.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import random
import sys
import time
import traceback
from pathlib import Path

import numpy as np
from submitit.slurm.slurm import _parse_node_list

from . import config as config_mod
from . import procid, provenance, sweep, tracking
from .context import PREEMPTED_EXIT_CODE, Preempted, StageContext
from .dag import StageNode, Unit, build
from .errors import UserError
from .fsio import remove_leftovers
from .logscrub import scrubbed_output
from .offline import prepare
from .rundir import RunDir, now

_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")
_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")


def _first_int(names: tuple[str, ...], default: int) -> int:
    for name in names:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return default


def launcher_rank() -> int:
    """This process's rank as the MPI launcher numbers it (srun, mpirun, ibrun): under TACC's `ibrun`
    every rank sees SLURM_PROCID=0, so the MPI variables come first."""
    return _first_int(_RANK_VARS, 0)


def rank_and_role(node: StageNode) -> tuple[int, int, str | None]:
    """(rank, world size, role). Roles follow the order of `resources.components`: the first
    component's ranks come first, as in `srun --het-group=0,1` and in the local mpirun layout."""
    rank = launcher_rank()
    world = _first_int(_SIZE_VARS, 1)
    components = node.config.resources.components
    if not components:
        return rank, world, None
    het_size = os.environ.get("SLURM_HET_SIZE")
    if het_size and int(het_size) != len(components):
        raise RuntimeError(f"stage {node.name}: Slurm says {het_size} hetjob components, the config declares {len(components)}")
    start = 0
    for group, (name, comp) in enumerate(components.items()):
        size = comp.nodes * comp.tasks_per_node
        if rank < start + size:
            _check_het_group(node.name, group, str(name))
            return rank, world, str(name)
        start += size
    raise RuntimeError(f"rank {rank} is beyond the {start} ranks of stage {node.name}'s components")


def _check_het_group(stage: str, group: int, role: str) -> None:
    """In a hetjob step ranks come in component order; confirm this rank runs on its component's nodes."""
    nodelist = os.environ.get(f"SLURM_JOB_NODELIST_HET_GROUP_{group}")
    host = os.environ.get("SLURMD_NODENAME")
    if not nodelist or not host:
        return

    if host not in _parse_node_list(nodelist):
        raise RuntimeError(f"stage {stage}: rank for role {role} runs on {host}, outside hetjob group {group} ({nodelist})")


def make_context(run: RunDir, node: StageNode, unit: Unit, cfg) -> StageContext:
    rank, world, role = rank_and_role(node)
    run_config = config_mod.typed(cfg)
    item = None if unit.index is None else node.items[unit.index]
    return StageContext(
        name=node.name,
        kind=node.kind,
        config=run_config.stages[node.name] if item is None else config_mod.unit_config(cfg, node.name, item),
        run_config=run_config,
        run_dir=run.path,
        out_dir=run.unit_dir(unit),
        inputs={need: run.stage_dir(need) for need in node.needs},
        # a sweep's variants share the seed (common random numbers); replicas differ by theirs
        seed=config_mod.stage_seed(cfg.seed, node.name, sweep.replica_index(node.config.fan_out, item)),
        item=item,
        item_index=unit.index,
        rank=rank,
        world_size=world,
        role=role,
        local_rank=_first_int(("OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"), 0),
    )


def _job_fields() -> dict:
    job = os.environ.get("SLURM_JOB_ID")
    fields = {"host": os.uname().nodename, "process": procid.identify()}
    if job:
        fields |= {"slurm_job_id": job, "node": os.environ.get("SLURMD_NODENAME", fields["host"])}
    return fields


def seed_global_generators(seed: int) -> None:
    """Python's and numpy's global generators, seeded from the unit's seed. Stages draw from their own
    generators, but checkpoints record these states too; unseeded, every checkpoint differed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)


def run_unit(run_dir: str | Path, stage: str, index: int | None = None, lock_wait_s: float = 0) -> int:
    """Run one unit; `lock_wait_s` > 0 waits that long for another runner of the unit to exit (a
    scheduler job whose predecessor is still being killed) instead of refusing at once (by hand)."""
    if not faulthandler.is_enabled():  # a rank that dies in C code (MPI, torch) leaves its Python stack in its log
        faulthandler.enable()
    run = RunDir.open(run_dir)
    cfg = run.config()
    dag = build(cfg)
    if stage not in dag.nodes:
        raise UserError(f"{run.path}: no stage {stage!r} in this run")
    node = dag[stage]
    unit = Unit(stage, index)
    if (index is None) != (node.items is None) or (index is not None and not 0 <= index < len(node.items)):
        raise UserError(f"stage {stage}: item {index} does not match its fan-out")
    rank, world, _ = rank_and_role(node)
    with run.unit_lock(unit, rank, lock_wait_s):  # nothing of the unit is read or written before it is ours
        if world == 1:
            remove_leftovers(run.unit_dir(unit))  # multi-rank units: the driver does it (ranks start together)
        return _run_locked(run, cfg, dag, node, unit)


def _run_locked(run: RunDir, cfg, dag, node: StageNode, unit: Unit) -> int:
    missing = [n for n in node.needs if not all(run.is_done(u) for u in dag[n].units)]
    if missing:  # e.g. a Slurm dependent released by `afterany` after its input's chain gave up
        print(f"[snowcat] {unit.key}: input stage(s) {', '.join(missing)} not done; not starting", file=sys.stderr, flush=True)
        run.update_stage(unit.key, status="failed", error=f"inputs not done: {', '.join(missing)}")
        return 1
    if run.is_done(unit) and not run.verify_unit(unit):
        stale = run.stale_inputs(dag, unit)
        if stale:  # set aside by `resume` (once, under the driver lock), not by every rank of a job
            raise UserError(
                f"{unit.key}: done, but input(s) {', '.join(stale)} changed since; "
                f"`snowcat resume {run.path}` sets its old outputs aside and re-runs it"
            )
        print(f"[snowcat] {unit.key}: already done, outputs verified; nothing to do", flush=True)
        return 0
    run.clear_done(unit)
    inputs = run.input_digests(dag, unit.stage)  # what this unit reads: its lineage in the DONE marker

    ctx = make_context(run, node, unit, cfg)
    ctx.signal.install()
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    lead = ctx.rank == 0
    if lead:
        run.update_stage(unit.key, status="running", started=now(), **_job_fields())
    else:
        provenance.record_rank(run, unit, ctx)
    print(f"[snowcat] {unit.key} ({node.kind}) rank {ctx.rank}/{ctx.world_size} role={ctx.role} starts", flush=True)
    t0 = time.monotonic()
    seed_global_generators(ctx.seed)
    try:
        ctx.staged = prepare(ctx)  # offline checks fail fast, naming what was not staged
        metrics = config_mod.stage_module(node.kind).run(ctx) or {}
    except Preempted:
        if lead:
            run.update_stage(unit.key, status="preempted", ended=now())
            tracking.after_unit(run, node, unit, ctx.run_config)  # what it recorded so far; never raises
        print(f"[snowcat] {unit.key}: checkpointed before the end of the job; continue with the next one", flush=True)
        return PREEMPTED_EXIT_CODE
    except UserError as e:  # bad input the stage found (a row without its answer): one line, as the CLI says it
        if lead:
            run.update_stage(unit.key, status="failed", ended=now(), error=f"UserError: {e}"[:500])
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:
        traceback.print_exc()
        if lead:
            run.update_stage(unit.key, status="failed", ended=now(), error=f"{type(e).__name__}: {e}"[:500])
        return 1
    if lead:
        metrics = {"duration_s": round(time.monotonic() - t0, 3), **metrics}
        provenance.record_unit(run, unit, ctx)
        run.mark_done(unit, metrics, inputs)
        run.update_stage(unit.key, status="done", ended=now(), error=None)
        tracking.after_unit(run, node, unit, ctx.run_config)  # trackers are fed from the run directory; never raises
    print(f"[snowcat] {unit.key}: done in {time.monotonic() - t0:.1f}s", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m snowcat.stages", description="Run one stage unit of a snowcat run.")
    parser.add_argument("run_dir")
    parser.add_argument("stage")
    parser.add_argument("--item", type=int, default=None, help="fan-out element index")
    args = parser.parse_args(argv)
    index = args.item
    if index is None and os.environ.get("SLURM_ARRAY_TASK_ID", "").isdigit() and os.environ.get("SNOWCAT_ARRAY") == "1":
        index = int(os.environ["SLURM_ARRAY_TASK_ID"])

    try:
        with scrubbed_output():
            return run_unit(args.run_dir, args.stage, index)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
