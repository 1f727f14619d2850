"""Expert parallelism: each MoE layer's routed experts sharded over a group of ranks.

With `ep` ranks per expert-parallel (EP) group, rank r of a group holds experts
[r*E/ep, (r+1)*E/ep) of every MoE layer; attention, router, shared expert and embeddings stay
replicated (data parallel). A layer's forward sends each token copy to the rank that owns its
expert (all-to-all, uneven splits, counts exchanged first), runs the local experts, and sends the
results back to where the copies came from: dropless unless the config sets a capacity.
Autograd flows back through both all-to-alls, so every rank of a group must run the same number of
MoE forwards (and backwards), as with any collective.

Groups over a world of W ranks: EP groups are consecutive ranks ({0..ep-1}, {ep..2ep-1}, ...: one
node's fast links on GPU clusters); the expert-data-parallel group of a rank is the ranks that hold
the same shard ({i, i+ep, i+2ep, ...}; none when ep == W).

A trainer (see docs/training.md, "Expert parallelism"):

    ep = expert_parallel_groups(size)               # collective, after init_process_group
    shard_experts(model, ep)                         # from the full weights: EP starts where EP=1 does
    exclude_experts_from_ddp(model)                  # before DistributedDataParallel(model)
    ... forward/backward of the step's micro-batches ...
    reduce_expert_grads(model, ep)                   # after the last backward
    clip_grad_norm_(model, max_norm, ep)             # the global norm, experts counted once
    with full_experts(model): save / load the HF layout
    shard_rows(model) / gather_shards(t, group)      # which rows a rank holds; a shard made whole
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from snowcat.pipeline.errors import UserError

from .config import ModelConfig
from .modeling import Experts, SparseMoeBlock

_WEIGHTS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertParallel:
    size: int  # ranks per EP group (the config's expert_parallel)
    rank: int  # this rank's place in its EP group: it holds shard `rank`
    group: dist.ProcessGroup  # this rank's EP group
    data_group: dist.ProcessGroup | None  # the ranks holding the same shard; None when size == world
    world_size: int  # all ranks: the backends' loss scaling assumes a mean over them


def check_expert_parallel(cfg: ModelConfig, size: int, world_size: int) -> None:
    """Refuse a layout that cannot shard: before any process group is formed or weight moved."""
    if cfg.num_experts % size:
        raise UserError(f"expert_parallel={size} does not divide num_experts={cfg.num_experts}")
    if world_size % size:
        raise UserError(f"expert_parallel={size} does not divide the {world_size} trainer ranks")


def expert_parallel_groups(size: int) -> ExpertParallel:
    """This rank's EP and expert-data-parallel groups (collective: every rank forms every group).
    New groups even when one spans the world, so the all-to-alls never interleave with DDP's
    all-reduces on the default group."""
    if not dist.is_initialized():
        raise UserError(f"expert_parallel={size} needs a distributed run (no torch process group)")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % size:
        raise UserError(f"expert_parallel={size} does not divide the {world} trainer ranks")
    group = data_group = None
    for start in range(0, world, size):
        g = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            group = g
    if world > size:
        for i in range(size):
            g = dist.new_group(list(range(i, world, size)))
            if rank % size == i:
                data_group = g
    return ExpertParallel(size=size, rank=rank % size, group=group, data_group=data_group, world_size=world)


class _AllToAll(torch.autograd.Function):
    """`dist.all_to_all_single` along dim 0 whose backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class ShardedExperts(Experts):
    """This rank's E/ep experts of one MoE layer, with `Experts`' contract: `forward(x, counts)` takes
    the layer's token copies sorted by expert and `counts` [E] over all E experts, and returns their
    outputs in the same order."""

    def __init__(self, full: Experts, cfg: ModelConfig, ep: ExpertParallel):
        local = full.num_experts // ep.size
        with torch.device("meta"):  # replaced by the full weights' rows below
            super().__init__(cfg, num_experts=local)
        self.ep = ep
        self.total = full.num_experts
        self.rows = slice(ep.rank * local, (ep.rank + 1) * local)
        for name in _WEIGHTS:
            w = getattr(full, name)
            setattr(self, name, nn.Parameter(w.detach()[self.rows].clone(), requires_grad=w.requires_grad))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        P, local, group = self.ep.size, self.num_experts, self.ep.group
        if self.gate_up_proj.shape[0] != local:  # would silently run the wrong experts
            raise RuntimeError("a sharded MoE layer cannot run inside full_experts(): evaluate a model loaded unsharded")
        # send[d, j]: copies for rank d's j-th expert; recv[s, j]: copies rank s sends for my j-th
        send = counts.view(P, local).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        x_in = _AllToAll.apply(x, recv_splits, send_splits, group)
        # arrived source-major (each source's rows sorted by my experts): regroup expert-major
        block = torch.repeat_interleave(torch.arange(P * local, device=x.device), recv.flatten(), output_size=x_in.shape[0])
        order = ((block % local) * P + block // local).argsort(stable=True)
        x_local = x_in[order]
        if x_local.shape[0]:
            y_local = super().forward(x_local, recv.sum(0))
        else:  # nothing for my experts: stay in the graph, the backward's all-to-alls need every rank
            y_local = x_local + 0.0 * sum(getattr(self, name).sum() for name in _WEIGHTS)
        y_in = y_local[order.argsort()]
        return _AllToAll.apply(y_in, send_splits, recv_splits, group)


def shard_experts(model: nn.Module, ep: ExpertParallel) -> nn.Module:
    """Replace every MoE layer's experts with this rank's shard of them, cut from the full weights the
    model holds now (so an EP run starts from the weights an unsharded one would)."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    if blocks:
        check_expert_parallel(blocks[0].cfg, ep.size, ep.world_size)
    for block in blocks:
        block.experts = ShardedExperts(block.experts, block.cfg, ep)
    return model


def sharded_layers(model: nn.Module) -> list[ShardedExperts]:
    return [m for m in model.modules() if isinstance(m, ShardedExperts)]


def expert_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The sharded (rank-specific) parameters by their names in `model.named_parameters()`."""
    sharded = {name for name, m in model.named_modules() if isinstance(m, ShardedExperts)}
    return {name: p for name, p in model.named_parameters() if name.rpartition(".")[0] in sharded}


def exclude_experts_from_ddp(model: nn.Module) -> None:
    """Keep the shards out of DDP (call before wrapping): its construction would broadcast rank 0's
    experts over everyone's, and its all-reduce would average different experts together."""
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(expert_parameters(model)))


