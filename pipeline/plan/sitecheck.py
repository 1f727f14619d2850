"""A plan against the site: walltime per job (continuation jobs), jobs in the queue against the submit
limits, nodes against the partition's maximum, and the charge against the allocation.

The allocation: `snowcat plan --budget N` compares the charge with a number you give; without it,
the remaining budget the site's tool reports (`budget.remaining`: TACC's taccinfo, read) where the
profile's `planner.budget` names one. JSC's `jutil` is not read (no published sample of its output)
and `budget: none` sites expose nothing: both a stub that says so. A tool that cannot be read leaves
the check unknown (ok, with the reason), never refused.
"""

from __future__ import annotations

import math

from snowcat.slurm import limits as limits_mod
from snowcat.stages.registry import RESUMABLE_KINDS

from . import budget as budget_mod


def jobs_for(stage, site, name: str, kind: str, hours: float, modelled: bool = True) -> dict:
    """How many jobs (one after the other) the stage needs at its walltime, and whether its resume
    policy allows that many. A job's usable time is its walltime less the preemption notice; a stage
    whose time is not modelled (its walltime stands in) is one job."""
    res = stage.resources
    part = site.partitions.get(res.partition or site.default_partition)
    walltime = min(int(res.time_min), part.max_time_min) if part else int(res.time_min)
    usable_h = max(1e-9, (walltime * 60 - int(stage.resume.signal_margin_s)) / 3600)
    jobs = max(1, math.ceil(hours / usable_h - 1e-9)) if modelled else 1
    allowed = 1 + (int(stage.resume.max_continuations) if kind in RESUMABLE_KINDS and stage.resume.strategy != "none" else 0)
    problem = None
    if jobs > allowed:
        if kind not in RESUMABLE_KINDS or stage.resume.strategy == "none":
            why = f"it cannot continue in a second job ({'kind ' + kind + ' does not resume' if kind not in RESUMABLE_KINDS else 'resume.strategy none'})"
        else:
            why = f"resume.max_continuations={stage.resume.max_continuations} allows {allowed}"
        problem = (
            f"stages.{name}.resources.time_min: the stage needs {hours:.2f} h, {jobs} jobs of {walltime} min; {why}: "
            f"raise time_min (partition maximum {part.max_time_min if part else '?'} min) or max_continuations"
        )
    return {"walltime_min": walltime, "jobs": jobs, "continuations": jobs - 1, "allowed": allowed, "problem": problem}


def queued_jobs(stage, site, kind: str, units: int) -> int:
    """Jobs the Slurm executor queues for the stage at submission (each array task and hetjob
    component counts; continuations it submits up front where compute nodes cannot call sbatch)."""
    components = max(1, len(stage.resources.components))
    strategy = stage.resume.strategy
    if strategy == "requeue" and not site.requeue_allowed:
        strategy = "chain"
    continuations = int(stage.resume.max_continuations) if kind in RESUMABLE_KINDS else 0
    per_unit = 1
    if strategy == "chain" and continuations:
        per_unit = 1 if site.sbatch_on_compute else 1 + continuations
    gate = 1 if strategy == "chain" and continuations and site.sbatch_on_compute else 0
    return units * components * per_unit + gate


def submit_checks(site, queued: dict[str, int]) -> list[dict]:
    """Jobs per partition (and over the site) against the profile's submit limits."""
    out = []
    for partition, n in sorted(queued.items()):
        found = limits_mod.profile_submit_limits(site, partition)
        if not found:
            out.append(
                {"check": f"jobs queued on {partition}", "ok": True, "detail": f"{n} jobs; the profile names no submit limit"}
            )
            continue
        limit, source = min(found)
        ok = n <= limit
        out.append({"check": f"jobs queued on {partition}", "ok": ok, "detail": f"{n} jobs, limit {limit} ({source})"})
    return out


def node_checks(site, stage_nodes: list[tuple[str, str, int]]) -> list[dict]:
    """(stage, partition, nodes of one job) against the partition's per-job and per-user node limits."""
    out = []
    for name, partition, nodes in stage_nodes:
        part = site.partitions.get(partition)
        if part is None:
            out.append(
                {"check": f"stages.{name} nodes", "ok": False, "detail": f"partition {partition} is not in site {site.name}"}
            )
            continue
        per_user = getattr(part, "max_nodes_per_user", None)  # where the profile records it
        limit = min(part.max_nodes, per_user) if per_user else part.max_nodes
        ok = nodes <= limit
        what = f"max_nodes {part.max_nodes}" + (f", max_nodes_per_user {per_user}" if per_user else "")
        out.append({"check": f"stages.{name} nodes", "ok": ok, "detail": f"{nodes} nodes on {partition} ({what})"})
    return out


def budget_check(site, charge: float | None, budget: float | None) -> dict:
    """The plan's charge against `--budget N` where given, else against what the site's tool says is
    left (refused when the charge is more); a stub line where the site's remaining budget is not read."""
    unit = site.planner.charge_unit
    if budget is not None:
        if charge is None:
            return {"check": "allocation", "ok": True, "detail": f"--budget {budget:g} {unit}: the plan's charge is not known"}
        return {"check": "allocation", "ok": charge <= budget, "detail": f"{charge:,.1f} of --budget {budget:,.1f} {unit}"}
    reading = budget_mod.remaining(site)
    if reading is None:
        why = budget_mod.UNREAD.get(site.planner.budget)
        detail = (
            f"remaining allocation not read: {why}; pass --budget N"
            if why
            else f"site {site.name} exposes no remaining allocation to the planner (stub); pass --budget N"
        )
        return {"check": "allocation", "ok": True, "detail": detail}
    if reading.amount is None:
        return {"check": "allocation", "ok": True, "detail": f"remaining allocation unknown: {reading.why}; pass --budget N"}
    left = f"{reading.amount:,.0f} {unit} left on {reading.account} ({reading.source}" + (
        f"; {reading.note})" if reading.note else ")"
    )
    found = {"amount": reading.amount, "unit": unit, "account": reading.account, "source": reading.source}
    if charge is None:
        return {"check": "allocation", "ok": True, "detail": f"{left}: the plan's charge is not known", "remaining": found}
    ok = charge <= reading.amount
    detail = f"{charge:,.1f} of the {left}" if ok else f"{charge:,.1f} {unit} planned, more than the {left}"
    return {"check": "allocation", "ok": ok, "detail": detail, "remaining": found}
