"""Which jobs a submission queues: per stage in DAG order, what its pending units need, what the
jobs still queued or running from an earlier submission keep, and what each job waits on.

Pure given the run's recorded state and the jobs the cluster says are alive: `submit` is a callback
(real sbatch, a dry run that writes scripts, or a count against the site's submit limits), so the
same plan is what is submitted, dry-run and counted (`benchmarks/fanout.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from snowcat.pipeline.dag import Dag, StageNode, Unit

from .hetjob import parse_job_id
from .scripts import BatchScripts


@dataclass
class Job:
    """One sbatch call: a stage's job, array (over `items`) or element job, in its chain."""

    label: str  # "more", "more.chunk1", "more[3]", "more.continuation2", ...
    node: StageNode
    items: list[int] | None
    array: bool
    dependency: str | None
    job_id: str = ""
    gate: str | None = None  # the partition of a stage's gate job (see BatchScripts.self_continuing)

    def counts(self) -> dict[str, int]:
        """Jobs this call adds against submit limits, by partition (array tasks and hetjob components
        count one each, as Slurm counts them)."""
        if self.gate:
            return {self.gate: 1}
        res = self.node.config.resources
        tasks = len(self.items) if self.array else 1
        out: dict[str, int] = {}
        for comp in res.components.values() or [res]:
            out[str(comp.partition)] = out.get(str(comp.partition), 0) + tasks
        return out


@dataclass
class StageRecord:
    """The jobs one stage got: main jobs, continuation jobs, what dependents wait on, and each unit's own ids."""

    main: list[str] = field(default_factory=list)
    continuations: list[str] = field(default_factory=list)
    wait_on: list[str] = field(default_factory=list)
    own: dict[str, list[str]] = field(default_factory=dict)
    gate: str | None = None


class RowIndex:
    """sacct rows by job id, so that a unit's rows are found by its own job ids in one lookup each
    (a 1000-element run's status would otherwise compare every unit with every row)."""

    def __init__(self, rows: dict[str, dict]):
        self.by_task: dict[tuple[str, str | None], list[dict]] = {}
        self.pending: dict[str, list[tuple[str, dict]]] = {}  # job -> [(`[0-5%2]`, row)]: tasks not started
        for jid, row in rows.items():
            parts = parse_job_id(jid)
            if parts["task"] is not None and parts["task"].startswith("["):
                self.pending.setdefault(parts["job"], []).append((parts["task"], row))
            else:
                self.by_task.setdefault((parts["job"], parts["task"]), []).append(row)

    def of(self, own_ids: list[str]) -> list[dict]:
        """The rows of these jobs (`124` whole, `124_2` one element), in the order of `own_ids`."""
        out = []
        for own in own_ids:
            mine = parse_job_id(own)
            out += self.by_task.get((mine["job"], mine["task"]), [])
            if mine["task"] is not None:
                out += [row for spec, row in self.pending.get(mine["job"], []) if _covers(spec, int(mine["task"]))]
        return out


def _covers(task: str | None, index: int) -> bool:
    """Whether sacct's array task field (`4`, or `[0-3,7%2]` for tasks not started) includes `index`."""
    if task is None:
        return False
    if not task.startswith("["):
        return task == str(index)
    for part in task.strip("[]").split("%")[0].split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and int(lo) <= index <= int(hi or lo):
            return True
    return False


# --- rendering ---------------------------------------------------------------------------------


def stage_job_ids(node: StageNode, state: dict) -> set[str]:
    """Every Slurm job id of a stage: its submissions, its gate, continuations its units queued themselves."""
    record = state.get(node.name, {})
    ids = {j for j in record.get("job_ids", []) if not str(j).startswith("local:")}
    if record.get("gate"):
        ids.add(record["gate"])
    for unit in node.units:
        ids |= {parse_job_id(j)["job"] for j in state.get(unit.key, {}).get("own_job_ids", [])}
    return ids


def own_ids(unit: Unit, state: dict) -> list[str]:
    """The jobs a unit owns (its element of each array, or its own jobs), in chain order."""
    return state.get(unit.key, {}).get("own_job_ids", [])


