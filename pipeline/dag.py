"""The stage DAG: stages from the config, their `needs`, and fan-out units.

A *unit* is what one job (or one array element) runs: a whole stage, or one element of a
stage's fan-out (the cartesian product of its `fan_out` lists, in key order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from snowcat.pipeline.schema import RunConfig, StageCommon

from .config import typed
from .errors import UserError
from .sweep import fan_out_items


@dataclass(frozen=True)
class Unit:
    stage: str
    index: int | None = None  # fan-out element, None for a plain stage

    @property
    def key(self) -> str:
        return self.stage if self.index is None else f"{self.stage}[{self.index}]"


@dataclass
class StageNode:
    name: str
    kind: str
    needs: list[str]
    items: list[dict[str, Any]] | None  # fan-out elements, None for a plain stage
    config: StageCommon  # the stage's typed config (its kind's dataclass)

    @property
    def units(self) -> list[Unit]:
        if self.items is None:
            return [Unit(self.name)]
        return [Unit(self.name, i) for i in range(len(self.items))]

    @property
    def is_multi_role(self) -> bool:
        return bool(self.config.resources.components)


class Dag:
    def __init__(self, nodes: dict[str, StageNode]):
        self.nodes = nodes
        self.order = _topological_order(nodes)

    def __iter__(self):
        return (self.nodes[n] for n in self.order)

    def __getitem__(self, name: str) -> StageNode:
        return self.nodes[name]

    def units(self) -> list[Unit]:
        return [u for node in self for u in node.units]

    def of_kind(self, kind: str, stage: str | None, where, reads: str) -> list[StageNode]:
        """The stage a command's `--stage` names, checked to be a `kind` stage (UserError naming it,
        with what the command `reads` from one), else every `kind` stage of the run at `where`."""
        if stage is None:
            return [n for n in self if n.kind == kind]
        if stage not in self.nodes:
            raise UserError(f"--stage {stage!r}: no such stage in {where}")
        if self.nodes[stage].kind != kind:
            raise UserError(f"--stage {stage!r}: a {self.nodes[stage].kind} stage; {reads}")
        return [self.nodes[stage]]

    def downstream(self, name: str) -> set[str]:
        """Every stage that (transitively) needs `name`."""
        out: set[str] = set()
        frontier = [name]
        while frontier:
            current = frontier.pop()
            for node in self.nodes.values():
                if current in node.needs and node.name not in out:
                    out.add(node.name)
                    frontier.append(node.name)
        return out


def build(cfg: DictConfig | RunConfig) -> Dag:
    """The DAG of a loaded config (as composed, or already typed: a stage's `ctx.run_config`)."""
    if not cfg.stages:
        raise UserError("stages: the config declares no stages")
    run = cfg if isinstance(cfg, RunConfig) else typed(cfg)
    nodes: dict[str, StageNode] = {}
    for name, section in run.stages.items():
        where = f"stages.{name}"
        needs = list(section.needs)
        for need in needs:
            if need not in cfg.stages:
                raise UserError(f"{where}.needs: unknown stage {need!r} (stages: {', '.join(cfg.stages.keys())})")
            if need == name:
                raise UserError(f"{where}.needs: a stage cannot need itself")
        nodes[name] = StageNode(name, section.kind, needs, fan_out_items(section.fan_out, where), section)
    return Dag(nodes)


def _topological_order(nodes: dict[str, StageNode]) -> list[str]:
    """Kahn's algorithm, ties broken by declaration order; a cycle is reported with its path."""
    order: list[str] = []
    remaining = dict.fromkeys(nodes)
    while remaining:
        ready = [n for n in remaining if all(d in order for d in nodes[n].needs)]
        if not ready:
            raise UserError(f"stages: cycle in needs: {' -> '.join(_find_cycle(nodes, list(remaining)))}")
        order.append(ready[0])
        del remaining[ready[0]]
    return order


def _find_cycle(nodes: dict[str, StageNode], candidates: list[str]) -> list[str]:
    path: list[str] = []
    current = candidates[0]
    while current not in path:
        path.append(current)
        current = next(d for d in nodes[current].needs if d in candidates)
    return path[path.index(current) :] + [current]
