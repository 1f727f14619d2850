"""Model directories: what evaluate / RL / export load.

    <dir>/model.safetensors            (or model-0000i-of-0000n.safetensors + model.safetensors.index.json)
    <dir>/model_config.json            ModelConfig fields
    <dir>/tokenizer.json               the ChatTokenizer
    <dir>/manifest.json                sha256 + size of every file (written last)

Tensors are stored under HF hub checkpoint names (per-expert `mlp.experts.{e}.gate_proj.weight`
...), the layout Qwen3-MoE checkpoints use on the hub: transformers 5 fuses them into its 3-D
expert tensors on load, transformers 4 and vLLM read them as they are. The directory is built
under a temp name and renamed into place, so a kill leaves the old directory or the new one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import MODEL_CONFIG, atomic_dir, atomic_write_json, read_json, verify_manifest, write_manifest
from snowcat.stages.tokenizer import ChatTokenizer

from .config import ModelConfig
from .modeling import MoEForCausalLM

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def hf_state_dict(model: MoEForCausalLM) -> dict[str, torch.Tensor]:
    """State dict under HF hub names: fused expert tensors split per expert; tied head omitted."""
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        m = _FUSED.match(name)
        if not m:
            out[name] = t
            continue
        prefix, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "gate_up_proj":
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
    return out


def load_hf_state_dict(model: MoEForCausalLM, tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of `hf_state_dict` (strict: every parameter must be present, nothing extra)."""
    fused: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    plain = {}
    for name, t in tensors.items():
        m = _PER_EXPERT.match(name)
        if m:
            prefix, e, kind = m.groups()
            fused.setdefault(prefix, {}).setdefault(int(e), {})[kind] = t
        else:
            plain[name] = t
    for prefix, experts in fused.items():
        ids = sorted(experts)
        plain[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in ids])
        plain[f"{prefix}.down_proj"] = torch.stack([experts[e]["down_proj"] for e in ids])
    if model.config.tie_word_embeddings:
        plain["lm_head.weight"] = plain["model.embed_tokens.weight"]
    model.load_state_dict(plain, strict=True)


def _write_tensors(dir: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> None:
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(dir / SINGLE), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(dir / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    atomic_write_json(dir / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if (path / SINGLE).is_file():
        return load_file(str(path / SINGLE))
    index = read_json(path / INDEX)
    if index is None:
        raise FileNotFoundError(f"{path}: neither {SINGLE} nor {INDEX}")
    out = {}
    for fname in sorted(set(index["weight_map"].values())):
        out.update(load_file(str(path / fname)))
    return out


def save_model_dir(
    path,
    model: MoEForCausalLM,
    tokenizer=None,
    meta: dict | None = None,
    max_shard_bytes: int = 4 << 30,
    extra_files: dict | None = None,
) -> Path:
    """Write a model directory atomically. `extra_files`: {relative name: callable(path)} written
    inside the same directory before the manifest (e.g. a trainer's resumable state)."""
    path = Path(path)
    with atomic_dir(path) as tmp:
        _write_tensors(tmp, hf_state_dict(model), max_shard_bytes)
        atomic_write_json(tmp / MODEL_CONFIG, model.config.to_dict())
        if tokenizer is not None:
            tokenizer.save(tmp)
        if meta:
            atomic_write_json(tmp / "meta.json", meta)
        for name, write in (extra_files or {}).items():
            write(tmp / name)
        write_manifest(tmp)
    return path


def load_model_config(path) -> ModelConfig:
    d = read_json(Path(path) / MODEL_CONFIG)
    if d is None:
        raise UserError(f"{path}: not a model directory (no {MODEL_CONFIG})")
    return ModelConfig.from_dict(d)


def load_model_dir(path, device="cpu", dtype: torch.dtype | None = None, verify: bool = True):
    """(model, cfg, tokenizer) from a model directory; sha256 checked against the manifest."""

    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: model directory not found")
    if verify:
        problems = verify_manifest(path)
        if problems:
            raise UserError(f"{path}: corrupt model directory: {problems[0]}")
    cfg = load_model_config(path)
    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    model.model.inv_freq.copy_(1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    load_hf_state_dict(model, read_tensors(path))
    if cfg.tie_word_embeddings:  # to_empty() broke the tie; restore it
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(device=device, dtype=dtype) if dtype else model.to(device)
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        tokenizer = ChatTokenizer.load(path)
    return model, cfg, tokenizer


def model_dir_meta(path) -> dict:
    return json.loads((Path(path) / "meta.json").read_text()) if (Path(path) / "meta.json").is_file() else {}
