"""Generation engines behind one interface: the in-process torch engine here, vLLM in `vllm_engine.py`.

`Engine.generate(prompts, params, seed)` takes token ids (token-in, token-out: the caller never
re-tokenises sampled text) and returns one `Completion` per prompt whose logprobs are under the
distribution each token was actually drawn from (see `sampling.py`), and, when top-k/top-p/greedy
truncate that distribution, the ids the engine kept for each token: the trainer computes its
logprobs on exactly that support instead of rebuilding it from its own logits.
`generate_seeded(prompts, params, seeds)` gives request i its own seed (the agent loop's per-episode
seeds).

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
from snowcat.stages.model import KVCache, load_model_dir, open_model_dir
from snowcat.stages.model.io import load_hf_state_dict, read_tensors
from snowcat.stages.rollout.sampling import SamplingParams, sample, support_ids


class EngineError(RuntimeError):
    """The engine failed (load, out of memory, device error): infrastructure, not a model failure."""


@dataclass
class Completion:
    token_ids: list[int]  # exactly as sampled; a stop id that ended the completion is included
    logprobs: list[float]  # per token, under the processed (temperature/top-k/top-p) distribution
    finish_reason: Literal["stop", "length"]
    # per token, the ids it could have been drawn from ([] = not known: the trainer rebuilds it);
    # None when the full distribution was sampled
    support: list[list[int]] | None = None
    # int16 [prompt + sampled - 1, moe layers * k]: the experts each fed token (the prompt, then every
    # sampled token but the last) was routed to, for router replay; None if not recorded
    routes: np.ndarray | None = None


class Engine(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int) -> list[Completion]: ...

    def generate_seeded(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[Completion]: ...

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

    def load_weights(self, model_dir: str | Path) -> None:
        """Replace the weights in place from a model/weights dir (safetensors under HF names, one
        file or shards + index, as `stages.model.save_model_dir` writes them)."""

        try:
            tensors = read_tensors(Path(model_dir))
            load_hf_state_dict(self.model, {k: v.to(self.device) for k, v in tensors.items()})
        except (OSError, RuntimeError, KeyError, ValueError, UserError) as e:  # a missing/torn weights dir: infrastructure
            raise EngineError(f"{model_dir}: cannot load weights: {e}") from e

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int) -> list[Completion]:
        return self._generate(prompts, params, [request_generator(seed, i) for i in range(len(prompts))])

    def generate_seeded(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]) -> list[Completion]:
        """Request i samples exactly as `generate([prompts[i]], params, seed=seeds[i])` would alone."""
        return self._generate(prompts, params, [request_generator(s, 0) for s in seeds])

    @torch.no_grad()
    def _generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, gens: list[torch.Generator]
    ) -> list[Completion]:
        out: list[Completion] = []
        for start in range(0, len(prompts), self.max_batch):
            chunk = [list(p) for p in prompts[start : start + self.max_batch]]
            try:
                out += self._generate_batch(chunk, params, gens[start : start + self.max_batch])
            except EngineError:
                raise
            except (RuntimeError, ValueError, IndexError) as e:  # device/OOM/shape failures are infra
                raise EngineError(f"generation failed: {e}") from e
        return out

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
        out = self.model(ids, kv_cache=cache)
        hidden = out.hidden
        routes = None if out.routes is None else [[out.routes[b, : len(p)].flatten(1)] for b, p in enumerate(prompts)]
        cache.truncate(lengths)
        logits = self.model.logits(hidden[torch.arange(batch, device=self.device), lengths - 1]).float()

        stop = set(params.stop_ids)
        tokens: list[list[int]] = [[] for _ in prompts]
        logps: list[list[float]] = [[] for _ in prompts]
        kept: list[list[list[int]]] | None = None if params.is_full_distribution else [[] for _ in prompts]
        finish: list[str | None] = [None] * batch
        rows = list(range(batch))  # request index of each cache row
        while True:
            tok, lp = sample(logits, params, [gens[r] for r in rows])
            if kept is not None:
                for r, ids in zip(rows, support_ids(logits, params).tolist()):
                    kept[r].append([i for i in ids if i >= 0])
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
            out = self.model(tok[:, None].to(self.device), kv_cache=cache)
            if routes is not None:
                for i, r in enumerate(rows):
                    routes[r].append(out.routes[i, :1].flatten(1))
            logits = self.model.logits(out.hidden[:, -1]).float()
        return [
            Completion(
                t,
                l,
                f,
                kept[i] if kept is not None else None,
                torch.cat(routes[i]).to(torch.int16).cpu().numpy() if routes is not None else None,
            )
            for i, (t, l, f) in enumerate(zip(tokens, logps, finish))
        ]


def serve_model_dir(
    path: str | Path, kind: str, *, vllm=None, max_batch: int = 64, device: str | torch.device = "cpu", seed: int = 0
) -> tuple[Engine, object, object]:
    """(engine, tokenizer, model config) for sampling from the model directory at `path` with the
    engine a stage's `engine` key names. torch loads the weights here; vllm (`vllm`: the stage's
    VllmConfig) loads them itself, so the torch model is never built, and vLLM is imported only here:
    processes that never sample with it never import it."""
    if kind == "vllm":
        from snowcat.stages.rollout.vllm_engine import VLLMEngine  # noqa: PLC0415 (rollout side only)

        cfg, tok = open_model_dir(path)
        return VLLMEngine(path, vllm, seed=seed), tok, cfg
    if kind != "torch":
        raise UserError(f"unknown engine {kind!r}; expected torch or vllm")
    # as vLLM's dtype `auto`: float32 on the CPU (bf16 there is slow or emulated, and the trainer
    # computes in float32), the stored dtype on a GPU
    dtype = torch.float32 if torch.device(device).type == "cpu" else None
    model, cfg, tok = load_model_dir(Path(path), device=device, dtype=dtype)
    return TorchEngine(model, max_batch=max_batch), tok, cfg
