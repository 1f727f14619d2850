"""Model directories: what evaluate / RL / export load.

    <dir>/model.safetensors            (or model-0000i-of-0000n.safetensors + model.safetensors.index.json)
    <dir>/model_config.json            ModelConfig fields
    <dir>/config.json                  the same in Hugging Face form, when an HF architecture can express it (vLLM loads the dir)
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
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import MODEL_CONFIG, atomic_dir, atomic_write_json, read_json, verify_manifest, write_manifest
from snowcat.stages.tokenizer import load_tokenizer

from . import hf
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


class _Placement:
    """Where loaded tensors go: `own(t)` puts a tensor there (with `copy`, always as the model's own
    memory rather than a view of a memory-mapped file), `empty(shape, like)` allocates a fused tensor
    there to copy expert pieces into."""

    def __init__(self, device=None, dtype: torch.dtype | None = None, copy: bool = False):
        self.device, self.dtype, self.copy = device, dtype, copy

    def _dtype(self, t: torch.Tensor) -> torch.dtype:
        return self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype

    def own(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device or t.device, dtype=self._dtype(t), copy=self.copy)

    def empty(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        return torch.empty(shape, dtype=self._dtype(like), device=self.device or like.device)


def _fused(
    tensors: Iterable[tuple[str, torch.Tensor]], num_experts: int, where: str, place: _Placement
) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert hub tensors copied into the model's fused expert tensors, a layer as soon as its
    experts are all read; other tensors pass through (each placed once, no intermediate stack)."""
    pending: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in tensors:
        m = _PER_EXPERT.match(name)
        if not m:
            yield name, place.own(t)
            continue
        prefix, e, kind = m.groups()
        layer = pending.setdefault(prefix, {})
        layer.setdefault(int(e), {})[kind] = t
        if len(layer) == num_experts and all(len(parts) == 3 for parts in layer.values()):
            experts = [layer[e] for e in sorted(pending.pop(prefix))]
            (inter, hidden), n = experts[0]["gate_proj"].shape, len(experts)
            gate_up = place.empty((n, 2 * inter, hidden), experts[0]["gate_proj"])
            down = place.empty((n, hidden, inter), experts[0]["down_proj"])
            for i, x in enumerate(experts):
                gate_up[i, :inter].copy_(x["gate_proj"])
                gate_up[i, inter:].copy_(x["up_proj"])
                down[i].copy_(x["down_proj"])
            yield f"{prefix}.gate_up_proj", gate_up
            yield f"{prefix}.down_proj", down
    for prefix, layer in pending.items():
        have = sorted(layer)
        raise UserError(
            f"{where}: {prefix}: tensors of {len(have)} experts (ids {have[0]}..{have[-1]}), the model has {num_experts}"
        )


def _state_dict(model: MoEForCausalLM, tensors, where: str, place: _Placement) -> dict[str, torch.Tensor]:
    state = dict(_fused(tensors, model.config.num_experts, where, place))
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # a checkpoint may store the tied head too
        if "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
    wanted = set(model.state_dict())
    missing, extra = sorted(wanted - set(state)), sorted(set(state) - wanted)
    if missing or extra:
        what = f"missing tensor {missing[0]}" if missing else f"unexpected tensor {extra[0]}"
        raise UserError(f"{where}: {what} ({len(missing)} missing, {len(extra)} unexpected for this model config)")
    return state


def load_hf_state_dict(model: MoEForCausalLM, tensors: dict[str, torch.Tensor], where: str = "checkpoint") -> None:
    """Inverse of `hf_state_dict` (strict: every parameter must be present, nothing extra)."""
    model.load_state_dict(_state_dict(model, tensors.items(), where, _Placement()), strict=True)


def stream_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a model directory's safetensors, one shard file open at a time (memory-mapped)."""
    path = Path(path)
    if (path / SINGLE).is_file():
        files = [path / SINGLE]
    else:
        index = read_json(path / INDEX)
        if index is None:
            raise UserError(f"{path}: neither {SINGLE} nor {INDEX}")
        files = [path / name for name in sorted(set(index["weight_map"].values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise UserError(f"{path / INDEX}: shard {absent[0]} is missing ({len(absent)} of {len(files)} shards absent)")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


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
    return dict(stream_tensors(path))


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
        serving = serving_config(model)
        if serving is not None:
            atomic_write_json(tmp / hf.CONFIG, serving)
        if tokenizer is not None:
            tokenizer.save(tmp)
        if meta:
            atomic_write_json(tmp / "meta.json", meta)
        for name, write in (extra_files or {}).items():
            write(tmp / name)
        write_manifest(tmp)
    return path


def serving_config(model: MoEForCausalLM) -> dict | None:
    """config.json that lets vLLM (or transformers) load the directory, in the architecture the model
    maps to; None when no Hugging Face architecture can express it (snowcat itself reads
    model_config.json, which wins when both are present)."""
    try:
        fields = hf.hf_config_dict(model.config)
    except UserError:
        return None
    return fields | {"dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}


def load_model_config(path) -> ModelConfig:
    """From a snowcat model directory (model_config.json) or a Hugging Face checkpoint (config.json)."""
    path = Path(path)
    d = read_json(path / MODEL_CONFIG)
    if d is not None:
        return ModelConfig.from_dict(d)
    if (path / hf.CONFIG).is_file():
        return hf.model_config_from_hf(hf.read_hf_config(path), str(path / hf.CONFIG))
    raise UserError(f"{path}: not a model directory (no {MODEL_CONFIG} or {hf.CONFIG})")


def load_weights(path, cfg: ModelConfig, device="cpu", dtype: torch.dtype | None = None) -> MoEForCausalLM:
    """The model of `cfg` with the directory's weights, each tensor read (memory-mapped), cast and
    placed once: the parameters are the loaded tensors, never a second full copy."""
    with torch.device("meta"):
        model = MoEForCausalLM(cfg)

    place = _Placement(device, dtype, copy=True)  # the model owns its memory: no view of the memory-mapped files
    model.load_state_dict(_state_dict(model, stream_tensors(path), str(path), place), strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
    model.model.inv_freq = inv_freq.to(device)  # a non-persistent buffer: not in any checkpoint
    return model


def open_model_dir(path, verify: bool = True):
    """(cfg, tokenizer) of a model directory, without its weights; sha256 checked against the
    manifest when it has one."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: model directory not found")
    if verify and ((path / MODEL_CONFIG).is_file() or (path / "manifest.json").is_file()):  # ours always have one
        problems = verify_manifest(path)
        if problems:
            raise UserError(f"{path}: corrupt model directory: {problems[0]}")
    return load_model_config(path), load_tokenizer(path)


def load_model_dir(path, device="cpu", dtype: torch.dtype | None = None, verify: bool = True):
    """(model, cfg, tokenizer) from a model directory; sha256 checked against the manifest when it has one."""
    cfg, tok = open_model_dir(path, verify)
    return load_weights(path, cfg, device, dtype), cfg, tok


def model_dir_meta(path) -> dict:
    return json.loads((Path(path) / "meta.json").read_text()) if (Path(path) / "meta.json").is_file() else {}
