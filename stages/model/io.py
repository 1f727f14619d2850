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

Nothing here needs a whole model in memory: `save_model_dir` writes a stream of tensors (a sharded
trainer gathers one at a time), `WeightReader` reads any row range of a weight from the
memory-mapped files (a rank that holds a slice of it reads only that slice), and `copy_model_dir`
rewrites a checkpoint in this layout one tensor at a time.
"""

from __future__ import annotations

import contextlib
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
from .modeling import MoEForCausalLM, rope_inv_freq
from .shards import DTYPES, INDEX, SINGLE, write_shards

_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def hf_tensors(cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the model's state dict under HF hub names, as they come: fused expert
    tensors split per expert (views), the tied head omitted."""
    for name, t in tensors:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        m = _FUSED.match(name)
        if not m:
            yield name, t
            continue
        prefix, kind = m.groups()
        for e in range(t.shape[0]):
            if kind == "gate_up_proj":
                gate, up = t[e].chunk(2, dim=0)
                yield f"{prefix}.{e}.gate_proj.weight", gate
                yield f"{prefix}.{e}.up_proj.weight", up
            else:
                yield f"{prefix}.{e}.down_proj.weight", t[e]


def hf_state_dict(model: MoEForCausalLM) -> dict[str, torch.Tensor]:
    """State dict under HF hub names: fused expert tensors split per expert; tied head omitted."""
    return dict(hf_tensors(model.config, model.state_dict().items()))


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


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory (one, or the shards its index names)."""
    path = Path(path)
    if (path / SINGLE).is_file():
        return [path / SINGLE]
    index = read_json(path / INDEX)
    if index is None:
        raise UserError(f"{path}: neither {SINGLE} nor {INDEX}")
    files = [path / name for name in sorted(set(index["weight_map"].values()))]
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise UserError(f"{path / INDEX}: shard {absent[0]} is missing ({len(absent)} of {len(files)} shards absent)")
    return files


def stream_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a model directory's safetensors, one shard file open at a time (memory-mapped)."""
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


_FILE_DTYPES = {v: k for k, v in DTYPES.items()}


