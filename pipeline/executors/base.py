"""The executor interface: what every backend (local processes, Slurm) implements.

`launch` starts the work for the stages that are not done (the local executor runs them to
completion; the Slurm executor submits the whole DAG at once and returns). `refresh` reconciles
the run's state records with reality (live processes, `sacct`); `cancel` stops everything.
"""

from __future__ import annotations

import abc

from ..dag import Dag, StageNode, Unit
from ..rundir import RunDir


class Executor(abc.ABC):
    name: str = "?"

    def __init__(self, run: RunDir, dag: Dag, cfg):
        self.run = run
        self.dag = dag
        self.cfg = cfg

    @abc.abstractmethod
    def launch(self, stages: list[str]) -> int:
        """Run or submit these stages (a dependency-closed set, in DAG order). Exit status."""

    def refresh(self) -> None:  # noqa: B027 (a hook: nothing to reconcile by default)
        """Reconcile state records with the processes or jobs behind them."""

    @abc.abstractmethod
    def cancel(self) -> list[str]:
        """Stop all work of the run; returns what was cancelled (process or job ids)."""

    # --- shared helpers ----------------------------------------------------------------------

    def pending_units(self, node: StageNode) -> list[Unit]:
        return [u for u in node.units if not self.run.is_done(u)]

    @staticmethod
    def world_size(node: StageNode) -> int:
        comps = node.config.resources.components
        if comps:
            return sum(c.nodes * c.tasks_per_node for c in comps.values())
        return node.config.resources.nodes * node.config.resources.tasks_per_node