def reduce_expert_grads(model: nn.Module, ep: ExpertParallel) -> None:
    """After the step's last backward, before clipping. A shard's gradient already sums the
    contributions of its EP group's tokens (through the all-to-alls); add those of the other groups
    (the ranks holding the same shard), then divide by the world size: the backends scale each
    rank's loss by world/global tokens and DDP averages the rest, so this makes the expert
    gradients equal to the unsharded model's."""
    for p in expert_parameters(model).values():
        if not p.requires_grad:
            continue
        if p.grad is None:  # a rank without a forward still joins the collective
            p.grad = torch.zeros_like(p)
        if ep.data_group is not None:
            dist.all_reduce(p.grad, group=ep.data_group)
        p.grad.div_(ep.world_size)


def clip_grad_norm_(model: nn.Module, max_norm: float, ep: ExpertParallel) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for a model with sharded experts: the norm of the whole
    (unsharded) gradient, each shard counted once, the same on every rank; returns it."""
    experts = expert_parameters(model).values()
    sharded = {id(p) for p in experts}
    dense = [p for p in model.parameters() if p.grad is not None and id(p) not in sharded]
    local = [p for p in experts if p.grad is not None]

    def sq_norm(params):
        return sum(
            (torch.linalg.vector_norm(p.grad, dtype=torch.float32) ** 2 for p in params), torch.zeros((), device=_device(model))
        )

    expert_sq = sq_norm(local)
    dist.all_reduce(expert_sq, group=ep.group)
    total = (sq_norm(dense) + expert_sq).sqrt()
    torch.nn.utils.clip_grads_with_norm_(dense + local, max_norm, total)
    return total


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def shard_rows(model: nn.Module) -> dict[str, tuple[slice, ExpertParallel]]:
    """{parameter name: (the rows of the whole weight this rank's shard holds, its EP groups)} of
    every expert shard of `model`."""
    return {
        f"{name}.{weight}": (m.rows, m.ep)
        for name, m in model.named_modules()
        if isinstance(m, ShardedExperts)
        for weight in _WEIGHTS
    }


def gather_shards(shard: torch.Tensor, group) -> torch.Tensor:
    """The full tensor (shards stacked in rank order), on the CPU: one layer's full tensor at a time
    on the accelerator."""
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts).cpu()


@contextlib.contextmanager
def full_experts(model: nn.Module):
    """Collective over each EP group. Inside, every sharded layer holds all its experts (gathered, on
    the CPU, not trainable), so code written for the unsharded model (`save_model_dir`,
    `hf_state_dict`, `load_hf_state_dict`) reads and writes the full, topology-independent layout.
    On a normal exit each rank keeps its own rows of what the full tensors then hold (what a load
    wrote into them); on an exception its shards are left as they were. No forward inside."""
    swapped = [(m, name, m._parameters[name]) for m in sharded_layers(model) for name in _WEIGHTS]
    for m, name, shard in swapped:
        m._parameters[name] = nn.Parameter(gather_shards(shard.detach(), m.ep.group), requires_grad=False)
    try:
        yield model
        with torch.no_grad():
            for m, name, shard in swapped:
                shard.copy_(m._parameters[name][m.rows])
    finally:
        for m, name, shard in swapped:
            m._parameters[name] = shard