@dataclass
class Planner:
    """Plans one submission. `state` is the run's stage records, `live` the run's jobs still queued
    or running ({job id: sacct/squeue row}), `pending` a stage's units not done."""

    dag: Dag
    scripts: BatchScripts
    state: dict
    live: dict[str, dict]
    pending: Callable[[StageNode], list[Unit]]
    replace: list[str] = field(default_factory=list)  # jobs the new ones stand in for: scancel them

    def plan(self, stages: list[str], submit: Callable[[Job], str]) -> dict[str, StageRecord]:
        """Queue what `stages` need, in DAG order. A unit whose own jobs are still queued or running
        keeps them; the others are queued again. A stage whose inputs were queued again is queued
        again whole (its jobs wait on replaced ones). Jobs to replace go to `self.replace`."""
        state, self.replace = self.state, []
        records: dict[str, StageRecord] = {}
        waits: dict[str, list[str]] = {}
        alive_jobs = {parse_job_id(k)["job"] for k in self.live}
        alive = RowIndex(self.live)
        for node in self.dag:
            if node.name not in stages:
                continue
            pending = self.pending(node)
            if not pending:  # it finished since the stages to run were listed (a job that ended as resume started)
                continue
            record = state.get(node.name, {})
            ids = stage_job_ids(node, state)
            live = {k: r for k, r in self.live.items() if parse_job_id(k)["job"] in ids}
            running = [u for u in pending if alive.of(own_ids(u, state))] if live else []
            gate = record.get("gate")
            replaced = any(n in records for n in node.needs) or any(
                "DependencyNeverSatisfied" in r["reason"] for r in live.values()
            )
            if replaced:
                self.replace += sorted({parse_job_id(k)["job"] for k in live})
                running = []
            elif running and len(running) == len(pending) and (not gate or gate in alive_jobs):
                waits[node.name] = record.get("wait_on") or [f"afterok:{j}" for j in record["job_ids"]]
                continue
            if gate and not replaced:
                self.replace.append(gate)  # a new gate stands for every unit, old and new
            terms = [t for n in node.needs if n in waits for t in waits[n]]
            todo = [u for u in pending if u not in running]
            records[node.name] = new = self._stage(node, ",".join(terms) or None, submit, todo)
            kept = [t for t in record.get("wait_on", []) if running and t.split(":")[-1] in alive_jobs and not new.gate]
            new.wait_on = kept + new.wait_on
            waits[node.name] = new.wait_on
        return records

    def _stage(self, node: StageNode, dependency: str | None, submit: Callable[[Job], str], units: list[Unit]) -> StageRecord:
        """Queue `units` of one stage through `submit` (real sbatch, or a dry run that only names the jobs).

        Every unit owns its jobs: its element of each array (`124_2`) or its own jobs, in chain order,
        so a unit that finishes cancels its own continuations and never another element's."""
        chain = self.scripts.strategy(node) == "chain"
        gated = self.scripts.self_continuing(node)
        rounds = 1 + (self.scripts.continuations(node) if chain and not gated else 0)
        record = StageRecord()
        for g, (items, array) in enumerate(self.scripts.groups(node, units)):
            base = node.name + (f"[{items[0]}]" if items and not array else f".chunk{g}" if g else "")
            previous = None
            for r in range(rounds):
                label = base + (f".continuation{r}" if r else "")
                job = Job(label, node, items, array, dependency if r == 0 else f"afterany:{previous}")
                job.job_id = previous = submit(job)
                (record.continuations if r else record.main).append(job.job_id)
                for t, index in enumerate(items or [None]):
                    key = Unit(node.name, index).key
                    record.own.setdefault(key, []).append(f"{job.job_id}_{t}" if array else job.job_id)
            # Dependents wait for the chain's last job to end (the runner checks that inputs are done).
            record.wait_on.append(f"afterany:{previous}" if chain else f"afterok:{previous}")
        if gated:
            record.gate = submit(Job(f"{node.name}.gate", node, None, False, None, gate=self.scripts.gate_partition(node)))
            record.wait_on = [f"afterok:{record.gate}"]
        return record
