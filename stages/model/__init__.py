"""The MoE causal LM: config + presets, modules, KV cache, and model directories (save/load).

Names resolve lazily (PEP 562), so that the torch-free configuration layer can read `PRESETS` from
`stages.model.config` without this package importing torch.
"""

import importlib

_WHERE = {
    "PRESETS": "config",
    "ModelConfig": "config",
    "count_params": "config",
    "KVCache": "kv_cache",
    "ModelOutput": "modeling",
    "MoEForCausalLM": "modeling",
    "save_model_dir": "io",
    "load_model_dir": "io",
    "open_model_dir": "io",
    "hf_state_dict": "io",
    "load_hf_state_dict": "io",
}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'snowcat.stages.model' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
