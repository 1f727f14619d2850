"""Fused linear -> logprob (+ entropy), forward + backward, side by side on the same inputs.

    python -m snowcat.benchmarks.logprob [--n 32768 --h 2048 --v 128256 --dtype bf16 --device cuda]

Rows: torch eager, torch.compile, torch's chunked linear_cross_entropy, Liger fused linear CE,
cut-cross-entropy, and this project's reference and Triton kernels.  Each row reports the median
time of forward + backward, effective TFLOP/s (6·N·H·V / time), extra peak memory (everything the
call allocates above the inputs, gradients included) and max |Δ| of logprob and entropy against an
fp32 reference.  An anchor that is not installed is a "missing" row, never silently dropped.
On CPU the defaults are small; memory there is glibc's allocated bytes sampled after every aten op.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from snowcat.kernels import linear_logprob_entropy
from snowcat.pipeline.fsio import atomic_write_json

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ANCHORS = ("eager", "compile", "torch_lce", "liger", "cce")
METHODS = ANCHORS + ("reference", "triton")


@dataclass
class Row:
    method: str
    status: str  # ok | missing | unavailable | error
    entropy: bool = False
    ms: float | None = None
    tflops: float | None = None
    extra_gib: float | None = None
    max_dlogp: float | None = None
    max_dent: float | None = None
    vs_best_anchor: float | None = None
    note: str = ""


# --- the methods: each maps (h, W, y, T) to (logprob, entropy or None) -------------------------


def eager(h, w, y, t):
    logp = torch.log_softmax((h @ w.T).float() / t, dim=-1)
    return logp.gather(1, y[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def torch_lce(h, w, y, t):
    options = torch.nn.LinearCrossEntropyOptions()
    return -torch.nn.functional.linear_cross_entropy(h / t, w, y, reduction="none", options=options), None


def liger(h, w, y, t):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # noqa: PLC0415 (optional, GPU only)

    loss = LigerFusedLinearCrossEntropyLoss(reduction="none")(w, h / t, y)
    return -(loss[0] if isinstance(loss, tuple) else loss), None


def cce(h, w, y, t):
    from cut_cross_entropy import linear_cross_entropy  # noqa: PLC0415 (optional, GPU only)

    return -linear_cross_entropy(h / t, w, y, reduction="none"), None


def ours(backend):
    return lambda h, w, y, t: linear_logprob_entropy(h, w, y, temperature=t, backend=backend)


def resolve(method: str, device: str):
    """(callable or None, status note)."""
    if method == "eager":
        return eager, ""
    if method == "compile":
        return torch.compile(eager), ""
    if method == "torch_lce":
        ok = hasattr(torch.nn, "LinearCrossEntropyOptions")
        return (torch_lce, "") if ok else (None, f"missing: torch {torch.__version__} has no chunked linear_cross_entropy")
    if method in ("liger", "cce"):
        package = {"liger": "liger_kernel", "cce": "cut_cross_entropy"}[method]
        if importlib.util.find_spec(package) is None:
            return None, f"missing: {package} not installed"
        if device != "cuda":
            return None, f"unavailable: {package} needs CUDA"
        return {"liger": liger, "cce": cce}[method], ""
    if method == "reference":
        return ours("reference"), ""
    if method == "triton":
        if device != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return None, "unavailable: needs CUDA (or TRITON_INTERPRET=1, very slow)"
        return ours("triton"), ""
    raise ValueError(method)


# --- measuring -------------------------------------------------------------------------------------


class _MallocPeak(TorchDispatchMode):
    """CPU stand-in for max_memory_allocated: glibc's in-use bytes sampled after every aten op."""

    def __init__(self):
        super().__init__()
        self._libc = ctypes.CDLL("libc.so.6")
        self._libc.mallinfo2.restype = _MallInfo2
        self.base = self.peak = self.now()

    def now(self) -> int:
        info = self._libc.mallinfo2()
        return info.uordblks + info.hblkhd

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.now())
        return out


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _step(fn, h, w, y, t, g_lp, g_ent):
    h.grad = w.grad = None
    logp, ent = fn(h, w, y, t)
    loss = (logp.float() * g_lp).sum()
    if ent is not None:
        loss = loss + (ent.float() * g_ent).sum()
    loss.backward()
    return logp.detach(), None if ent is None else ent.detach()


def _extra_peak_bytes(fn, args, device) -> int | None:
    args[0].grad = args[1].grad = None  # the gradients this call makes count as its memory
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _step(fn, *args)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    try:
        with _MallocPeak() as probe:
            _step(fn, *args)
        return probe.peak - probe.base
    except (OSError, AttributeError):  # not glibc
        return None


def measure(method, fn, args, truth, flops, device, warmup, iters) -> Row:
    out = None
    for _ in range(max(1, warmup)):  # at least one untimed call: compilation, autotuning, caches
        out = _step(fn, *args)
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        out = _step(fn, *args)
        _sync(device)
        times.append(time.perf_counter() - start)
    ms = statistics.median(times) * 1e3
    extra = None if (method == "compile" and device != "cuda") else _extra_peak_bytes(fn, args, device)
    logp, ent = out
    return Row(
        method,
        "ok",
        entropy=ent is not None,
        ms=ms,
        tflops=flops / ms / 1e9,
        extra_gib=None if extra is None else extra / 2**30,
        max_dlogp=(logp.float() - truth[0]).abs().max().item(),
        max_dent=None if ent is None else (ent.float() - truth[1]).abs().max().item(),
    )


