"""What runs inside a stage's job: the callable submitit pickles (`StageJob`), which runs one unit
from the run directory and then, by how the unit ended, continues it past the walltime (requeue,
its own successor job, or the next pre-submitted one), stops it after a cancel, releases the stage's
gate, or cancels what can only fail downstream of a failed unit.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass

import submitit

from snowcat.pipeline.config import typed
from snowcat.pipeline.context import PREEMPTED_EXIT_CODE, catch_notice_early, first_notice
from snowcat.pipeline.dag import Unit, build
from snowcat.pipeline.rundir import RunDir, now
from snowcat.pipeline.runner import launcher_rank, run_unit
from snowcat.slurm.site import use_local_cluster

from . import commands
from .plan import stage_job_ids
from .scripts import BatchScripts

LOCK_WAIT_S = 600.0  # well past Slurm's defaults for killing a job's processes (KillWait 30 s + UnkillableStepTimeout 60 s)


def current_job_id() -> str:
    """This job as the unit records it: `123_4` for an array task, `123` otherwise."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID", "")


@contextlib.contextmanager
def _outside_this_job() -> Iterator[None]:
    """sbatch from inside a job hands the new job this job's environment: an inherited
    SLURM_ARRAY_TASK_ID would make a plain successor believe it is this array element. Submit
    without this job's SLURM_* variables (the cluster's SLURM_CONF stays)."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("SLURM_") and k != "SLURM_CONF"}
    try:
        yield
    finally:
        os.environ.update(saved)


@dataclass
class StageJob(submitit.helpers.Checkpointable):
    """The callable submitit pickles: run one unit of a stage from the run directory.

    The stage runner installs its own SIGUSR2 handler (the stage saves at a step boundary, not in
    the middle of an update, which is where submitit's handler would interrupt it); after the
    stage checkpointed, rank 0 requeues the job or leaves the unit to its next chained job.
    Rank 0 is the launcher's rank 0 (`runner.launcher_rank`): under `ibrun` every rank sees
    SLURM_PROCID=0, so submitit's own idea of the rank is corrected before it writes results.
    """

    run_dir: str
    stage: str
    strategy: str = "requeue"
    max_continuations: int = 3
    self_continue: bool = False  # chain by submitting its own successor (see BatchScripts.self_continuing)

    def __call__(self, index: int | None = None) -> dict:
        catch_notice_early()  # submitit's handler would requeue (refused under --no-requeue)
        rank = launcher_rank()
        os.environ["SLURM_PROCID"] = str(rank)  # submitit: only rank 0 writes the result file
        run = RunDir.open(self.run_dir)
        # A job resubmitted after a scancel or a node failure may start before the old job's
        # processes are killed (KillWait, UnkillableStepTimeout): wait for them rather than fail.
        code = run_unit(self.run_dir, self.stage, index, lock_wait_s=LOCK_WAIT_S)
        unit = Unit(self.stage, index)
        if code == PREEMPTED_EXIT_CODE:
            self._continue(run, unit, rank)
        if rank == 0:
            # Done or failed, this unit's pre-submitted continuations have nothing left to do.
            commands.scancel(self._own_continuations(run, unit))
            if code == 0:
                self._release_gate(run, unit)
        if code != 0:
            if rank == 0:
                self._contain_failure(run, unit, code)
            raise RuntimeError(f"stage {unit.key} failed with exit code {code}; see its Slurm log")
        return run.metrics(unit)

    def _continue(self, run: RunDir, unit: Unit, rank: int) -> None:
        if rank != 0:
            raise SystemExit(PREEMPTED_EXIT_CODE)
        if first_notice() == signal.SIGTERM:
            # a cancel (scancel, `snowcat cancel`), not the walltime notice (SIGUSR2): checkpointed,
            # the unit stays stopped (requeued, it undid the cancel); `snowcat resume` continues it
            commands.scancel(self._own_continuations(run, unit))
            error = "cancelled (SIGTERM) after it checkpointed; `snowcat resume` continues it"
            run.update_stage(unit.key, status="cancelled", ended=now(), error=error)
            raise SystemExit(PREEMPTED_EXIT_CODE)
        used = int(run.record(unit.key).get("continuations_used", 0))
        # (continuations queued up front run out by themselves: the chain has no job left)
        if (self.strategy == "requeue" or self.self_continue) and used >= self.max_continuations:
            error = f"stopped before its end {used + 1} times; max_continuations={self.max_continuations}"
            run.update_stage(unit.key, status="failed", error=error)
            self._contain_failure(run, unit, PREEMPTED_EXIT_CODE)
            raise RuntimeError(f"stage {unit.key}: out of continuations")
        if self.strategy == "requeue":
            run.update_stage(unit.key, status="submitted", continuations_used=used + 1, ended=now())
            submitit.JobEnvironment()._requeue(self.max_continuations - used - 1)
        elif self.self_continue:  # chain: this job queues the unit's next one itself
            successor = self._submit_successor(run, unit)
            own = [*run.record(unit.key).get("own_job_ids", []), successor]
            run.update_stage(unit.key, status="submitted", continuations_used=used + 1, ended=now(), own_job_ids=own)
        else:  # chain: the unit's next pre-submitted continuation job takes over
            run.update_stage(unit.key, status="submitted", continuations_used=used + 1, ended=now())
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def _submit_successor(self, run: RunDir, unit: Unit) -> str:
        """Queue this unit's next job (afterany this one), from the compute node: the site allows it."""
        cfg = run.config()
        site = typed(cfg).site
        use_local_cluster(site)
        ex = BatchScripts(run, cfg, site).executor_for(build(cfg)[unit.stage], f"afterany:{current_job_id()}")
        try:
            with _outside_this_job():
                job = ex.submit(self, *(() if unit.index is None else (unit.index,)))
        except (submitit.core.utils.FailedJobError, submitit.core.utils.FailedSubmissionError) as e:
            why = " ".join(str(e).split())[:300]
            run.update_stage(unit.key, status="failed", error=f"could not queue its continuation: {why}")
            self._contain_failure(run, unit, PREEMPTED_EXIT_CODE)
            raise RuntimeError(f"stage {unit.key}: could not queue its continuation: {why}") from None
        return str(job.job_id)

    @staticmethod
    def _release_gate(run: RunDir, unit: Unit) -> None:
        """The last unit of a stage to finish lets its dependents start (each unit writes its DONE
        marker before looking, so the last one always sees every marker; a second release is harmless)."""
        gate = run.record(unit.stage).get("gate")
        if gate and all(run.is_done(u) for u in build(run.config())[unit.stage].units):
            commands.release(gate)

    @staticmethod
    def _own_continuations(run: RunDir, unit: Unit) -> list[str]:
        """The unit's own chained jobs after this one (`124_2` for element 2 of a continuation array):
        never another element's, which may still need its own."""
        ids = run.record(unit.key).get("own_job_ids", [])
        me = current_job_id()
        return ids[ids.index(me) + 1 :] if me in ids else []

    def _contain_failure(self, run: RunDir, unit: Unit, code: int) -> None:
        """A failed unit stops what can only fail after it: the jobs of every stage downstream (they
        would start, find their input not done, and fail one by one, each after its own queue wait)."""
        dag = build(run.config())
        state = run.state()["stages"]
        why = f"input {unit.key} failed (exit {code}, job {current_job_id()}); fix it, then `snowcat resume {run.path}`"
        commands.scancel([g for g in [state.get(unit.stage, {}).get("gate")] if g])  # the stage cannot complete now
        for name in sorted(dag.downstream(unit.stage)):
            ids = sorted(stage_job_ids(dag[name], state))
            if not ids or all(run.is_done(u) for u in dag[name].units):
                continue
            commands.scancel(ids)
            for u in dag[name].units:
                if not run.is_done(u):
                    run.update_stage(u.key, status="cancelled", ended=now(), error=f"not run: {why}")
            if dag[name].items is not None:
                run.update_stage(name, status="cancelled", ended=now(), error=f"not run: {why}")

    def checkpoint(self, *args, **kwargs):
        # Used only if submitit's own handler fires (e.g. a preemption signal the runner did not
        # take over): requeue the same unit; it resumes from its last atomic checkpoint.
        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


# --- plans ---------------------------------------------------------------------------------------
