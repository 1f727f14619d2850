"""Memory per device: a trainer rank (weights, gradients, optimizer state, activations, what its
backend adds) and a rollout engine (weights, KV cache, CUDA graphs).

The formulas, in bytes (P = parameters a rank holds, before sharding):

- weights P·m, gradients P·m, AdamW moments 2·P·m, with m the master dtype's bytes (4 for
  float32, 2 for bfloat16), divided by the data-parallel degree as ZeRO shards them (stage 1:
  moments, 2: and gradients, 3 / FSDP: and weights);
- P itself: the dense part (attention, norms, routers, embeddings) over tensor parallelism, the
  routed experts over expert parallelism, both over pipeline stages (the first/last stage holds the
  embedding/head);
- activations kept for backward: per token and layer, the norms' inputs, normalised values and
  outputs (6H), q/k/v and their normed and rotated copies, the attention output (on the CPU's
  packed path q/k/v/output once more, padded), and per routed copy the expert's input,
  gate/up/activation/product and output (2H + 4I) — all in the compute dtype, split by TP where the
  matrices are; with activation checkpointing only each layer's input (H) plus one layer's full set;
  with pipeline parallelism the first stage holds min(PP, micro-batches) micro-batches in flight;
- the LM head's logits chunk (kernels/reference.py: 64 Mi float32 logits at most, three live copies);
- transients: DDP's gradient buckets (torch backend, DP > 1: one more copy of the dense gradients),
  FSDP/ZeRO-3's gathered layer (weights and gradients of two layers, prefetch), autocast's bf16
  copies of float32 weights on GPUs, and AdamW's foreach temporary (one moment's size) in the
  optimizer step. Peak = the state + the larger of the forward/backward transients and the
  optimizer's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from snowcat.pipeline.errors import UserError

from .model import Arch

GIB = 2**30
LOGIT_CHUNK_ELEMS = 1 << 26  # kernels/reference.py: _DEFAULT_CHUNK_ELEMS
# vLLM: what a plan adds for CUDA graphs and the engine's workspace beyond weights and KV cache
# (an assumption, not measured here: vLLM's CUDA graphs typically take one to a few GiB).
VLLM_GRAPHS_GIB = 2.0


@dataclass(frozen=True)
class Layout:
    """How a trainer spreads over its ranks (stages/config.py `Parallelism`)."""

    ranks: int
    backend: str = "torch"
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero_stage: int = 0
    master_bytes: int = 4
    compute_bytes: int = 4
    activation_checkpointing: bool = False

    @property
    def dp(self) -> int:
        return self.ranks // (self.tp * self.pp)

    @property
    def shard(self) -> int:
        """The effective ZeRO stage: FSDP is ZeRO-3; DeepSpeed its own; torch/DDP and megatron nothing
        (snowcat's megatron backend keeps AdamW whole on every data-parallel replica: docs/megatron.md)."""
        if self.backend == "fsdp":
            return 3
        if self.backend == "deepspeed":
            return self.zero_stage
        return 0

    def describe(self) -> str:
        parts = [f"{self.backend}", f"{self.ranks} ranks", f"DP {self.dp}"]
        parts += [f"{k} {v}" for k, v in (("TP", self.tp), ("PP", self.pp), ("EP", self.ep)) if v > 1]
        if self.shard:
            parts.append(f"ZeRO-{self.shard}")
        if self.activation_checkpointing:
            parts.append("activation checkpointing")
        return ", ".join(parts)


def make_layout(stage, ranks: int, where: str, arch: Arch, on_gpu: bool) -> Layout:
    """The trainer layout of a stage's config, refused (naming the key) where it does not divide."""
    tp, pp, ep = int(stage.tensor_parallel), int(stage.pipeline_parallel), int(stage.expert_parallel)
    c = arch.cfg
    if ranks % (tp * pp):
        key = "tensor_parallel" if tp > 1 else "pipeline_parallel"
        raise UserError(f"{where}.{key}: tensor_parallel {tp} x pipeline_parallel {pp} does not divide the {ranks} trainer ranks")
    dp = ranks // (tp * pp)
    if c.num_experts % ep:
        raise UserError(f"{where}.expert_parallel: {ep} does not divide num_experts={c.num_experts} of {arch.source}")
    if dp % ep:  # the experts split over data-parallel replicas (stages/model/layout.py)
        raise UserError(f"{where}.expert_parallel: {ep} does not divide the {dp} data-parallel ranks")
    if tp > 1 and (c.num_heads % tp or c.num_kv_heads % tp):
        raise UserError(
            f"{where}.tensor_parallel: {tp} does not divide the attention heads ({c.num_heads}) and KV heads ({c.num_kv_heads})"
        )
    if c.num_layers % pp:
        raise UserError(f"{where}.pipeline_parallel: {pp} does not divide num_layers={c.num_layers}")
    master = 2 if stage.master_dtype == "bfloat16" else 4
    compute = {"float32": 4, "bfloat16": 2}.get(stage.compute_dtype, 2 if on_gpu else 4)
    return Layout(
        ranks=ranks,
        backend=stage.backend,
        tp=tp,
        pp=pp,
        ep=ep,
        zero_stage=int(stage.zero_stage),
        master_bytes=master,
        compute_bytes=compute,
        activation_checkpointing=bool(stage.activation_checkpointing),
    )


@dataclass(frozen=True)
class Params:
    """Parameters one rank holds before ZeRO sharding: dense and expert parts."""

    dense: float
    experts: float
    largest_layer: float  # one decoder layer's parameters on this rank (ZeRO-3's gathered unit)

    @property
    def total(self) -> float:
        return self.dense + self.experts


def rank_params(arch: Arch, lay: Layout) -> Params:
    L = arch.cfg.num_layers
    layers = L / lay.pp
    outer = (arch.embed + arch.head if lay.pp == 1 else max(arch.embed, arch.head)) + arch.cfg.hidden_size  # + final norm
    dense = (arch.layer_dense * layers + outer) / lay.tp
    experts = arch.experts_total / lay.pp / lay.ep
    layer = arch.layer_dense / lay.tp + arch.experts_total / max(1, arch.moe_layers) / lay.ep
    return Params(dense=dense, experts=experts, largest_layer=max(layer, outer / lay.tp))


def activation_bytes_per_token_layer(arch: Arch, lay: Layout, on_gpu: bool = True) -> float:
    """Bytes one token keeps for backward in one decoder layer (no checkpointing)."""
    c = arch.cfg
    H, D, tp = c.hidden_size, c.head_dim, lay.tp
    replicated = 6 * H  # the two RMSNorms: input, normalised (float32), output
    qkv = (c.num_heads + 2 * c.num_kv_heads) * D  # projections
    normed_rotated = 2 * (c.num_heads + c.num_kv_heads) * D  # q/k after norm and after rope
    attn = c.num_heads * D  # attention output (flash/SDPA: no score matrix kept)
    if not on_gpu:  # the CPU's packed path pads documents into batches: q, k, v and the output once more
        attn += (2 * c.num_heads + 2 * c.num_kv_heads) * D
    router = 2 * c.num_experts + c.experts_per_token
    routed = c.experts_per_token * (2 * H + 4 * c.moe_intermediate_size)  # per copy: input, gate/up, act, product, output
    shared = (2 * H + 4 * c.shared_expert_intermediate_size) if c.shared_expert_intermediate_size else 0
    split = (qkv + normed_rotated + attn + shared) / tp + routed + router
    if c.mlp_only_layers:  # dense layers in place of experts, averaged over the layers
        frac = len(c.mlp_only_layers) / c.num_layers
        split += frac * ((4 * c.dense_intermediate_size) / tp - routed - router)
    return (replicated + split) * lay.compute_bytes


def trainer_memory(arch: Arch, lay: Layout, tokens_per_micro: int, micro_batches: int, on_gpu: bool) -> dict:
    """Bytes per trainer rank, by part, and the peak. `tokens_per_micro`: tokens one rank computes
    in one micro-batch (rows x sequence length)."""
    p = rank_params(arch, lay)
    m = lay.master_bytes
    dp, z = lay.dp, lay.shard
    expert_dp = max(1, dp // lay.ep)
    # ZeRO shards each group over the ranks that hold a replica of it
    sharded = p.dense / dp + p.experts / expert_dp

    def over(stage: int) -> float:
        return sharded if z >= stage else p.total

    weights = over(3) * m
    grads = over(2) * m
    optimizer = over(1) * 2 * m
    parts = {"weights": weights, "gradients": grads, "optimizer": optimizer}
    layers = arch.cfg.num_layers / lay.pp
    per_token_layer = activation_bytes_per_token_layer(arch, lay, on_gpu)
    if lay.activation_checkpointing:
        acts = tokens_per_micro * (layers * arch.cfg.hidden_size * lay.compute_bytes + per_token_layer)
    else:
        acts = tokens_per_micro * layers * per_token_layer
    if lay.pp > 1:
        acts *= min(lay.pp, micro_batches)
    parts["activations"] = acts
    vocab = arch.cfg.vocab_size / lay.tp
    chunk = min(tokens_per_micro, max(1, LOGIT_CHUNK_ELEMS // max(1, int(vocab))))
    parts["logits"] = 3 * chunk * vocab * 4
    transient = {}
    if lay.backend == "torch" and dp > 1:  # DDP's bucket copy of the gradients it reduces (experts under EP excluded)
        transient["ddp_buckets"] = (p.dense + (p.experts if lay.ep == 1 else 0)) * m
    if lay.backend == "deepspeed":  # ZeRO keeps its own float32 partition of the masters
        transient["fp32_partition"] = sharded * 4
    if z >= 3:  # the unit being computed (weights and gradients whole) and the next one prefetched
        transient["gathered_layers"] = p.largest_layer * 2 * m + p.total / max(1.0, layers) * m
    if on_gpu and lay.compute_bytes < m:
        transient["autocast_copies"] = (p.largest_layer * 2 if z >= 3 else p.total) * lay.compute_bytes
    parts.update(transient)
    parts["optimizer_step_temp"] = over(1) * m  # AdamW foreach: one moment-sized temporary
    kept = weights + optimizer + transient.get("ddp_buckets", 0) + transient.get("fp32_partition", 0)
    # forward/backward: activations at their largest when backward starts, gradients not yet made
    # (zero_grad frees them); optimizer step: every gradient, no activations
    fwd_bwd = kept + acts + parts["logits"] + transient.get("gathered_layers", 0) + transient.get("autocast_copies", 0)
    step = kept + grads + parts["optimizer_step_temp"]
    peak = max(fwd_bwd, step)
    return {
        "parts": parts,
        "peak": peak,
        "params_on_rank": p.total,
        "params_after_sharding": sharded if z else p.total,
        "peak_phase": "forward/backward" if fwd_bwd >= step else "optimizer step",
    }


def rollout_memory(arch: Arch, *, engine: str, device_bytes: float | None, seqs: int, context: int, vllm, on_gpu: bool) -> dict:
    """Bytes per rollout device. vLLM takes gpu_memory_utilization of the GPU up front and fits the
    weights, CUDA graphs and KV cache inside it; the torch engine allocates weights and a KV cache
    for its batch."""
    if engine == "vllm" and on_gpu:
        tp = int(vllm.tensor_parallel_size)
        wb = 2  # bf16 weights ("auto": the checkpoint's dtype; hub MoE checkpoints are bf16)
        batch = min(seqs, int(vllm.max_num_seqs))
        weights = arch.total * wb / tp
        kv = batch * context * arch.kv_bytes_per_token(wb) / tp
        logits = batch * arch.cfg.vocab_size * 4 * 2
        graphs = VLLM_GRAPHS_GIB * GIB
        need = weights + kv + logits + graphs
        budget = float(vllm.gpu_memory_utilization) * device_bytes if device_bytes else None
        kv_room = (budget - weights - logits - graphs) if budget else None
        return {
            "parts": {"weights": weights, "kv_cache": kv, "logits": logits, "cuda_graphs_assumed": graphs},
            "peak": need,
            "budget": budget,
            "kv_tokens_room": int(kv_room / (arch.kv_bytes_per_token(wb) / tp)) if kv_room and kv_room > 0 else 0,
            "batch": batch,
            "tp": tp,
        }
    wb = 2 if on_gpu else 4
    weights = arch.total * wb
    kv = seqs * context * arch.kv_bytes_per_token(wb)
    logits = seqs * arch.cfg.vocab_size * 4 * 2
    return {
        "parts": {"weights": weights, "kv_cache": kv, "logits": logits},
        "peak": weights + kv + logits,
        "batch": seqs,
        "tp": 1,
    }


def gib(n: float) -> float:
    return round(n / GIB, 3)


def parts_gib(mem: dict) -> dict:
    return {k: gib(v) for k, v in mem["parts"].items()}


def fits(peak: float, capacity: float | None, margin: float) -> bool | None:
    if capacity is None:
        return None
    return peak <= capacity * (1 - margin)


def ceil_div(a: float, b: float) -> int:
    return int(math.ceil(a / b)) if b else 0


__all__ = ["Layout", "Params", "asdict", "make_layout", "rank_params", "rollout_memory", "trainer_memory"]
