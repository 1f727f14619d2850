"""Peak memory per rank of loading, training and checkpointing a model: DDP against ZeRO and expert parallelism, side by side.

    snowcat bench trainer-memory [--hidden 384 --layers 6 --experts 16 --vocab 16384]
                                 [--modes ddp,zero2,zero3,ddp+ep2,fsdp,fsdp+ep2,megatron,megatron+ep2,megatron+tp2,megatron+pp2]
                                 [--rows 2 --seq 256] [--steps 1] [--allocator both|default|fixed]
                                 [--shard-mib 16] [--json FILE]

The model (seed 0) is written once as a model directory. Every mode runs as 2 gloo ranks on the
CPU, each rank a fresh process (so no two measurements share a high-water mark), one mode after
the other. A rank loads the directory into the mode's train-step backend
(`stages.train.load_for_training`), takes `--steps` optimizer steps (AdamW) of `--rows` x `--seq`
random tokens through the SFT loss (the last one is measured: from the second on, AdamW's moments
are held through forward and backward, as in every step of a run), and writes a resumable checkpoint (`stages.train.save_checkpoint`:
the weights whole, as `final/` and a weight version have them too, and the trainer state; rank 0
writes the weights in shards of `--shard-mib`, so that this model spans several shards as a large
one spans its 256 MiB shards). Memory is the resident high-water mark (VmHWM) above `start` (torch,
deepspeed and snowcat imported, process group joined): `setup` while loading the model into the
backend; `held` resident just before the step; `step` during the step and `save` during the
write (the mark is reset before each, so each counts what that phase holds and allocates, not a
transient of the one before); `save_added` is what the checkpoint adds to the RSS the trained state
had before it (what is gathered for rank 0 to write, and the shards in flight). `setup` counts the
pages of the memory-mapped files a rank read (page cache, reclaimable) beside what it allocated.
The ratios compare each mode's largest rank with DDP's (< 1: less memory), for setup, step, save
and the whole run (`peak`, the largest of the three). Every mode is measured twice: with glibc's
allocator as a run has it, and with its mmap threshold fixed, so that RSS follows the live tensors
rather than what the allocator kept of freed ones (see ALLOCATORS; `--allocator` picks one).

Modes: `ddp` (torch backend: DistributedDataParallel), `zero2` (DeepSpeed ZeRO-2: optimizer state
and gradients partitioned), `zero3` (ZeRO-3: the parameters too; the backend's DeepSpeed
settings), `ddp+ep2` (DDP with each MoE layer's experts sharded over both ranks,
`stages.model.expert_parallel`, the torch backend's `expert_parallel=2`), `fsdp` (torch FSDP2:
ZeRO-3, the fsdp backend) and `fsdp+ep2` (ZeRO-3 + EP: the experts sharded over both ranks, the
rest by FSDP), and megatron-core's `megatron` (data parallel), `megatron+ep2`, `megatron+tp2` (sequence
parallel) and `megatron+pp2` (`snowcat bench trainer` runs these beside ddp and zero2, with each
mode's step time: the slowest rank's fastest optimizer step from the second on; its CPU time, the
rank's own work (one thread each), which other work on a shared machine disturbs less than the
wall time; and tokens per second: each data-parallel replica trains on its own `--rows`, so a
mode with one replica, TP2 or PP2, takes half the tokens per step of a data-parallel one). fp32
on CPU: parameters, gradients and the two Adam moments are 4 bytes per parameter each.

Beside RSS, each rank counts the trained state it holds after the step, from the tensors
themselves (`state`): its master weights (the parameters, or ZeRO's fp32 partitions) and its
optimizer state (AdamW's moments), in bytes per parameter of the whole model. The masters are
float32 whatever the checkpoint stores (`--stored-dtype bfloat16`: a model directory as the hub
has them; stages/train/precision.py), so DDP holds 12 bytes per parameter, and ZeRO/FSDP/EP divide
what they shard over the ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_json
from snowcat.stages.model.config import ModelConfig, count_params

WORLD = 2
# mode -> make_backend arguments
MODES: dict[str, dict] = {
    "ddp": {"backend": "torch", "zero_stage": 0, "expert_parallel": 1},
    "zero2": {"backend": "deepspeed", "zero_stage": 2, "expert_parallel": 1},
    "zero3": {"backend": "deepspeed", "zero_stage": 3, "expert_parallel": 1},
    "ddp+ep2": {"backend": "torch", "zero_stage": 0, "expert_parallel": 2},
    "fsdp": {"backend": "fsdp", "zero_stage": 3, "expert_parallel": 1},
    "fsdp+ep2": {"backend": "fsdp", "zero_stage": 3, "expert_parallel": 2},
    # megatron-core (stages/train/megatron): data parallel, experts over both ranks, every matrix
    # split over both (sequence parallel), the layers in two pipeline stages
    "megatron": {"backend": "megatron", "zero_stage": 0, "expert_parallel": 1},
    "megatron+ep2": {"backend": "megatron", "zero_stage": 0, "expert_parallel": 2},
    "megatron+tp2": {"backend": "megatron", "zero_stage": 0, "expert_parallel": 1, "tensor_parallel": 2},
    "megatron+pp2": {"backend": "megatron", "zero_stage": 0, "expert_parallel": 1, "pipeline_parallel": 2},
}
DEFAULT_MODES = ("ddp", "zero2", "zero3", "ddp+ep2", "fsdp", "fsdp+ep2")

# RSS counts freed memory that the allocator keeps: glibc raises its mmap threshold as large blocks
# are freed (up to 32 MiB), so later tensors come from a heap it rarely gives back, and a rank's RSS
# then depends on what it allocated and freed before (e.g. the whole model ZeRO-3 partitions).
# Each mode is measured as a run would see it and with the threshold fixed (tensors above it are
# returned to the system when freed): RSS then follows the live tensors.
ALLOCATORS = {"glibc default": {}, "fixed mmap threshold 128 KiB": {"MALLOC_MMAP_THRESHOLD_": "131072"}}

CHILD = r"""
import json, os, sys


