"""Train-step backends: one optimizer step over a list of micro-batches, behind one small API.

    backend = make_backend("torch" | "fsdp" | "deepspeed", model, optim_cfg, zero_stage=..., expert_parallel=...)
    backend, tok = load_for_training(model_dir, "fsdp", optim_cfg, device=...)   # the same, from a model directory
    stats = backend.train_step(micro_batches, loss_fn)   # -> StepStats; loss_fn(model, batch, n_tokens, n_micro)
    backend.save_state(dir) / backend.load_state(dir)     # optimizer + schedule + step (collective)
    backend.load_weights(model_dir)                       # each rank reads the rows it holds
    for name, whole in backend.whole_tensors(): ...       # whole weights one at a time on rank 0 (collective)
    with backend.full_params(): ...                       # all whole weights on every rank (collective)

`torch`: single process, or DDP when a process group is initialised (gloo on CPU, NCCL on GPU).
`fsdp`: torch FSDP2, ZeRO-3 over the same process group; with expert parallelism (`torch` too).
`deepspeed`: ZeRO stage 0-3 over the same process group (gloo on CPU works with deepspeed 0.19).
All normalise the loss by the step's total target-token count across micro-batches and ranks, so
the update does not depend on how a step is split into micro-batches or ranks.
Precision (stages/train/precision.py): the parameters are the masters (float32 unless the config
says bfloat16), the forward computes under autocast when the compute dtype differs (bf16 on GPUs by
default, plain float32 on the CPU: deterministic there); what is written for others is cast to the
storage dtype as it streams out.

Memory at scale: under fsdp no rank ever holds the whole model. `load_for_training` builds it on
the meta device, shards it, and each rank allocates and reads only its rows of each weight from
the memory-mapped files; `whole_tensors` gathers one weight at a time for rank 0 to write (model
directories, weight versions), and the optimizer's moments are gathered one tensor at a time,
kept by rank 0 only. The replicated backends (torch, deepspeed) load the whole model on every
rank, as their ranks hold it whole anyway.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from snowcat.pipeline.errors import UserError
from snowcat.stages.model.expert_parallel import (
    check_expert_parallel,
    clip_grad_norm_,
    exclude_experts_from_ddp,
    expert_parallel_groups,
    expert_parameters,
    full_experts,
    gather_shards,
    reduce_expert_grads,
    shard_experts,
    shard_rows,
)
from snowcat.stages.model.io import (
    WeightReader,
    distinct_tensors,
    empty_model,
    load_hf_state_dict,
    load_weights,
    open_model_dir,
    read_tensors,
    skeleton,
)
from snowcat.stages.model.shards import write_shards

from . import canonical
from .optim import OptimConfig, build_optimizer, lr_factor
from .precision import FP32
from .rendezvous import forget_process_group_env, init_process_group, rendezvous, will_export

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

# FSDP2 and DTensor are imported where a backend shards (0.6 s of CPU): a process that only samples,
# scores or exports (rollout ranks, evaluate, teacher, export) never pays for them. No DTensor can
# exist before torch.distributed.tensor is imported, so until then nothing is one.


def is_dtensor(t) -> bool:
    """Whether `t` is a DTensor (an FSDP2 shard), without importing torch's DTensor machinery."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def is_fsdp_module(m) -> bool:
    """Whether module `m` is sharded by FSDP2 (`fully_shard`), without importing FSDP."""
    module = sys.modules.get("torch.distributed.fsdp")
    return module is not None and isinstance(m, module.FSDPModule)


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step reports, the same for every loss.

    A loss function returns `(loss, stats)`; `stats` holds tensors summed over micro-batches:
    `tokens` (trained target tokens), `input_tokens`, `entropy_sum` (over trained tokens), an optional
    `router` dict (averaged over micro-batches here) and anything loss-specific, kept in `sums`."""

    step: int
    lr: float
    grad_norm: float
    step_time_s: float
    num_micro: int
    tokens: float
    input_tokens: float
    entropy: float  # mean over trained tokens
    router: dict[str, float] = field(default_factory=dict)
    sums: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.input_tokens / max(self.step_time_s, 1e-9)

    def record(self) -> dict[str, float]:
        """The fields every training log line carries."""
        return {
            "lr": self.lr,
            "grad_norm": self.grad_norm,
            "tokens": self.tokens,
            "entropy": self.entropy,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            **{f"router/{k}": v for k, v in self.router.items()},
        }


def local_device(local_rank: int = 0) -> torch.device:
    """This rank's accelerator when there is one (GPU sites), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_distributed(world_size: int, addr_suffix: str = "") -> tuple[int, int]:
    """(rank, world size) of this process in its data-parallel group, joined when it is one of
    several ranks where the launcher's environment says the group meets (stages.train.rendezvous:
    MASTER_ADDR/PORT, else the Slurm job, else the MPI world); gloo on CPU, NCCL on GPU."""
    if world_size > 1 and not dist.is_initialized():
        init_process_group(rendezvous(addr_suffix=addr_suffix))
    return world()


