"""Rollout: sampling with exact probability accounting, and generation engines.

`from stages.rollout import SamplingParams, TorchEngine, Completion` — see sampling.py and engine.py;
`VLLMEngine` lives in vllm_engine.py (imported by rollout ranks only, through `serve_model_dir`).
`ChatEndpoint` and `EndpointEngine` (an OpenAI-compatible endpoint as a teacher, text re-tokenised by
the student's tokenizer) live in endpoint.py, imported by the teacher stage.
"""

from snowcat.stages.rollout.engine import Completion, Engine, EngineError, TorchEngine, serve_model_dir
from snowcat.stages.rollout.sampling import SamplingParams, processed_logprobs, sample, support_ids, support_mask

__all__ = [
    "Completion",
    "Engine",
    "EngineError",
    "SamplingParams",
    "TorchEngine",
    "serve_model_dir",
    "processed_logprobs",
    "sample",
    "support_ids",
    "support_mask",
]
