"""Generation engines behind one interface: an in-process torch engine, and vLLM for GPU sites.

`Engine.generate(prompts, params, seed)` takes token ids (token-in, token-out: the caller never
re-tokenises sampled text) and returns one `Completion` per prompt whose logprobs are under the
distribution each token was actually drawn from (see `sampling.py`).

Determinism: request i of a `generate` call draws from its own CPU generator seeded from
(seed, i), one uniform per sampled token, so its completion depends only on its prompt, the weights
and (seed, i) -- not on how requests are grouped into batches. Across batch compositions the
tokens are the same as long as batched kernels give the same logits (exact in fp32 on CPU; bf16
GPU kernels may differ in the last bits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
import torch

from snowcat.pipeline.errors import UserError
from snowcat.stages.model import KVCache, load_model_dir
from snowcat.stages.model.io import load_hf_state_dict, read_tensors
from snowcat.stages.rollout.sampling import SamplingParams, sample


class EngineError(RuntimeError):
    """The engine failed (load, out of memory, device error): infrastructure, not a model failure."""


@dataclass
class Completion:
    token_ids: list[int]  # exactly as sampled; a stop id that ended the completion is included
    logprobs: list[float]  # per token, under the processed (temperature/top-k/top-p) distribution
    finish_reason: Literal["stop", "length"]


class Engine(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int) -> list[Completion]: ...

    def load_weights(self, model_dir: str | Path) -> None: ...


def request_generator(seed: int, index: int) -> torch.Generator:
    """The CPU generator of request `index` in a `generate(..., seed)` call."""
    state = np.random.SeedSequence([int(seed) & 0xFFFFFFFFFFFFFFFF, int(index)]).generate_state(2, np.uint64)
    return torch.Generator().manual_seed(int(state[0] >> np.uint64(1)))


class TorchEngine:
    """Batched generation on `MoEForCausalLM` with a preallocated KV cache.

    All prompts of a batch are prefilled in one forward, right-padded; the cache is then cut back
    to each row's prompt length so padding slots are overwritten, never attended. Each decoding
    step feeds one token per unfinished row at that row's own position; finished rows are dropped
    from the batch (and the cache).
    """

    def __init__(self, model: torch.nn.Module, *, max_batch: int = 64, device: str | torch.device | None = None):
        self.model = model.eval()
        self.cfg = model.config
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model.to(self.device)
        self.max_batch = max_batch

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, **kwargs) -> TorchEngine:
        try:
            model, _cfg, _tokenizer = load_model_dir(Path(model_dir))
        except Exception as e:
            raise EngineError(f"{model_dir}: cannot load model: {e}") from e
        return cls(model, **kwargs)

    def load_weights(self, model_dir: str | Path) -> None:
        """Replace the weights in place from a model/weights dir (safetensors under HF names, one
        file or shards + index, as `stages.model.save_model_dir` writes them)."""

        try:
            tensors = read_tensors(Path(model_dir))
            load_hf_state_dict(self.model, {k: v.to(self.device) for k, v in tensors.items()})
        except (OSError, RuntimeError, KeyError, ValueError, UserError) as e:  # a missing/torn weights dir: infrastructure
            raise EngineError(f"{model_dir}: cannot load weights: {e}") from e

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int) -> list[Completion]:
        out: list[Completion] = []
        for start in range(0, len(prompts), self.max_batch):
            chunk = [list(p) for p in prompts[start : start + self.max_batch]]
            gens = [request_generator(seed, start + i) for i in range(len(chunk))]
            try:
                out += self._generate_batch(chunk, params, gens)
            except EngineError:
                raise
            except (RuntimeError, ValueError, IndexError) as e:  # device/OOM/shape failures are infra
                raise EngineError(f"generation failed: {e}") from e
        return out

    @torch.no_grad()  # also called directly by the agent loop: sampling never keeps a graph
    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams, gens: list[torch.Generator]):
        if any(len(p) == 0 for p in prompts):
            raise EngineError("empty prompt")
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        longest = int(lengths.max())
        if longest + params.max_tokens > self.cfg.max_position_embeddings:
            raise EngineError(
                f"prompt of {longest} tokens + max_tokens {params.max_tokens} exceeds "
                f"max_position_embeddings {self.cfg.max_position_embeddings}"
            )
        batch = len(prompts)
        dtype = next(self.model.parameters()).dtype
        cache = KVCache.allocate(self.cfg, batch, longest + params.max_tokens, dtype, self.device)
        ids = torch.zeros(batch, longest, dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p)
        hidden = self.model(ids, kv_cache=cache).hidden
        cache.truncate(lengths)
        logits = self.model.logits(hidden[torch.arange(batch, device=self.device), lengths - 1]).float()

        stop = set(params.stop_ids)
        tokens: list[list[int]] = [[] for _ in prompts]
        logps: list[list[float]] = [[] for _ in prompts]
        finish: list[str | None] = [None] * batch
        rows = list(range(batch))  # request index of each cache row
        while True:
            tok, lp = sample(logits, params, [gens[r] for r in rows])
            for r, t, l in zip(rows, tok.tolist(), lp.tolist()):
                tokens[r].append(t)
                logps[r].append(l)
                if t in stop:
                    finish[r] = "stop"
                elif len(tokens[r]) >= params.max_tokens:
                    finish[r] = "length"
            keep = [i for i, r in enumerate(rows) if finish[r] is None]
            if not keep:
                break
            if len(keep) < len(rows):
                index = torch.tensor(keep, device=self.device)
                cache, tok, rows = cache.select_rows(index), tok[index], [rows[i] for i in keep]
            hidden = self.model(tok[:, None].to(self.device), kv_cache=cache).hidden
            logits = self.model.logits(hidden[:, -1]).float()
        return [Completion(t, l, f) for t, l, f in zip(tokens, logps, finish)]


class VLLMEngine:
    """vLLM (>= 0.10) behind the same interface, for GPU sites. Not exercised in this workplace.

    `logprobs_mode="processed_logprobs"` makes vLLM report logprobs after temperature/top-k/top-p
    renormalisation, matching `sampling.processed_logprobs`; `SamplingParams(logprobs=0)` returns the
    sampled token's logprob only. Each request carries its own seed derived from (seed, index).
    """

    def __init__(self, model_dir: str | Path, **llm_kwargs):
        try:
            import vllm  # noqa: PLC0415 (the GPU extra; absent on CPU installs)
        except ImportError as e:
            raise EngineError("VLLMEngine needs the vllm package (>= 0.10), which is not installed") from e
        self._vllm = vllm
        self._llm_kwargs = {"logprobs_mode": "processed_logprobs", **llm_kwargs}
        self.llm = vllm.LLM(model=str(model_dir), **self._llm_kwargs)

    def load_weights(self, model_dir: str | Path) -> None:
        # simplest correct reload; in-place weight updates are a later optimisation
        self.llm = self._vllm.LLM(model=str(model_dir), **self._llm_kwargs)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int) -> list[Completion]:
        from vllm.inputs import TokensPrompt  # noqa: PLC0415 (the GPU extra; absent on CPU installs)

        per_request = [
            self._vllm.SamplingParams(
                temperature=params.temperature,
                top_k=params.top_k if params.top_k > 0 else -1,
                top_p=params.top_p,
                max_tokens=params.max_tokens,
                stop_token_ids=list(params.stop_ids),
                logprobs=0,
                seed=int(request_generator(seed, i).initial_seed() % (2**31)),
            )
            for i in range(len(prompts))
        ]
        try:
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], per_request, use_tqdm=False)
        except Exception as e:
            raise EngineError(f"vllm generation failed: {e}") from e
        completions = []
        for o in outputs:
            c = o.outputs[0]
            logprobs = [step[t].logprob for t, step in zip(c.token_ids, c.logprobs)]
            reason = "stop" if c.finish_reason == "stop" else "length"
            completions.append(Completion(list(c.token_ids), logprobs, reason))
        return completions
