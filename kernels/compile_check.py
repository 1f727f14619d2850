"""Compile the Triton kernels for a GPU architecture without a GPU and report their resources.

    python -m snowcat.kernels.compile_check [--arch 90] [--dtype bf16]

Runs Triton's whole pipeline (TTIR -> TTGIR -> PTX -> cubin via the bundled ptxas) the way a
launch at the target shape would (pointers 16-byte aligned, sizes multiples of 16), then reads
ptxas' register and spill report. Shared memory well above one stage means the loads are
software-pipelined; spills mean the tile configuration is too large for the register file.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from snowcat.kernels import triton_fused as tf

_TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_POINTERS = {"y_ptr": "*i64", "bits_ptr": "*u8", "h_ptr": None, "w_ptr": None, "dz_ptr": None}
_ALIGNED_INTS = {"n_rows", "vocab", "hdim", "nbytes", "v_chunk"}  # multiples of 16 at the target shape


@dataclass
class KernelReport:
    kernel: str
    support: bool
    shared_bytes: int
    registers: int | None
    spill_bytes: int | None


def _signature(kernel, dtype, constexprs):
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = _POINTERS.get(name) or ("*" + _TRITON_DTYPES[dtype] if name in _POINTERS else "*fp32")
        else:
            sig[name] = "fp32" if name == "inv_t" else "i32"
    return sig


def _ptxas_report(ptx: str, arch: int) -> tuple[int | None, int | None]:
    from triton.backends.nvidia.compiler import get_ptxas  # noqa: PLC0415 (Triton's own choice of ptxas for this arch)

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        gpu = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
        log = subprocess.run(
            [get_ptxas(arch).path, "-v", f"--gpu-name={gpu}", str(src), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", log)
    return (int(regs.group(1)) if regs else None, sum(map(int, spills)) if spills else None)


def compile_kernels(arch: int, dtype: torch.dtype) -> list[KernelReport]:
    if tf.INTERPRETED:
        raise RuntimeError("kernels.compile_check needs TRITON_INTERPRET unset (it compiles the real kernels)")
    cfg = tf.tile_config(dtype)
    reports = []
    for name, kernel in (("forward", tf._fwd_stats_kernel), ("backward", tf._grad_logits_kernel)):
        for support in (False, True):
            constexprs = {
                "HAS_SUPPORT": support,
                "BLOCK_N": cfg.block_n,
                "BLOCK_V": cfg.block_v,
                "BLOCK_H": cfg.block_h,
                "GROUP_N": cfg.group_n,
                "UPCAST": False,
                "PRECISION": tf._precision(dtype),
            }
            constexprs = {k: v for k, v in constexprs.items() if k in kernel.arg_names}
            sig = _signature(kernel, dtype, constexprs)
            names = list(sig)
            src = ASTSource(
                fn=kernel,
                signature=sig,
                constexprs={(names.index(k),): v for k, v in constexprs.items()},
                attrs={
                    (i,): [["tt.divisibility", 16]] for i, k in enumerate(names) if sig[k].startswith("*") or k in _ALIGNED_INTS
                },
            )
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=cfg.launch_options())
            regs, spills = _ptxas_report(compiled.asm["ptx"], arch)
            reports.append(KernelReport(name, support, compiled.metadata.shared, regs, spills))
    return reports


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m snowcat.kernels.compile_check", description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x10: 80 (A100), 90 (H100/H200/GH200)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    args = p.parse_args(argv)
    dtype = {v: k for k, v in _TRITON_DTYPES.items()}[args.dtype]
    print(f"sm_{args.arch} {args.dtype} {tf.tile_config(dtype)}")
    for r in compile_kernels(args.arch, dtype):
        print(
            f"{r.kernel:<9} support={'yes' if r.support else 'no ':<3} shared={r.shared_bytes // 1024:>4} KiB "
            f"registers={r.registers} spilled={r.spill_bytes} B"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
