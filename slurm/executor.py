"""Slurm executor: the whole stage DAG submitted at once from the login node, through submitit.

Each stage is one job (a fan-out is one job array, or separate jobs where the site has no
arrays; a multi-role stage is one heterogeneous job), linked to the stages it needs by
`--dependency=afterok:`. Nothing stays alive on the login node and no compute node calls sbatch.
Job ids, batch scripts and Slurm logs live in `<run>/slurm/<stage>/`.

Long stages continue past the walltime in one of two ways (`stages.X.resume.strategy`):
- `requeue`: `--signal=USR2@margin`; the stage checkpoints at its next step boundary and the job
  requeues itself through submitit's job environment (`scontrol requeue`), keeping its job id;
- `chain`: continuation jobs pre-submitted with `--dependency=afterany:` on the previous one,
  resuming from the last checkpoint; the one that completes the stage cancels the rest.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import submitit

from snowcat.containers.wrap import site_mpi_plugin, srun_line, wrap_command
from snowcat.pipeline.config import typed
from snowcat.pipeline.context import PREEMPTED_EXIT_CODE
from snowcat.pipeline.dag import StageNode, Unit
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.executors.base import Executor
from snowcat.pipeline.fsio import atomic_write_text
from snowcat.pipeline.rundir import RunDir, now
from snowcat.pipeline.runner import run_unit
from snowcat.slurm import site as site_mod
from snowcat.slurm.site import SiteProfile, use_local_cluster

from .hetjob import HetjobExecutor, parse_job_id

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


# --- what runs inside the job ----------------------------------------------------------------


LOCK_WAIT_S = 600.0  # well past Slurm's defaults for killing a job's processes (KillWait 30 s + UnkillableStepTimeout 60 s)


@dataclass
class StageJob(submitit.helpers.Checkpointable):
    """The callable submitit pickles: run one unit of a stage from the run directory.

    The stage runner installs its own SIGUSR2 handler (the stage saves at a step boundary, not in
    the middle of an update, which is where submitit's handler would interrupt it); after the
    stage checkpointed, rank 0 requeues the job through submitit's job environment.
    """

    run_dir: str
    stage: str
    strategy: str = "requeue"
    max_continuations: int = 3

    def __call__(self, index: int | None = None) -> dict:
        run = RunDir.open(self.run_dir)
        # A job resubmitted after a scancel or a node failure may start before the old job's
        # processes are killed (KillWait, UnkillableStepTimeout): wait for them rather than fail.
        code = run_unit(self.run_dir, self.stage, index, lock_wait_s=LOCK_WAIT_S)
        unit = Unit(self.stage, index)
        if code == PREEMPTED_EXIT_CODE:
            self._continue(run, unit)
        if code != 0:
            raise RuntimeError(f"stage {unit.key} failed with exit code {code}; see its Slurm log")
        self._cancel_continuations(run, unit)
        return run.metrics(unit)

    def _continue(self, run: RunDir, unit: Unit) -> None:
        env = submitit.JobEnvironment()
        if env.global_rank != 0:
            raise SystemExit(PREEMPTED_EXIT_CODE)
        record = run.state()["stages"].get(unit.key, {})
        used = int(record.get("continuations_used", 0))
        if self.strategy == "requeue":
            if used >= self.max_continuations:
                run.update_stage(
                    unit.key,
                    status="failed",
                    error=f"walltime reached {used + 1} times; max_continuations={self.max_continuations}",
                )
                raise RuntimeError(f"stage {unit.key}: out of continuations")
            run.update_stage(unit.key, status="submitted", continuations_used=used + 1, ended=now())
            env._requeue(self.max_continuations - used - 1)
        else:  # chain: the next pre-submitted continuation job takes over
            run.update_stage(unit.key, status="submitted", continuations_used=used + 1, ended=now())
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def _cancel_continuations(self, run: RunDir, unit: Unit) -> None:
        env = submitit.JobEnvironment()
        if env.global_rank != 0:
            return
        rest = [j for j in run.state()["stages"].get(unit.stage, {}).get("continuations", []) if j != env.job_id]
        if rest:
            subprocess.run(["scancel", *rest], check=False, capture_output=True)

    def checkpoint(self, *args, **kwargs):
        # Used only if submitit's own handler fires (e.g. a preemption signal the runner did not
        # take over): requeue the same unit; it resumes from its last atomic checkpoint.
        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


# --- rendering ---------------------------------------------------------------------------------


class SlurmExecutor(Executor):
    name = "slurm"

    def __init__(self, run: RunDir, dag, cfg):
        super().__init__(run, dag, cfg)
        if cfg.site is None:
            raise UserError("executor slurm needs a site profile: pass --site NAME (e.g. --site local)")
        self.site: SiteProfile = typed(cfg).site

        use_local_cluster(self.site)

    # options ---------------------------------------------------------------------------------

    def _partition(self, res) -> str:
        partition = res.partition or self.site.default_partition
        if not partition:
            raise UserError(f"site {self.site.name}: no partition given and the profile has no default_partition")
        return str(partition)

    def _resource_options(self, where: str, res, time_min: int) -> dict:
        """sbatch options (long names, dashes) for one job or hetjob component, checked and filtered."""

        partition = self._partition(res)
        gpus = int(res.gpus_per_node)
        try:
            site_mod.validate_request(
                self.site, partition=partition, nodes=int(res.nodes), gpus_per_node=gpus, time_min=int(time_min)
            )
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
        options = {
            "partition": partition,
            "nodes": int(res.nodes),
            "ntasks-per-node": int(res.tasks_per_node),
            "cpus-per-task": int(res.cpus_per_task),
        }
        if gpus:
            options["gpus-per-node"] = gpus
        if getattr(res, "mem_gb", None):
            options["mem"] = f"{int(res.mem_gb)}G"
        return site_mod.filter_sbatch_options(self.site, options)

    def _job_options(self, node: StageNode, time_min: int) -> dict:
        options = {
            "job-name": f"snowcat-{self.run.run_id}-{node.name}"[:120],
            "time": int(time_min),
            "signal": f"USR2@{node.config.resume.signal_margin_s}",
        }
        account = self.site.account
        if account:
            options["account"] = account
        # Requeue only what asks for it: otherwise a node failure ends the job (NODE_FAIL), the
        # stage shows failed, and `snowcat resume` resubmits it.
        options["requeue" if self.strategy(node) == "requeue" else "no-requeue"] = True
        return site_mod.filter_sbatch_options(self.site, options)

    def _setup(self, node: StageNode) -> list[str]:
        lines = [f"module load {m}" for m in self.site.modules]
        if node.config.image and self.site.container_module:
            lines.append(f"module load {self.site.container_module}")
        for key, value in self.site.env.items():
            lines.append(f"export {key}={shlex.quote(str(value))}")
        lines.append(f"export SNOWCAT_RUN_DIR={shlex.quote(str(self.run.path))}")
        lines.append("export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}")
        return lines

    def _python(self, node: StageNode) -> str:
        """The python command the job runs: on the host, or inside the stage's container image."""
        runtime = self.site.container_runtime
        if not node.config.image or runtime == "none":
            return shlex.quote(sys.executable)

        binds = [str(self.run.path)] + [str(p) for p in (self.site.scratch, self.site.project) if p]
        gpu = node.config.resources.gpus_per_node > 0 or any(
            c.gpus_per_node > 0 for c in node.config.resources.components.values()
        )
        return shlex.join(wrap_command(["python"], runtime=runtime, image=node.config.image, binds=binds, gpu=gpu))

    def _launch_args(self, node: StageNode) -> list[str]:
        if self.world_size(node) <= 1:
            return []
        plugin = site_mpi_plugin(self.site)
        return ([f"--mpi={plugin}"] if plugin else []) + ["--kill-on-bad-exit=1"]

    def strategy(self, node: StageNode) -> str:
        """The continuation strategy: `requeue` falls back to `chain` where the site disallows requeue."""
        wanted = node.config.resume.strategy
        if wanted == "requeue" and not self.site.requeue_allowed:
            return "chain"
        return wanted

    def executor_for(self, node: StageNode, dependency: str | None) -> submitit.SlurmExecutor:
        folder = self.run.path / "slurm" / node.name  # submitit creates it when it submits
        res = node.config.resources
        time_min = int(res.time_min)
        where = f"stages.{node.name}.resources"
        job = self._job_options(node, time_min)
        if dependency:
            job["dependency"] = dependency
        max_timeouts = node.config.resume.max_continuations
        if res.components:
            if not self.site.hetjobs_allowed:
                raise UserError(f"stages.{node.name}: site {self.site.name} does not allow heterogeneous jobs")

            comps = [
                self._resource_options(f"{where}.components.{name}", comp, time_min) for name, comp in res.components.items()
            ]
            launcher = srun_line(self.site, list(range(len(comps))), [], extra=["--kill-on-bad-exit=1"])
            return HetjobExecutor(
                folder, comps, job, launcher, setup=self._setup(node), python=self._python(node), max_num_timeout=max_timeouts
            )
        python = self._python(node)
        if self.site.launcher == "ibrun" and self.world_size(node) > 1:
            python = f"ibrun {python}"  # TACC: ibrun starts the ranks where others use srun
        ex = submitit.SlurmExecutor(folder, max_num_timeout=max_timeouts, python=python)
        options = {**job, **self._resource_options(where, res, time_min)}
        params = {
            "job_name": options.pop("job-name"),
            "time": options.pop("time"),
            "signal_delay_s": node.config.resume.signal_margin_s,
            "setup": self._setup(node),
            "srun_args": self._launch_args(node),
            "use_srun": self.site.launcher == "srun",
            "wckey": "snowcat",
            "array_parallelism": int(node.config.max_parallel or self.site.max_array_parallel),
        }
        options.pop("signal", None)  # submitit renders --signal from signal_delay_s
        for key in ("partition", "nodes", "dependency", "account"):
            if key in options:
                params[key] = options.pop(key)
        if "ntasks-per-node" in options:
            params["ntasks_per_node"] = options.pop("ntasks-per-node")
        if "cpus-per-task" in options:
            params["cpus_per_task"] = options.pop("cpus-per-task")
        if "gpus-per-node" in options:
            params["gpus_per_node"] = options.pop("gpus-per-node")
        params["additional_parameters"] = {k.replace("-", "_"): v for k, v in options.items()}
        ex.update_parameters(**params)
        return ex

    def render(self, node: StageNode, dependency: str | None = None) -> str:
        """The batch script this stage would be submitted with (nothing is submitted or written)."""
        ex = self.executor_for(node, dependency)
        if node.items is not None and self.site.arrays_allowed:
            site_mod.validate_request(self.site, partition=self._partition(node.config.resources), array_size=len(node.items) - 1)
            ex.parameters["map_count"] = len(node.items)
        return ex._make_submission_file_text(ex._submitit_command_str, "render")

    def dry_run(self, stages: list[str], out: Path) -> list[Path]:
        """Write the batch script of every job `launch` would submit into `out`, after the same checks
        (rendering runs them; on an error the caller discards `out`); job ids that only sbatch can
        give appear as `<job of STAGE>` in dependencies."""
        written: list[Path] = []
        wait_on: dict[str, list[str]] = {}
        for node in self.dag:
            if node.name not in stages:
                continue
            terms = [t for n in node.needs if n in wait_on for t in wait_on[n]]
            jobs = [(node.name, ",".join(terms) or None)]
            if self.strategy(node) == "chain":
                for i in range(1, node.config.resume.max_continuations + 1):
                    jobs.append((f"{node.name}.continuation{i}", f"afterany:<job of {jobs[-1][0]}>"))
                wait_on[node.name] = [f"afterany:<job of {jobs[-1][0]}>"]
            else:
                wait_on[node.name] = [f"afterok:<job of {node.name}>"]
            for job_name, dependency in jobs:
                written.append(out / f"{job_name}.sbatch")
                atomic_write_text(written[-1], self.render(node, dependency))
        return written

    # submission -------------------------------------------------------------------------------

    def _alive_jobs(self) -> dict[str, dict]:
        """sacct rows of this run's jobs that are still queued or running, by job id."""
        return {jid: row for jid, row in self.sacct().items() if row["state"].split()[0] in ALIVE}

    def launch(self, stages: list[str]) -> int:
        for name in stages:  # refuse impossible requests before anything is queued
            self.render(self.dag[name])
        state = self.run.state()["stages"]
        alive = self._alive_jobs()
        deps: dict[str, list[str]] = {}  # stage -> dependency terms its dependents wait on
        resubmitted: set[str] = set()
        submitted = []
        for node in self.dag:
            if node.name not in stages:
                continue
            record = state.get(node.name, {})
            live = {k: row for k, row in alive.items() if parse_job_id(k)["job"] in record.get("job_ids", [])}
            stale = any(n in resubmitted for n in node.needs) or any(
                "DependencyNeverSatisfied" in row["reason"] for row in live.values()
            )
            if live and not stale:  # still queued or running from an earlier submission: keep it
                deps[node.name] = record.get("wait_on") or [f"afterok:{j}" for j in record["job_ids"]]
                continue
            if live:  # waits on jobs that were replaced or can never succeed: replace it too
                subprocess.run(["scancel", *sorted({parse_job_id(k)["job"] for k in live})], check=False, capture_output=True)
            need_terms = [t for n in node.needs if n in deps for t in deps[n]]
            ids, wait_on = self._submit(node, ",".join(need_terms) or None)
            deps[node.name] = wait_on
            resubmitted.add(node.name)
            submitted.append(f"{node.name}: {', '.join(ids)}")
        for line in submitted:
            print(f"submitted {line}", file=sys.stderr)
        print(f"the run continues on the cluster; follow it with: snowcat status {self.run.path}", file=sys.stderr)
        return 0

    def _submit(self, node: StageNode, dependency: str | None) -> tuple[list[str], list[str]]:
        """Submit one stage; returns (job ids, dependency terms its dependents wait on)."""
        ex = self.executor_for(node, dependency)
        job = StageJob(str(self.run.path), node.name, self.strategy(node), node.config.resume.max_continuations)
        pending = self.pending_units(node)
        try:
            if node.items is None:
                jobs = [ex.submit(job)]
            elif self.site.arrays_allowed and len(pending) == len(node.units):
                jobs = ex.map_array(job, [u.index for u in pending])
            else:  # no arrays on this site (Frontera), or only some elements left
                jobs = [ex.submit(job, u.index) for u in pending]
                for u, j in zip(pending, jobs):
                    self.run.update_stage(u.key, own_job_ids=[str(j.job_id)])
        except (submitit.core.utils.FailedSubmissionError, subprocess.CalledProcessError) as e:
            raise UserError(f"stages.{node.name}: sbatch refused the job: {' '.join(str(e).split())[:300]}") from None
        ids = sorted({str(j.job_id).split("_")[0] for j in jobs})
        wait_on = [f"afterok:{i}" for i in ids]
        continuations = []
        if self.strategy(node) == "chain":
            previous = ids
            for _ in range(node.config.resume.max_continuations):
                cont = self.executor_for(node, ":".join(["afterany", *previous]))
                cjobs = [cont.submit(job)] if node.items is None else cont.map_array(job, [u.index for u in pending])
                previous = sorted({str(j.job_id).split("_")[0] for j in cjobs})
                continuations += previous
            # Dependents start once the chain has ended; the runner checks that inputs are done.
            wait_on = [f"afterany:{i}" for i in (continuations[-1:] or ids)]
        record = self.run.state()["stages"].get(node.name, {})
        self.run.update_stage(
            node.name,
            status="submitted",
            executor="slurm",
            submitted=now(),
            job_ids=ids + continuations,
            attempts=record.get("attempts", 0) + 1,
            wait_on=wait_on,
            continuations=continuations,
            slurm_folder=str(ex.folder),
        )
        for u in pending:
            if u.index is not None:
                self.run.update_stage(u.key, status="submitted", executor="slurm")
        return ids + continuations, wait_on

    # reconciliation ----------------------------------------------------------------------------

    def job_ids(self) -> list[str]:
        return [
            j for rec in self.run.state()["stages"].values() for j in rec.get("job_ids", []) if not str(j).startswith("local:")
        ]

    def sacct(self) -> dict[str, dict]:
        """One sacct call for every job of the run: {job id: row}. Array and hetjob rows keep
        their own ids (`123_4`, `123+1`); steps (`123.batch`) are dropped."""
        ids = self.job_ids()
        if not ids:
            return {}
        fields = "JobID,State,ExitCode,Reason,NodeList,Partition,Account,Elapsed,Start,End"
        proc = subprocess.run(
            ["sacct", "-n", "-P", "-X", "--duplicates", "-j", ",".join(ids), "-o", fields],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if proc.returncode != 0:
            raise UserError(f"sacct failed: {proc.stderr.strip() or proc.stdout.strip()}")
        rows: dict[str, dict] = {}
        for line in proc.stdout.splitlines():
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
        for node in self.dag:
            record = state.get(node.name, {})
            ids = record.get("job_ids", [])
            if not ids:
                continue
            mine = {k: v for k, v in rows.items() if parse_job_id(k)["job"] in ids}
            for unit in node.units:
                if self.run.is_done(unit):
                    continue
                unit_rows = self._unit_rows(unit, mine, state.get(unit.key, {}).get("own_job_ids"))
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

    @staticmethod
    def _unit_rows(unit: Unit, rows: dict[str, dict], own_ids: list[str] | None = None) -> list[dict]:
        """The sacct rows of one unit: the whole job, its array element, or its own separate job."""
        out = []
        for jid, row in rows.items():
            parts = parse_job_id(jid)
            task = parts["task"]
            if own_ids and unit.index is not None and task is None:
                if parts["job"] in own_ids:
                    out.append(row)
            elif unit.index is None or task is None or task == str(unit.index) or task.startswith("["):
                out.append(row)
        return out

    def cancel(self) -> list[str]:
        ids = self.job_ids()
        if ids:
            subprocess.run(["scancel", *ids], check=False, capture_output=True, timeout=60)
        for key, record in self.run.state()["stages"].items():
            if record.get("status") in ("submitted", "running", "pending"):
                self.run.update_stage(key, status="cancelled", ended=now())
        return ids
