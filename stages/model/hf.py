"""Hugging Face checkpoints in and out: `config.json` <-> `ModelConfig`, and the `hf:` model source.

Supported architectures (`model_type`): `qwen3_moe` and `qwen3` (dense: every layer a SwiGLU MLP),
and `olmoe` — chosen over Mixtral because it is the same block as Qwen3-MoE except for one thing
the model already parameterises (q/k RMSNorm over the whole projection instead of per head),
while Mixtral has no q/k norm and its own tensor names. Anything in a `config.json` that the
trainer cannot represent (sliding windows, rope scaling, attention biases, other activations,
qkv clipping, dropout) is refused with the field's name: never silently dropped.

Torch-free on purpose: `snowcat config` reads a checkpoint's size from here on a login node.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from snowcat.pipeline.errors import UserError

from .config import ModelConfig, count_params

SUPPORTED = ("qwen3_moe", "qwen3", "olmoe")
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM", "olmoe": "OlmoeForCausalLM"}
CONFIG = "config.json"


def read_hf_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        return json.loads((path / CONFIG).read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: not a Hugging Face checkpoint (no {CONFIG})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path / CONFIG}: not valid JSON ({e})") from None


def _refuse(where: str, key: str, value, why: str) -> UserError:
    return UserError(f"{where}: {key}={value!r}: {why}")


def _rope_theta(hf: dict, where: str) -> float:
    """The rope base; any rope scaling kind (yarn, linear, dynamic, llama3...) is refused."""
    params = hf.get("rope_parameters") or {}
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise _refuse(where, "rope_parameters.rope_type", kind, "only plain rotary embeddings ('default') are supported")
    scaling = hf.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise _refuse(where, "rope_scaling", scaling, "rope scaling is not supported")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _check_common(hf: dict, where: str) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise _refuse(where, "hidden_act", hf["hidden_act"], "only SwiGLU (silu) MLPs are supported")
    if hf.get("attention_bias"):
        raise _refuse(where, "attention_bias", True, "attention projections with biases are not supported")
    if hf.get("use_sliding_window") or (hf.get("sliding_window") and hf.get("model_type") not in ("qwen3", "qwen3_moe")):
        raise _refuse(
            where, "use_sliding_window", hf.get("use_sliding_window", True), "sliding-window attention is not supported"
        )
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        bad = next(t for t in layer_types if t != "full_attention")
        raise _refuse(where, "layer_types", bad, "only full attention layers are supported")
    if float(hf.get("attention_dropout") or 0.0):
        raise _refuse(where, "attention_dropout", hf["attention_dropout"], "dropout is not supported")
    if hf.get("clip_qkv") is not None:
        raise _refuse(where, "clip_qkv", hf["clip_qkv"], "clipping q/k/v is not supported")


def model_config_from_hf(hf: dict, where: str) -> ModelConfig:
    """The trainer's ModelConfig for a checkpoint's config.json (`where` names the file in errors)."""
    kind = hf.get("model_type")
    if kind not in SUPPORTED:
        raise UserError(f"{where}: model_type={kind!r} is not supported (supported: {', '.join(SUPPORTED)})")
    _check_common(hf, where)
    L = int(hf["num_hidden_layers"])
    heads = int(hf["num_attention_heads"])
    common = dict(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        num_layers=L,
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        rope_theta=_rope_theta(hf, where),
        max_position_embeddings=int(hf["max_position_embeddings"]),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        initializer_range=float(hf.get("initializer_range", 0.02)),
        # these checkpoints were not trained with a router z-loss; keep the objective theirs
        router_z_loss_coef=float(hf.get("router_z_loss_coef", 0.0)),
    )
    if kind == "qwen3":
        width = int(hf["intermediate_size"])
        moe = dict(num_experts=1, experts_per_token=1, moe_intermediate_size=width, router_aux_loss_coef=0.0)
        return _build(where, common, moe, mlp_only_layers=list(range(L)), dense_intermediate_size=width)
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    if experts <= 0:
        raise _refuse(where, "num_experts", experts, "a mixture-of-experts model needs experts")
    moe = dict(
        num_experts=experts,
        experts_per_token=int(hf["num_experts_per_tok"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
    )
    if kind == "olmoe":
        return _build(where, common, moe, moe_intermediate_size=int(hf["intermediate_size"]), qk_norm="full")
    # qwen3_moe: a layer is sparse unless listed in mlp_only_layers or skipped by decoder_sparse_step
    step = int(hf.get("decoder_sparse_step", 1))
    dense = sorted(set(hf.get("mlp_only_layers") or []) | {i for i in range(L) if (i + 1) % step})
    return _build(
        where,
        common,
        moe,
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        mlp_only_layers=dense,
        dense_intermediate_size=int(hf["intermediate_size"]) if dense else 0,
    )


def _build(where: str, *parts: dict, **more) -> ModelConfig:
    try:
        return ModelConfig(**{k: v for part in parts for k, v in part.items()}, **more)
    except ValueError as e:
        raise UserError(f"{where}: {e}") from None


def hf_model_type(cfg: ModelConfig) -> str:
    """The architecture a ModelConfig exports as (the inverse of `model_config_from_hf`)."""
    all_dense = len(cfg.mlp_only_layers) == cfg.num_layers
    if cfg.qk_norm == "full":
        if cfg.mlp_only_layers:
            raise UserError("export: an OLMoE-style model (qk_norm 'full') with dense layers has no Hugging Face architecture")
        return "olmoe"
    return "qwen3" if all_dense else "qwen3_moe"


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """config.json fields of the architecture `cfg` exports as (inverse of `model_config_from_hf`;
    the caller adds token ids and dtype). Refuses what that architecture cannot express."""
    kind = hf_model_type(cfg)
    if cfg.shared_expert_intermediate_size and kind != "qwen3":
        raise UserError(f"export: the model has a shared expert, which {ARCHITECTURES[kind]} cannot express")
    if cfg.expert_capacity_factor > 0:
        raise UserError(f"export: the model drops tokens (expert_capacity_factor > 0); {ARCHITECTURES[kind]} is dropless")
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": kind,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.initializer_range,
        "rms_norm_eps": cfg.rms_norm_eps,
        "use_cache": True,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,  # transformers 4 reads this key
        "attention_bias": False,
        "attention_dropout": 0.0,
    }
    if kind == "qwen3":
        return out | {
            "head_dim": cfg.head_dim,
            "intermediate_size": cfg.dense_intermediate_size,
            "use_sliding_window": False,
            "sliding_window": None,
        }
    if cfg.head_dim * cfg.num_heads != cfg.hidden_size and kind == "olmoe":
        raise UserError(f"export: OLMoE needs head_dim * heads == hidden_size, got {cfg.head_dim} * {cfg.num_heads}")
    moe = {
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "norm_topk_prob": cfg.norm_topk_prob,
        "output_router_logits": False,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
    }
    if kind == "olmoe":
        return out | moe | {"intermediate_size": cfg.moe_intermediate_size, "clip_qkv": None}
    return (
        out
        | moe
        | {
            "head_dim": cfg.head_dim,
            "intermediate_size": cfg.dense_intermediate_size or cfg.moe_intermediate_size,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(cfg.mlp_only_layers),
            "use_sliding_window": False,
            "sliding_window": None,
        }
    )


def model_card(path: str | Path) -> dict[str, Any]:
    """The metadata of a checkpoint's model card (the YAML front matter of its README.md); {} if none."""
    readme = Path(path) / "README.md"
    text = readme.read_text(errors="replace") if readme.is_file() else ""
    parts = text.split("---", 2) if text.startswith("---") else []
    try:
        meta = yaml.safe_load(parts[1]) if len(parts) == 3 else None
    except yaml.YAMLError:
        return {}
    return meta if isinstance(meta, dict) else {}


