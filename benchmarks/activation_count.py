"""What a forward keeps for backward, tensor by tensor, beside the planner's activation model.

    snowcat bench activation-count [--hidden 384 --layers 6 --experts 16 --vocab 16384]
                                   [--rows 2 --seq 256] [--json FILE]

The trainer-memory benchmark's model (seed 0) in one process, fp32 on the CPU: one SFT forward
(packed rows, one document each, as there) under a saved-tensors hook that records every tensor
autograd keeps for backward, each storage once and parameters left out, with the source line that
made it; then the backward. Beside them: the resident high-water mark above what the model held
before, during the forward and during the backward (glibc's mmap threshold fixed first, so that
RSS follows the live tensors), and the planner's `activations` and `logits` parts for the same
tokens (pipeline/plan/memory.py): the saved tensors are what `activations` counts; the backward's
mark adds the fused logprob kernel's buffers (`logits`) at its start.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import traceback
from collections import Counter
from pathlib import Path

from snowcat.pipeline.fsio import atomic_write_json
from snowcat.pipeline.plan.memory import Layout, trainer_memory
from snowcat.pipeline.plan.model import Arch

from .trainer_memory import bench_model

MIB = 2**20
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": the high-water mark restarts from the current RSS
        f.write("5")


def _site(roots: tuple[str, ...]) -> str:
    """The innermost frame in snowcat's code or torch's (the module call that saved the tensor)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(roots):
            return f"{Path(frame.filename).name}:{frame.lineno} {(frame.line or '').strip()[:70]}"
    return "?"


def count(rows: int, seq: int, cfg) -> dict:
    import torch  # noqa: PLC0415 (the benchmark's own run)

    from snowcat.stages.model import MoEForCausalLM  # noqa: PLC0415
    from snowcat.stages.train.loss import sft_loss  # noqa: PLC0415

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MoEForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (rows, seq + 1), generator=torch.Generator().manual_seed(1))
    batch = {
        "input_ids": ids[:, :-1],
        "targets": ids[:, 1:],
        "segment_ids": torch.zeros(rows, seq, dtype=torch.long),
        "position_ids": torch.arange(seq).expand(rows, seq).contiguous(),
    }
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    roots = (str(Path(__file__).resolve().parents[1]), str(Path(torch.__file__).parent))
    saved: dict[int, tuple[int, str]] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in saved and ptr not in params:
            saved[ptr] = (t.untyped_storage().nbytes(), _site(roots))
        return t

    base = _status_kib("VmRSS")
    _reset_hwm()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = sft_loss(model, batch, rows * seq, 1)
    forward_hwm = _status_kib("VmHWM")
    _reset_hwm()
    loss.backward()
    backward_hwm = _status_kib("VmHWM")
    by_site = Counter()
    for nbytes, site in saved.values():
        by_site[site] += nbytes
    return {
        "saved_bytes": sum(by_site.values()),
        "saved_by_site_mib": {k: round(v / MIB, 2) for k, v in by_site.most_common()},
        "forward_hwm_above_model_bytes": (forward_hwm - base) * 1024,
        "backward_hwm_above_model_bytes": (backward_hwm - base) * 1024,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="snowcat bench activation-count", description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    cfg = bench_model(args.hidden, args.layers, args.experts, args.vocab, args.seq)
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 << 10)  # this process's allocator from here on
    measured = count(args.rows, args.seq, cfg)
    tokens = args.rows * args.seq
    plan = trainer_memory(Arch("trainer-memory benchmark", cfg), Layout(ranks=1), tokens, 1, on_gpu=False)["parts"]
    result = {
        "benchmark": "activation-count",
        "what": __doc__.splitlines()[0],
        "model": cfg.to_dict(),
        "rows": args.rows,
        "seq": args.seq,
        "tokens": tokens,
        **measured,
        "planned_activations_bytes": plan["activations"],
        "planned_logits_bytes": plan["logits"],
        "command": " ".join(["snowcat", "bench", "activation-count", *(argv if argv is not None else sys.argv[1:])]),
    }
    print(
        f"{tokens} tokens: saved for backward {measured['saved_bytes'] / MIB:.1f} MiB, planned {plan['activations'] / MIB:.1f} MiB"
    )
    print(
        f"  backward's high-water mark above the model {measured['backward_hwm_above_model_bytes'] / MIB:.1f} MiB,"
        f" planned activations + logprob kernel {(plan['activations'] + plan['logits']) / MIB:.1f} MiB"
    )
    for site, mib in list(measured["saved_by_site_mib"].items())[:12]:
        print(f"  {mib:9.2f} MiB  {site}")
    if args.json:
        atomic_write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
