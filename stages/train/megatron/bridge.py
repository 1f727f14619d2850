"""Hugging Face <-> Megatron: the GPTModel of a run's model, and its weights both ways, through mbridge.

    bridge = make_bridge(model_cfg)                  # UserError for an architecture it cannot convert
    gpt = build_gpt(bridge)                          # this rank's part (its stage, TP/EP slices)
    bridge.load_weights([gpt], model_dir)            # HF-named safetensors -> this rank's slices
    for hf_name, whole in bridge.export_weights([gpt]): ...   # collective, whole tensors, HF names

mbridge maps names and layouts (fused QKV, gate/up, TP/EP/PP slices) for Qwen3-MoE, Qwen3 and more.
What it lacks is written here: its names assume Transformer Engine's grouped experts
(`experts.linear_fc1.weight<e>`), while without TE (the CPU, a site without it) megatron-core
builds one module per expert (`experts.local_experts.<e>.linear_fc1.weight`); a model whose
input embedding is tied to its output reads the output weight from the embedding; a shared expert
(Qwen2-MoE's form, on a model otherwise Qwen3-MoE) is declared to megatron; a model directory is
read without a config.json (none where no Hugging Face architecture expresses the model); and the
model configuration comes from the run's own ModelConfig, made CPU-safe where no GPU is present.
"""

from __future__ import annotations

import dataclasses
import os
import re

import torch

from snowcat.pipeline.errors import UserError
from snowcat.stages.model import hf
from snowcat.stages.model.config import ModelConfig
from snowcat.stages.model.layout import unsupported

from . import cpu

_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def hf_config(cfg: ModelConfig):
    """The transformers config of the architecture `cfg` exports as. A shared expert (ours is
    Qwen2-MoE's: a SwiGLU MLP behind a sigmoid gate, under Qwen2-MoE's weight names) is carried as
    Qwen2-MoE's `shared_expert_intermediate_size` on the Qwen3-MoE config: Qwen3-MoE has no field
    for it, and mbridge's Qwen3-MoE bridge inherits Qwen2-MoE's names for its weights."""
    from transformers import AutoConfig

    fields = hf.hf_config_dict(dataclasses.replace(cfg, shared_expert_intermediate_size=0))
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config.rope_theta = cfg.rope_theta  # transformers 5 keeps it in rope_parameters only; mbridge reads this
    if cfg.shared_expert_intermediate_size:
        config.shared_expert_intermediate_size = cfg.shared_expert_intermediate_size
    return config


def make_bridge(cfg: ModelConfig, dtype: torch.dtype = torch.float32):
    """An mbridge bridge for `cfg` over megatron's current process groups (made by the backend first)."""
    why = unsupported(cfg)
    if why:
        raise UserError(f"trainer.backend megatron: {why}")
    cpu.apply()
    from mbridge import AutoBridge

    base = type(AutoBridge.from_config(hf_config(cfg), dtype=dtype))
    bridge = type(f"Snowcat{base.__name__}", (_Adapted, base), {})(hf_config(cfg), dtype=dtype)
    bridge.set_extra_args(**_overrides(cfg, dtype))
    return bridge


