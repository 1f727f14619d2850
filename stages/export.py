"""`export` stage: a trained checkpoint as a Hugging Face model, proven equivalent.

The architecture is the one the model came in as (`hf:` sources: Qwen3-MoE, Qwen3, OLMoE) and
Qwen3-MoE for snowcat's own models; a checkpoint's own tokenizer is written back as its files were.

Outputs in the stage dir:
    model/          config.json, generation_config.json, model*.safetensors (+ index), tokenizer.json,
                    tokenizer_config.json (chat template, special tokens), manifest.json (sha256 of every file)
    export.json     which checkpoint was exported and why, the conversion, the equivalence check

The checkpoint is `checkpoint` ("<stage>:<name>") or, by default, the best retained checkpoint of the
needed training stage: the best live step of its retention ledger (`checkpoints/retention.json`),
else `final`. Tensors keep the HF hub names (per-expert `mlp.experts.{e}.*_proj.weight`, as Qwen3-MoE
checkpoints on the hub are stored): transformers 5 fuses them into its 3-D expert tensors on load,
transformers 4 and vLLM read them as they are.

Inference equivalence (the stage fails otherwise): a fresh process with HF_HUB_OFFLINE=1 loads the
export with `transformers` (`local_files_only=True`); its logits on a seeded probe batch must match the
trainer's model (with the same exported-dtype weights, both computing in float32) within `tolerance`,
greedy generations from fixed chat prompts must match token for token, and its tokenizer's chat
template must give the trainer tokenizer's ids. `debug_corrupt` plants a conversion bug so tests can
show the check catches one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_dir, atomic_write_json, checkpoint_dir, read_json, sha256_file, write_manifest
from snowcat.stages.model import hf_state_dict, load_model_dir
from snowcat.stages.model.hf import hf_config_dict
from snowcat.stages.model.io import _write_tensors
from snowcat.stages.rollout import SamplingParams, TorchEngine
from snowcat.stages.tokenizer import SPECIAL_TOKENS, ChatTokenizer
from snowcat.stages.train.precision import stored_dtype

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# role -> the ChatTokenizer's role token; the template renders exactly what ChatTokenizer.render_prompt does
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


# ---------------------------------------------------------------- which checkpoint


def _step_dir(ckpts: Path, step: int) -> Path | None:
    for name in (f"step_{step:06d}", f"step_{step}"):
        if (ckpts / name).is_dir():
            return ckpts / name
    return None


def choose_checkpoint(inputs: dict[str, Path]) -> tuple[Path, dict]:
    """The checkpoint to export when the config names none: (its dir, record of the choice: ref,
    reason, and the ledger facts it rests on)."""

    trained = sorted(s for s, p in inputs.items() if (Path(p) / "checkpoints").is_dir())
    if len(trained) != 1:
        raise UserError(
            f"export: needs {'no' if not trained else 'several'} training stage(s) with checkpoints "
            f"({', '.join(trained) or 'none'}); name one with export.checkpoint='<stage>:<name>'"
        )
    stage = trained[0]
    ckpts = Path(inputs[stage]) / "checkpoints"
    ledger = _read_json(ckpts / "retention.json")
    if ledger:
        policy = ledger.get("policy") or {}
        metric, mode = policy.get("metric", "?"), policy.get("mode", "max")
        live = {int(s): c.get("value") for s, c in ledger.get("checkpoints", {}).items() if not c.get("deleted")}
        scored = sorted((s for s, v in live.items() if v is not None), key=lambda s: ((-1 if mode == "max" else 1) * live[s], s))
        every = {int(s): c.get("value") for s, c in ledger.get("checkpoints", {}).items() if c.get("value") is not None}
        hist = sorted(every, key=lambda s: ((-1 if mode == "max" else 1) * every[s], s))
        if scored and (path := _step_dir(ckpts, scored[0])) is not None:
            best = scored[0]
            reason = f"best retained checkpoint by {metric} ({mode}): {live[best]:g} at step {best}"
            if hist and hist[0] != best:
                reason += f"; the historical best ({every[hist[0]]:g} at step {hist[0]}) had been deleted by retention"
            return path, {
                "ref": f"{stage}:{path.name}",
                "reason": reason,
                "metric": metric,
                "mode": mode,
                "value": live[best],
                "step": best,
                "historical_best_step": hist[0] if hist else None,
                "ledger": str(Path("checkpoints") / "retention.json"),
            }
        why = "no retained checkpoint with a metric value in retention.json"
    else:
        why = "no retention ledger (checkpoints/retention.json)"
    return checkpoint_dir(inputs[stage], "final"), {"ref": f"{stage}:final", "reason": f"{why}; the stage's final checkpoint"}


def _read_json(path: Path):
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None


# ---------------------------------------------------------------- conversion


def hf_config(mcfg, tok, dtype: str) -> dict:
    """config.json for a snowcat ModelConfig in the architecture it came from (or Qwen3-MoE)."""
    import transformers  # noqa: PLC0415 (transformers takes seconds to import; only the export check needs it)

    return hf_config_dict(mcfg) | {
        "bos_token_id": None,
        "eos_token_id": tok.end_of_turn_id,
        "pad_token_id": tok.pad_id,
        "dtype": dtype,
        "transformers_version": transformers.__version__,
    }


def tokenizer_files(tok, max_len: int) -> dict[str, dict]:
    """tokenizer_config.json and special_tokens_map.json for the ChatTokenizer's tokenizer.json."""

    specials = {"eos_token": "<|end|>", "pad_token": "<|pad|>"}
    added = {
        str(tok.special_ids[t]): {
            "content": t,
            "special": True,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_len,
        "bos_token": None,
        "unk_token": None,
        **specials,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in specials.values()],
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    return {
        "tokenizer_config.json": config,
        "special_tokens_map.json": {**specials, "additional_special_tokens": config["additional_special_tokens"]},
    }


def generation_config(tok) -> dict:
    import transformers  # noqa: PLC0415 (transformers takes seconds to import; only the export check needs it)

    # full-distribution sampling is snowcat's default (top_k 0 disables HF's default top-k of 50)
    return {
        "eos_token_id": [tok.end_of_turn_id, tok.eos_id],
        "pad_token_id": tok.pad_id,
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "transformers_version": transformers.__version__,
    }


def corrupt(tensors: dict, how: str) -> dict:
    """Plant a conversion bug (tests only): the equivalence check must catch it."""
    if how == "transpose_q":
        name = "model.layers.0.self_attn.q_proj.weight"
        w = tensors[name]
        tensors[name] = w.T.contiguous() if w.shape[0] == w.shape[1] else w.flip(0).contiguous()
    elif how == "swap_experts":
        a, b = "model.layers.0.mlp.experts.0.gate_proj.weight", "model.layers.0.mlp.experts.1.gate_proj.weight"
        tensors[a], tensors[b] = tensors[b], tensors[a]
    return tensors


def convert(src: Path, dst: Path, dtype: str = "float32", max_shard_bytes: int = 4 << 30, debug_corrupt: str = "") -> dict:
    """Write the HF model dir `dst` (atomically, with manifest.json) from the snowcat model dir `src`."""

    model, mcfg, tok = load_model_dir(src)
    if tok is None:
        raise UserError(f"{src}: checkpoint has no tokenizer.json; nothing to export a tokenizer from")
    config = hf_config(mcfg, tok, dtype)
    tensors = {k: v.to(getattr(torch, dtype)) for k, v in hf_state_dict(model).items()}
    tensors = corrupt(tensors, debug_corrupt)
    with atomic_dir(dst) as tmp:
        _write_tensors(tmp, tensors, max_shard_bytes)
        atomic_write_json(tmp / "config.json", config)
        atomic_write_json(tmp / "generation_config.json", generation_config(tok))
        tok.save(tmp)  # a checkpoint's own tokenizer writes its original files; snowcat's gets a config beside
        if isinstance(tok, ChatTokenizer):
            for name, obj in tokenizer_files(tok, mcfg.max_position_embeddings).items():
                atomic_write_json(tmp / name, obj)
        files = write_manifest(tmp)
    return {
        "files": len(files),
        "bytes": sum(f["size"] for f in files.values()),
        "tensors": len(tensors),
        "params": sum(t.numel() for t in tensors.values()),
    }


# ---------------------------------------------------------------- inference equivalence


def probe_batch(vocab_size: int, rows: int, length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (rows, length), generator=g)


def _hf_side(model_dir: str, probe_file: str, out_file: str) -> None:
    """Runs in a fresh process with the hub offline: transformers loads the export from disk only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 (transformers takes seconds to import; only the export check needs it)

    probe = load_file(probe_file)
    spec = json.loads(Path(probe_file).with_suffix(".json").read_text())
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    model.eval()
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits.float()
        gens, template_ids = [], []
        for messages in spec["conversations"]:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            template_ids.append([int(i) for i in ids])
        for prompt in spec["prompt_ids"]:
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=spec["max_new_tokens"],
                do_sample=False,
                eos_token_id=spec["stop_id"],
                pad_token_id=spec["pad_id"],
            )
            new = out[0, len(prompt) :].tolist()
            gens.append(new[:-1] if new and new[-1] == spec["stop_id"] else new)
    save_file({"logits": logits.contiguous()}, out_file)
    Path(out_file).with_suffix(".json").write_text(
        json.dumps(
            {
                "generations": gens,
                "template_ids": template_ids,
                "architecture": type(model).__name__,
                "expert_params": sorted(
                    {n.split("layers.0.")[-1] for n, _ in model.named_parameters() if "layers.0.mlp.experts" in n}
                ),
            }
        )
    )


def check_equivalence(src: Path, export_dir: Path, cfg, seed: int) -> dict:
    """Compare the trainer's model (weights rounded to the export dtype) with transformers on the export."""

    # Like with like: the checkpoint read into float32 whatever it stores, rounded as the export
    # rounded it, then float32 compute on both sides. What is left is the order of operations
    # (fused vs per-expert matmuls, attention kernels): ~1e-6 on logits of order 10 here, so
    # `tolerance` (1e-4 by default) keeps two orders of magnitude of room and still catches any
    # conversion bug (a transposed or swapped weight moves logits by O(0.1-1)).
    model, mcfg, tok = load_model_dir(src, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(getattr(torch, cfg.dtype)).float())
    model.eval()
    ids = probe_batch(mcfg.vocab_size, cfg.probe_rows, cfg.probe_len, seed)
    conversations = [[{"role": "user", "content": text}] for text in cfg.probe_prompts]
    prompts = [tok.render_prompt(m) for m in conversations]
    with torch.no_grad():
        ours = model.logits(model(ids).hidden).float()
    greedy = SamplingParams(0.0, 0, 1.0, cfg.max_new_tokens, (tok.end_of_turn_id,))
    outs = TorchEngine(model, max_batch=1).generate(prompts, greedy, seed=0)
    our_gens = [c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids for c in outs]

    with tempfile.TemporaryDirectory(prefix="export-probe-") as tmp:
        probe_file, out_file = Path(tmp) / "probe.safetensors", Path(tmp) / "hf.safetensors"
        save_file({"input_ids": ids.contiguous()}, str(probe_file))
        probe_file.with_suffix(".json").write_text(
            json.dumps(
                {
                    "conversations": conversations,
                    "prompt_ids": prompts,
                    "max_new_tokens": cfg.max_new_tokens,
                    "stop_id": tok.end_of_turn_id,
                    "pad_id": tok.pad_id,
                }
            )
        )
        code = (
            f"from snowcat.stages.export import _hf_side; _hf_side({str(export_dir)!r}, {str(probe_file)!r}, {str(out_file)!r})"
        )
        proc = subprocess.run(
            [sys.executable, "-P", "-c", code],
            env={**os.environ, **OFFLINE_ENV},
            capture_output=True,
            text=True,
            timeout=cfg.timeout_s,
        )
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise RuntimeError(f"export: transformers could not load {export_dir} offline:\n{tail}")
        theirs = load_file(str(out_file))["logits"]
        hf = json.loads(out_file.with_suffix(".json").read_text())

    delta = float((ours - theirs).abs().max()) if ours.shape == theirs.shape else float("inf")
    first_diff = [
        next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None if len(x) == len(y) else min(len(x), len(y)))
        for x, y in zip(our_gens, hf["generations"])
    ]
    return {
        "transformers_architecture": hf["architecture"],
        "hf_expert_params": hf["expert_params"],
        "offline_env": OFFLINE_ENV,
        "local_files_only": True,
        "stored_dtype": str(stored_dtype(src)).removeprefix("torch."),  # the checkpoint's
        "export_dtype": cfg.dtype,  # both sides' weights rounded to it
        "compute_dtype": "float32",  # both sides
        "probe": {"rows": cfg.probe_rows, "len": cfg.probe_len, "seed": seed, "prompts": list(cfg.probe_prompts)},
        "max_abs_dlogit": delta,
        "tolerance": cfg.tolerance,
        "logits_match": delta <= cfg.tolerance,
        "greedy_tokens_compared": sum(len(g) for g in our_gens),
        "greedy_trainer": our_gens,
        "greedy_transformers": hf["generations"],
        "greedy_first_mismatch": first_diff,
        "greedy_match": our_gens == hf["generations"],
        "chat_template_match": hf["template_ids"] == prompts,
    }