@contextlib.contextmanager
def distributed(world_size: int, addr_suffix: str = "") -> Iterator[tuple[int, int]]:
    """init_distributed for a block: a group formed in it (here, or by a backend that needs one on
    a single process: fsdp, deepspeed) is left on the way out (see leave_distributed); a group the
    caller had formed stays up for the caller."""
    was_up = dist.is_initialized()
    ranks = init_distributed(world_size, addr_suffix)
    try:
        yield ranks
    except BaseException:
        if not was_up:
            leave_distributed()
        raise
    if not was_up:
        leave_distributed(together=True)


def leave_distributed(together: bool = False) -> None:
    """Tear the process group down before the interpreter exits: left up, gloo's threads may
    outlive it and abort the process ("terminate called without an active exception", exit 134).
    `together` (a normal end, every rank gets here): wait for the others first. A rank that tore
    its groups down while another still worked on them (rank 0 writing the last weights) aborted
    the same way now and then: 2 of 110 two-rank runs with expert-parallel groups, 0 of 100 with
    the wait. Not on an error path: a failed rank never comes to wait."""
    if dist.is_available() and dist.is_initialized():
        if together and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()
    forget_process_group_env()


def _all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    if world()[1] > 1:
        dist.all_reduce(x)
    return x


class NonFiniteGradient(RuntimeError):
    """A step's gradient norm is NaN or infinite: the step is refused before the optimizer runs."""


def refuse_nonfinite(step: int, grad_norm, stats: dict) -> None:
    """Stop before the optimizer steps on a NaN or infinite gradient: clipping scales by the norm and
    does not remove a NaN, so one such step writes NaN into every weight, silently, and every later
    checkpoint carries it. The norm is global (every rank computed the same), so every rank stops here
    together. The weights, the optimizer and the last checkpoint stay those before this step."""
    norm = float(grad_norm)
    if math.isfinite(norm):
        return
    losses = ", ".join(f"{k}={float(v):.4g}" for k, v in stats.items() if "loss" in k and not isinstance(v, dict))
    raise NonFiniteGradient(
        f"step {step}: gradient norm {norm} ({losses or 'no loss reported'}); the optimizer did not step, "
        f"the weights and the last checkpoint are those of step {step - 1}"
    )


def _merge_stats(acc: dict, s: dict) -> None:
    for k, v in s.items():
        if isinstance(v, dict):
            _merge_stats(acc.setdefault(k, {}), v)
        elif v is not None:
            v = v.detach().float()
            acc[k] = acc[k] + v if k in acc else v


