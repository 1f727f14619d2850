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
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import submitit

from snowcat.containers.wrap import SAFE_PATH, hetjob_step, role_images, site_mpi_plugin, wrap_command
from snowcat.pipeline import notify
from snowcat.pipeline.config import typed
from snowcat.pipeline.context import PREEMPTED_EXIT_CODE, catch_notice_early, first_notice
from snowcat.pipeline.dag import StageNode, Unit, build
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.executors.base import Executor
from snowcat.pipeline.fsio import atomic_write_json, atomic_write_text, read_json
from snowcat.pipeline.rundir import RunDir, now
from snowcat.pipeline.runner import launcher_rank, run_unit
from snowcat.slurm import site as site_mod
from snowcat.slurm.limits import cached_live_limits, stage_problem, submit_limit
from snowcat.slurm.site import SiteProfile, use_local_cluster
from snowcat.stages.registry import RESUMABLE_KINDS

from .hetjob import HetjobExecutor, parse_job_id, sbatch_flag

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


def stage_job_ids(node: StageNode, state: dict) -> set[str]:
    """Every Slurm job id of a stage: its submissions, its gate, continuations its units queued themselves."""
    record = state.get(node.name, {})
    ids = {j for j in record.get("job_ids", []) if not str(j).startswith("local:")}
    if record.get("gate"):
        ids.add(record["gate"])
    for unit in node.units:
        ids |= {parse_job_id(j)["job"] for j in state.get(unit.key, {}).get("own_job_ids", [])}
    return ids


def scancel(ids: list[str]) -> None:
    if ids:
        subprocess.run(["scancel", *ids], check=False, capture_output=True, timeout=60)


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
    self_continue: bool = False  # chain by submitting its own successor (see SlurmExecutor.self_continuing)

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
            scancel(self._own_continuations(run, unit))
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
            scancel(self._own_continuations(run, unit))
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
        graph = build(cfg)
        ex = SlurmExecutor(run, graph, cfg).executor_for(graph[unit.stage], f"afterany:{current_job_id()}")
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
            subprocess.run(["scontrol", "release", gate], check=False, capture_output=True, timeout=60)

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
        scancel([g for g in [state.get(unit.stage, {}).get("gate")] if g])  # the stage cannot complete now
        for name in sorted(dag.downstream(unit.stage)):
            ids = sorted(stage_job_ids(dag[name], state))
            if not ids or all(run.is_done(u) for u in dag[name].units):
                continue
            scancel(ids)
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

JOURNAL = "submitting.json"  # job ids queued by a submission still in progress


@dataclass
class Job:
    """One sbatch call: a stage's job, array (over `items`) or element job, in its chain."""

    label: str  # "more", "more.chunk1", "more[3]", "more.continuation2", ...
    node: StageNode
    items: list[int] | None
    array: bool
    dependency: str | None
    job_id: str = ""
    gate: str | None = None  # the partition of a stage's gate job (see SlurmExecutor.self_continuing)

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