def make_inputs(n, hdim, vocab, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # Scales like a trained LM head: logits with a std of a few units.
    h = torch.randn(n, hdim, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hdim, generator=gen) * hdim**-0.5 * 3).to(device=device, dtype=dtype).requires_grad_()
    y = torch.randint(0, vocab, (n,), generator=gen).to(device)
    g_lp = torch.randn(n, generator=gen).to(device)
    g_ent = torch.randn(n, generator=gen).to(device)
    return h, w, y, g_lp, g_ent


@torch.no_grad()
def fp32_truth(h, w, y, t, chunk=1024):
    """Plain fp32 log_softmax over chunks of tokens: independent of the code under test."""
    w32 = w.detach().float()
    logps, ents = [], []
    for lo in range(0, h.shape[0], chunk):
        logp = torch.log_softmax(h[lo : lo + chunk].detach().float() @ w32.T / t, dim=-1)
        logps.append(logp.gather(1, y[lo : lo + chunk, None])[:, 0])
        ents.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(logps), torch.cat(ents)


def run(args) -> list[Row]:
    device = args.device
    h, w, y, g_lp, g_ent = make_inputs(args.n, args.h, args.v, DTYPES[args.dtype], device)
    truth = fp32_truth(h, w, y, args.temperature)
    flops = 6 * args.n * args.h * args.v
    rows = []
    for method in args.methods:
        try:
            fn, note = resolve(method, device)
            if fn is None:
                rows.append(Row(method, note.split(":")[0], note=note))
                continue
            rows.append(
                measure(method, fn, (h, w, y, args.temperature, g_lp, g_ent), truth, flops, device, args.warmup, args.iters)
            )
        except Exception as exc:  # one broken anchor must not hide the others
            rows.append(Row(method, "error", note=f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"))
        gc.collect()
    anchor_ms = [r.ms for r in rows if r.method in ANCHORS and r.ms is not None]
    for r in rows:
        if r.ms is not None and anchor_ms:
            r.vs_best_anchor = r.ms / min(anchor_ms)
    return rows


def _fmt(value, spec):
    return format(value, spec) if value is not None else format("-", ">" + spec.split(".")[0])


def render(rows, args) -> str:
    head = (
        f"logprob fwd+bwd  N={args.n} H={args.h} V={args.v} {args.dtype} on {args.device}"
        f" ({torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}), T={args.temperature}"
    )
    lines = [
        head,
        f"{'method':<10} {'status':<11} {'ent':<4} {'ms':>9} {'TFLOP/s':>8} {'extraGiB':>9} "
        f"{'max|dlogp|':>10} {'max|dent|':>10} {'vs best':>8}  note",
    ]
    for r in rows:
        lines.append(
            f"{r.method:<10} {r.status:<11} {'yes' if r.entropy else 'no':<4} {_fmt(r.ms, '9.2f')} "
            f"{_fmt(r.tflops, '8.2f')} {_fmt(r.extra_gib, '9.3f')} {_fmt(r.max_dlogp, '10.2e')} "
            f"{_fmt(r.max_dent, '10.2e')} {_fmt(r.vs_best_anchor, '8.2f')}  {r.note}"
        )
    return "\n".join(lines)


def parse_args(argv):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m snowcat.benchmarks.logprob", description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if cuda else "cpu")
    p.add_argument("--n", type=int, help="tokens (default 32768 on cuda, 512 on cpu)")
    p.add_argument("--h", type=int, help="hidden size (default 2048 on cuda, 128 on cpu)")
    p.add_argument("--v", type=int, help="vocabulary (default 128256 on cuda, 4096 on cpu)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list from {','.join(METHODS)}")
    p.add_argument("--warmup", type=int, help="untimed calls per method (default 3 cuda, 1 cpu)")
    p.add_argument("--iters", type=int, help="timed calls per method (default 10 cuda, 3 cpu)")
    p.add_argument("--json", help="also write the rows to this JSON file (e.g. benchmarks/results/...)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not cuda:
        p.error("--device cuda but torch sees no GPU")
    gpu = args.device == "cuda"
    for key, on_gpu, on_cpu in (
        ("n", 32768, 512),
        ("h", 2048, 128),
        ("v", 128256, 4096),
        ("dtype", "bf16", "fp32"),
        ("warmup", 3, 1),
        ("iters", 10, 3),
    ):
        if getattr(args, key) is None:
            setattr(args, key, on_gpu if gpu else on_cpu)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        p.error(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    print(render(rows, args))
    if args.json:
        atomic_write_json(
            args.json,
            {
                "shape": {"n": args.n, "h": args.h, "v": args.v, "dtype": args.dtype, "temperature": args.temperature},
                "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                "torch": torch.__version__,
                "rows": [asdict(r) for r in rows],
            },
        )
    return 0 if all(r.status != "error" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