class TorchBackend:
    name = "torch"
    ep = None  # this rank's expert-parallel groups when the experts are sharded
    shards_parameters = False  # True: a forward needs every rank (each holds a slice of each weight)
    data_group = None  # the ranks that split the data (None: all of them); megatron's TP/PP ranks share theirs

    @property
    def data_rank(self) -> int:
        """This rank's index among the ranks that split each batch (here every rank is one)."""
        return self.rank

    @property
    def data_ranks(self) -> int:
        return self.world_size

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, expert_parallel: int = 1, device=None, precision=FP32):
        self.cfg, self.precision = cfg, precision
        self.model = model
        self.rank, self.world_size = world()
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.wrapped = model
        if expert_parallel > 1:  # shard from the full weights, and keep the shards out of DDP
            check_expert_parallel(model.config, expert_parallel, self.world_size)
            self.ep = expert_parallel_groups(expert_parallel)
            shard_experts(model, self.ep)
            exclude_experts_from_ddp(model)
        if self.world_size > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.wrapped = DistributedDataParallel(model, device_ids=ids)
        self.optimizer, self.scheduler = build_optimizer(model, cfg)
        self.step = 0

    def _autocast(self):
        return self.precision.autocast(self.device)

    def _no_sync(self, last: bool):
        if self.world_size > 1 and not last:
            return self.wrapped.no_sync()
        return contextlib.nullcontext()

    def _clip(self) -> torch.Tensor:
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        if self.ep is not None:  # shards' grads summed over the ranks holding them; each counted once
            reduce_expert_grads(self.model, self.ep)
            return clip_grad_norm_(self.model, max_norm, self.ep)
        params = [p for p in self.model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def _backward(self, loss):
        loss.backward()

    def _optimizer_step(self):
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def train_step(self, micro_batches: list[dict], loss_fn) -> StepStats:
        t0 = time.perf_counter()
        lr = self.cfg.lr * lr_factor(self.step, self.cfg)
        n_tokens = _all_reduce_sum(torch.tensor(sum(int((b["targets"] >= 0).sum()) for b in micro_batches), dtype=torch.float64))
        # DP backends average gradients over ranks; scale so the result is a mean over all tokens.
        n_local = max(1.0, float(n_tokens)) / self.world_size
        self.wrapped.train()
        acc: dict = {}
        for i, mb in enumerate(micro_batches):
            mb = {k: v.to(self.device, non_blocking=True) for k, v in mb.items()}
            with self._no_sync(i == len(micro_batches) - 1), self._autocast():
                loss, stats = loss_fn(self.wrapped, mb, n_local, len(micro_batches))
            self._backward(loss)
            _merge_stats(acc, stats)
        grad_norm = self._clip()
        refuse_nonfinite(self.step + 1, grad_norm, acc)
        self._optimizer_step()
        self.step += 1
        tokens = float(acc.pop("tokens"))
        return StepStats(
            step=self.step,
            lr=lr,
            grad_norm=self._grad_norm(grad_norm),
            step_time_s=time.perf_counter() - t0,
            num_micro=len(micro_batches),
            tokens=tokens,
            input_tokens=float(acc.pop("input_tokens")),
            entropy=float(acc.pop("entropy_sum")) / max(tokens, 1.0),
            router={k: float(v) / len(micro_batches) for k, v in acc.pop("router", {}).items()},
            sums=acc,
        )

    def _grad_norm(self, clipped) -> float:
        return float(clipped)

    # ---------------------------------------------------------------- topology-independent state
    #
    # trainer_state/optimizer.pt holds what is small (param groups, each parameter's scalars such as
    # AdamW's step, which of its state tensors are moments, the schedule); trainer_state/moments/
    # every state tensor shaped like its parameter (AdamW's moments), whole, as safetensors named
    # `<key>/<parameter name>`: gathered one at a time where ranks hold slices, written as they come
    # by rank 0, read back by each rank as the rows it holds. No rank holds the whole state, and
    # nothing depends on the number of ranks or the backend (torch, fsdp, with or without EP).

    MOMENTS = "moments"

    def _named_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(name, parameter) in the order `optimizer.state_dict()` numbers them."""
        name_of = {id(p): n for n, p in self.model.named_parameters()}
        return [(name_of[id(p)], p) for g in self.optimizer.param_groups for p in g["params"]]

    def save_state(self, dir, max_shard_bytes: int | None = None) -> None:
        """Optimizer + schedule + step into `dir` (collective; rank 0 writes; the moments in shards
        of `max_shard_bytes`, default `shards.SHARD_BYTES`)."""
        sd, params, experts = self.optimizer.state_dict(), self._named_params(), shard_rows(self.model)
        moments = {i: [k for k, v in state.items() if _shaped_like(v, params[i][1])] for i, state in sd["state"].items()}
        stream = (
            (f"{key}/{params[i][0]}", self._gathered(params[i][0], sd["state"][i][key], experts))
            for i in sorted(moments)
            for key in moments[i]
        )
        if self.rank != 0:
            for _ in stream:  # take part in every gather
                pass
            return
        (dir / self.MOMENTS).mkdir(parents=True)
        write_shards(dir / self.MOMENTS, stream, max_shard_bytes)
        small = {i: {k: v for k, v in state.items() if k not in moments[i]} for i, state in sd["state"].items()}
        optimizer = {"state": small, "moments": moments, "param_groups": sd["param_groups"], "names": [n for n, _ in params]}
        state = {"optimizer": optimizer, "scheduler": self.scheduler.state_dict(), "step": self.step}
        canonical.save(state, dir / "optimizer.pt")  # a resumed run's equal state: equal bytes

    def load_state(self, dir) -> None:
        """Each rank reads its rows of every moment (no collective)."""
        # on the CPU: load_state_dict moves each state tensor to its parameter's device, but keeps
        # AdamW's `step` where it was loaded, and a fresh run keeps it on the CPU (else a resumed
        # GPU run pickles it as a CUDA tensor: other bytes for the same state)
        sd = torch.load(dir / "optimizer.pt", map_location="cpu", weights_only=False)
        if "optimizer" not in sd or "moments" not in sd["optimizer"]:
            raise UserError(
                f"{dir}: not a torch or fsdp backend's trainer state (written by backend: deepspeed, or an older snowcat?)"
            )
        saved, params, experts = sd["optimizer"], self._named_params(), shard_rows(self.model)
        if saved["names"] != [n for n, _ in params]:
            raise UserError(f"{dir}: trainer state of other parameters than this model's")
        state = {}
        with WeightReader(dir / self.MOMENTS, self.model.config) as moments:
            for i, keys in saved["moments"].items():
                name, p = params[i]
                _, start, stop = _held(name, p, experts)
                state[i] = dict(saved["state"][i])
                for key in keys:
                    local = moments.rows(f"{key}/{name}", start, stop).to(self.device)
                    state[i][key] = (
                        sys.modules["torch.distributed.tensor"].DTensor.from_local(
                            local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                        )
                        if is_dtensor(p)
                        else local
                    )
        self.optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
        self.scheduler.load_state_dict(sd["scheduler"])
        self.step = int(sd["step"])

    def _gathered(self, name: str, t: torch.Tensor, experts: dict) -> torch.Tensor | None:
        """Tensor `t`, laid out on this rank as parameter `name` is, whole on rank 0 (None on the
        others): gathered where ranks hold slices of it (collective then), on the CPU."""
        if name in experts:
            whole = gather_shards(t.detach(), experts[name][1].group)
        elif is_dtensor(t):
            whole = t.detach().full_tensor()
        else:
            whole = t.detach()
        return whole.cpu() if self.rank == 0 else None

    def full_params(self, modify: bool = False):
        """Context in which `self.model`'s parameters are whole on every rank (ZeRO-3 gathers, expert
        shards gathered); collective. `modify`: writes to them inside are kept."""
        return contextlib.nullcontext() if self.ep is None else full_experts(self.model)

    # ---------------------------------------------------------------- weights, one tensor at a time

    def whole_tensors(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """(name, whole tensor) of each state-dict tensor of the unsharded model, in its order, a tied
        weight once: the tensor on rank 0 (gathered where ranks hold slices of it, one weight at a
        time, so no rank ever holds more than one gathered weight), None on the others. Collective
        where weights are sharded: every rank iterates it to the end, in step."""
        experts = shard_rows(self.model)
        for name, t in distinct_tensors(self.model):
            yield name, self._gathered(name, t, experts)

    def load_weights(self, path) -> None:
        """The weights of model directory `path` into the model, each rank reading only the rows it
        holds (`load_rows`). No collective."""
        load_rows(self.model, path)

    def frozen_copy(self, path=None) -> torch.nn.Module:
        """A forward-only model of the trained one's config in its dtype, with the weights of model
        directory `path` (uninitialised without one: weights are about to be loaded into it), laid
        out as this backend holds weights: whole here (the RL reference and behaviour weights)."""
        model = empty_model(self.model.config, next(self.model.parameters()).dtype, self.device)
        if path is not None:
            load_rows(model, path)
        return model


def load_rows(model: torch.nn.Module, path) -> None:
    """The weights of model directory `path` into `model`, each rank reading only the rows it holds:
    all of a replicated weight, its slice of a sharded one (an FSDP DTensor, an expert shard), from
    the memory-mapped files. No collective. UserError naming the directory where it does not match."""
    experts = shard_rows(model)
    with torch.no_grad(), WeightReader(path, model.config) as weights:
        tensors = list(distinct_tensors(model))
        weights.check(name for name, _ in tensors)
        for name, t in tensors:
            local, start, stop = _held(name, t, experts)
            part = weights.rows(name, start, stop)
            if part.shape != local.shape:
                raise UserError(
                    f"{path}: {name} rows {start}..{stop} have shape {list(part.shape)}, the model {list(local.shape)}"
                )
            local.copy_(part)


def _held(name: str, t: torch.Tensor, experts: dict) -> tuple[torch.Tensor, int, int]:
    """(what this rank holds of parameter `name`, tensor `t`, and the rows [start, stop) of the
    whole weight that is): an expert shard's rows, an FSDP shard's, or all of a replicated one."""
    if name in experts:
        rows = experts[name][0]
        return t, rows.start, rows.stop
    if is_dtensor(t):
        return t.to_local(), *_shard_rows(t)
    return t, 0, t.shape[0]


def _shaped_like(v, p: torch.Tensor) -> bool:
    """Whether optimizer state `v` of parameter `p` is laid out like it (a moment, not a scalar)."""
    return torch.is_tensor(v) and v.dim() > 0 and v.shape == p.shape


def _shard_rows(t: DTensor) -> tuple[int, int]:
    """The rows [start, stop) of the whole tensor that this rank's local shard of FSDP's Shard(0)
    placement holds (torch.chunk's split: ceil(n / ranks) rows each, the last ranks fewer or none)."""
    (placement,) = t.placements
    if not placement.is_shard(0):
        raise RuntimeError(f"expected FSDP's Shard(0) placement, got {placement}")
    n, ranks, rank = t.shape[0], t.device_mesh.size(), t.device_mesh.get_local_rank()
    chunk = -(-n // ranks)
    start = min(n, rank * chunk)
    return start, min(n, start + chunk)


class DeepSpeedBackend(TorchBackend):
    """ZeRO 0-3 via deepspeed.initialize with our AdamW + LambdaLR as client optimizer/scheduler.

    Stage 3 partitions the parameters too: each module's are gathered around its forward and
    backward (the LM head inside `MoEForCausalLM.forward`, which reads it for the fused logprob).
    `persistence_threshold`: stage-3 parameters with fewer elements stay whole on every rank
    (DeepSpeed's default; 0 shards every parameter)."""

    name = "deepspeed"

    @property
    def shards_parameters(self) -> bool:
        return self.zero_stage == 3

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: OptimConfig,
        zero_stage: int = 1,
        persistence_threshold: int = 100_000,
        precision=FP32,
    ):
        import deepspeed  # noqa: PLC0415 (optional extra)

        self.cfg, self.precision = cfg, precision
        self.model = model
        self.rank, self.world_size = world()
        self.device = next(model.parameters()).device
        optimizer, scheduler = build_optimizer(model, cfg)
        zero: dict = {"stage": zero_stage}
        if zero_stage == 3:
            zero["stage3_param_persistence_threshold"] = persistence_threshold
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,  # nominal: we feed our own micro-batches
            "gradient_accumulation_steps": 1,
            "gradient_clipping": cfg.grad_clip,
            "zero_optimization": zero,
            # bf16 compute: DeepSpeed's own mixed precision (bf16 weights in the model, fp32 masters
            # and moments in the optimizer's partitions)
            "bf16": {"enabled": precision.compute == torch.bfloat16 and precision.master == torch.float32},
            "steps_per_print": 1 << 30,
            "zero_allow_untested_optimizer": True,
        }
        # wraps an existing torch process group (or creates one from the env:// variables); it sets
        # these itself (a machine address and port 29500 on one process), put back on leaving
        will_export(("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE"))
        deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo")
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=ds_config,
        )
        self.zero_stage = zero_stage
        self.wrapped = self.engine
        self.step = 0

    def _no_sync(self, last: bool):
        return contextlib.nullcontext()  # deepspeed reduces gradients in step()

    def _autocast(self):
        return contextlib.nullcontext()  # the engine casts (bf16 config) itself

    def _backward(self, loss):
        with self._read_outside_their_module():
            self.engine.backward(loss, scale_wrt_gas=False)

    def _read_outside_their_module(self):
        """Stage 3: a parameter that a forward read without calling its module (the LM head, for the
        fused logprob in `MoEForCausalLM.forward`) is gathered there by DeepSpeed, which registers it
        as an external parameter of the module being run, but not for backward: DeepSpeed gathers
        those when gradients reach the module's outputs, and it cannot see into `ModelOutput` (a
        dataclass). Gathered here for the whole backward instead (collective, as gathering is)."""
        if self.zero_stage != 3:
            return contextlib.nullcontext()
        import deepspeed  # noqa: PLC0415 (optional extra)

        external = {
            id(p): p for m in self.model.modules() if hasattr(m, "ds_external_parameters") for _, p in m.ds_external_parameters()
        }
        return deepspeed.zero.GatheredParameters(list(external.values()), modifier_rank=None)

    def _clip(self) -> torch.Tensor:
        return torch.tensor(0.0)  # clipped inside engine.step(); norm read after it

    def _optimizer_step(self):
        self.engine.step()

    def _grad_norm(self, _clipped) -> float:
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    # ---------------------------------------------------------------- topology-independent state
    #
    # ZeRO keeps each rank's slice of the fp32 master weights and AdamW moments. They are saved
    # whole, per parameter name (DeepSpeed's safe_get/safe_set_full_* gather and scatter them), so a
    # checkpoint does not depend on the number of ranks or the ZeRO stage that wrote it.

    MOMENTS = ("exp_avg", "exp_avg_sq")

    def _trained(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def _base_optimizer(self) -> torch.optim.Optimizer:
        """The torch AdamW that steps this rank's fp32 partitions (stage 0: the client optimizer)."""
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def _stepped(self) -> list[torch.Tensor]:
        """What the torch AdamW steps on this rank: ZeRO's flat fp32 partitions (one per group;
        stage 3 hands them to the optimizer only during its step) or, stage 0, the parameters."""
        for flat in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):  # ZeRO-3, ZeRO-1/2
            if hasattr(self.optimizer, flat):
                return list(getattr(self.optimizer, flat))
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _adam_state(self, step: int) -> None:
        """AdamW creates its state at the first step; a save before it or a load needs it now
        (the values torch would create, with `step` steps taken)."""
        base = self._base_optimizer()
        for p in self._stepped():
            state = base.state[p]
            if not state:
                state.update({key: torch.zeros_like(p, memory_format=torch.preserve_format) for key in self.MOMENTS})
            state["step"] = torch.tensor(float(step), dtype=torch.get_default_dtype())

    def _link_moments(self) -> None:
        """ZeRO-1/2 map each parameter to its slice of the moments once, after the first step of the
        first param group, when the other groups' moments do not exist yet (deepspeed 0.19): the
        safe_*_full_optimizer_state calls would then miss them. Map every group again."""
        from deepspeed.utils import lazy_init_hp_params_optimizer_state  # noqa: PLC0415

        if hasattr(self.optimizer, "single_partition_of_fp32_groups"):
            for params, flat in zip(self.optimizer.bit16_groups, self.optimizer.single_partition_of_fp32_groups):
                lazy_init_hp_params_optimizer_state(params, flat, self._base_optimizer().state)

    def _get_full(self, p, key: str | None) -> torch.Tensor:
        """Collective: the whole fp32 master weight (key None) or moment of parameter `p`."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: PLC0415

        full = safe_get_full_fp32_param(p) if key is None else safe_get_full_optimizer_state(p, key)
        if full is None:  # stage 0: the client optimizer steps the model's own parameters
            full = p.detach() if key is None else self._base_optimizer().state[p][key]
        return full.detach().float().cpu().reshape(p.ds_shape if hasattr(p, "ds_shape") else p.shape)

    def _set_full(self, p, value: torch.Tensor, key: str | None) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state  # noqa: PLC0415

        value = value.to(self.device)
        if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):
            if key is None:
                safe_set_full_fp32_param(p, value)
            else:
                safe_set_full_optimizer_state(p, value, key)
        elif key is not None:  # stage 0 (the weights themselves are loaded with the model)
            self._base_optimizer().state[p][key].copy_(value)

    def save_state(self, dir, max_shard_bytes: int | None = None) -> None:
        """Collective: every rank takes part in gathering; rank 0 writes `optimizer.pt` (one file:
        `max_shard_bytes` does not apply)."""
        if not any(self._base_optimizer().state.get(p) for p in self._stepped()):
            self._adam_state(self.step)
        self._link_moments()
        params = {}
        for name, p in self._trained():
            whole = {key or "fp32": self._get_full(p, key) for key in (None, *self.MOMENTS)}  # every rank gathers
            if self.rank == 0:  # ... and only the writer keeps them
                params[name] = whole
        if self.rank == 0:
            dir.mkdir(parents=True, exist_ok=True)
            state = {"params": params, "scheduler": self.scheduler.state_dict(), "step": self.step}
            canonical.save(state, dir / "optimizer.pt")

    def load_state(self, dir) -> None:
        sd = torch.load(dir / "optimizer.pt", map_location="cpu", weights_only=False)
        if "params" not in sd:
            raise UserError(f"{dir}: not a deepspeed backend's trainer state (written by backend: torch?)")
        self.step = int(sd["step"])
        self._adam_state(self.step)
        self._link_moments()
        for name, p in self._trained():
            for key, value in sd["params"][name].items():
                self._set_full(p, value, None if key == "fp32" else key)
        self.scheduler.load_state_dict(sd["scheduler"])
        # the schedule sets the groups' lr when it steps; a loaded one has not stepped yet
        for group, lr in zip(self._base_optimizer().param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr

    def full_params(self, modify: bool = False):
        """Every rank must enter it (stage 3 gathers). `modify`: rank 0's writes to the parameters
        are kept (scattered back to every rank's partition on exit)."""
        if self.zero_stage == 3:
            import deepspeed  # noqa: PLC0415 (optional extra)

            return deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=0 if modify else None)
        return contextlib.nullcontext()

    def whole_tensors(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        if self.zero_stage != 3:
            yield from super().whole_tensors()
            return
        import deepspeed  # noqa: PLC0415 (optional extra)

        for name, p in distinct_tensors(self.model):
            with deepspeed.zero.GatheredParameters([p]):  # a copy: the gathered memory is freed on exit
                whole = p.detach().clone() if self.rank == 0 else None
            yield name, whole

    def load_weights(self, path) -> None:
        """Every rank reads the whole model; stage 3 keeps rank 0's (scattered to the partitions)."""
        with self.full_params(modify=True), torch.no_grad():
            load_hf_state_dict(self.model, {k: v.to(self.device) for k, v in read_tensors(path).items()})


class FSDPBackend(TorchBackend):
    """ZeRO-3 through torch's FSDP2 (`fully_shard`): parameters, gradients and AdamW moments sharded
    over the trainer ranks, each decoder layer's weights gathered around its forward and backward
    (the root's, embeddings, final norm and LM head, around the whole forward: the fused logprob
    reads the head inside it). Composes with expert parallelism, which DeepSpeed's ZeRO-3 does not
    for a model of our own (it shards only its own MoE layers): the expert shards are left out of
    FSDP (`ignored_params`) and reduced as under the torch backend; everything else is sharded.

    The trainer state has the torch backend's layout (`optimizer.state_dict()` of the unsharded
    model, moments gathered whole), so either backend, on any number of ranks, resumes the other's."""

    name = "fsdp"
    shards_parameters = True

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, expert_parallel: int = 1, device=None, precision=FP32):
        if not dist.is_initialized():  # one process: a group of itself, as DeepSpeed forms one
            init_process_group(rendezvous(env={}))
        self.cfg, self.precision, self.model = cfg, precision, model
        self.rank, self.world_size = world()
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if expert_parallel > 1:
            check_expert_parallel(model.config, expert_parallel, self.world_size)
            self.ep = expert_parallel_groups(expert_parallel)
        from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415 (see is_dtensor)

        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        self._shard(model)
        self.wrapped = model
        self.optimizer, self.scheduler = build_optimizer(model, cfg)
        self.step = 0

    def _shard(self, model: torch.nn.Module) -> None:
        """Shard `model` as this backend does: the experts over the EP group (cut from its weights),
        the rest by FSDP per decoder layer and at the root. Built on the meta device, only the
        shards are then allocated (uninitialised: load_rows fills them)."""
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415 (see is_dtensor)

        if self.ep is not None:
            shard_experts(model, self.ep)
        ignored = set(expert_parameters(model).values())
        for layer in model.model.layers:
            fully_shard(layer, mesh=self.mesh, ignored_params=ignored & set(layer.parameters()))
        fully_shard(model, mesh=self.mesh, ignored_params=ignored)
        if next(model.parameters()).device.type == "meta":
            model.materialize(self.device)

    def frozen_copy(self, path=None) -> torch.nn.Module:
        """Sharded as the trained model is, so no rank holds it whole: every trainer rank must run
        each of its forwards in step (as the trained model's)."""
        model = skeleton(self.model.config, next(self.model.parameters()).dtype).requires_grad_(False)
        self._shard(model)
        if path is not None:
            load_rows(model, path)
        return model

    def _no_sync(self, last: bool):
        self.model.set_requires_gradient_sync(last)  # accumulate unsharded; reduce-scatter on the last
        return contextlib.nullcontext()

    def _clip(self) -> torch.Tensor:
        """The global norm of the whole gradient: FSDP's shards are disjoint over all ranks, expert
        shards over each EP group (after their reduction); every grad scaled by the same factor."""
        if self.ep is not None:
            reduce_expert_grads(self.model, self.ep)
        experts = {id(p) for p in expert_parameters(self.model).values()}
        sharded, local = [], []
        for p in self.model.parameters():
            if p.grad is not None:
                g = p.grad
                (local if id(p) in experts else sharded).append(g.to_local() if is_dtensor(g) else g)

        def sq(grads):
            return sum(
                (torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in grads), torch.zeros((), device=self.device)
            )

        dense_sq, expert_sq = sq(sharded), sq(local)
        dist.all_reduce(dense_sq)
        if self.ep is not None:
            dist.all_reduce(expert_sq, group=self.ep.group)
        total = (dense_sq + expert_sq).sqrt()
        if self.cfg.grad_clip > 0:  # torch.nn.utils.clip_grads_with_norm_'s factor, on the local tensors
            factor = (self.cfg.grad_clip / (total + 1e-6)).clamp(max=1.0)
            for g in sharded + local:
                g.mul_(factor)
        return total

    def _sharded(self):
        """(module, name, DTensor parameter) of every parameter FSDP shards."""
        return [(m, n, p) for m in self.model.modules() for n, p in m._parameters.items() if is_dtensor(p)]

    @contextlib.contextmanager
    def _whole(self, modify: bool):
        """Each sharded parameter replaced by a plain one holding the whole tensor (all-gathered) for
        the block; with `modify`, what the block wrote is cut back into this rank's shard. FSDP's
        hooks on load_state_dict, which would take the plain tensors for its shards, are held off."""
        from torch.distributed.tensor import distribute_tensor  # noqa: PLC0415 (see is_dtensor)

        swapped = self._sharded()
        held = [(m, m._load_state_dict_post_hooks) for m in {id(m): m for m, _, _ in swapped}.values()]
        whole = {id(p): torch.nn.Parameter(p.full_tensor(), requires_grad=False) for _, _, p in swapped}  # tied: once
        for m, n, p in swapped:
            m._parameters[n] = whole[id(p)]
        for m, _ in held:
            m._load_state_dict_post_hooks = type(m._load_state_dict_post_hooks)()
        try:
            yield self.model
            if modify:
                with torch.no_grad():
                    for m, n, p in swapped:
                        p.to_local().copy_(distribute_tensor(m._parameters[n].detach(), p.device_mesh, p.placements).to_local())
        finally:
            for m, n, p in swapped:
                m._parameters[n] = p
            for m, hooks in held:
                m._load_state_dict_post_hooks = hooks

    @contextlib.contextmanager
    def full_params(self, modify: bool = False):
        """Collective. `modify`: rank 0's writes are kept (scattered to every rank's shard), as
        under DeepSpeed's ZeRO-3; expert shards keep each rank's own rows, as under the torch backend."""
        experts = full_experts(self.model) if self.ep is not None else contextlib.nullcontext()
        with self._whole(modify), experts:
            yield self.model


