"""Rollout: sampling with exact probability accounting, and generation engines.

`from stages.rollout import SamplingParams, TorchEngine, Completion` — see sampling.py and engine.py.
"""

from snowcat.stages.rollout.engine import Completion, Engine, EngineError, TorchEngine, VLLMEngine
from snowcat.stages.rollout.sampling import SamplingParams, processed_logprobs, sample, support_ids, support_mask

__all__ = [
    "Completion",
    "Engine",
    "EngineError",
    "SamplingParams",
    "TorchEngine",
    "VLLMEngine",
    "processed_logprobs",
    "sample",
    "support_ids",
    "support_mask",
]
