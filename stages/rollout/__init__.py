"""Rollout: sampling with exact probability accounting, and generation engines.

`from stages.rollout import SamplingParams, TorchEngine, Completion` — see sampling.py and engine.py;
`VLLMEngine` lives in vllm_engine.py (imported by rollout ranks only, through `open_engine`).
"""

from snowcat.stages.rollout.engine import Completion, Engine, EngineError, TorchEngine, open_engine
from snowcat.stages.rollout.sampling import SamplingParams, processed_logprobs, sample, support_ids, support_mask

__all__ = [
    "Completion",
    "Engine",
    "EngineError",
    "SamplingParams",
    "TorchEngine",
    "open_engine",
    "processed_logprobs",
    "sample",
    "support_ids",
    "support_mask",
]