def _overrides(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """TransformerConfig fields that differ from mbridge's defaults: the run's router losses and
    top-k normalisation, no dropout, and no fused kernels where there is no GPU."""
    gpu = torch.cuda.is_available()
    return {
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "bf16": dtype == torch.bfloat16,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        # HF Qwen3-MoE: softmax over all experts, top-k, renormalised when norm_topk_prob; the same
        # distribution as a softmax over the top-k logits (megatron's pre_softmax=False)
        "moe_router_pre_softmax": not cfg.norm_topk_prob,
        "moe_router_load_balancing_type": "aux_loss" if cfg.router_aux_loss_coef else "none",
        "moe_aux_loss_coeff": cfg.router_aux_loss_coef,
        "moe_z_loss_coeff": cfg.router_z_loss_coef or None,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": gpu and _have_te(),
        "moe_permute_fusion": False,
        "moe_router_dtype": "fp32",
        "masked_softmax_fusion": gpu,
        "persist_layer_norm": gpu,
        "bias_activation_fusion": gpu,
        "bias_dropout_fusion": gpu,
        "gradient_accumulation_fusion": False,
        "use_cpu_initialization": not gpu,
        "moe_shared_expert_overlap": False,
        # our shared expert: a SwiGLU MLP beside the routed experts, scaled by sigmoid(x . gate)
        "moe_shared_expert_intermediate_size": cfg.shared_expert_intermediate_size or None,
        "moe_shared_expert_gate": bool(cfg.shared_expert_intermediate_size),
    }


def _have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


class _Adapted:
    """What the bridge lacks, mixed in front of mbridge's class for the model's architecture."""

    def _get_transformer_layer_spec(self, vp_stage=None):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(self.config, use_transformer_engine=_have_te(), vp_stage=vp_stage)

    def _get_safetensor_io(self, weights):
        if isinstance(weights, dict):  # a model in memory (a fresh init), by HF name
            return _InMemory(weights)
        return super()._get_safetensor_io(str(weights))

    def _get_actual_hf_path(self, weight_path: str) -> str:
        # a local model directory as it is: mbridge finds one by its config.json, which ours lacks
        # where no Hugging Face architecture expresses the model (a shared expert); it reads the
        # safetensors only
        return weight_path if os.path.isdir(weight_path) else super()._get_actual_hf_path(weight_path)

    def _weight_name_mapping_mcore_to_hf(self, name: str) -> list[str]:
        if name == "output_layer.weight" and self.hf_config.tie_word_embeddings:
            return ["model.embed_tokens.weight"]  # a tied model's checkpoint stores the embedding only
        if name.endswith(".input_layernorm.weight"):  # without TE the norm is its own module, not fused into QKV
            return [f"model.layers.{name.split('.')[2]}.input_layernorm.weight"]
        return super()._weight_name_mapping_mcore_to_hf(name)

    def _weight_merge_across_tp(self, name, weights, param):
        if "mlp.experts.linear_fc" in name and self.mpu.etp_size == 1:  # experts are whole on each TP rank
            return weights[0]
        return super()._weight_merge_across_tp(name, weights, param)

    def load_weights(self, models, weights, memory_efficient: bool = True) -> None:
        """This rank's slices of `weights` (a model directory or {HF name: tensor}) into `models`."""
        super().load_weights([_GroupedNames(m) for m in models], weights, memory_efficient)

    def export_weights(self, models):
        """Whole tensors under HF names (collective)."""
        yield from super().export_weights([_GroupedNames(m) for m in models])


class _InMemory:
    """mbridge's weight reader over {HF name: tensor}."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def load_some_hf_weight(self, names: list[str]) -> dict:
        return {n: self.tensors[n] for n in names}

    def load_one_hf_weight(self, name: str) -> torch.Tensor:
        return self.tensors[name]


class _GroupedNames(torch.nn.Module):
    """A view of a GPT chunk whose per-expert parameters carry the grouped names mbridge maps (and
    whose expert-parallel offsets it then applies)."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    @property
    def decoder(self):
        return self.inner.decoder

    def named_parameters(self, *args, **kwargs):
        for name, p in self.inner.named_parameters(*args, **kwargs):
            m = _LOCAL_EXPERT.search(name)
            yield (f"{name[: m.start()]}.mlp.experts.{m.group(2)}.weight{m.group(1)}" if m else name), p

    def state_dict(self, *args, **kwargs):
        return {
            (f"{k[: m.start()]}.mlp.experts.{m.group(2)}.weight{m.group(1)}" if (m := _LOCAL_EXPERT.search(k)) else k): v
            for k, v in self.inner.state_dict(*args, **kwargs).items()
        }


def build_gpt(bridge):
    """This rank's GPTModel chunk (its pipeline stage), parameters initialised, weights not loaded;
    its forward returns the final hidden states (the LM head is applied by the caller's fused kernel)."""
    from megatron.core import parallel_state

    provider = bridge._model_provider([])
    pre = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    post = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    with cpu.construction_context():
        gpt = provider(pre_process=pre, post_process=post)
    gpt.__class__ = _hidden_states_class(type(gpt))
    return gpt


_HIDDEN: dict[type, type] = {}


def _hidden_states_class(cls: type) -> type:
    """`cls` whose forward stops at the final norm's output ([s, b, h], sequence-parallel slice)."""
    if cls not in _HIDDEN:

        def _postprocess(self, hidden_states, **_):
            return hidden_states

        _HIDDEN[cls] = type(f"HiddenStates{cls.__name__}", (cls,), {"_postprocess": _postprocess})
    return _HIDDEN[cls]