def checkpoint_license(path: str | Path) -> str | None:
    """The license a checkpoint declares: its model card's front matter (`license:`), else config.json."""
    declared = model_card(path).get("license")
    if declared:
        return str(declared)
    return (read_hf_config(path).get("license") or None) if (Path(path) / CONFIG).is_file() else None


def checkpoint_parents(path: str | Path) -> tuple[list[str], str | None]:
    """The checkpoints this one was made from, as its model card names them (`base_model`, one or a
    list) and how (`base_model_relation`: finetune, merge, quantized, adapter); model cards name
    parents by hub id, not by a pinned revision or hash."""
    meta = model_card(path)
    base = meta.get("base_model") or []
    return ([str(b) for b in base] if isinstance(base, list) else [str(base)]), meta.get("base_model_relation")


def snapshot_revision(path: str | Path) -> str | None:
    """The commit of a hub cache snapshot directory (`.../snapshots/<commit>/`), None elsewhere."""
    parts = Path(path).resolve().parts
    for parent, name in zip(parts, parts[1:]):
        if parent == "snapshots" and len(name) == 40 and all(c in "0123456789abcdef" for c in name):
            return name
    return None


def describe(cfg: ModelConfig, *, dtype_bytes: int = 4, backend: str = "torch", zero_stage: int = 0, world_size: int = 1) -> str:
    """Parameters (total / active per token) and the memory the trainer will hold per rank."""
    total, active = count_params(cfg)
    sharding = backend in ("deepspeed", "fsdp")
    if backend == "fsdp":  # FSDP2 shards as ZeRO-3 does
        zero_stage = 3
    shards = world_size if sharding else 1
    weights = total * dtype_bytes
    held = weights / (shards if zero_stage >= 3 else 1)  # ZeRO-3: a slice of each weight between uses
    grads = weights / (shards if zero_stage >= 2 else 1)
    adam = total * 8 / (shards if zero_stage >= 1 else 1)  # AdamW's two fp32 moments
    zero = f" ZeRO-{zero_stage} over {world_size}" if sharding else ""
    # ZeRO-3 gathers a module's weights whole around its forward and backward (and one at a time to save)
    gathered = "; plus the weights gathered at a time" if sharding and zero_stage >= 3 else ""
    return (
        f"{hf_model_type(cfg)}: {total / 1e6:,.2f} M parameters ({active / 1e6:,.2f} M active per token); "
        f"weights {_gib(weights)}; training state {_gib(held + grads + adam)} per rank "
        f"({backend}{zero}: weights + gradients + AdamW moments; activations come on top{gathered})"
    )


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