def make_backend(
    name: str,
    model,
    cfg: OptimConfig,
    zero_stage: int = 1,
    expert_parallel: int = 1,
    device=None,
    precision=FP32,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    **options,
):
    """`options`: backend-specific keywords (DeepSpeedBackend's persistence_threshold). `precision`:
    the model must already be in its master dtype. `device`: where
    the weights live (default: where the model's are; fsdp takes a model on the meta device, see
    `load_for_training`). On several ranks the MoE's router losses balance the whole data-parallel
    batch (balance_router_over)."""
    if name == "torch":
        backend = TorchBackend(model, cfg, expert_parallel=expert_parallel, device=device, precision=precision)
    elif name == "fsdp":
        backend = FSDPBackend(model, cfg, expert_parallel=expert_parallel, device=device, precision=precision)
    elif name == "deepspeed":
        if expert_parallel > 1:  # ZeRO would treat the shards as replicated parameters
            raise UserError(f"expert_parallel={expert_parallel} needs backend: torch or fsdp (deepspeed shards differently)")
        backend = DeepSpeedBackend(model, cfg, zero_stage=zero_stage, precision=precision, **options)
    elif name == "megatron":
        from .megatron import Layout, megatron_backend  # noqa: PLC0415 (megatron-core: only when asked for)

        return megatron_backend(model, cfg, Layout(tensor_parallel, pipeline_parallel, expert_parallel), device, precision)
    else:
        raise UserError(f"train backend {name!r} is not one of: torch, fsdp, deepspeed, megatron")
    if backend.world_size > 1 and hasattr(model, "balance_router_over"):
        model.balance_router_over(dist.group.WORLD)
    return backend


