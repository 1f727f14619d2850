"""Resumable training checkpoints: a model directory plus the trainer's state, all or nothing.

    checkpoints/step_000123/
        model.safetensors (+ shards/index) model_config.json tokenizer.json meta.json
        trainer_state/optimizer.pt            optimizer + schedule + step, rank 0 writes it:
                                              torch backend: the (replicated) torch state dict;
                                              deepspeed: per parameter name, the whole fp32 master
                                              weight and AdamW moments (gathered from ZeRO's slices)
        trainer_state/client.pt               step, data-loader state (a global position), user state
        trainer_state/rng_rank00000.pt ...    torch / numpy / python RNG of every rank
        manifest.json                         sha256 of every file, written last

Nothing in it depends on the number of ranks that wrote it: weights are whole (ZeRO-3 gathers them),
so are optimizer moments, and the loader's position counts global batches. A run resumes on another
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
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from snowcat.pipeline.fsio import verify_manifest
from snowcat.stages.model.io import load_hf_state_dict, read_tensors, save_model_dir

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
    path, backend, tokenizer=None, client_state: dict | None = None, meta: dict | None = None, max_shard_bytes: int = 4 << 30
) -> Path:
    """Collective: every rank calls it. Returns the checkpoint path."""

    path = Path(path)
    rank, world_size = backend.rank, backend.world_size
    staging = path.parent / f".{path.name}.staging"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        (staging / STATE).mkdir(parents=True)
    _barrier(world_size)
    backend.save_state(staging / STATE)
    canonical.save(_rng_state(), staging / STATE / f"rng_rank{rank:05d}.pt")
    if rank == 0:
        canonical.save({"step": backend.step, **(client_state or {})}, staging / STATE / "client.pt")
    _barrier(world_size)
    with backend.full_params():
        if rank == 0:
            meta = {"step": backend.step, "backend": backend.name, "world_size": world_size, **(meta or {})}
            save_model_dir(
                path,
                backend.model,
                tokenizer,
                meta=meta,
                max_shard_bytes=max_shard_bytes,
                extra_files={STATE: lambda dst: os.replace(staging / STATE, dst)},
            )
            shutil.rmtree(staging, ignore_errors=True)
    _barrier(world_size)
    return path


def load_checkpoint(path, backend) -> dict:
    """Restore weights, optimizer/schedule, this rank's RNG; returns the client state (step, loader...)."""

    path = Path(path)
    with backend.full_params(modify=True):
        with torch.no_grad():
            load_hf_state_dict(backend.model, {k: v.to(backend.device) for k, v in read_tensors(path).items()})
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
