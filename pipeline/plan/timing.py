"""Time per step: the trainer's compute and communication, a rollout's decode, the weight handoff.

Training FLOPs per token: 6 x the active parameters a token multiplies with (forward 2, backward 4)
plus causal attention, 6 x layers x heads x head_dim x sequence length (forward 2 x 2 x n·d·s/2);
activation checkpointing adds one more forward (x 4/3); RL's forward-only passes (behaviour policy,
KL reference) one forward each. Compute time = FLOPs / (ranks x peak per rank x MFU), a CPU rank's
peak being its share of the node's.

Communication per step, never overlapped with compute (a conservative assumption), each volume
over the bandwidth of the links it crosses (within a node or across nodes) x the achieved fraction:
- data parallel: a ring all-reduce of the gradients, 2 (n-1)/n x their bytes (ZeRO's
  reduce-scatter + all-gather is the same volume), ZeRO-3 also gathers the weights in forward and
  backward (+ 2 (n-1)/n x weight bytes); experts are reduced over their own replicas only;
- expert parallel: per MoE layer a dispatch and a combine all-to-all in forward and again in
  backward, tokens x top-k x hidden x bytes x (EP-1)/EP each;
- tensor parallel (Megatron): per layer two all-reduces of the activations in forward, two in
  backward, 2 (TP-1)/TP x tokens x hidden x bytes each;
- pipeline parallel: the bubble, (PP-1) / (micro-batches + PP-1) of the step idle.

Decode (rollout) is bound by reading the weights and the KV cache from device memory each step, or
by compute when the batch is large: per step max(bytes / (bandwidth x efficiency), FLOPs / (peak x MFU)),
plus what the engine spends beside the hardware bound (the site's `decode_step_s` a step: the
forward call's framework overhead; `decode_token_s` a sampled token: sampling, stop checks, the
episode's bookkeeping and verification). An engine samples in waves of at most its batch: a wave
prefills its prompts padded to its longest and runs until its longest response ends (`Waves`,
built from the stage's episode lengths in `lengths.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from snowcat.pipeline.errors import UserError

from .memory import Layout, rank_params
from .model import Arch


@dataclass(frozen=True)
class Hardware:
    """One partition's facts and the planner's assumptions, with where each came from."""

    site: str
    partition: str
    gpus_per_node: int
    device_memory_gib: float | None
    peak_tflops: float | None
    memory_gbps: float | None
    intra_node_gbps: float | None
    inter_node_gbps: float | None
    charge_per_node_hour: float | None
    charge_unit: str
    mfu: float
    bandwidth_efficiency: float
    memory_margin: float
    filesystem_gbps: float
    ranks_per_node: int = 1
    decode_step_s: float = 0.0
    decode_token_s: float = 0.0
    mfu_of: str = ""  # whose efficiency `mfu` is: "" the site's one MFU, "backend megatron" its own

    @property
    def on_gpu(self) -> bool:
        return self.gpus_per_node > 0

    def need(self, key: str):
        """A fact the plan needs; its absence is one line naming the key (exit 2)."""
        value = getattr(self, key)
        if value is None:
            raise UserError(
                f"site {self.site}: key planner.partitions.{self.partition}.{key} is not set; "
                f"the plan needs it (docs/planning.md, 'Site fields')"
            )
        return value

    def rank_flops(self) -> float:
        """Peak FLOP/s of one rank: a GPU's, or on CPU nodes (whose peak is the node's) its share
        of the node among the ranks placed there."""
        peak = self.need("peak_tflops") * 1e12
        return peak if self.on_gpu else peak / max(1, self.ranks_per_node)

    def link_gbps(self, group: int, where: str) -> float:
        """Bandwidth per rank of a collective over `group` consecutive ranks."""
        per_node = max(1, self.ranks_per_node)
        if group <= per_node:
            if self.on_gpu and per_node > 1:
                return self.need("intra_node_gbps")
            return self.need("memory_gbps")  # ranks of one node on the CPU (or one GPU): shared memory
        return self.need("inter_node_gbps") / per_node

    def assumption(self, *, compute: bool = True, links: bool = False, hbm: bool = False, fs: bool = False) -> str:
        parts = []
        if compute:
            whose = f" ({self.mfu_of})" if self.mfu_of else ""
            share = f"{self.mfu:.0%}" if self.mfu >= 0.1 else f"{self.mfu:.1%}"
            parts.append(f"MFU {share}{whose} of {self.peak_tflops:g} TFLOP/s")
        if hbm:
            parts.append(f"memory {self.memory_gbps:g} GB/s x {self.bandwidth_efficiency:.0%}")
            if self.decode_step_s or self.decode_token_s:
                parts.append(f"engine {self.decode_step_s * 1e3:.3g} ms a step, {self.decode_token_s * 1e3:.3g} ms a token")
        if links:
            links_ = [f"{k} {v:g} GB/s" for k, v in (("intra", self.intra_node_gbps), ("inter", self.inter_node_gbps)) if v]
            parts.append(f"links {', '.join(links_) or 'shared memory'} x {self.bandwidth_efficiency:.0%}")
        if fs:
            parts.append(f"filesystem {self.filesystem_gbps:g} GB/s")
        return "; ".join(parts)


def flops_per_token(arch: Arch, seq_len: int, checkpointing: bool) -> float:
    c = arch.cfg
    fwd = 2 * arch.matmul_active + 2 * c.num_layers * c.num_heads * c.head_dim * seq_len
    return fwd * (4 if checkpointing else 3)


def train_step(
    arch: Arch, lay: Layout, hw: Hardware, *, tokens: int, seq_len: int, micro_batches: int, extra_forwards: int = 0
) -> dict:
    """Seconds of one optimizer step over `tokens` tokens (all ranks), by part. `extra_forwards`:
    forwards without backward beside the step (RL: the behaviour policy's logprobs when lag >= 1,
    a reference model's for a KL penalty)."""
    peak = hw.rank_flops()
    flops = tokens * flops_per_token(arch, seq_len, lay.activation_checkpointing)
    flops += extra_forwards * tokens * flops_per_token(arch, seq_len, False) / 3
    compute = flops / (lay.ranks * peak * hw.mfu)
    eff = hw.bandwidth_efficiency
    p = rank_params(arch, lay)
    gb = lay.master_bytes
    ab = lay.compute_bytes
    comm = {}
    if lay.dp > 1:
        # megatron keeps an expert whole on each tensor-parallel rank: its replicas span TP too
        expert_dp = max(1, (lay.dp * lay.tp if lay.backend == "megatron" else lay.dp) // lay.ep)
        volume = 2 * (lay.dp - 1) / lay.dp * p.dense * gb
        volume += 2 * (expert_dp - 1) / expert_dp * p.experts * gb if expert_dp > 1 else 0
        if lay.shard >= 3:
            volume += 2 * (lay.dp - 1) / lay.dp * p.total * ab
        comm["data_parallel"] = volume / (hw.link_gbps(lay.ranks, "data_parallel") * 1e9 * eff)
    tokens_rank = tokens / lay.dp  # each rank of a pipeline stage sees its data-parallel share of the tokens
    layers = arch.cfg.num_layers / lay.pp
    moe_layers = arch.moe_layers / lay.pp
    if lay.ep > 1:
        per_layer = 4 * tokens_rank * arch.cfg.experts_per_token * arch.cfg.hidden_size * ab * (lay.ep - 1) / lay.ep
        comm["expert_parallel"] = moe_layers * per_layer / (hw.link_gbps(lay.ep * lay.tp, "expert_parallel") * 1e9 * eff)
    if lay.tp > 1:
        per_layer = 4 * 2 * (lay.tp - 1) / lay.tp * tokens_rank * arch.cfg.hidden_size * ab
        comm["tensor_parallel"] = layers * per_layer / (hw.link_gbps(lay.tp, "tensor_parallel") * 1e9 * eff)
    bubble = (lay.pp - 1) / (micro_batches + lay.pp - 1) if lay.pp > 1 else 0.0
    compute_total = compute / (1 - bubble)
    total = compute_total + sum(comm.values())
    return {
        "flops": flops,
        "compute_s": compute,
        "pipeline_bubble": round(bubble, 4),
        "comm_s": comm,
        "step_s": total,
        "tokens": tokens,
        "assumes": hw.assumption(links=bool(comm)),
    }


@dataclass(frozen=True)
class Waves:
    """What the engines do to sample a stage's episodes: `count` waves of at most `batch` sequences;
    in all, the prompt tokens prefilled (each wave padded to its longest prompt), the decode steps
    (each wave runs until its longest response ends), the tokens sampled, and the mean tokens in
    context while a step reads the KV cache."""

    sequences: int
    batch: int
    count: int
    prefill_tokens: float
    steps: float
    sampled: float
    context: float


def decode(arch: Arch, hw: Hardware, waves: Waves, *, engines: int, tp: int) -> dict:
    """Seconds for `engines` engines of `tp` devices each to sample `waves` (spread evenly over them)."""
    peak = hw.rank_flops()
    hbm = hw.need("memory_gbps") * 1e9 * hw.bandwidth_efficiency
    wb = 2 if hw.on_gpu else 4
    c = arch.cfg
    rows = waves.sampled / waves.steps if waves.steps else 1.0  # sequences a decode step advances, on average
    touched = 1 - (1 - c.experts_per_token / c.num_experts) ** rows  # experts a decode step reads
    weight_bytes = (arch.dense + arch.experts_total * touched) * wb / tp
    kv_bytes = rows * waves.context * arch.kv_bytes_per_token(wb) / tp
    flops = 2 * arch.matmul_active * rows / tp
    memory_s, compute_s = (weight_bytes + kv_bytes) / hbm, flops / (peak * hw.mfu)
    step = max(memory_s, compute_s) + hw.decode_step_s
    prefill = waves.prefill_tokens * 2 * arch.matmul_active / tp / (peak * hw.mfu)
    engines = max(1, engines)
    total = (waves.steps * step + waves.sampled * hw.decode_token_s + prefill) / engines
    return {
        "sequences": waves.sequences,
        "engines": engines,
        "batch": waves.batch,
        "waves": waves.count,
        "decode_steps": round(waves.steps, 1),
        "sampled_tokens": round(waves.sampled, 1),
        "prefill_tokens": round(waves.prefill_tokens, 1),
        "decode_step_s": step,
        "prefill_s": prefill / engines,
        "rollout_s": total,
        "bound": "memory" if memory_s >= compute_s else "compute",
        "assumes": hw.assumption(hbm=True),
    }


def handoff(arch: Arch, hw: Hardware, *, storage_bytes: int, readers: int) -> dict:
    """Seconds to publish a weight version through the shared filesystem and for `readers` engines to
    load it (reads share the filesystem's bandwidth)."""
    size = arch.total * storage_bytes
    fs = hw.filesystem_gbps * 1e9
    return {
        "bytes": size,
        "write_s": size / fs,
        "read_s": size * max(1, readers) / fs,
        "assumes": hw.assumption(compute=False, fs=True),
    }


def transport(hw: Hardware, *, seqs: int, tokens: int) -> dict:
    """Seconds to move a batch of trajectories from rollout to trainer ranks (MPI): token ids,
    logprobs, masks and a support set, about 16 bytes a token (an estimate)."""
    size = seqs * tokens * 16
    per_node = hw.inter_node_gbps or hw.memory_gbps or hw.intra_node_gbps
    if per_node is None:
        hw.need("inter_node_gbps")
    return {"bytes": size, "transport_s": size / (per_node * 1e9 * hw.bandwidth_efficiency)}
