"""Heterogeneous jobs on top of submitit (which cannot express them: its upstream issue 1741).

`HetjobExecutor` is a submitit `SlurmExecutor` whose batch script has one `#SBATCH hetjob`
section per component and launches a single `srun --het-group=0,1,... --mpi=PLUGIN` step, so all
components share one MPI world. Pickling, the job folder, the `_submit` entry point and result
files are submitit's own: every rank of the step sees the leader's `SLURM_JOB_ID` (checked on
Slurm 22.05), so each finds the same submitted pickle. Component job ids (`123+0`, `123+1`) are
parsed by `parse_job_id`. The srun line runs under `slurm.stepwatch`, which ends it if srun hangs
after the step finished (a Slurm 22.05 bug with heterogeneous PMIx steps).
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import submitit
from submitit.core import utils as submitit_utils

from snowcat.containers.wrap import SAFE_PATH

_HET_ID = re.compile(r"^(?P<job>\d+)(?:\+(?P<component>\d+))?(?:_(?P<task>\d+|\[.*\]))?(?:\.(?P<step>.+))?$")


def parse_job_id(job_id: str) -> dict[str, Any]:
    """`123`, `123+1` (hetjob component), `123_4` (array task), `123+0.batch` (step) -> parts."""
    m = _HET_ID.match(job_id.strip())
    if m is None:
        raise ValueError(f"not a Slurm job id: {job_id!r}")
    parts = m.groupdict()
    return {
        "job": parts["job"],
        "component": None if parts["component"] is None else int(parts["component"]),
        "task": parts["task"],
        "step": parts["step"],
    }


def sbatch_flag(key: str, value: Any) -> str:
    key = key.replace("_", "-")
    return f"#SBATCH --{key}" if value is True else f"#SBATCH --{key}={value}"


class HetjobExecutor(submitit.SlurmExecutor):
    """submitit's Slurm executor, rendering a heterogeneous job.

    `components`: ordered list of per-component sbatch options (already filtered for the site),
    e.g. `[{"partition": "gpu", "nodes": 2, "ntasks-per-node": 4, "gpus-per-node": 4}, ...]`.
    `job_options`: options for the whole job (name, output, signal, dependency, account, ...).
    `step(python_args, extra)`: the srun line of the one step over every component, which runs
    `python PYTHON_ARGS` in each (e.g. `containers.wrap.hetjob_step`: per-role images, MPMD form
    when they differ); `extra` are srun options for every component (per-rank log files).
    """

    def __init__(
        self,
        folder: str | Path,
        components: list[dict],
        job_options: dict,
        step: Callable[[list[str], list[str]], list[str]],
        setup: list[str] = (),
        python: str | None = None,
        max_num_timeout: int = 3,
    ):
        super().__init__(folder, max_num_timeout=max_num_timeout, python=python)
        if len(components) < 2:
            raise ValueError("a heterogeneous job needs at least two components")
        self.components = components
        self.job_options = job_options
        self.step = step
        self.setup = list(setup)
        # submitit reads the time limit for its timeout bookkeeping from its own parameters.
        self.parameters["time"] = int(job_options.get("time", 5))

    def _num_tasks(self) -> int:
        return sum(int(c.get("nodes", 1)) * int(c.get("ntasks-per-node", 1)) for c in self.components)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        paths = submitit_utils.JobPaths(folder=self.folder)
        stdout = str(paths.stdout).replace("%t", "0")
        lines = ["#!/bin/bash", "", "# Heterogeneous job rendered by snowcat (slurm/hetjob.py)"]
        job = {"output": stdout, "error": stdout, "open-mode": "append", **self.job_options}
        job.pop("time", None)
        for i, comp in enumerate(self.components):
            if i:
                lines.append("#SBATCH hetjob")
            opts = dict(comp)
            if i == 0:
                opts = {**{k: v for k, v in job.items()}, "time": self.job_options.get("time"), **opts}
            for key in sorted(opts):
                if opts[key] is not None:
                    lines.append(sbatch_flag(key, opts[key]))
        if self.setup:
            lines += ["", "# setup", *self.setup]
        per_task = str(paths.stdout)  # %j_%t: one log per rank, as submitit does for plain jobs
        srun = self.step(
            ["-u", "-m", "submitit.core._submit", str(self.folder)], ["--unbuffered", "--output", per_task, "--error", per_task]
        )
        watch = [
            sys.executable,
            SAFE_PATH,
            "-m",
            "snowcat.slurm.stepwatch",
            "--",
        ]  # host python: the launcher runs outside any container
        lines += [
            "",
            "# one step over every component: one MPI world",
            "export SUBMITIT_EXECUTOR=slurm",
            shlex.join(watch + srun),  # submitit's `command` is the step's python, one per component
            "",
        ]
        return "\n".join(lines)
