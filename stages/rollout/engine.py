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

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, Sequence

import numpy as np
import torch

from stages.rollout.sampling import SamplingParams, sample


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

    Prompts of different lengths share one batch without padding: the common prefix length is
    prefilled in one forward, then every step feeds each row one token at the same position --
    its next prompt token while its prompt lasts, else its last sampled token. Rows that finished
    stop sampling; the batch ends when all rows have finished.
    """

    def __init__(self, model: torch.nn.Module, *, max_batch: int = 64, device: str | torch.device | None = None):
        self.model = model.eval()
        self.cfg = model.cfg if hasattr(model, "cfg") else model.config
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model.to(self.device)
        self.max_batch = max_batch

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, **kwargs) -> "TorchEngine":
        from stages.model import load_model_dir

        try:
            model, _cfg, _tokenizer = load_model_dir(Path(model_dir))
        except Exception as e:
            raise EngineError(f"{model_dir}: cannot load model: {e}") from e
        return cls(model, **kwargs)

    def load_weights(self, model_dir: str | Path) -> None:
        """Replace the weights in place from a dir of safetensors (one file or shards)."""
        from safetensors.torch import load_file

        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise EngineError(f"{model_dir}: no *.safetensors files")
        state = {}
        for f in files:
            state.update(load_file(f, device=str(self.device)))
        try:
            self.model.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise EngineError(f"{model_dir}: weights do not fit the model: {e}") from e

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

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams, gens: list[torch.Generator]):
        from stages.model import KVCache

        if any(len(p) == 0 for p in prompts):
            raise EngineError("empty prompt")
        lengths = [len(p) for p in prompts]
        max_len = max(lengths) + params.max_tokens
        if max_len > self.cfg.max_position_embeddings:
            raise EngineError(
                f"prompt of {max(lengths)} tokens + max_tokens {params.max_tokens} exceeds "
                f"max_position_embeddings {self.cfg.max_position_embeddings}"
            )
        batch = len(prompts)
        dtype = next(self.model.parameters()).dtype
        cache = KVCache.allocate(self.cfg, batch, max_len, dtype, self.device)
        stop = set(params.stop_ids)
        tokens: list[list[int]] = [[] for _ in prompts]
        logps: list[list[float]] = [[] for _ in prompts]
        finish: list[str | None] = [None] * batch

        pos = min(lengths)
        ids = torch.tensor([p[:pos] for p in prompts], device=self.device)
        logits = self._forward(ids, 0, cache)
        while True:
            # rows whose prompt is consumed sample from the logits of their last position
            active = [b for b in range(batch) if finish[b] is None and pos >= lengths[b]]
            if active:
                tok, lp = sample(logits[active], params, [gens[b] for b in active])
                for b, t, l in zip(active, tok.tolist(), lp.tolist()):
                    tokens[b].append(t)
                    logps[b].append(l)
                    if t in stop:
                        finish[b] = "stop"
                    elif len(tokens[b]) >= params.max_tokens:
                        finish[b] = "length"
            if all(f is not None for f in finish):
                break
            # next input per row: its next prompt token, its last sample, or (finished) anything
            nxt = [
                prompts[b][pos] if pos < lengths[b] else (tokens[b][-1] if tokens[b] else prompts[b][-1])
                for b in range(batch)
            ]
            logits = self._forward(torch.tensor(nxt, device=self.device)[:, None], pos, cache)
            pos += 1
        return [Completion(t, l, f) for t, l, f in zip(tokens, logps, finish)]

    def _forward(self, ids: torch.Tensor, start: int, cache) -> torch.Tensor:
        """fp32 logits [B, V] of the last position after feeding `ids` [B, T] at positions start..start+T-1."""
        positions = torch.arange(start, start + ids.shape[1], device=self.device).expand_as(ids)
        out = self.model(ids, position_ids=positions, kv_cache=cache)
        return self.model.logits(out.hidden[:, -1]).float()


class VLLMEngine:
    """vLLM (>= 0.10) behind the same interface, for GPU sites. Not exercised in this workplace.

    `logprobs_mode="processed_logprobs"` makes vLLM report logprobs after temperature/top-k/top-p
    renormalisation, matching `sampling.processed_logprobs`; `SamplingParams(logprobs=0)` returns the
    sampled token's logprob only. Each request carries its own seed derived from (seed, index).
    """

    def __init__(self, model_dir: str | Path, **llm_kwargs):
        try:
            import vllm
        except ImportError as e:
            raise EngineError("VLLMEngine needs the vllm package (>= 0.10), which is not installed") from e
        self._vllm = vllm
        self._llm_kwargs = {"logprobs_mode": "processed_logprobs", **llm_kwargs}
        self.llm = vllm.LLM(model=str(model_dir), **self._llm_kwargs)

    def load_weights(self, model_dir: str | Path) -> None:
        # simplest correct reload; in-place weight updates are a later optimisation
        self.llm = self._vllm.LLM(model=str(model_dir), **self._llm_kwargs)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int) -> list[Completion]:
        from vllm.inputs import TokensPrompt

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
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], per_request, use_tqdm=False
            )
        except Exception as e:
            raise EngineError(f"vllm generation failed: {e}") from e
        completions = []
        for o in outputs:
            c = o.outputs[0]
            logprobs = [step[t].logprob for t, step in zip(c.token_ids, c.logprobs)]
            reason = "stop" if c.finish_reason == "stop" else "length"
            completions.append(Completion(list(c.token_ids), logprobs, reason))
        return completions
