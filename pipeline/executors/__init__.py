"""Executors: where stage units run. `local` (processes here) and `slurm` (jobs via submitit)."""

from __future__ import annotations

from ..errors import UserError
from .base import Executor


def make_executor(kind: str, run, dag, cfg) -> Executor:
    if kind == "local":
        from .local import LocalExecutor

        return LocalExecutor(run, dag, cfg)
    if kind == "slurm":
        from snowcat.slurm.executor import SlurmExecutor

        return SlurmExecutor(run, dag, cfg)
    raise UserError(f"executor.kind: unknown executor {kind!r} (local, slurm)")