def load_for_training(
    path,
    name: str,
    cfg: OptimConfig,
    *,
    device,
    precision=FP32,
    activation_checkpointing: bool = False,
    verify: bool = True,
    **backend_options,
):
    """(backend, tokenizer) for training the model of directory `path` with backend `name`
    (`backend_options`: make_backend's), its parameters in `precision.master` whatever dtype the
    directory stores. fsdp builds the model on the meta device, shards it, and
    each rank reads only its rows of each weight; the replicated backends load it whole, then wrap
    it. The directory's sha256 manifest is checked first (`verify`)."""
    path = Path(path)
    if name == "megatron":  # each rank reads its slices of the directory (through mbridge)
        from .megatron import Layout, MegatronBackend  # noqa: PLC0415 (megatron-core: only when asked for)

        opts = {k: backend_options.get(k, 1) for k in ("tensor_parallel", "pipeline_parallel", "expert_parallel")}
        layout = Layout(opts["tensor_parallel"], opts["pipeline_parallel"], opts["expert_parallel"])
        return MegatronBackend.from_model_dir(path, cfg, layout, device, precision, verify)
    mcfg, tokenizer = open_model_dir(path, verify)
    if name == "fsdp":
        model = skeleton(mcfg, precision.master)
    else:
        model = load_weights(path, mcfg, device, dtype=precision.master)
    model.set_activation_checkpointing(activation_checkpointing)
    backend = make_backend(name, model, cfg, device=device, precision=precision, **backend_options)
    if name == "fsdp":
        backend.load_weights(path)
    return backend, tokenizer
