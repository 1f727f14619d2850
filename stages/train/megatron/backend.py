"""`trainer.backend: megatron`: megatron-core's GPTModel with tensor, pipeline and expert parallelism,
behind the train-step API every backend has (stages/train/backend.py).

    backend = MegatronBackend.from_model_dir(path, optim_cfg, Layout(tensor=2, pipeline=2, expert=2), device=..., precision=...)
    stats = backend.train_step(micro_batches, loss_fn)

What is megatron's and what is ours:
- the model, its parallel layers, MoE token dispatch and router (aux and z losses included), the
  pipeline schedule (1F1B), and `dist_checkpointing` for the optimizer's state are megatron-core's;
- Hugging Face <-> Megatron conversion is mbridge's (bridge.py adds what it lacks);
- the loss is the run's own (SFT's, RL's TIS policy loss), called unchanged on the last pipeline
  stage through MegatronCausalLM, and the optimizer is the same AdamW and schedule as the other
  backends, so a layout changes how the work is split, not what is computed;
- gradients are reduced here: over data-parallel replicas (experts over their own replicas),
  sequence-parallel weights over the tensor-parallel group, a tied embedding over its two stages.

Every rank of a tensor-parallel or pipeline group must be given the same micro-batches: the data
is split over `data_rank` / `data_ranks`, not over the world.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from snowcat.pipeline.errors import UserError
from snowcat.stages.model.config import ModelConfig
from snowcat.stages.model.io import hf_state_dict, open_model_dir
from snowcat.stages.model.layout import Layout

from .. import canonical
from ..backend import StepStats, _merge_stats, refuse_nonfinite, world
from ..optim import OptimConfig, build_optimizer, lr_factor
from ..precision import FP32
from ..rendezvous import init_process_group, rendezvous
from . import cpu
from .bridge import build_gpt, make_bridge
from .model import MegatronCausalLM

DIST = "dist_optimizer"  # trainer_state/<this>: megatron's distributed checkpoint of AdamW's moments


class _StageCall(Exception):
    """Raised by `_Capture` to stop a loss at its model call: a pipeline stage before the last one
    runs the model with the very arguments the loss gives it (router replay included), and no loss."""

    def __init__(self, args, kwargs):
        super().__init__("stage call")
        self.args, self.kwargs = args, kwargs


def _initialize(layout: Layout) -> None:
    """megatron-core's process groups for `layout` over the default group (collective)."""
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor,
        pipeline_model_parallel_size=layout.pipeline,
        expert_model_parallel_size=layout.expert,
        expert_tensor_parallel_size=1,  # experts are split over ranks (EP), not within them
    )


def _stage_call(model: MegatronCausalLM, uses_model):
    """On a pipeline stage before the last: run `model` with the arguments `uses_model` (the loss,
    a logprob function) calls it with, and stop there (the stage has no output layer)."""
    try:
        uses_model(_Capture(model.config))
    except _StageCall as call:
        return model(*call.args, **call.kwargs)
    raise RuntimeError("the loss never called the model")


class _Capture:
    def __init__(self, config):
        self.config = config

    def __call__(self, *args, **kwargs):
        raise _StageCall(args, kwargs)


class _ScheduleView:
    """What megatron's pipeline schedules ask of a model chunk (its TransformerConfig, input tensor)."""

    def __init__(self, model: MegatronCausalLM):
        self.model, self.config, self.model_type = model, model.gpt.config, model.gpt.model_type

    def set_input_tensor(self, tensor) -> None:
        self.model.set_input_tensor(tensor)


