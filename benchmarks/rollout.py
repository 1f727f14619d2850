"""Rollout throughput, side by side: snowcat's TorchEngine, vLLM and Hugging Face `generate`.

    snowcat bench rollout [--hidden 256 --layers 4 --experts 8 --batch 32 --tokens 64] [--json FILE]

Writes a random Qwen3-MoE checkpoint (transformers' save_pretrained), then in one fresh process per
engine samples the same prompts (`--batch` prompts of 32 random token ids) with the same settings
(temperature 1, top-k 50, `--tokens` new tokens each, no stop id) and reports generated tokens per
second of the timed call (after one small warm-up call), the engine's start-up time, and each
engine's throughput as a multiple of TorchEngine's; then the time vLLM takes to serve a new weight
version both ways, in place (`reload_weights`) and by a rebuilt engine. On a CPU vLLM runs its CPU build in fp32, in
process (`VllmConfig()` defaults); on a GPU each engine runs on the GPU in its default dtype.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

from snowcat.benchmarks import run_python
from snowcat.pipeline.fsio import atomic_write_json

ENGINES = ("torch", "vllm", "hf_generate")

CHILD = r"""
import json, sys, time
from pathlib import Path
import torch

path, engine, batch, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
g = torch.Generator().manual_seed(0)
prompts = torch.randint(1, 4000, (batch, 32), generator=g).tolist()
t0 = time.perf_counter()
if engine == "hf_generate":
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    def run(ps, n):
        with torch.no_grad():
            out = model.generate(torch.tensor(ps), do_sample=True, temperature=1.0, top_k=50, top_p=1.0,
                                 max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
        return int(out.shape[0] * (out.shape[1] - len(ps[0])))
else:
    from snowcat.stages.config import VllmConfig
    from snowcat.stages.rollout import SamplingParams, serve_model_dir
    eng = serve_model_dir(path, engine, vllm=VllmConfig(), max_batch=batch)[0]
    def run(ps, n):
        return sum(len(c.token_ids) for c in eng.generate(ps, SamplingParams(temperature=1.0, top_k=50, max_tokens=n), seed=0))
start_s = time.perf_counter() - t0
run(prompts[:2], 4)  # warm-up: first-call costs are start-up, not throughput
t0 = time.perf_counter()
made = run(prompts, tokens)
seconds = time.perf_counter() - t0
row = {"tokens": made, "seconds": seconds, "tokens_per_s": made / seconds, "start_s": start_s}
if engine == "vllm":  # a new weight version: vLLM's in-place reload against a rebuilt engine
    t0 = time.perf_counter(); eng._reload_in_place(Path(path)); row["reload_in_place_s"] = time.perf_counter() - t0
    t0 = time.perf_counter(); eng._rebuild(Path(path)); row["rebuild_s"] = time.perf_counter() - t0
print(json.dumps(row))
"""


def make_checkpoint(out: Path, hidden: int, layers: int, experts: int) -> int:
    import torch  # noqa: PLC0415 (the parent needs torch only here)
    import transformers  # noqa: PLC0415

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        moe_intermediate_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=max(1, hidden // 128),
        head_dim=32,  # vLLM's CPU attention rejects 16
        num_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="snowcat bench rollout", description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rollout-") as tmp:
        params = make_checkpoint(Path(tmp), args.hidden, args.layers, args.experts)
        rows = {engine: run_python(CHILD, tmp, engine, str(args.batch), str(args.tokens)) for engine in ENGINES}
    print(f"model: random Qwen3-MoE, {params:,} parameters; {args.batch} prompts x {args.tokens} new tokens, T=1, top-k 50")
    base = rows["torch"]["tokens_per_s"]
    for engine, r in rows.items():
        r["vs_torch"] = r["tokens_per_s"] / base
        print(
            f"  {engine:12s} {r['tokens_per_s']:9.0f} tokens/s  ({r['vs_torch']:.2f} x TorchEngine)  start-up {r['start_s']:.1f} s"
        )
    vllm = rows["vllm"]
    print(f"  new weights on vLLM: in-place reload {vllm['reload_in_place_s']:.2f} s, rebuilt engine {vllm['rebuild_s']:.2f} s")
    if args.json:
        atomic_write_json(
            args.json,
            {
                "what": __doc__.splitlines()[0],
                "shape": vars(args) | {"json": None, "parameters": params},
                "sampling": {"temperature": 1.0, "top_k": 50, "stop_ids": []},
                "machine": {"processor": platform.processor() or platform.machine(), "cores": len(os.sched_getaffinity(0))},
                "rows": rows,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
