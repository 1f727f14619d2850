"""The stage kinds a run config may use, torch-free: what the config loader, the runner and the
executors look a kind up in. A kind's section is its class in `stages/config.py`; the code that runs
it is `stages/<kind>.py`, which nothing here imports.
"""

from __future__ import annotations

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

# Stage kinds, in pipeline order: the kind names a run config may use, and their sections.
KINDS: dict[str, type] = {
    "prestage": PrestageConfig,
    "validate": ValidateConfig,
    "tasks": TasksConfig,
    "sft": SftConfig,
    "teacher": TeacherConfig,
    "prompts": PromptsConfig,
    "probe": ProbeConfig,
    "select": SelectConfig,
    "rl": RlConfig,
    "evaluate": EvaluateConfig,
    "export": ExportConfig,
    "card": CardConfig,
    "scan": ScanConfig,
    "mpi_check": MpiCheckConfig,
}
# Kinds that run a model and so want GPUs by default; the others are CPU work (resources.gpus_per_node).
GPU_KINDS = frozenset({"sft", "teacher", "prompts", "probe", "rl", "evaluate", "export"})
# Kinds that checkpoint on the preemption notice and continue from there; a walltime continuation of any
# other kind would start from scratch and end the same way, so they get none (stages.X.resume).
RESUMABLE_KINDS = frozenset({"validate", "sft", "teacher", "prompts", "probe", "rl"})  # validate: from the verdict cache
# Fan-out keys a kind reads from its unit's element itself (ctx.item), not a key of its section.
ITEM_KEYS = {"evaluate": ("checkpoint",), "validate": ("shard",)}  # read by the stage itself from ctx.item