class MegatronBackend:
    name = "megatron"
    ep = None  # (the torch backend's own expert sharding; megatron shards experts itself)

    def __init__(self, model_cfg: ModelConfig, weights, cfg: OptimConfig, layout: Layout, device=None, precision=FP32):
        """`weights`: a model directory, or {HF name: tensor} of the whole model (a fresh init)."""
        self.cfg, self.layout, self.precision = cfg, layout, precision
        if not dist.is_initialized():  # megatron's groups need a process group, even on one rank
            init_process_group(rendezvous())
        self.rank, self.world_size = world()
        problems = list(layout.problems(model_cfg, self.world_size))
        if problems:
            key, why = problems[0]
            raise UserError(f"trainer.{key}: {why}")
        cpu.apply()
        _initialize(layout)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.bridge = make_bridge(model_cfg, precision.master)
        self.model = MegatronCausalLM(build_gpt(self.bridge), model_cfg).to(self.device)
        self.load_weights(weights)
        self.data_rank, self.data_ranks = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.data_group = ps.get_data_parallel_group()
        # the model is megatron's, not ours: a quick evaluation samples from a plain copy of its weights
        self.shards_parameters = True
        # routed experts: replicated over the expert-data-parallel ranks, not the data-parallel ones
        # (by name: only Transformer Engine's expert layers mark themselves)
        self.experts = {id(p) for name, p in self.model.named_parameters() if ".mlp.experts." in name}
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg)
        self.step = 0

    @classmethod
    def from_model_dir(cls, path, cfg: OptimConfig, layout: Layout, device=None, precision=FP32, verify: bool = True):
        """(backend, tokenizer) for the model of directory `path`."""
        model_cfg, tokenizer = open_model_dir(path, verify)
        return cls(model_cfg, Path(path), cfg, layout, device, precision), tokenizer

    # ---------------------------------------------------------------- one optimizer step

    def train_step(self, micro_batches: list[dict], loss_fn) -> StepStats:
        t0 = time.perf_counter()
        lr = self.cfg.lr * lr_factor(self.step, self.cfg)
        n = len(micro_batches)
        n_tokens = torch.tensor(sum(int((b["targets"] >= 0).sum()) for b in micro_batches), dtype=torch.float64)
        dist.all_reduce(n_tokens, group=ps.get_data_parallel_group())
        # gradients are averaged over the data-parallel replicas (as DDP does): a mean over all tokens
        n_local = max(1.0, float(n_tokens)) / self.data_ranks
        acc: dict = {}
        batches = iter([{k: v.to(self.device) for k, v in mb.items()} for mb in micro_batches])

        def forward_step(data, _view):
            mb = next(data)
            if not self.model.post_process:
                return _stage_call(self.model, lambda m: loss_fn(m, mb, n_local, n)), _no_loss
            loss, stats = loss_fn(self.model, mb, n_local, n)
            _merge_stats(acc, stats)
            return loss, lambda out: (out * n, {})  # the schedule divides by the micro-batch count

        self.model.train()
        self._schedule(self.model, forward_step, batches, micro_batches, forward_only=False)
        self._reduce_grads()
        grad_norm = self._clip()
        refuse_nonfinite(self.step + 1, grad_norm, acc)  # (acc: only the last pipeline stage's losses)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        acc = self._from_last_stage(acc)
        tokens = float(acc.pop("tokens"))
        return StepStats(
            step=self.step,
            lr=lr,
            grad_norm=grad_norm,
            step_time_s=time.perf_counter() - t0,
            num_micro=n,
            tokens=tokens,
            input_tokens=float(acc.pop("input_tokens")),
            entropy=float(acc.pop("entropy_sum")) / max(tokens, 1.0),
            router={k: float(v) / n for k, v in acc.pop("router", {}).items() if torch.as_tensor(v).dim() == 0},
            sums=acc,
        )

    def _schedule(self, model: MegatronCausalLM, forward_step, batches, micro_batches: list[dict], forward_only: bool):
        """Megatron's schedule for the layout (1F1B across pipeline stages, or none) over `micro_batches`."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        first = micro_batches[0]["input_ids"]
        with cpu.schedule_context(), self.precision.autocast(self.device):
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=batches,
                model=[_ScheduleView(model)],
                num_microbatches=len(micro_batches),
                seq_length=first.shape[1],
                micro_batch_size=first.shape[0],
                forward_only=forward_only,
            )

    def forward_only(self, model: MegatronCausalLM, batch: dict, fn) -> torch.Tensor | None:
        """`fn(model, batch)` (a tensor computed from the model's output, e.g. token logprobs) through
        the pipeline, without gradients: its value on the last stage, None on the others. Collective
        over every trainer rank (a forward of a sharded model needs them all)."""
        batch = {k: v.to(self.device) for k, v in batch.items()}
        out = {}

        def forward_step(data, _view):
            next(data)
            if not model.post_process:
                return _stage_call(model, lambda m: fn(m, batch)), _no_loss
            out["value"] = fn(model, batch)
            return out["value"].sum(), lambda o: (o, {})

        with torch.no_grad():
            self._schedule(model, forward_step, iter([batch]), [batch], forward_only=True)
        return out.get("value")

    def _from_last_stage(self, acc: dict) -> dict:
        """The step's loss statistics, computed on the last pipeline stage, on every stage."""
        if self.layout.pipeline == 1:
            return acc
        box = [acc if self.model.post_process else None]
        dist.broadcast_object_list(
            box, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
        )
        return box[0]

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _reduce_grads(self) -> None:
        """What megatron's DDP and finalize_model_grads would do, on plain gradients."""
        for p in self._params():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.layout.tensor > 1:  # weights applied to each rank's own sequence slice
            for p in self._params():
                if getattr(p, "sequence_parallel", False):
                    dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
        if self.layout.pipeline > 1 and self.model.gpt.share_embeddings_and_output_weights:
            if ps.is_pipeline_first_stage(ignore_virtual=True) or ps.is_pipeline_last_stage(ignore_virtual=True):
                dist.all_reduce(self.model.gpt.shared_embedding_or_output_weight().grad, group=ps.get_embedding_group())
        for p in self._params():
            expert = id(p) in self.experts
            group = ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group()
            if dist.get_world_size(group) > 1:
                dist.all_reduce(p.grad, group=group)
            p.grad /= self.data_ranks

    def _clip(self) -> float:
        """Global gradient norm over the whole model (each weight counted once), clipped to cfg.grad_clip."""
        dense = torch.zeros((), dtype=torch.float64)
        experts = torch.zeros((), dtype=torch.float64)
        tp_rank = ps.get_tensor_model_parallel_rank()
        tied_copy = (
            self.model.gpt.share_embeddings_and_output_weights
            and self.layout.pipeline > 1
            and not ps.is_pipeline_first_stage(ignore_virtual=True)
        )
        for p in self._params():
            sq = p.grad.double().pow(2).sum()
            if id(p) in self.experts:
                experts += sq
            elif getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
                if not (tied_copy and p is self.model.gpt.shared_embedding_or_output_weight()):
                    dense += sq
        if dist.get_world_size(ps.get_model_parallel_group()) > 1:
            dist.all_reduce(dense, group=ps.get_model_parallel_group())
        group = ps.get_expert_tensor_model_pipeline_parallel_group()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(experts, group=group)
        norm = float((dense + experts).sqrt())
        if self.cfg.grad_clip > 0 and norm > self.cfg.grad_clip:
            scale = self.cfg.grad_clip / (norm + 1e-6)
            for p in self._params():
                p.grad.mul_(scale)
        return norm

    # ---------------------------------------------------------------- weights

    def load_weights(self, weights) -> None:
        """Each rank reads its slices of a model directory (or of {HF name: whole tensor})."""
        with torch.no_grad():
            self.bridge.load_weights([self.model.gpt], weights)

    def whole_tensors(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """(name, whole tensor) of our model's state dict (stages.model: routed experts fused per
        layer), on rank 0 (None on the others); collective: every rank iterates to the end. No rank
        holds more than one layer's experts at a time."""
        seen = set()
        with torch.no_grad():
            for name, t in _fused(self.bridge.export_weights([self.model.gpt]), self.model.config.num_experts):
                if name not in seen:  # a tied output weight comes back as the embedding a second time
                    seen.add(name)
                    yield name, (t.detach().cpu() if self.rank == 0 else None)

    def load_copy(self, copy: MegatronCausalLM, path) -> None:
        """The weights of model directory `path` into a `frozen_copy` (each rank its slices)."""
        with torch.no_grad():
            self.bridge.load_weights([copy.gpt], Path(path))

    def frozen_copy(self, path=None) -> MegatronCausalLM:
        """A forward-only model laid out as the trained one, with the weights of model directory `path`."""
        copy = MegatronCausalLM(build_gpt(self.bridge), self.model.config).to(self.device)
        if path is not None:
            with torch.no_grad():
                self.bridge.load_weights([copy.gpt], Path(path))
        return copy.requires_grad_(False).eval()

    # ---------------------------------------------------------------- optimizer state

    def _sharded_optimizer_state(self, state: dict) -> dict:
        from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map, optim_state_to_sharding_state

        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        ids = get_param_id_to_sharded_param_map(self.model.gpt.sharded_state_dict(prefix=""), params)
        optim_state_to_sharding_state(state, ids, exclude_keys=("step",))
        return state

    def save_state(self, dir, max_shard_bytes: int | None = None) -> None:
        """AdamW's moments as a megatron distributed checkpoint (every rank writes its slices; loads
        on any layout), the schedule and step by rank 0; collective."""
        from megatron.core import dist_checkpointing

        dir = Path(dir)
        state = self._sharded_optimizer_state(self.optimizer.state_dict())
        (dir / DIST).mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save({"optimizer": state}, str(dir / DIST))
        if self.rank == 0:
            small = {"scheduler": self.scheduler.state_dict(), "step": self.step, "layout": vars(self.layout)}
            canonical.save(small, dir / "megatron.pt")

    def load_state(self, dir) -> None:
        from megatron.core import dist_checkpointing

        dir = Path(dir)
        if not (dir / DIST).is_dir():
            raise UserError(f"{dir}: not a megatron backend's trainer state (written by another backend?)")
        small = torch.load(dir / "megatron.pt", map_location="cpu", weights_only=False)
        for group in self.optimizer.param_groups:  # moments to load into, laid out as this rank holds them
            for p in group["params"]:
                self.optimizer.state[p] = {
                    "step": torch.tensor(float(small["step"])),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }
        template = self._sharded_optimizer_state(self.optimizer.state_dict())
        loaded = dist_checkpointing.load({"optimizer": template}, str(dir / DIST))["optimizer"]
        for state in loaded["state"].values():  # AdamW's step: every parameter steps on every update
            state["step"] = torch.tensor(float(small["step"]))
        self.optimizer.load_state_dict(loaded)
        self.scheduler.load_state_dict(small["scheduler"])
        self.step = int(small["step"])


_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _fused(tensors, num_experts: int):
    """HF-named tensors with each layer's per-expert weights fused as our model stores them
    (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]), the rest as they come."""
    pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, t in tensors:
        m = _PER_EXPERT.match(name)
        if not m:
            yield name, t
            continue
        prefix, expert, kind = m.group(1), int(m.group(2)), m.group(3)
        parts = pending.setdefault(prefix, {})
        parts[(expert, kind)] = t
        if len(parts) == 3 * num_experts:
            del pending[prefix]
            yield (
                f"{prefix}.gate_up_proj",
                torch.stack([torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(num_experts)]),
            )
            yield f"{prefix}.down_proj", torch.stack([parts[(e, "down_proj")] for e in range(num_experts)])
    if pending:
        raise RuntimeError(f"megatron export: experts of {sorted(pending)} incomplete")


def _no_loss(output):
    return output, {}


def megatron_backend(model, cfg: OptimConfig, layout: Layout, device=None, precision=FP32) -> MegatronBackend:
    """The megatron backend for an in-memory model of ours (a fresh, seeded init): its weights are
    handed over by name, and each rank keeps its slices."""
    device = device if device is not None else next(model.parameters()).device
    return MegatronBackend(model.config, hf_state_dict(model), cfg, layout, device, precision)
