"""Executors: where stage units run. `local` (processes here) and `slurm` (jobs via submitit)."""

from __future__ import annotations

from ..errors import UserError
from .base import Executor
from .local import LocalExecutor


def make_executor(kind: str, run, dag, cfg) -> Executor:
    if kind == "local":
        return LocalExecutor(run, dag, cfg)
    if kind == "slurm":
        # the Slurm layer builds on executors.base: imported here, not at the top, to avoid the cycle
        from snowcat.slurm.executor import SlurmExecutor  # noqa: PLC0415

        return SlurmExecutor(run, dag, cfg)
    raise UserError(f"executor.kind: unknown executor {kind!r} (local, slurm)")