# ---------------------------------------------------------------- the stage


def run(ctx) -> dict:
    cfg = ctx.config
    torch.set_num_threads(ctx.threads)
    if cfg.checkpoint:  # named (a pretrained hf: one is exported as it is: the round trip)
        src, choice = (
            ctx.checkpoint(cfg.checkpoint, "checkpoint"),
            {"ref": cfg.checkpoint, "reason": "named in the export stage's config"},
        )
    else:
        src, choice = choose_checkpoint(dict(ctx.inputs))
    out = Path(ctx.out_dir)
    conversion = convert(src, out / "model", cfg.dtype, cfg.max_shard_mb << 20, cfg.debug_corrupt)
    architecture = read_json(out / "model" / "config.json")["architectures"][0]
    check = check_equivalence(src, out / "model", cfg, ctx.seed)
    record = {
        "source": {
            **choice,
            "path": os.path.relpath(src, ctx.run_dir),
            "manifest_sha256": sha256_file(src / "manifest.json") if (src / "manifest.json").is_file() else None,
            "meta": read_json(src / "meta.json", {}),
        },
        "format": {
            "architecture": architecture,
            "dtype": cfg.dtype,
            "expert_layout": "per-expert hub names",
            **conversion,
        },
        "model_manifest_sha256": sha256_file(out / "model" / "manifest.json"),
        "equivalence": check,
        "debug_corrupt": cfg.debug_corrupt or None,
    }
    atomic_write_json(out / "export.json", record)
    failed = [
        what
        for what, ok in (
            ("logits", check["logits_match"]),
            ("greedy generations", check["greedy_match"]),
            ("chat template ids", check["chat_template_match"]),
        )
        if not ok
    ]
    if failed:
        raise RuntimeError(
            f"export: inference-equivalence check failed ({', '.join(failed)}): max |Δlogit| "
            f"{check['max_abs_dlogit']:.3g} (tolerance {cfg.tolerance:g}); see {out / 'export.json'}"
        )
    return {
        "max_abs_dlogit": check["max_abs_dlogit"],
        "tolerance": cfg.tolerance,
        "greedy_tokens_matched": check["greedy_tokens_compared"],
        "files": conversion["files"],
        "bytes": conversion["bytes"],
        "params": conversion["params"],
        "source": choice["ref"],
    }
