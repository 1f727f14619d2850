"""The MoE causal LM: config + presets, modules, KV cache, and model directories (save/load)."""

from .config import PRESETS, ModelConfig, count_params
from .io import hf_state_dict, load_hf_state_dict, load_model_dir, save_model_dir
from .kv_cache import KVCache
from .modeling import ModelOutput, MoEForCausalLM

__all__ = [
    "PRESETS",
    "ModelConfig",
    "count_params",
    "KVCache",
    "ModelOutput",
    "MoEForCausalLM",
    "save_model_dir",
    "load_model_dir",
    "hf_state_dict",
    "load_hf_state_dict",
]
