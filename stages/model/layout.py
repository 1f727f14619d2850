"""How a Megatron trainer lays the model over its ranks, checked before anything is built or submitted
(torch-free: the configuration layer checks a layout at load).

    layout = Layout(tensor=2, pipeline=2, expert=2)
    problems = list(layout.problems(model_cfg, world_size=8))   # [(key, why)], empty when it fits

Ranks are ordered as megatron-core orders them (tp-cp-ep-dp-pp): tensor-parallel ranks are
neighbours (one node), pipeline stages the farthest apart. Data parallelism is what is left:
world / (tensor x pipeline); the experts are additionally split over `expert` of those ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.schema import Problem
from snowcat.stages.model import hf
from snowcat.stages.model.config import ModelConfig

CONVERTIBLE = ("qwen3_moe",)  # architectures the bridge converts (mbridge's, with what stages/train/megatron adds)


@dataclass(frozen=True)
class Layout:
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1

    @classmethod
    def of(cls, cfg) -> Layout:
        """The layout a trainer config (stages.config.Parallelism) asks for."""
        return cls(cfg.tensor_parallel, cfg.pipeline_parallel, cfg.expert_parallel)

    def data(self, world_size: int) -> int:
        return world_size // (self.tensor * self.pipeline)

    def problems(self, model: ModelConfig | None, world_size: int) -> Iterator[Problem]:
        """(config key, why) for each way this layout cannot hold `model` on `world_size` ranks."""
        model_parallel = self.tensor * self.pipeline
        if world_size % model_parallel:
            key = "tensor_parallel" if world_size % self.tensor else "pipeline_parallel"
            product = f"tensor_parallel x pipeline_parallel = {self.tensor} x {self.pipeline}"
            yield key, f"{product} does not divide the {world_size} trainer ranks"
            return
        data = world_size // model_parallel
        if data % self.expert:
            yield "expert_parallel", f"{self.expert} does not divide the {data} data-parallel ranks (world / (tensor x pipeline))"
        if model is None:
            return
        if model.num_experts % self.expert:
            yield "expert_parallel", f"{self.expert} does not divide the model's {model.num_experts} experts"
        if self.pipeline > model.num_layers:
            yield "pipeline_parallel", f"{self.pipeline} stages for {model.num_layers} layers"
        elif model.num_layers % self.pipeline:
            yield "pipeline_parallel", f"{self.pipeline} does not divide the model's {model.num_layers} layers"
        if model.num_kv_heads % self.tensor:
            yield "tensor_parallel", f"{self.tensor} does not divide the model's {model.num_kv_heads} key/value heads"
        if model.vocab_size % self.tensor:
            yield "tensor_parallel", f"{self.tensor} does not divide the vocabulary ({model.vocab_size})"


def unsupported(cfg: ModelConfig) -> str | None:
    """Why the Megatron backend cannot hold this model, or None."""
    try:
        kind = hf.hf_model_type(cfg)
    except UserError as e:
        return str(e)
    if kind not in CONVERTIBLE:
        return f"architecture {kind} has no Megatron conversion here (supported: {', '.join(CONVERTIBLE)})"
    if cfg.mlp_only_layers:
        return "dense layers between MoE layers (mlp_only_layers) are not converted yet"
    if cfg.expert_capacity_factor > 0:
        return "token dropping (expert_capacity_factor > 0) is not mapped to Megatron's capacity"
    return None
