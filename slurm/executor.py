"""Slurm executor: the whole stage DAG submitted at once from the login node, through submitit.

Each stage is one job (a fan-out is one job array, or separate jobs where the site has no
arrays; a multi-role stage is one heterogeneous job), linked to the stages it needs by
`--dependency=afterok:`. Nothing stays alive on the login node and no compute node calls sbatch.
Job ids, batch scripts and Slurm logs live in `<run>/slurm/<stage>/`.

Long stages continue past the walltime in one of two ways (`stages.X.resume.strategy`):
- `requeue`: `--signal=USR2@margin`; the stage checkpoints at its next step boundary and the job
  requeues itself through submitit's job environment (`scontrol requeue`), keeping its job id;
- `chain`: continuation jobs pre-submitted with `--dependency=afterany:` on the previous one,
  resuming from the last checkpoint. Each unit owns its jobs (its element of each array, or its own
  jobs where the site has no arrays): a unit that ends cancels only its own continuations.

A submission is checked whole before anything is queued (every script rendered, jobs and array
tasks counted against the site's submit limits) and is all-or-nothing: a refused sbatch cancels
what the call queued. A unit that fails cancels the jobs of every stage downstream and says why.
Stages with `where: login` run in the submitting process, before the jobs that need them.

This module is the login node's side: submission and reconciliation with what Slurm says. The batch
scripts are rendered in `scripts.py`, the jobs a submission queues are planned in `plan.py`, what
runs inside a job is `jobside.py`, and every Slurm command goes through `commands.py`.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
import time
from pathlib import Path

import submitit

from snowcat.pipeline.config import typed
from snowcat.pipeline.dag import StageNode
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.executors.base import Executor
from snowcat.pipeline.fsio import atomic_write_json, atomic_write_text, read_json
from snowcat.pipeline.rundir import RunDir, now
from snowcat.slurm.limits import cached_live_limits, stage_problem, submit_limit
from snowcat.slurm.site import SiteProfile, use_local_cluster

from . import commands
from .hetjob import parse_job_id
from .jobside import StageJob
from .plan import Job, Planner, RowIndex, StageRecord, own_ids, stage_job_ids
from .scripts import BatchScripts

ALIVE = {
    "PENDING",
    "RUNNING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "CONFIGURING",
    "COMPLETING",
    "SUSPENDED",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
    "PREEMPTED",
}
CANCELLED = {"CANCELLED"}


JOURNAL = "submitting.json"  # job ids queued by a submission still in progress


def _user() -> str:
    return os.environ.get("USER") or pwd.getpwuid(os.getuid()).pw_name


def queued_jobs_by_partition() -> dict[str, int]:
    """This user's jobs now queued or running, by partition, array tasks expanded (what MaxSubmit counts)."""
    reply = commands.query(["squeue", "-h", "-r", "-u", _user(), "-o", "%P"])
    counts: dict[str, int] = {}
    for line in reply.out.split() if reply.ok else []:
        counts[line] = counts.get(line, 0) + 1
    return counts


