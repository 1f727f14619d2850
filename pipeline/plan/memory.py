"""Memory per device: a trainer rank (weights, gradients, optimizer state, activations, what its
backend adds) and a rollout engine (weights, KV cache, CUDA graphs).

The formulas, in bytes (P = parameters a rank holds, before sharding):

- weights P·m, gradients P·m, AdamW moments 2·P·m, with m the master dtype's bytes (4 for
  float32, 2 for bfloat16; DeepSpeed's module holds weights and gradients in the compute dtype),
  divided by the data-parallel degree as ZeRO shards them (stage 1: moments, 2: and gradients,
  3 / FSDP: and weights);
- P itself: the dense part (attention, norms, routers, embeddings) over tensor parallelism, the
  routed experts over expert parallelism, both over pipeline stages (the first/last stage holds the
  embedding/head);
- activations kept for backward, per token and layer, as autograd saves them in
  stages/model/modeling.py (counted tensor by tensor with `snowcat bench activation-count`): the
  norms' inputs, normalised values and outputs (6H), the q/k norms' inputs and normalised values,
  the attention's own copies (flash-attn: rotated q/k and v; the CPU's packed path: q/k/v gathered
  per document, SDPA's output and index_copy's source) and its output, the router's logits and
  probabilities, and per routed copy the expert's gathered input, gate/up, activation, product,
  output and weighted output (3H + 4I: index_add_ keeps its source) — in the compute dtype, split
  by TP where the matrices are; with activation checkpointing only each layer's input (H) plus one
  layer's full set; with pipeline parallelism the first stage holds min(PP, micro-batches)
  micro-batches in flight; plus the final norm's (3H);
- the fused logprob kernel's buffers at the start of backward (kernels/): on the CPU five float32
  [chunk, V] blocks and a boolean one per chunk of at most 64 Mi logits, on a GPU one [N, vocabulary
  chunk] block of about 256 MiB; and its gradients dh [N, H] and dW [V, H];
- what backends add: DDP's gradient buckets (torch backend, DP > 1: one more copy of the dense
  gradients), FSDP's gathered layer (weights and gradients of two layers, prefetch), DeepSpeed's
  float32 master partition, its gradient partition (kept between steps), its contiguous gradient
  bucket (`reduce_bucket_size`, 5e8 elements: allocated whole on a GPU, on the CPU the pages
  written) and, ZeRO-3, the parameters it keeps gathered within `stage3_max_reuse_distance` (1e9
  elements: at the forward/backward turn the model's last 5e8 elements); autocast's bf16 copies of
  float32 weights on GPUs; forward-only model copies (RL's behaviour policy and KL reference); and
  AdamW's foreach temporary (one moment's size) in the optimizer step;
- on the CPU the rank's process itself (`runtime`: the interpreter and libraries, measured).

Peak = what is held + the larger of the forward/backward transients and the optimizer step's, in
a step after the first (AdamW's moments exist)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from snowcat.pipeline.errors import UserError

from .model import Arch

GIB = 2**30
LOGIT_CHUNK_ELEMS = 1 << 26  # kernels/reference.py: _DEFAULT_CHUNK_ELEMS
TRITON_DZ_BYTES = 256 << 20  # kernels/triton_fused.py: default_vocab_chunk's buffer
# A CPU rank's process beside its tensors (on a GPU this is host memory, not the device's), as
# `snowcat bench trainer-memory` measures it on the CPU: the interpreter with torch, deepspeed and
# snowcat imported (its `start`: 413-417 MiB; 582-590 MiB with megatron-core), and what the first
# steps add beyond the tensors (code pages, thread stacks, the allocator: 80-135 MiB over the modes).
CPU_IMPORTS_BYTES = {"megatron": 590 << 20, "default": 417 << 20}
CPU_STEP_RUNTIME_BYTES = 110 << 20
# DeepSpeed's defaults (deepspeed/runtime/zero/config.py, 0.19), which stages/train/backend.py keeps
DS_REDUCE_BUCKET_ELEMS = 500_000_000  # reduce_bucket_size: the contiguous gradient bucket (ZeRO 1-3)
DS_REUSE_DISTANCE_ELEMS = 1_000_000_000  # stage3_max_reuse_distance
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


def activation_bytes_per_token_layer(arch: Arch, lay: Layout, on_gpu: bool = True, seq_len: int = 0) -> float:
    """Bytes one token keeps for backward in one decoder layer (no checkpointing): what autograd
    saves, counted tensor by tensor (`snowcat bench activation-count`; the validation record has
    the CPU's count beside this one). snowcat's model (stages/model/modeling.py) for the torch,
    fsdp and deepspeed backends; megatron-core's layers for the megatron backend."""
    c = arch.cfg
    H, I, k, tp = c.hidden_size, c.moe_intermediate_size, c.experts_per_token, lay.tp
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    router = 2 * c.num_experts + k  # logits (logsumexp), probabilities, top-k
    if lay.backend == "megatron":
        return _megatron_bytes_per_token_layer(arch, lay, on_gpu, seq_len, q, kv, router)
    norms = 6 * H  # the layer's two RMSNorms: input, normalised values (float32), output
    qk_norms = 2 * (q + kv)  # the q/k norms' inputs (the projections) and normalised values
    attn = q  # the attention output: o_proj's input
    if on_gpu:  # flash-attn varlen keeps the rotated q and k and v itself
        attn += q + 2 * kv
    else:  # the CPU's packed path: q/k/v gathered into per-document batches, SDPA's output, and
        attn += (q + 2 * kv) + q + q  # index_copy's source (it keeps it) before o_proj's input
    # per routed copy: the gathered input x[token], gate/up, the activation, the product, the
    # experts' output (kept by the routing weight's product) and the weighted output (index_add_ keeps its source)
    routed = k * (3 * H + 4 * I)
    # the shared expert's gate/up, activation, product, and its output (kept by its sigmoid gate)
    shared = (H + 4 * c.shared_expert_intermediate_size) if c.shared_expert_intermediate_size else 0
    split = (qk_norms + attn + shared) / tp + routed + router
    if c.mlp_only_layers:  # dense layers in place of experts, averaged over the layers
        frac = len(c.mlp_only_layers) / c.num_layers
        split += frac * ((4 * c.dense_intermediate_size) / tp - routed - router)
    return (norms + split) * lay.compute_bytes


def _megatron_bytes_per_token_layer(arch: Arch, lay: Layout, on_gpu: bool, seq_len: int, q: int, kv: int, router: int) -> float:
    """megatron-core's layers as snowcat builds them (stages/train/megatron/bridge.py; counted on
    the CPU in megatron-core 0.16): sequence parallel whenever TP > 1 (mbridge), so every part is
    split over TP. Per token: each RMSNorm's input and normalised values, the inputs of the
    qkv, output, router, fc1 and fc2 linears, the q/k norms', and per routed copy fc1's output
    (kept twice by SwiGLU), its activation and the routing weight's product. Attention: on the
    CPU megatron's own DotProductAttention (no Transformer Engine) keeps q, k and v expanded to
    every head and the softmax probabilities, heads x sequence length per token; on GPUs Transformer
    Engine's flash attention keeps q, k, v and its output."""
    c = arch.cfg
    H, I, k = c.hidden_size, c.moe_intermediate_size, c.experts_per_token
    norms = 4 * H + 2 * (q + kv)
    linears = H + q + H  # qkv's input, the output projection's, the router's
    attn = (q + 2 * kv) if on_gpu else 3 * q + c.num_heads * seq_len
    routed = k * (H + I) + k * 5 * I  # fc1/fc2 inputs; SwiGLU's and the routing product's
    shared = (H + 4 * c.shared_expert_intermediate_size) if c.shared_expert_intermediate_size else 0
    per_token = norms + linears + attn + routed + shared + router
    if c.mlp_only_layers:
        frac = len(c.mlp_only_layers) / c.num_layers
        per_token += frac * (H + 5 * c.dense_intermediate_size - routed - router)
    return per_token / lay.tp * lay.compute_bytes


def logprob_kernel_bytes(arch: Arch, lay: Layout, tokens: int, on_gpu: bool) -> float:
    """What the fused LM head -> logprob kernel (kernels/) holds at the start of backward, beyond
    its saved inputs, for `tokens` tokens: its gradients dh [N, H] (float32) and dW [V, H].

    - CPU (kernels/reference.py): per chunk of tokens (64 Mi logits at most), five [chunk, V]
      float32 blocks live at once (the logits, their probabilities, the masked logits and the two
      temporaries of the logit gradient's product) plus a boolean one (the target mask);
    - GPU (kernels/triton_fused.py): one [N, vocabulary chunk] buffer of the logit gradient in the
      compute dtype, its chunk sized to 256 MiB."""
    vocab = arch.cfg.vocab_size / lay.tp
    H = arch.cfg.hidden_size
    grads = tokens * H * 4 + vocab * H * (lay.compute_bytes if on_gpu else 4)
    if on_gpu:
        return min(TRITON_DZ_BYTES, tokens * vocab * lay.compute_bytes) + grads
    chunk = min(tokens, max(1, LOGIT_CHUNK_ELEMS // max(1, int(vocab))))
    return chunk * vocab * (5 * 4 + 1) + grads


def cpu_imports_bytes(backend: str) -> int:
    """What a CPU rank's interpreter holds once its libraries are imported (part of `runtime`)."""
    return CPU_IMPORTS_BYTES.get(backend, CPU_IMPORTS_BYTES["default"])


def trainer_memory(
    arch: Arch,
    lay: Layout,
    tokens_per_micro: int,
    micro_batches: int,
    on_gpu: bool,
    frozen_copies: int = 0,
    seq_len: int | None = None,
) -> dict:
    """Bytes per trainer rank, by part, and the peak, in a step after the first (AdamW's moments
    exist). `tokens_per_micro`: tokens one rank computes in one micro-batch (rows x `seq_len`, the
    row length: one row when not given); `frozen_copies`: forward-only copies of the model the
    trainer holds (RL: the behaviour policy when lag >= 1, the KL reference)."""
    seq_len = seq_len or tokens_per_micro
    p = rank_params(arch, lay)
    m = lay.master_bytes
    dp, z = lay.dp, lay.shard
    expert_dp = max(1, dp // lay.ep)
    # ZeRO shards each group over the ranks that hold a replica of it
    sharded = p.dense / dp + p.experts / expert_dp
    deepspeed = lay.backend == "deepspeed"
    # DeepSpeed's bf16 mode casts the module itself (weights and gradients in the compute dtype)
    # and keeps the float32 masters in its own partition (below)
    module = lay.compute_bytes if deepspeed else m

    def over(stage: int) -> float:
        return sharded if z >= stage else p.total

    weights = over(3) * module
    grads = over(2) * module
    optimizer = over(1) * 2 * m
    parts = {"weights": weights, "gradients": grads, "optimizer": optimizer}
    layers = arch.cfg.num_layers / lay.pp
    per_token_layer = activation_bytes_per_token_layer(arch, lay, on_gpu, seq_len)
    if lay.activation_checkpointing:
        acts = tokens_per_micro * (layers * arch.cfg.hidden_size * lay.compute_bytes + per_token_layer)
    else:
        acts = tokens_per_micro * layers * per_token_layer
    if lay.pp > 1:
        acts *= min(lay.pp, micro_batches)
    # after the layers: the final norm's input, normalised values and output (the LM head's input)
    acts += tokens_per_micro * 3 * arch.cfg.hidden_size * lay.compute_bytes
    if lay.backend == "megatron" and not on_gpu:  # DotProductAttention's score buffer: one layer's, reused
        acts += tokens_per_micro * arch.cfg.num_heads / lay.tp * seq_len * lay.compute_bytes
    parts["activations"] = acts
    parts["logits"] = logprob_kernel_bytes(arch, lay, tokens_per_micro, on_gpu)
    kept = {}  # held through the whole step, beside weights and optimizer state
    if not on_gpu:
        kept["runtime"] = cpu_imports_bytes(lay.backend) + CPU_STEP_RUNTIME_BYTES
    transient = {}  # forward/backward only
    if lay.backend == "torch" and dp > 1:  # DDP's bucket copy of the gradients it reduces (experts under EP excluded)
        kept["ddp_buckets"] = (p.dense + (p.experts if lay.ep == 1 else 0)) * m
    if frozen_copies:  # the torch backends hold them whole (stages/train/backend.py frozen_copy), fsdp sharded
        kept["frozen_copies"] = frozen_copies * (weights if lay.backend in ("fsdp", "megatron") else arch.total * module)
    if deepspeed:
        kept["fp32_partition"] = sharded * 4  # ZeRO's float32 masters
        if z >= 1:
            # the contiguous bucket backward copies gradients into (reduce_bucket_size elements):
            # a GPU allocates all of it; on the CPU only the pages written count, at most every gradient
            bucket = DS_REDUCE_BUCKET_ELEMS if on_gpu else min(DS_REDUCE_BUCKET_ELEMS, p.total)
            kept["ds_gradient_bucket"] = bucket * lay.compute_bytes
    if z >= 3 and deepspeed:
        # from the second step on (a complete trace) a parameter whose next use comes within
        # stage3_max_reuse_distance elements stays gathered: at the forward/backward turn the
        # model's last reuse_distance / 2 elements, whole, in the compute dtype
        transient["gathered_layers"] = min(p.total, DS_REUSE_DISTANCE_ELEMS / 2) * lay.compute_bytes
    elif z >= 3:  # FSDP: the unit being computed (weights and gradients whole) and the next one prefetched
        transient["gathered_layers"] = p.largest_layer * 2 * m + p.total / max(1.0, layers) * m
    if on_gpu and lay.compute_bytes < m and not deepspeed:
        transient["autocast_copies"] = (p.largest_layer * 2 if z >= 3 else p.total) * lay.compute_bytes
    parts.update(kept)
    parts.update(transient)
    parts["optimizer_step_temp"] = over(1) * m  # AdamW foreach: one moment-sized temporary
    # DeepSpeed's gradient partition stays allocated between steps; other backends' gradients are
    # freed by zero_grad and made again in backward
    held = weights + optimizer + sum(kept.values()) + (grads if deepspeed else 0)
    # forward/backward: activations at their largest when backward starts; optimizer step: every
    # gradient, no activations
    fwd_bwd = held + acts + parts["logits"] + sum(transient.values())
    step = held + (0 if deepspeed else grads) + parts["optimizer_step_temp"]
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
    parts = {"weights": weights, "kv_cache": kv, "logits": logits}
    if not on_gpu:  # the engine's process (the torch engine imports what a trainer does)
        parts["runtime"] = cpu_imports_bytes("torch") + CPU_STEP_RUNTIME_BYTES
    return {
        "parts": parts,
        "peak": sum(parts.values()),
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
