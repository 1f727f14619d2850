"""Train-step backends: one optimizer step over a list of micro-batches, behind one small API.

    backend = make_backend("torch" | "deepspeed", model, optim_cfg, zero_stage=...)
    stats = backend.train_step(micro_batches, loss_fn)   # -> StepStats; loss_fn(model, batch, n_tokens, n_micro)
    backend.save_state(dir) / backend.load_state(dir)     # optimizer + schedule + step (collective)

`torch`: single process, or DDP when a process group is initialised (gloo on CPU, NCCL on GPU).
`deepspeed`: ZeRO stage 1-2 over the same process group (gloo on CPU works with deepspeed 0.19).
Both normalise the loss by the step's total target-token count across micro-batches and ranks, so
the update does not depend on how a step is split into micro-batches or ranks.
Mixed precision: bf16 autocast on GPU, plain fp32 on CPU (deterministic there).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from snowcat.pipeline.errors import UserError

from . import canonical
from .optim import OptimConfig, build_optimizer, lr_factor


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


def init_distributed(rank: int, world_size: int) -> tuple[int, int]:
    """Join the data-parallel process group (env:// rendezvous: MASTER_ADDR/MASTER_PORT set by the
    launcher) when running as one of several ranks; gloo on CPU, NCCL on GPU."""
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    return world()


def _all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    if world()[1] > 1:
        dist.all_reduce(x)
    return x


def _merge_stats(acc: dict, s: dict) -> None:
    for k, v in s.items():
        if isinstance(v, dict):
            _merge_stats(acc.setdefault(k, {}), v)
        elif v is not None:
            v = v.detach().float()
            acc[k] = acc[k] + v if k in acc else v


class TorchBackend:
    name = "torch"

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig):
        self.cfg = cfg
        self.model = model
        self.rank, self.world_size = world()
        self.device = next(model.parameters()).device
        self.wrapped = model
        if self.world_size > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.wrapped = DistributedDataParallel(model, device_ids=ids)
        self.optimizer, self.scheduler = build_optimizer(model, cfg)
        self.step = 0

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _no_sync(self, last: bool):
        if self.world_size > 1 and not last:
            return self.wrapped.no_sync()
        return contextlib.nullcontext()

    def _clip(self) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
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

    def save_state(self, dir) -> None:
        """Optimizer + schedule + step into `dir` (collective; replicated state: rank 0 writes)."""
        if self.rank == 0:
            dir.mkdir(parents=True, exist_ok=True)
            state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(), "step": self.step}
            canonical.save(state, dir / "optimizer.pt")  # a resumed run's equal state: equal bytes

    def load_state(self, dir) -> None:
        # on the CPU: load_state_dict moves each state tensor to its parameter's device, but keeps
        # AdamW's `step` where it was loaded, and a fresh run keeps it on the CPU (else a resumed
        # GPU run pickles it as a CUDA tensor: other bytes for the same state)
        sd = torch.load(dir / "optimizer.pt", map_location="cpu", weights_only=False)
        self.optimizer.load_state_dict(sd["optimizer"])
        self.scheduler.load_state_dict(sd["scheduler"])
        self.step = int(sd["step"])

    def full_params(self):
        """Context in which `self.model`'s parameters are whole on every rank (ZeRO-3 gathers)."""
        return contextlib.nullcontext()


class DeepSpeedBackend(TorchBackend):
    """ZeRO 1-2 via deepspeed.initialize with our AdamW + LambdaLR as client optimizer/scheduler."""

    name = "deepspeed"

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, zero_stage: int = 1):
        import deepspeed  # noqa: PLC0415 (optional extra)

        self.cfg = cfg
        self.model = model
        self.rank, self.world_size = world()
        self.device = next(model.parameters()).device
        optimizer, scheduler = build_optimizer(model, cfg)
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,  # nominal: we feed our own micro-batches
            "gradient_accumulation_steps": 1,
            "gradient_clipping": cfg.grad_clip,
            "zero_optimization": {"stage": zero_stage},
            "bf16": {"enabled": self.device.type == "cuda"},
            "steps_per_print": 1 << 30,
            "zero_allow_untested_optimizer": True,
        }
        # wraps an existing torch process group (or creates one from the env:// variables)
        deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo")
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=ds_config,
        )
        self.wrapped = self.engine
        self.step = 0

    def _no_sync(self, last: bool):
        return contextlib.nullcontext()  # deepspeed reduces gradients in step()

    def _autocast(self):
        return contextlib.nullcontext()  # the engine casts (bf16 config) itself

    def _backward(self, loss):
        self.engine.backward(loss, scale_wrt_gas=False)

    def _clip(self) -> torch.Tensor:
        return torch.tensor(0.0)  # clipped inside engine.step(); norm read after it

    def _optimizer_step(self):
        self.engine.step()

    def _grad_norm(self, _clipped) -> float:
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def save_state(self, dir) -> None:
        # ZeRO partitions optimizer state across ranks; deepspeed's own collective checkpoint
        # writes every rank's partition (our model weights are saved separately, in HF layout).
        self.engine.save_checkpoint(str(dir), tag="zero", client_state={"step": self.step}, save_latest=False)

    def load_state(self, dir) -> None:
        _, client = self.engine.load_checkpoint(str(dir), tag="zero", load_module_strict=True)
        self.step = int(client["step"])

    def full_params(self):
        if self.engine.zero_optimization_stage() == 3:
            import deepspeed  # noqa: PLC0415 (optional extra)

            return deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None)
        return contextlib.nullcontext()


def make_backend(name: str, model, cfg: OptimConfig, zero_stage: int = 1):
    if name == "torch":
        return TorchBackend(model, cfg)
    if name == "deepspeed":
        if zero_stage not in (0, 1, 2):
            # ZeRO-3 partitions the LM head, which the fused logprob kernel reads outside
            # lm_head.forward; gathering it there is not done yet (a trial run deadlocked).
            raise UserError(f"deepspeed zero_stage={zero_stage}: only stages 0-2 are supported")
        return DeepSpeedBackend(model, cfg, zero_stage=zero_stage)

    raise UserError(f"train backend {name!r} is not one of: torch, deepspeed")
