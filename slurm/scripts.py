"""The batch scripts of a run's stages, as a site wants them: sbatch options checked against the
site profile and filtered of what it refuses, the job's set-up lines, how Python starts (on the host
or in the stage's image; under srun or the site's own launcher), hetjob steps, a stage's gate, and how
a stage is split into jobs (arrays, or one job per element).

Pure: nothing here asks the cluster or writes a file, so every site's scripts are rendered and
golden-tested on any machine (tests/test_golden_scripts.py).
"""

from __future__ import annotations

import shlex
import sys
from typing import TYPE_CHECKING

import submitit

from snowcat.containers.wrap import SAFE_PATH, hetjob_step, role_images, site_mpi_plugin, wrap_command
from snowcat.pipeline import notify
from snowcat.pipeline.config import typed
from snowcat.pipeline.dag import StageNode, Unit
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.executors.base import Executor
from snowcat.pipeline.rundir import RunDir
from snowcat.slurm import site as site_mod
from snowcat.slurm.site import SiteProfile
from snowcat.stages.registry import RESUMABLE_KINDS

from .hetjob import HetjobExecutor, sbatch_flag

if TYPE_CHECKING:
    from .plan import Job


class BatchScripts:
    """What each job of a run is asked to be, on one site."""

    def __init__(self, run: RunDir, cfg, site: SiteProfile):
        self.run, self.cfg, self.site = run, cfg, site

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
        if Executor.world_size(node) > 1:
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
        if Executor.world_size(node) <= 1:
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
            if Executor.world_size(node) > 1:
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
            f"# Gate of stage {node.name} (slurm/scripts.py): held until every unit of the stage is done; the",
            "# last unit to finish releases it, and the stages that need this one wait for it to complete.",
            *(sbatch_flag(k, v) for k, v in sorted(site_mod.filter_sbatch_options(self.site, options).items())),
            "",
            "true",
            "",
        ]
        return "\n".join(lines)

    def render_job(self, job: Job) -> str:
        if job.gate:
            return self.render_gate(job.node)
        return self.render(job.node, job.dependency, job.items if job.array else None)

    # how a stage is split into jobs ------------------------------------------------------------------

    def arrays(self, node: StageNode) -> bool:
        """Whether a fan-out stage goes as job arrays: not where the site has none, nor for a hetjob
        (Slurm has no arrays of heterogeneous jobs): one job per element then."""
        return self.site.arrays_allowed and not node.config.resources.components

    def groups(self, node: StageNode, pending: list[Unit]) -> list[tuple[list[int] | None, bool]]:
        """(items, as an array) per job of one round: the whole stage, arrays of at most
        max_array_size elements, or one job per element where the site has no arrays."""
        if node.items is None:
            return [(None, False)]
        indices = [u.index for u in pending]
        if not self.arrays(node):
            return [([i], False) for i in indices]
        size = self.site.max_array_size
        return [(indices[k : k + size], True) for k in range(0, len(indices), size)]