def status_kib(key):
    return int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith(key + ":")))


def hwm_kib():  # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across fork and exec
    return status_kib("VmHWM")


def state_bytes(backend):  # (master bytes, optimizer-state bytes) this rank holds, each tensor once
    seen = set()

    def size(t):
        if not torch.is_tensor(t):
            return 0
        t = t.to_local() if hasattr(t, "to_local") else t
        t = getattr(t, "ds_tensor", None) if getattr(t, "ds_tensor", None) is not None else t  # ZeRO-3's partition
        key = (t.data_ptr(), t.numel())
        if t.numel() == 0 or key in seen:
            return 0
        seen.add(key)
        return t.numel() * t.element_size()

    flat = backend._stepped() if hasattr(backend, "_stepped") else []  # ZeRO's fp32 partitions: the masters
    masters = sum(size(t) for t in [*flat, *backend.model.parameters()])
    base = backend._base_optimizer() if hasattr(backend, "_base_optimizer") else backend.optimizer
    optimizer = sum(size(v) for state in base.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return masters, optimizer


def reset_hwm():
    with open("/proc/self/clear_refs", "w") as f:  # "5": the high-water mark restarts from the current RSS
        f.write("5")


import deepspeed, torch  # every mode imports the same: one baseline
import time
spec = json.loads(sys.argv[1])
if spec["backend"] == "megatron":  # before `start` too: memory is counted above what the imports hold
    import snowcat.stages.train.megatron.backend
from snowcat.stages.train import OptimConfig, load_for_training, save_checkpoint
from snowcat.stages.train.backend import init_distributed, leave_distributed
from snowcat.stages.train.loss import sft_loss

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.set_num_threads(1)  # two ranks on the same cores
init_distributed(world)
start = hwm_kib()
optim = OptimConfig(lr=1e-4, warmup_steps=0, total_steps=10)
options = {k: spec[k] for k in ("zero_stage", "expert_parallel", "tensor_parallel", "pipeline_parallel") if k in spec}
backend, _ = load_for_training(spec["model_dir"], spec["backend"], optim, device="cpu", verify=False, **options)
setup = hwm_kib()
g = torch.Generator().manual_seed(1 + backend.data_rank)  # ranks of one model replica see the same rows
rows, seq = spec["rows"], spec["seq"]
ids = torch.randint(0, backend.model.config.vocab_size, (rows, seq + 1), generator=g)
batch = {
    "input_ids": ids[:, :-1],
    "targets": ids[:, 1:],
    "segment_ids": torch.zeros(rows, seq, dtype=torch.long),
    "position_ids": torch.arange(seq).expand(rows, seq).contiguous(),
}
steps_kib, steps_s, steps_cpu_s = [], [], []
for _ in range(spec["steps"]):  # the mark restarts before each step: the last one is measured
    reset_hwm()
    held = status_kib("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    stats = backend.train_step([batch], sft_loss)
    steps_s.append(time.perf_counter() - t0)
    steps_cpu_s.append(time.process_time() - c0)
    steps_kib.append(hwm_kib())
# the fastest step from the second on (AdamW's moments held, as in a run): the least slowed by other
# work on a shared machine; its CPU time (one thread per rank) is the rank's own work, waits excluded
step_s, step_cpu_s = min(steps_s[1:] or steps_s), min(steps_cpu_s[1:] or steps_cpu_s)
step = steps_kib[-1]
reset_hwm()
trained = status_kib("VmRSS")
save_checkpoint(spec["save_to"], backend, max_shard_bytes=spec["shard_bytes"])
saved = hwm_kib()
loss = float(stats.sums["nll_sum"]) / stats.tokens
masters, moments = state_bytes(backend)
report = {"step_s": step_s, "steps_s": steps_s, "step_cpu_s": step_cpu_s, "steps_cpu_s": steps_cpu_s, "start_kib": start, "setup_kib": setup, "held_kib": held, "step_kib": step, "steps_kib": steps_kib, "trained_kib": trained, "save_kib": saved,
          "master_bytes": masters, "optimizer_bytes": moments, "master_dtype": str(next(backend.model.parameters()).dtype)}
print(json.dumps({"rank": rank, **report, "local_nll": loss}), flush=True)
leave_distributed(together=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mode(spec: dict, allocator_env: dict) -> list[dict]:
    """One training step on WORLD fresh rank processes; each rank's report."""
    port = _free_port()
    procs = []
    for rank in range(WORLD):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "LOCAL_RANK": str(rank),
            "LOCAL_SIZE": str(WORLD),
            "OMP_WAIT_POLICY": "PASSIVE",
            **allocator_env,
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", CHILD, json.dumps(spec)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    try:
        outs = [p.communicate(timeout=1200) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        # DeepSpeed's CPU all-reduce leaves a shared-memory buffer per rank in /dev/shm
        for leftover in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
            leftover.unlink(missing_ok=True)
    for p, (_out, err) in zip(procs, outs):
        if p.returncode != 0:
            raise SystemExit(f"trainer-memory {spec['mode']}: a rank failed ({p.returncode}):\n{err[-3000:]}")
    return [json.loads(out.strip().splitlines()[-1]) for out, _err in outs]


PHASES = ("setup", "step", "save")


def measure(
    modes: list[str], allocator_env: dict, model_dir: Path, params: int, rows: int, seq: int, shard_bytes: int, steps: int = 1
) -> dict:
    results = {}
    for mode in modes:
        with tempfile.TemporaryDirectory(prefix="snowcat-bench-save-") as tmp:
            spec = {"mode": mode, **MODES[mode], "model_dir": str(model_dir), "save_to": f"{tmp}/step_000001"}
            ranks = run_mode(spec | {"rows": rows, "seq": seq, "steps": steps, "shard_bytes": shard_bytes}, allocator_env)
        for r in ranks:
            for phase in ("held", *PHASES):
                r[f"{phase}_mib"] = round((r[f"{phase}_kib"] - r["start_kib"]) / 1024, 1)
            r["peak_mib"] = max(r[f"{phase}_mib"] for phase in PHASES)
            r["save_added_mib"] = round((r["save_kib"] - r["trained_kib"]) / 1024, 1)
            r["step_bytes_per_param"] = round(r["step_mib"] * 2**20 / params, 2)
            r["state_bytes_per_param"] = round((r["master_bytes"] + r["optimizer_bytes"]) / params, 2)
        results[mode] = {
            **MODES[mode],
            "ranks": ranks,
            **{f"max_rank_{phase}_mib": max(r[f"{phase}_mib"] for r in ranks) for phase in (*PHASES, "peak", "save_added")},
            "step_s": round(max(r["step_s"] for r in ranks), 3),  # the slowest rank sets the step's pace
            "step_cpu_s": round(max(r["step_cpu_s"] for r in ranks), 3),
            # each data-parallel replica trains on its own rows: TP2 and PP2 (one replica) take
            # half the tokens of a step of the data-parallel modes
            "tokens_per_step": _replicas(MODES[mode]) * rows * seq,
        }
        results[mode]["tokens_per_s"] = round(results[mode]["tokens_per_step"] / results[mode]["step_s"], 1)
    ddp = results["ddp"]
    for res in results.values():
        for phase in (*PHASES, "peak"):
            res[f"{phase}_ratio_to_ddp"] = round(res[f"max_rank_{phase}_mib"] / ddp[f"max_rank_{phase}_mib"], 3)
        res["step_time_ratio_to_ddp"] = round(res["step_s"] / ddp["step_s"], 3)
        res["tokens_per_s_ratio_to_ddp"] = round(res["tokens_per_s"] / ddp["tokens_per_s"], 3)
        res["step_cpu_ratio_to_ddp"] = round(res["step_cpu_s"] / ddp["step_cpu_s"], 3)
    return results


def _replicas(spec: dict) -> int:
    """Data-parallel replicas of a mode on WORLD ranks (each trains on its own rows)."""
    return WORLD // (spec.get("tensor_parallel", 1) * spec.get("pipeline_parallel", 1))


def bench_model(hidden: int, layers: int, experts: int, vocab: int, seq: int) -> ModelConfig:
    """The benchmark's MoE: 8 heads (2 KV), top-2 routing, experts as wide as the hidden size."""
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=8,
        num_kv_heads=2,
        head_dim=hidden // 8,
        num_experts=experts,
        experts_per_token=2,
        moe_intermediate_size=hidden,
        max_position_embeddings=max(1024, seq),
    )


def write_model(cfg: ModelConfig, path: Path, dtype: str = "float32") -> None:
    """The benchmark's model (seed 0) as a model directory, its weights stored in `dtype`: what every mode loads."""
    import torch  # noqa: PLC0415 (the parent needs torch only here)

    from snowcat.stages.model import MoEForCausalLM, save_model_dir  # noqa: PLC0415

    torch.manual_seed(0)
    save_model_dir(path, MoEForCausalLM(cfg), dtype=getattr(torch, dtype))


def main(argv: list[str] | None = None, command: str | None = None) -> int:
    """`command`: how the run is recorded in --json (default: this benchmark with `argv`)."""
    ap = argparse.ArgumentParser(prog="snowcat bench trainer-memory", description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--rows", type=int, default=2, help="sequences per rank in the step")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    ap.add_argument(
        "--steps",
        type=int,
        default=1,
        help="optimizer steps; the last is measured (2: a step with AdamW's moments held throughout, as every later one)",
    )
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, from {', '.join(MODES)}; ddp first")
    ap.add_argument("--shard-mib", type=float, default=16, help="safetensors shard size of the saved weights")
    ap.add_argument("--stored-dtype", choices=("float32", "bfloat16"), default="float32", help="what the model directory stores")
    ap.add_argument(
        "--allocator",
        choices=("both", "default", "fixed"),
        default="both",
        help="measure with glibc's default allocator, with the fixed mmap threshold (what plan-validation reads), or both",
    )
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    allocators = {
        name: env
        for i, (name, env) in enumerate(ALLOCATORS.items())
        if args.allocator == "both" or (args.allocator == "default") == (i == 0)
    }
    modes = [m.strip() for m in args.modes.split(",")]
    unknown = [m for m in modes if m not in MODES]
    if unknown or modes[0] != "ddp":
        raise UserError(f"--modes: {', '.join(unknown) or modes[0]} (choose from {', '.join(MODES)}; ddp first, the reference)")
    model = bench_model(args.hidden, args.layers, args.experts, args.vocab, args.seq)
    params = count_params(model)[0]
    shard_bytes = int(args.shard_mib * 2**20)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="snowcat-bench-model-") as tmp:
        write_model(model, Path(tmp) / "model", args.stored_dtype)
        results = {
            name: measure(modes, env, Path(tmp) / "model", params, args.rows, args.seq, shard_bytes, args.steps)
            for name, env in allocators.items()
        }
    load_after = os.getloadavg()
    print(
        f"model: {params / 1e6:.1f} M parameters ({params * 4 / 2**20:.0f} MiB fp32), {WORLD} gloo ranks,"
        f" {args.steps} step(s) of {args.rows}x{args.seq} tokens per rank (the last measured), saved in {args.shard_mib:g} MiB shards"
    )
    for allocator, by_mode in results.items():
        print(f"\n{allocator}")
        print(
            f"{'mode':<8} {'rank':>4} {'start MiB':>10} {'setup +MiB':>11} {'held +MiB':>10} {'step +MiB':>10}"
            f" {'save +MiB':>10} {'(added)':>8} {'B/param':>8} {'state B/param':>14} {'step s':>7}"
        )
        for mode, res in by_mode.items():
            for r in res["ranks"]:
                print(
                    f"{mode:<8} {r['rank']:>4} {r['start_kib'] / 1024:>10.0f} {r['setup_mib']:>11.0f} {r['held_mib']:>10.0f}"
                    f" {r['step_mib']:>10.0f} {r['save_mib']:>10.0f} {r['save_added_mib']:>8.0f} {r['step_bytes_per_param']:>8.2f}"
                    f" {r['state_bytes_per_param']:>14.2f} {r['step_s']:>7.2f}"
                )
        print("largest rank against ddp's:")
        for m, r in by_mode.items():
            phases = "  ".join(f"{phase} {r[f'{phase}_ratio_to_ddp']:.2f}x" for phase in (*PHASES, "peak"))
            speed = (
                f"step time {r['step_time_ratio_to_ddp']:.2f}x, tokens/s {r['tokens_per_s_ratio_to_ddp']:.2f}x,"
                f" step CPU time {r['step_cpu_ratio_to_ddp']:.2f}x"
            )
            print(f"  {m:<12} {phases}  {speed}")
    print(f"\nload average before / after: {load_before[0]:.2f} / {load_after[0]:.2f} ({os.cpu_count()} cpus)")
    if args.json:
        atomic_write_json(
            args.json,
            {
                "benchmark": "trainer-memory",
                "what": __doc__.splitlines()[0],
                "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
                "load_average_1min": {"before": load_before[0], "after": load_after[0]},
                "model": model.to_dict() | {"params": params},
                "step": {
                    "ranks": WORLD,
                    "rows_per_rank": args.rows,
                    "seq": args.seq,
                    "optimizer": "AdamW",
                    "dtype": "fp32",
                    "steps": args.steps,
                    "measured_step": args.steps,
                },
                "stored_dtype": args.stored_dtype,
                "save": {"shard_bytes": shard_bytes},
                "peak_unit": "MiB of VmHWM above the rank's start (after imports and joining the process group)",
                "allocators": {name: env or "glibc's defaults" for name, env in allocators.items()},
                "results": results,
                "command": command
                or " ".join(["snowcat", "bench", "trainer-memory", *(argv if argv is not None else sys.argv[1:])]),
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
