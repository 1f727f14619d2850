"""Resumable training checkpoints: a model directory plus the trainer's state, all or nothing.

    checkpoints/step_000123/
        model.safetensors (+ shards/index) model_config.json tokenizer.json meta.json
                                              (the weights in the master dtype: a resumed run
                                              continues from the very bits it stopped at)
        trainer_state/optimizer.pt            optimizer + schedule + step, rank 0 writes it:
                                              torch, fsdp: param groups, per-parameter scalars;
                                              deepspeed: per parameter name, the whole fp32 master
                                              weight and AdamW moments (gathered from ZeRO's slices)
        trainer_state/moments/                torch, fsdp: the moments whole, safetensors named
                                              <key>/<parameter>, each rank reads back its rows
        trainer_state/client.pt               step, data-loader state (a global position), user state
        trainer_state/rng_rank00000.pt ...    torch / numpy / python RNG of every rank
        manifest.json                         sha256 of every file, written last

Nothing in it depends on the number of ranks that wrote it: weights are whole (gathered one tensor
at a time for rank 0 to write), so are optimizer moments, and the loader's position counts global
batches; each rank loads back only the rows it holds. A run resumes on another
number of ranks with the same weights, optimizer state and data; a rank without an RNG snapshot of
its own (more ranks than before) keeps its seeded generators (training draws nothing from them).

Ranks first write their parts into `.step_000123.staging/`; rank 0 then builds the directory with
`pipeline.fsio.atomic_dir` (temp name, fsync, rename), so a kill at any instant leaves the previous
checkpoint or the new one. A directory with a verified manifest is complete by construction.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from snowcat.pipeline.fsio import verify_manifest
from snowcat.stages.model.io import hf_tensors, save_model_dir

from . import canonical

STEP_RE = re.compile(r"^step_(\d+)$")
STATE = "trainer_state"


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def _barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def seed_rng(seed: int) -> None:
    """A fresh start's generators (torch on every device, numpy's and Python's global ones), from the
    unit's seed alone: whether the model was just initialised, read from `initial` by a retry, or
    loaded from elsewhere, the states every checkpoint records are then the same."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    path, backend, tokenizer=None, client_state: dict | None = None, meta: dict | None = None, max_shard_bytes: int | None = None
) -> Path:
    """Collective: every rank calls it. Returns the checkpoint path."""

    path = Path(path)
    rank, world_size = backend.rank, backend.world_size
    staging = path.parent / f".{path.name}.staging"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        (staging / STATE).mkdir(parents=True)
    _barrier(world_size)
    backend.save_state(staging / STATE, max_shard_bytes)
    canonical.save(_rng_state(), staging / STATE / f"rng_rank{rank:05d}.pt")
    if rank == 0:
        canonical.save({"step": backend.step, **(client_state or {})}, staging / STATE / "client.pt")
    _barrier(world_size)
    meta = {"step": backend.step, "backend": backend.name, "world_size": world_size, **(meta or {})}
    extra = {STATE: lambda dst: os.replace(staging / STATE, dst)}
    save_weights(
        path, backend, tokenizer, meta=meta, max_shard_bytes=max_shard_bytes, extra_files=extra, dtype=backend.precision.master
    )
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    _barrier(world_size)
    return path


def with_whole_tensors(backend, write: Callable[[Iterator[tuple[str, torch.Tensor]]], object], dtype: torch.dtype | None = None):
    """Collective: `write(tensors)` on rank 0, `tensors` the model's whole weights under HF hub
    names in `dtype` (default the storage dtype), each gathered as `write` consumes it; the other
    ranks take part in every gather. Returns what `write` returns (None on the other ranks)."""
    stream = backend.whole_tensors()
    dtype = dtype or backend.precision.storage
    cast = ((name, t.to(dtype)) for name, t in hf_tensors(backend.model.config, stream))
    result = write(cast) if backend.rank == 0 else None
    for _ in stream:  # the other ranks (and rank 0, had `write` stopped early) gather to the end
        pass
    return result


def save_weights(path, backend, tokenizer=None, meta: dict | None = None, dtype: torch.dtype | None = None, **options) -> Path:
    """Collective: model directory `path` of the backend's model in `dtype` (default the storage
    dtype; rank 0 writes; `options`: save_model_dir's), without any rank holding more than one whole
    weight beyond the shards being written."""
    dtype = dtype or backend.precision.storage
    with_whole_tensors(
        backend,
        lambda tensors: save_model_dir(path, backend.model, tokenizer, meta=meta, tensors=tensors, dtype=dtype, **options),
        dtype,
    )
    return Path(path)


def load_checkpoint(path, backend) -> dict:
    """Restore weights, optimizer/schedule, this rank's RNG; returns the client state (step, loader...)."""

    path = Path(path)
    backend.load_weights(path)
    backend.load_state(path / STATE)
    rng = path / STATE / f"rng_rank{backend.rank:05d}.pt"
    if rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=False))
    return torch.load(path / STATE / "client.pt", weights_only=False)


def list_checkpoints(root) -> list[tuple[int, Path]]:
    """(step, path) of resumable checkpoints under `root`, oldest first (no integrity check)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_RE.match(p.name)) and (p / STATE).is_dir()]
    return sorted(out)


def latest_checkpoint(root, verify: bool = True) -> Path | None:
    """Newest resumable checkpoint whose manifest verifies (a corrupt one is skipped, not trusted)."""
    for _, path in reversed(list_checkpoints(root)):
        if not verify or not verify_manifest(path):
            return path
    return None