def queued_jobs_by_partition() -> dict[str, int]:
    """This user's jobs now queued or running, by partition, array tasks expanded (what MaxSubmit counts)."""
    user = os.environ.get("USER") or pwd.getpwuid(os.getuid()).pw_name
    try:
        proc = subprocess.run(["squeue", "-h", "-r", "-u", user, "-o", "%P"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    counts: dict[str, int] = {}
    for line in proc.stdout.split() if proc.returncode == 0 else []:
        counts[line] = counts.get(line, 0) + 1
    return counts


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
        options |= notify.sbatch_options(typed(self.cfg).notify, node.name)  # Slurm's own mail, if asked for
        return site_mod.filter_sbatch_options(self.site, options)

    def _setup(self, node: StageNode) -> list[str]:
        lines = [f"module load {m}" for m in self.site.modules]
        images = (
            [node.config.image, *role_images(node.config).values()] if node.config.resources.components else [node.config.image]
        )
        if any(images) and self.site.container_module and self.site.container_module not in self.site.modules:
            lines.append(f"module load {self.site.container_module}")
        for key, value in self.site.env.items():
            lines.append(f"export {key}={shlex.quote(str(value))}")
        lines.append(f"export SNOWCAT_RUN_DIR={shlex.quote(str(self.run.path))}")
        lines.append("export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}")
        if self.world_size(node) > 1:
            # torch.distributed rendezvous: the job's first node (hetjob: the first component's), on
            # the site's interconnect name (JSC: hostname + "i"); a port per job, so jobs sharing a
            # node do not collide.
            suffix = self.site.master_addr_suffix
            lines.append(f'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1){suffix}"')
            lines.append("export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))")
        return lines

    def _python(self, node: StageNode) -> str:
        """The python command the job runs: on the host, or inside the stage's container image."""
        runtime = self.site.container_runtime
        if not node.config.image or runtime == "none":
            return f"{shlex.quote(sys.executable)} {SAFE_PATH}"

        res = node.config.resources
        image = self._image(node.config.image, res)
        return shlex.join(
            wrap_command(
                ["python", SAFE_PATH],
                runtime=runtime,
                image=image,
                binds=self._binds(),
                gpu=res.gpus_per_node > 0 and self.site.partitions[self._partition(res)].accel() == "cuda",  # --nv: NVIDIA only
            )
        )

    def _image(self, image: str | None, res) -> str | None:
        """An image path for the nodes it runs on: `{cpu_arch}` becomes the partition's CPU
        architecture, so one config serves aarch64 (Vista, JUPITER) and x86_64 (JUWELS, Frontera)."""
        if image is None or "{cpu_arch}" not in image:
            return image
        return image.replace("{cpu_arch}", self.site.partitions[self._partition(res)].cpu_arch)

    def _binds(self) -> list[str]:
        """What a container sees of the host: the run directory, scratch and project storage."""
        return [str(self.run.path)] + [str(p) for p in (self.site.scratch, self.site.project) if p]

    def _launch_args(self, node: StageNode) -> list[str]:
        # Slurm 22.05-23.02 do not hand sbatch's --cpus-per-task down to srun: say it again.
        args = [f"--cpus-per-task={int(node.config.resources.cpus_per_task)}"]
        if self.world_size(node) <= 1:
            return args
        plugin = site_mpi_plugin(self.site)
        return args + ([f"--mpi={plugin}"] if plugin else []) + ["--kill-on-bad-exit=1"]

    @staticmethod
    def continuations(node: StageNode) -> int:
        """Walltime continuations of a stage: none for kinds that cannot continue from a checkpoint."""
        return node.config.resume.max_continuations if node.kind in RESUMABLE_KINDS else 0

    def self_continuing(self, node: StageNode) -> bool:
        """Chain without pre-submitted continuations: where compute nodes may call sbatch
        (`sbatch_on_compute`), a preempted unit queues its own next job, and dependents wait on the
        stage's gate, a held job that the last unit to finish releases. Only the jobs that are needed
        are ever queued (a chain of 3 costs 1 + 1 jobs instead of 4)."""
        return self.strategy(node) == "chain" and self.site.sbatch_on_compute and self.continuations(node) > 0

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
            # A dependency that can never be met (afterok on a failed or cancelled job) ends the job
            # instead of leaving it pending forever (DependencyNeverSatisfied).
            job["kill-on-invalid-dep"] = "yes"
        max_timeouts = node.config.resume.max_continuations
        if res.components:
            if not self.site.hetjobs_allowed:
                raise UserError(f"stages.{node.name}: site {self.site.name} does not allow heterogeneous jobs")

            comps = [
                self._resource_options(f"{where}.components.{name}", comp, time_min) for name, comp in res.components.items()
            ]
            images = [self._image(image, comp) for image, comp in zip(role_images(node.config).values(), res.components.values())]
            gpus = [c.gpus_per_node > 0 for c in res.components.values()]

            def step(python_args: list[str], io: list[str]) -> list[str]:
                return hetjob_step(
                    self.site,
                    self.site.container_runtime,
                    images,
                    python_args,
                    binds=self._binds(),
                    gpus=gpus,
                    cpus_per_task=[int(c.cpus_per_task) for c in res.components.values()],
                    extra=["--kill-on-bad-exit=1", *io],
                    host_python=sys.executable,
                )

            return HetjobExecutor(folder, comps, job, step, setup=self._setup(node), max_num_timeout=max_timeouts)
        python = self._python(node)
        in_batch_step = self.site.launcher != "srun"
        if in_batch_step:
            # TACC: python (or ibrun) runs in the batch step, which only `--signal=B:` reaches. A
            # single rank is exec'd so it is the batch step's process; ibrun runs under stepwatch,
            # which forwards the signal to it.
            if self.world_size(node) > 1:
                python = (
                    f"exec {shlex.quote(sys.executable)} {SAFE_PATH} -m snowcat.slurm.stepwatch -- {self.site.launcher} {python}"
                )
            else:
                python = f"exec {python}"
        ex = submitit.SlurmExecutor(folder, max_num_timeout=max_timeouts, python=python)
        options = {**job, **self._resource_options(where, res, time_min)}
        params = {
            "job_name": options.pop("job-name"),
            "time": options.pop("time"),
            "signal_delay_s": node.config.resume.signal_margin_s,
            "setup": self._setup(node),
            "srun_args": self._launch_args(node),
            "use_srun": not in_batch_step,
            "wckey": "snowcat",
            "array_parallelism": int(node.config.max_parallel or self.site.max_array_parallel),
        }
        signal_opt = options.pop("signal", None)
        if in_batch_step:
            options["signal"] = f"B:{signal_opt}"  # overrides submitit's own --signal (no B:)
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

    def render(self, node: StageNode, dependency: str | None = None, items: list[int] | None = None) -> str:
        """The batch script of one job of this stage (nothing is submitted or written): `items` makes
        it an array over those elements (all pending ones by default, for a fan-out stage)."""
        ex = self.executor_for(node, dependency)
        if items is None and node.items is not None and self.arrays(node):
            items = [u.index for u in node.units][: self.site.max_array_size]
        if items is not None:
            ex.parameters["map_count"] = len(items)
        return ex._make_submission_file_text(ex._submitit_command_str, "render")

    def gate_partition(self, node: StageNode) -> str:
        return self.site.cpu_partition or self._partition(node.config.resources)

    def render_gate(self, node: StageNode) -> str:
        """The batch script of a stage's gate: held until its last unit finishes, then it runs `true`."""
        folder = self.run.path / "slurm" / node.name
        options = {
            "job-name": f"snowcat-{self.run.run_id}-{node.name}-gate"[:120],
            "partition": self.gate_partition(node),
            "nodes": 1,
            "ntasks-per-node": 1,
            "cpus-per-task": 1,
            "time": 1,
            "hold": True,
            "no-requeue": True,
            "output": str(folder / "gate_%j.out"),
            "account": self.site.account,
            "wckey": "snowcat",
        }
        lines = [
            "#!/bin/bash",
            "",
            f"# Gate of stage {node.name} (slurm/executor.py): held until every unit of the stage is done; the",
            "# last unit to finish releases it, and the stages that need this one wait for it to complete.",
            *(sbatch_flag(k, v) for k, v in sorted(site_mod.filter_sbatch_options(self.site, options).items())),
            "",
            "true",
            "",
        ]
        return "\n".join(lines)

    def _render_job(self, job: Job) -> str:
        if job.gate:
            return self.render_gate(job.node)
        return self.render(job.node, job.dependency, job.items if job.array else None)

    # planning ------------------------------------------------------------------------------------

    def arrays(self, node: StageNode) -> bool:
        """Whether a fan-out stage goes as job arrays: not where the site has none, nor for a hetjob
        (Slurm has no arrays of heterogeneous jobs): one job per element then."""
        return self.site.arrays_allowed and not node.config.resources.components

    def _groups(self, node: StageNode, pending: list[Unit]) -> list[tuple[list[int] | None, bool]]:
        """(items, as an array) per job of one round: the whole stage, arrays of at most
        max_array_size elements, or one job per element where the site has no arrays."""
        if node.items is None:
            return [(None, False)]
        indices = [u.index for u in pending]
        if not self.arrays(node):
            return [([i], False) for i in indices]
        size = self.site.max_array_size
        return [(indices[k : k + size], True) for k in range(0, len(indices), size)]

    def _plan_stage(
        self, node: StageNode, dependency: str | None, submit: Callable[[Job], str], units: list[Unit]
    ) -> StageRecord:
        """Queue `units` of one stage through `submit` (real sbatch, or a dry run that only names the jobs).

        Every unit owns its jobs: its element of each array (`124_2`) or its own jobs, in chain order,
        so a unit that finishes cancels its own continuations and never another element's."""
        chain = self.strategy(node) == "chain"
        gated = self.self_continuing(node)
        rounds = 1 + (self.continuations(node) if chain and not gated else 0)
        record = StageRecord()
        for g, (items, array) in enumerate(self._groups(node, units)):
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
            record.gate = submit(Job(f"{node.name}.gate", node, None, False, None, gate=self.gate_partition(node)))
            record.wait_on = [f"afterok:{record.gate}"]
        return record

    def _plan(self, stages: list[str], submit: Callable[[Job], str]) -> dict[str, StageRecord]:
        """Queue what `stages` need, in DAG order. A unit whose own jobs are still queued or running
        keeps them; the others are queued again. A stage whose inputs were queued again is queued
        again whole (its jobs wait on replaced ones). Jobs to replace go to `self._replace`."""
        state = self.run.state()["stages"]
        records: dict[str, StageRecord] = {}
        waits: dict[str, list[str]] = {}
        self._replace: list[str] = []
        alive_jobs = {parse_job_id(k)["job"] for k in self._live}
        alive = RowIndex(self._live)
        for node in self.dag:
            if node.name not in stages:
                continue
            pending = self.pending_units(node)
            if not pending:  # it finished since the stages to run were listed (a job that ended as resume started)
                continue
            record = state.get(node.name, {})
            ids = stage_job_ids(node, state)
            live = {k: r for k, r in self._live.items() if parse_job_id(k)["job"] in ids}
            running = [u for u in pending if alive.of(self._own_ids(u, state))] if live else []
            gate = record.get("gate")
            replaced = any(n in records for n in node.needs) or any(
                "DependencyNeverSatisfied" in r["reason"] for r in live.values()
            )
            if replaced:
                self._replace += sorted({parse_job_id(k)["job"] for k in live})
                running = []
            elif running and len(running) == len(pending) and (not gate or gate in alive_jobs):
                waits[node.name] = record.get("wait_on") or [f"afterok:{j}" for j in record["job_ids"]]
                continue
            if gate and not replaced:
                self._replace.append(gate)  # a new gate stands for every unit, old and new
            terms = [t for n in node.needs if n in waits for t in waits[n]]
            todo = [u for u in pending if u not in running]
            records[node.name] = new = self._plan_stage(node, ",".join(terms) or None, submit, todo)
            kept = [t for t in record.get("wait_on", []) if running and t.split(":")[-1] in alive_jobs and not new.gate]
            new.wait_on = kept + new.wait_on
            waits[node.name] = new.wait_on
        return records

    @staticmethod
    def _own_ids(unit: Unit, state: dict) -> list[str]:
        return state.get(unit.key, {}).get("own_job_ids", [])

    def dry_run(self, stages: list[str], out: Path) -> list[Path]:
        """Write the batch script of every job `launch` would submit into `out`, after the same checks
        (rendering runs them; on an error the caller discards `out`); job ids that only sbatch can
        give appear as `<job of LABEL>` in dependencies."""
        self._live = {}
        written: list[Path] = []

        def write(job: Job) -> str:
            written.append(out / f"{job.label}.sbatch")
            atomic_write_text(written[-1], self._render_job(job))
            return f"<job of {job.label}>"

        self._plan([s for s in stages if self.dag[s].config.where != "login"], write)
        return written

    # submission ----------------------------------------------------------------------------------

    def _alive_jobs(self) -> dict[str, dict]:
        """This run's jobs that are still queued or running, by job id: sacct's rows, and squeue's for
        jobs accounting does not list yet (slurmdbd records a submission a moment after sbatch returns:
        a `resume` right after `run` saw none of them alive and queued the whole DAG again)."""
        self._wait_for_ending_jobs()
        rows = self.sacct()
        alive = {jid: row for jid, row in rows.items() if row["state"].split()[0] in ALIVE}
        # squeue speaks only for jobs accounting does not know: a job sacct lists as CANCELLED may
        # still be in squeue a moment (COMPLETING), and resume took it for alive and queued nothing
        known = {parse_job_id(jid)["job"] for jid in rows}
        unknown = sorted({parse_job_id(jid)["job"] for jid in self.job_ids()} - known)
        queued = self._queued() if unknown else {}
        if queued is None:  # a busy controller: "no answer" is not "none queued", which resubmits the DAG
            raise UserError(
                f"squeue did not answer and accounting does not list jobs {', '.join(unknown)} of this run yet: "
                "whether they are queued is not known, so nothing was submitted; run `snowcat resume` again"
            )
        unlisted = {jid: row for jid, row in queued.items() if parse_job_id(jid)["job"] not in known and row["state"] in ALIVE}
        return {**unlisted, **alive}

    def _wait_for_ending_jobs(self, limit_s: float = 120.0) -> None:
        """A cancelled job's processes may still be saving its checkpoint (SIGTERM): a job queued
        for the unit now would meet them holding it. Wait, up to `limit_s` (a node stuck in
        COMPLETING must not block every resume), until squeue lists none of the run's jobs COMPLETING."""
        deadline, said = time.monotonic() + limit_s, False
        while ending := sorted(j for j, r in (self._queued() or {}).items() if r["state"] == "COMPLETING"):
            if time.monotonic() > deadline:
                print(f"jobs {', '.join(ending)} still COMPLETING after {limit_s:.0f} s; going on", file=sys.stderr)
                return
            if not said:
                print(f"waiting for jobs {', '.join(ending)} to finish ending (COMPLETING)", file=sys.stderr)
                said = True
            time.sleep(2)

    def _queued(self) -> dict[str, dict] | None:
        """The run's jobs squeue lists, {job id: state and reason}; None when squeue gave no answer
        (a controller under load times out now and then)."""
        ids = set(self.job_ids())
        user = os.environ.get("USER") or pwd.getpwuid(os.getuid()).pw_name
        try:
            proc = subprocess.run(
                ["squeue", "-h", "-r", "-u", user, "-o", "%i|%T|%r"], capture_output=True, text=True, timeout=60
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        if proc.returncode != 0:
            return None
        rows = [line.split("|") for line in proc.stdout.splitlines()]
        return {r[0]: {"state": r[1], "reason": r[2]} for r in rows if len(r) == 3 and parse_job_id(r[0])["job"] in ids}

    def launch(self, stages: list[str]) -> int:
        self._cancel_unrecorded()
        compute = self._run_login_stages(stages)
        if compute is None:
            return 1
        self._live = self._alive_jobs()
        planned: list[Job] = []

        def count(job: Job) -> str:
            self._render_job(job)  # every check, before anything is queued
            planned.append(job)
            return f"<job of {job.label}>"

        self._plan(compute, count)
        self._check_budget(planned)
        scancel(self._replace)  # waits on replaced jobs, or a gate a new one stands in for
        records = self._submit_all(compute)
        for name, record in records.items():
            self._record(self.dag[name], record)
            gate = f" (gate {record.gate})" if record.gate else ""
            print(f"submitted {name}: {', '.join(record.main + record.continuations)}{gate}", file=sys.stderr)
        print(f"the run continues on the cluster; follow it with: snowcat status {self.run.path}", file=sys.stderr)
        return 0

    def _submit_all(self, stages: list[str]) -> dict[str, StageRecord]:
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
            ex = self.executor_for(job.node, job.dependency)
            node = job.node
            call = StageJob(
                str(self.run.path),
                node.name,
                self.strategy(node),
                node.config.resume.max_continuations,
                self.self_continuing(node),
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
            records = self._plan(stages, submit)
        except (
            submitit.core.utils.FailedJobError,
            submitit.core.utils.FailedSubmissionError,
            subprocess.CalledProcessError,
        ) as e:
            scancel(queued)
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
        atomic_write_text(script, self.render_gate(node))
        proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, "sbatch", proc.stdout, proc.stderr.strip() or proc.stdout)
        return re.search(r"(\d+)", proc.stdout).group(1)

    def _cancel_unrecorded(self) -> None:
        """Jobs an interrupted submission queued but never recorded: cancel them before submitting again."""
        journal = self.run.path / "slurm" / JOURNAL
        if journal.is_file():
            ids = read_json(journal).get("queued", [])
            scancel(ids)
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
        index = RowIndex(rows)
        for node in self.dag:
            ids = stage_job_ids(node, state)
            if not ids:
                continue
            for unit in node.units:
                if self.run.is_done(unit):
                    continue
                own = self._own_ids(unit, state)
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

    def cancel(self) -> list[str]:
        ids = self.job_ids()
        if ids:
            subprocess.run(["scancel", *ids], check=False, capture_output=True, timeout=60)
        for key, record in self.run.state()["stages"].items():
            if record.get("status") in ("submitted", "running", "pending"):
                self.run.update_stage(key, status="cancelled", ended=now())
        return ids