class WeightReader:
    """A model directory's weights under the model's own names (each MoE layer's experts fused, as
    the model holds them), read a row range at a time from the memory-mapped files: a rank that holds
    rows [a, b) of a weight (a ZeRO-3 shard, an expert-parallel shard) reads only those bytes.

        with WeightReader(path, cfg) as weights:
            weights.check(names)                 # exactly the tensors of these parameters, or UserError
            part = weights.rows(name, a, b)      # rows a..b-1 (dim 0) of parameter `name`
    """

    def __init__(self, path, cfg: ModelConfig):
        self.path, self.cfg = Path(path), cfg
        self._open = contextlib.ExitStack()
        self._file: dict[str, object] = {}  # tensor name in the files -> its open file

    def __enter__(self) -> WeightReader:
        for file in weight_files(self.path):
            f = self._open.enter_context(safe_open(str(file), framework="pt"))
            self._file.update(dict.fromkeys(f.keys(), f))
        return self

    def __exit__(self, *exc) -> None:
        self._open.close()

    def _stored(self, name: str) -> str:
        """The stored tensor a parameter that is stored whole reads (the tied head: the embeddings)."""
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return "model.embed_tokens.weight"
        return name

    def _expert_parts(self, name: str) -> tuple[str, list[str]] | None:
        """(prefix, per-expert kinds) of a fused expert weight stored per expert, else None."""
        m = _FUSED.match(name)
        if m is None or name in self._file:
            return None
        prefix, kind = m.groups()
        return prefix, ["gate_proj", "up_proj"] if kind == "gate_up_proj" else ["down_proj"]

    def check(self, names: Iterable[str]) -> None:
        """UserError naming the directory unless its tensors are exactly those of parameters `names`
        (a stored tied head is allowed)."""
        needed = set()
        for name in names:
            parts = self._expert_parts(name)
            if parts is None:
                needed.add(self._stored(name))
            else:
                prefix, kinds = parts
                needed.update(f"{prefix}.{e}.{kind}.weight" for e in range(self.cfg.num_experts) for kind in kinds)
        spare = {"lm_head.weight"} if self.cfg.tie_word_embeddings else set()
        missing, extra = sorted(needed - set(self._file)), sorted(set(self._file) - needed - spare)
        if missing or extra:
            what = f"missing tensor {missing[0]}" if missing else f"unexpected tensor {extra[0]}"
            raise UserError(f"{self.path}: {what} ({len(missing)} missing, {len(extra)} unexpected for this model config)")

    def dtype(self) -> torch.dtype:
        """The dtype the files store floating-point weights in."""
        for name, f in self._file.items():
            dtype = _FILE_DTYPES.get(f.get_slice(name).get_dtype())
            if dtype is not None and dtype.is_floating_point:
                return dtype
        return torch.get_default_dtype()

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) along dim 0 of parameter `name` (experts start..stop-1 of a fused
        expert weight), in the stored dtype."""
        parts = self._expert_parts(name)
        if parts is None:
            stored = self._stored(name)
            return self._file[stored].get_slice(stored)[start:stop]
        prefix, kinds = parts
        pieces = [
            torch.cat([self._file[n].get_tensor(n) for n in (f"{prefix}.{e}.{kind}.weight" for kind in kinds)])
            for e in range(start, stop)
        ]
        if pieces:
            return torch.stack(pieces)
        first = [self._file[n].get_slice(n) for n in (f"{prefix}.0.{kind}.weight" for kind in kinds)]
        shape = [sum(s.get_shape()[0] for s in first), *first[0].get_shape()[1:]]
        return torch.empty((0, *shape), dtype=_FILE_DTYPES[first[0].get_dtype()])


def skeleton(cfg: ModelConfig, dtype: torch.dtype | None = None) -> MoEForCausalLM:
    """The model of `cfg` on the meta device (names and shapes, no memory), floating-point weights
    in `dtype`: what a sharded trainer wraps before each rank allocates and reads its slices."""
    with torch.device("meta"):
        model = MoEForCausalLM(cfg)
    return model if dtype is None else model.to(dtype)


def empty_model(cfg: ModelConfig, dtype: torch.dtype, device) -> MoEForCausalLM:
    """The model of `cfg` in plain tensors on `device`, uninitialised and not trainable: a copy that
    weights are loaded into next (the RL quick eval's, reference and behaviour weights)."""
    return skeleton(cfg, dtype).materialize(device).requires_grad_(False)


def distinct_tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the model's state dict (parameters as they are), a tied weight once under
    its first name."""
    seen = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            yield name, t


def copy_model_dir(src, path, tokenizer=None, meta: dict | None = None) -> Path:
    """Model directory `src` (ours or a Hugging Face checkpoint) rewritten at `path` in this layout,
    one tensor in memory at a time; the bytes `save_model_dir` writes for the model loaded from it."""
    cfg = load_model_config(src)
    with WeightReader(src, cfg) as weights:
        model = skeleton(cfg, weights.dtype())
        whole = list(distinct_tensors(model))
        weights.check(name for name, _ in whole)
        tensors = ((name, weights.rows(name, 0, t.shape[0])) for name, t in whole)
        return save_model_dir(path, model, tokenizer, meta=meta, tensors=hf_tensors(cfg, tensors))


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
    max_shard_bytes: int | None = None,
    extra_files: dict | None = None,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a model directory atomically. `tensors`: its weights as (HF hub name, tensor) pairs,
    consumed as they come (default: `model`'s own, which must then be whole here); `model` gives
    the config; `dtype` the stored dtype of floating-point weights (default `model`'s). Shards of
    `max_shard_bytes` (default `shards.SHARD_BYTES`), hashed as written. `extra_files`: {relative
    name: callable(path)} written inside the same directory before the manifest (e.g. a trainer's
    resumable state)."""
    path = Path(path)
    if tensors is None:
        tensors = hf_tensors(model.config, model.state_dict().items())
    dtype = dtype or next(model.parameters()).dtype
    tensors = ((name, t.to(dtype) if t.is_floating_point() else t) for name, t in tensors)
    with atomic_dir(path) as tmp:
        hashed = write_shards(tmp, tensors, max_shard_bytes)
        atomic_write_json(tmp / MODEL_CONFIG, model.config.to_dict())
        serving = serving_config(model, dtype)
        if serving is not None:
            atomic_write_json(tmp / hf.CONFIG, serving)
        if tokenizer is not None:
            tokenizer.save(tmp)
        if meta:
            atomic_write_json(tmp / "meta.json", meta)
        for name, write in (extra_files or {}).items():
            write(tmp / name)
        write_manifest(tmp, hashed=hashed)
    return path


def serving_config(model: MoEForCausalLM, dtype: torch.dtype | None = None) -> dict | None:
    """config.json that lets vLLM (or transformers) load the directory, in the architecture the model
    maps to, naming `dtype` (default the model's) as the stored one; None when no Hugging Face
    architecture can express it (snowcat itself reads model_config.json, which wins when both are
    present)."""
    try:
        fields = hf.hf_config_dict(model.config)
    except UserError:
        return None
    return fields | {"dtype": str(dtype or next(model.parameters()).dtype).removeprefix("torch.")}


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
    model.model.inv_freq = rope_inv_freq(cfg, device)  # a non-persistent buffer: not in any checkpoint
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
