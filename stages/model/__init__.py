"""The MoE causal LM: config + presets, modules, KV cache, and model directories (save/load).

Names are resolved lazily, so `from stages.model import PRESETS` (config validation in the CLI)
does not import torch.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "PRESETS": "config", "ModelConfig": "config", "count_params": "config",
    "KVCache": "kv_cache", "ModelOutput": "modeling", "MoEForCausalLM": "modeling",
    "save_model_dir": "io", "load_model_dir": "io", "resolve_checkpoint": "io",
    "hf_state_dict": "io", "load_hf_state_dict": "io",
}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'stages.model' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