class SlurmExecutor(Executor):
    name = "slurm"

    def __init__(self, run: RunDir, dag, cfg):
        super().__init__(run, dag, cfg)
        if cfg.site is None:
            raise UserError("executor slurm needs a site profile: pass --site NAME (e.g. --site local)")
        self.site: SiteProfile = typed(cfg).site
        for node in dag:  # what no queue state can fix: refused before anything is rendered (dry-run too)
            why = stage_problem(self.site, node.config)
            if why:
                raise UserError(f"stage {node.name}, site {self.site.name}: {why}")
        self.scripts = BatchScripts(run, cfg, self.site)
        use_local_cluster(self.site)

    def planner(self, live: dict[str, dict]) -> Planner:
        """A plan against the run's records as they are now and the jobs `live` says are alive."""
        return Planner(self.dag, self.scripts, self.run.state()["stages"], live, self.pending_units)

    def dry_run(self, stages: list[str], out: Path) -> list[Path]:
        """Write the batch script of every job `launch` would submit into `out`, after the same checks
        (rendering runs them; on an error the caller discards `out`); job ids that only sbatch can
        give appear as `<job of LABEL>` in dependencies."""
        written: list[Path] = []

        def write(job: Job) -> str:
            written.append(out / f"{job.label}.sbatch")
            atomic_write_text(written[-1], self.scripts.render_job(job))
            return f"<job of {job.label}>"

        self.planner(live={}).plan([s for s in stages if self.dag[s].config.where != "login"], write)
        return written

    # submission ----------------------------------------------------------------------------------

    def _alive_jobs(self) -> dict[str, dict]:
        """This run's jobs that are still queued or running, by job id: sacct's rows, and squeue's for
        jobs accounting does not list yet (slurmdbd records a submission a moment after sbatch returns:
        a `resume` right after `run` saw none of them alive and queued the whole DAG again)."""
        queued = self._wait_for_ending_jobs()  # squeue's last answer: asked again, it cost a busy controller twice
        rows = self.sacct()
        alive = {jid: row for jid, row in rows.items() if row["state"].split()[0] in ALIVE}
        # squeue speaks only for jobs accounting does not know: a job sacct lists as CANCELLED may
        # still be in squeue a moment (COMPLETING), and resume took it for alive and queued nothing
        known = {parse_job_id(jid)["job"] for jid in rows}
        unknown = sorted({parse_job_id(jid)["job"] for jid in self.job_ids()} - known)
        if not unknown:
            queued = {}
        elif queued is None:  # a busy controller: "no answer" is not "none queued", which resubmits the DAG
            raise UserError(
                f"squeue did not answer and accounting does not list jobs {', '.join(unknown)} of this run yet: "
                "whether they are queued is not known, so nothing was submitted; run `snowcat resume` again"
            )
        unlisted = {jid: row for jid, row in queued.items() if parse_job_id(jid)["job"] not in known and row["state"] in ALIVE}
        return {**unlisted, **alive}

    def _wait_for_ending_jobs(self, limit_s: float = 120.0) -> dict[str, dict] | None:
        """A cancelled job's processes may still be saving its checkpoint (SIGTERM): a job queued
        for the unit now would meet them holding it. Wait, up to `limit_s` (a node stuck in
        COMPLETING must not block every resume), until squeue lists none of the run's jobs COMPLETING.
        Returns squeue's last answer (`_queued`'s: None when it gave none)."""
        deadline, said = time.monotonic() + limit_s, False
        while True:
            queued = self._queued()
            ending = sorted(j for j, r in (queued or {}).items() if r["state"] == "COMPLETING")
            if not ending:
                return queued
            if time.monotonic() > deadline:
                print(f"jobs {', '.join(ending)} still COMPLETING after {limit_s:.0f} s; going on", file=sys.stderr)
                return queued
            if not said:
                print(f"waiting for jobs {', '.join(ending)} to finish ending (COMPLETING)", file=sys.stderr)
                said = True
            time.sleep(2)

    def _queued(self) -> dict[str, dict] | None:
        """The run's jobs squeue lists, {job id: state and reason}; None when squeue gave no answer
        (a controller under load times out now and then)."""
        ids = set(self.job_ids())
        reply = commands.query(["squeue", "-h", "-r", "-u", _user(), "-o", "%i|%T|%r"])
        if not reply.ok:
            return None
        rows = [line.split("|") for line in reply.out.splitlines()]
        return {r[0]: {"state": r[1], "reason": r[2]} for r in rows if len(r) == 3 and parse_job_id(r[0])["job"] in ids}

    def launch(self, stages: list[str]) -> int:
        self._cancel_unrecorded()
        compute = self._run_login_stages(stages)
        if compute is None:
            return 1
        live = self._alive_jobs()
        planned: list[Job] = []

        def count(job: Job) -> str:
            self.scripts.render_job(job)  # every check, before anything is queued
            planned.append(job)
            return f"<job of {job.label}>"

        counted = self.planner(live)
        counted.plan(compute, count)
        self._check_budget(planned)
        commands.scancel(counted.replace)  # waits on replaced jobs, or a gate a new one stands in for
        records = self._submit_all(compute, live)
        for name, record in records.items():
            self._record(self.dag[name], record)
            gate = f" (gate {record.gate})" if record.gate else ""
            print(f"submitted {name}: {', '.join(record.main + record.continuations)}{gate}", file=sys.stderr)
        print(f"the run continues on the cluster; follow it with: snowcat status {self.run.path}", file=sys.stderr)
        return 0

    def _submit_all(self, stages: list[str], live: dict[str, dict]) -> dict[str, StageRecord]:
        """Submit every planned job, or none: a refused sbatch cancels what this call queued (the
        journal names them, also for a `launch` killed half-way: the next one cancels them)."""
        queued: list[str] = []
        journal = self.run.path / "slurm" / JOURNAL

        def submit(job: Job) -> str:
            if job.gate:
                job_id = self._submit_gate(job.node)
                queued.append(job_id)
                atomic_write_json(journal, {"queued": queued})
                return job_id
            ex = self.scripts.executor_for(job.node, job.dependency)
            node = job.node
            call = StageJob(
                str(self.run.path),
                node.name,
                self.scripts.strategy(node),
                node.config.resume.max_continuations,
                self.scripts.self_continuing(node),
            )
            if job.array:
                job_id = str(ex.map_array(call, job.items)[0].job_id).split("_")[0]
            else:
                job_id = str(ex.submit(call, *(job.items or ())).job_id)
            queued.append(job_id)
            atomic_write_json(journal, {"queued": queued})
            return job_id

        journal.parent.mkdir(parents=True, exist_ok=True)
        try:
            records = self.planner(live).plan(stages, submit)
        except (
            submitit.core.utils.FailedJobError,
            submitit.core.utils.FailedSubmissionError,
            subprocess.CalledProcessError,  # commands.SlurmCommandError too
        ) as e:
            commands.scancel(queued)
            journal.unlink(missing_ok=True)
            reason = " ".join(str(getattr(e, "stderr", None) or e).split())[:300]
            raise UserError(
                f"sbatch refused a job ({reason}); the {len(queued)} job(s) this submission had queued were cancelled, "
                "nothing was recorded"
            ) from None
        journal.unlink(missing_ok=True)
        return records

    def _submit_gate(self, node: StageNode) -> str:
        script = self.run.path / "slurm" / node.name / "gate.sbatch"
        script.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(script, self.scripts.render_gate(node))
        return commands.sbatch(script)

    def _cancel_unrecorded(self) -> None:
        """Jobs an interrupted submission queued but never recorded: cancel them before submitting again."""
        journal = self.run.path / "slurm" / JOURNAL
        if journal.is_file():
            ids = read_json(journal).get("queued", [])
            commands.scancel(ids)
            print(f"cancelled {len(ids)} job(s) an interrupted submission left unrecorded: {', '.join(ids)}", file=sys.stderr)
            journal.unlink()

    def _record(self, node: StageNode, record: StageRecord) -> None:
        previous = self.run.record(node.name)
        self.run.update_stage(
            node.name,
            status="submitted",
            executor="slurm",
            submitted=now(),
            job_ids=record.main + record.continuations,  # added to the earlier submissions' ids
            gate=record.gate,
            attempts=previous.get("attempts", 0) + 1,
            wait_on=record.wait_on,
            continuations=record.continuations,
            slurm_folder=str(self.run.path / "slurm" / node.name),
            error=None,
            **({"own_job_ids": record.own[node.name]} if node.items is None else {}),
        )
        if node.items is not None:
            for key, ids in record.own.items():
                self.run.update_stage(key, status="submitted", executor="slurm", own_job_ids=ids, error=None)

    def _check_budget(self, planned: list[Job]) -> None:
        """Refuse, before anything is queued, a submission that the site's submit limits (jobs queued or
        running per user; each array task and each hetjob component counts) would refuse part-way."""
        need: dict[str, int] = {}
        for job in planned:
            for partition, n in job.counts().items():
                need[partition] = need.get(partition, 0) + n
        total = sum(need.values())
        queued = queued_jobs_by_partition()
        limits = [(f"partition {p}", n, *submit_limit(self.site, p), queued.get(p, 0)) for p, n in sorted(need.items())]
        live = cached_live_limits(account=self.site.account)  # association/QoS limits span every partition
        for node in {job.node.name: job.node for job in planned}.values():  # co-running parts, live caps too
            why = stage_problem(self.site, node.config, live)
            if why:
                raise UserError(f"stage {node.name}, site {self.site.name}: {why}; nothing was submitted")
        for limit, source in [
            (self.site.max_submit_jobs, f"site profile {self.site.name}: max_submit_jobs"),
            (live.max_submit_per_user, live.max_submit_source),
        ]:
            if limit is not None:
                limits.append(("all partitions", total, limit, source, sum(queued.values())))
        for where, n, limit, source, already in limits:
            if limit is not None and already + n > limit:
                biggest = max(planned, key=lambda j: sum(j.counts().values()))
                raise UserError(
                    f"site {self.site.name}, {where}: this submission needs {n} jobs (array tasks and continuation jobs "
                    f"count one each; {len(planned)} sbatch calls), {already} already queued, limit {limit} ({source}); "
                    f"nothing was submitted. Lower stages.<stage>.resume.max_continuations, fan out less, or wait for "
                    f"queued jobs (largest: {biggest.label}, {sum(biggest.counts().values())} jobs)"
                )

    def _run_login_stages(self, stages: list[str]) -> list[str] | None:
        """Run the login-node stages whose inputs are done, here and now; returns the compute stages
        to submit (those downstream of a login stage that cannot run yet wait for a later `resume`),
        or None when a login stage failed."""
        from snowcat.pipeline.executors.local import LocalExecutor  # noqa: PLC0415 (only for login stages)

        login = [n for n in stages if self.dag[n].config.where == "login"]
        waiting: set[str] = set()
        for name in login:
            if any(n in stages and n not in login for n in self.dag[name].needs) or any(
                n in waiting for n in self.dag[name].needs
            ):
                waiting.add(name)
                continue
            print(f"running {name} on this login node (where: login)", file=sys.stderr)
            if LocalExecutor(self.run, self.dag, self.cfg).launch([name]) != 0:
                return None
        held = set(waiting)
        for name in waiting:
            held |= self.dag.downstream(name)
        if waiting:
            print(
                f"{', '.join(sorted(waiting))} run(s) on the login node once their inputs are done: run "
                f"`snowcat resume {self.run.path}` then; not submitted now: {', '.join(sorted(held - waiting)) or 'nothing else'}",
                file=sys.stderr,
            )
        return [n for n in stages if n not in login and n not in held]

    # reconciliation ----------------------------------------------------------------------------

    def job_ids(self) -> list[str]:
        state = self.run.state()["stages"]
        return sorted({j for node in self.dag for j in stage_job_ids(node, state)})

    def sacct(self) -> dict[str, dict]:
        """One sacct call for every job of the run: {job id: row}. Array and hetjob rows keep
        their own ids (`123_4`, `123+1`); steps (`123.batch`) are dropped."""
        ids = self.job_ids()
        if not ids:
            return {}
        fields = "JobID,State,ExitCode,Reason,NodeList,Partition,Account,Elapsed,Start,End"
        reply = commands.query(["sacct", "-n", "-P", "-X", "--duplicates", "-j", ",".join(ids), "-o", fields])
        if not reply.ok:
            raise UserError(f"sacct failed: {(reply.err or reply.out).strip()}")
        rows: dict[str, dict] = {}
        for line in reply.out.splitlines():
            values = line.split("|")
            if len(values) != len(fields.split(",")):
                continue
            row = dict(zip([f.lower() for f in fields.split(",")], values))
            if parse_job_id(row["jobid"])["step"] is None:
                rows[row["jobid"]] = row  # with --duplicates the latest requeue comes last
        return rows

    def refresh(self) -> None:
        rows = self.sacct()
        if not rows:
            return
        state = self.run.state()["stages"]
        index = RowIndex(rows)
        for node in self.dag:
            ids = stage_job_ids(node, state)
            if not ids:
                continue
            for unit in node.units:
                if self.run.is_done(unit):
                    continue
                own = own_ids(unit, state)
                # a record without own ids (written before they existed): every row of its stage
                unit_rows = index.of(own) if own else [r for k, r in rows.items() if parse_job_id(k)["job"] in ids]
                if not unit_rows:
                    continue
                states = [r["state"].split()[0] for r in unit_rows]
                latest = unit_rows[-1]
                info = {
                    "state": latest["state"],
                    "reason": latest["reason"] if latest["reason"] not in ("None", "") else None,
                    "nodes": latest["nodelist"],
                    "exit_code": latest["exitcode"],
                    "partition": latest["partition"],
                    "account": latest["account"],
                }
                if "DependencyNeverSatisfied" in (info["reason"] or ""):
                    status = "failed"  # waits on an input that failed: it would pend forever
                    info["reason"] = "an input stage failed (dependency never satisfied); snowcat resume resubmits"
                elif any(s in ALIVE for s in states):
                    status = "running" if "RUNNING" in states else "submitted"
                elif any(s in CANCELLED for s in states) and all(s in CANCELLED or s in ("TIMEOUT", "FAILED") for s in states):
                    status = "cancelled"
                else:  # every job of the unit ended and none wrote DONE: failed, never an endless wait
                    status = "failed"
                self.run.update_stage(unit.key, status=status, slurm=info)
                if unit.index is not None:
                    self.run.update_stage(node.name, status=status, slurm=info)
            if gate := state.get(node.name, {}).get("gate"):
                self._cancel_orphaned_gate(gate, node, rows)

    def _cancel_orphaned_gate(self, gate: str, node: StageNode, rows: dict[str, dict]) -> None:
        """A stage's gate still held when none of its unfinished units has a job left: nothing will
        release it (a unit that failed in Python cancels it itself; one whose job never started Python,
        e.g. cancelled while pending or failing at exec, cannot), and it would sit in the queue,
        counted against the user's job limits, until `snowcat resume` replaces it."""
        if rows.get(gate, {}).get("state", "PENDING").split()[0] not in ALIVE:  # (accounting may not list it yet)
            return
        left = [self.run.record(u.key).get("status") for u in node.units if not self.run.is_done(u)]
        if left and all(s in ("failed", "cancelled") for s in left):
            commands.scancel([gate])

    def cancel(self) -> list[str]:
        ids = self.job_ids()
        commands.scancel(ids)
        for key, record in self.run.state()["stages"].items():
            if record.get("status") in ("submitted", "running", "pending"):
                self.run.update_stage(key, status="cancelled", ended=now())
        return ids
