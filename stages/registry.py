"""The stage kinds a run config may use, torch-free: what the config loader, the runner and the
executors look a kind up in. A kind's section is its class in `stages/config.py`; the code that runs
it is `stages/<kind>.py`, which nothing here imports. A new kind is one entry in `KINDS`, its config
class and its module (plus, as tests check, its row in docs/configuration.md and its module in the
import contracts of pyproject.toml).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
    summary: str  # what it does, one line (docs/configuration.md's table of stage kinds, `snowcat config --help`)
    # runs a model and so wants GPUs by default; otherwise CPU work (resources.gpus_per_node)
    gpu: bool = False
    # checkpoints on the preemption notice and continues from there; a walltime continuation of any
    # other kind would start from scratch and end the same way, so it gets none (stages.X.resume)
    resumable: bool = False
    # fan-out keys it reads from its unit's element itself (ctx.item), not keys of its section
    item_keys: tuple[str, ...] = ()
    # how `snowcat plan` counts its time (pipeline/plan/core.py): "model" (steps, sampling, episodes),
    # "short" (a job's start plus the site's stage_work_s), "walltime" (not modelled: an upper bound)
    plan: Literal["model", "short", "walltime"] = "walltime"

    @property
    def module(self) -> str:
        """The module that runs it, with `run(ctx)`: imported only to run a unit (it may import torch)."""
        return f"snowcat.stages.{self.name}"


# Stage kinds, in pipeline order: the kind names a run config may use, and their sections. A summary is
# what docs/configuration.md's table of stage kinds says (tests/test_config.py compares them).
KINDS: dict[str, StageKind] = {
    k.name: k
    for k in (
        StageKind(
            "prestage",
            PrestageConfig,
            "stage models, tokenizers, datasets, wheels into shared storage with sha256 (login node)",
            plan="short",
        ),
        StageKind(
            "validate",
            ValidateConfig,
            "check a tasks stage's imported tasks before it runs, as a job array (`fan_out: {shard: [0, 1, ...]}`)",
            resumable=True,  # from the verdict cache
            item_keys=("shard",),
        ),
        StageKind(
            "tasks",
            TasksConfig,
            "generate and import verifiable tasks (imported ones validated first) with a held-out split",
            plan="short",
        ),
        StageKind(
            "sft",
            SftConfig,
            "tokenizer, MoE model, supervised fine-tuning with Relay examples",
            gpu=True,
            resumable=True,
            plan="model",
        ),
        StageKind(
            "teacher",
            TeacherConfig,
            "a teacher model plays the training tasks in the agent loop; its verified successes become SFT demonstrations"
            " (a job array over `shard`); with `student`, Relay: a checkpoint of the run starts each episode and the"
            " teacher takes over",
            gpu=True,
            resumable=True,
            plan="model",
        ),
        StageKind(
            "prompts",
            PromptsConfig,
            "score candidate prompts on development tasks with a checkpoint; choose one with paired statistics"
            ' (`rl.rollout_prompt: "prompts:<stage>"`)',
            gpu=True,
            resumable=True,
        ),
        StageKind(
            "probe",
            ProbeConfig,
            "sample a checkpoint on the training tasks: pass counts per task",
            gpu=True,
            resumable=True,
            plan="model",
        ),
        StageKind(
            "select", SelectConfig, "keep the tasks in the useful band (solved `min_pass`..`max_pass` times)", plan="short"
        ),
        StageKind(
            "rl",
            RlConfig,
            "GRPO / Dr. GRPO / RLOO / RLOO-N with truncated importance sampling; trainer and rollout ranks",
            gpu=True,
            resumable=True,
            plan="model",
        ),
        StageKind(
            "evaluate",
            EvaluateConfig,
            "pass@k, standard errors over tasks, paired differences, infrastructure failures excluded",
            gpu=True,
            item_keys=("checkpoint",),
            plan="model",
        ),
        StageKind(
            "export",
            ExportConfig,
            "Hugging Face checkpoint plus an inference-equivalence check with `transformers`",
            gpu=True,
            plan="short",
        ),
        StageKind("card", CardConfig, "the provenance card", plan="short"),
        StageKind("scan", ScanConfig, "fail the run if a credential is anywhere in the run directory", plan="short"),
        StageKind("mpi_check", MpiCheckConfig, "prove a multi-role job is one MPI world (run it as a hetjob)", plan="short"),
    )
}
GPU_KINDS = frozenset(name for name, k in KINDS.items() if k.gpu)
RESUMABLE_KINDS = frozenset(name for name, k in KINDS.items() if k.resumable)
