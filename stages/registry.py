"""The stage kinds a run config may use, torch-free: what the config loader, the runner and the
executors look a kind up in. A kind's section is its class in `stages/config.py`; the code that runs
it is `stages/<kind>.py`, which nothing here imports. A new kind is one entry in `KINDS`, its config
class and its module.
"""

from __future__ import annotations

from dataclasses import dataclass

from snowcat.stages.config import (
    CardConfig,
    EvaluateConfig,
    ExportConfig,
    MpiCheckConfig,
    PrestageConfig,
    ProbeConfig,
    PromptsConfig,
    RlConfig,
    ScanConfig,
    SelectConfig,
    SftConfig,
    TasksConfig,
    TeacherConfig,
    ValidateConfig,
)


@dataclass(frozen=True)
class StageKind:
    name: str  # what `stages.<name>.kind` says
    config: type  # its section's class (stages/config.py), beneath the common keys
    # runs a model and so wants GPUs by default; otherwise CPU work (resources.gpus_per_node)
    gpu: bool = False
    # checkpoints on the preemption notice and continues from there; a walltime continuation of any
    # other kind would start from scratch and end the same way, so it gets none (stages.X.resume)
    resumable: bool = False
    # fan-out keys it reads from its unit's element itself (ctx.item), not keys of its section
    item_keys: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        """The module that runs it, with `run(ctx)`: imported only to run a unit (it may import torch)."""
        return f"snowcat.stages.{self.name}"


# Stage kinds, in pipeline order: the kind names a run config may use, and their sections.
KINDS: dict[str, StageKind] = {
    k.name: k
    for k in (
        StageKind("prestage", PrestageConfig),
        StageKind("validate", ValidateConfig, resumable=True, item_keys=("shard",)),  # resumes from the verdict cache
        StageKind("tasks", TasksConfig),
        StageKind("sft", SftConfig, gpu=True, resumable=True),
        StageKind("teacher", TeacherConfig, gpu=True, resumable=True),
        StageKind("prompts", PromptsConfig, gpu=True, resumable=True),
        StageKind("probe", ProbeConfig, gpu=True, resumable=True),
        StageKind("select", SelectConfig),
        StageKind("rl", RlConfig, gpu=True, resumable=True),
        StageKind("evaluate", EvaluateConfig, gpu=True, item_keys=("checkpoint",)),
        StageKind("export", ExportConfig, gpu=True),
        StageKind("card", CardConfig),
        StageKind("scan", ScanConfig),
        StageKind("mpi_check", MpiCheckConfig),
    )
}
GPU_KINDS = frozenset(name for name, k in KINDS.items() if k.gpu)
RESUMABLE_KINDS = frozenset(name for name, k in KINDS.items() if k.resumable)
