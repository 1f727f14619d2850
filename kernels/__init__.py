"""snowcat kernels: fused linear -> per-token logprob and entropy, never materialising [N, V] logits.

The math, the support format and the backend choice are in docs/kernels.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from snowcat.kernels.reference import linear_logprob_entropy_reference
from snowcat.pipeline.errors import UserError

BACKENDS = ("auto", "reference", "triton")


def _check_inputs(h, weight, targets, temperature, support, backend, chunk_size):
    if backend not in BACKENDS:
        raise UserError(f"kernels: backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if not temperature > 0:
        raise UserError(f"kernels: temperature must be > 0, got {temperature!r}")
    if chunk_size is not None and chunk_size < 1:
        raise UserError(f"kernels: chunk_size must be >= 1, got {chunk_size!r}")
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise ValueError(f"kernels: need h [N, H] and weight [V, H], got {tuple(h.shape)} and {tuple(weight.shape)}")
    if h.dtype != weight.dtype or h.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"kernels: h and weight must share one of fp32/bf16/fp16, got {h.dtype} and {weight.dtype}")
    if targets.shape != (h.shape[0],) or targets.dtype != torch.int64:
        raise ValueError(f"kernels: targets must be int64 [{h.shape[0]}], got {targets.dtype} {tuple(targets.shape)}")
    if support is not None and (support.dim() != 2 or support.shape[0] != h.shape[0] or support.dtype != torch.int64):
        raise ValueError(f"kernels: support must be int64 [N, K] padded with -1, got {support.dtype} {tuple(support.shape)}")


def linear_logprob_entropy(
    h: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    support: Tensor | None = None,
    backend: str = "auto",
    chunk_size: int | None = None,
    tp_group=None,
) -> tuple[Tensor, Tensor]:
    """(logprob [N] fp32, entropy [N] fp32). backend: auto|reference|triton. auto = triton on CUDA, else reference.

    h [N, H] and weight [V, H] (or this rank's vocabulary shard when tp_group is given); targets [N]
    int64, negative = ignored (logprob 0, no gradient from it); support [N, K] int64 global token ids
    padded with -1: the distribution is softmax(h W^T / T) renormalised over those ids.
    chunk_size: tokens per chunk (reference) or vocabulary ids per backward chunk (triton).
    tp_group: weight holds rows [r*V/P, (r+1)*V/P) on rank r; h, targets, support are replicated.
    """
    _check_inputs(h, weight, targets, temperature, support, backend, chunk_size)
    if backend == "auto":
        backend = "triton" if h.is_cuda else "reference"
    if backend == "triton":
        from snowcat.kernels.triton_fused import linear_logprob_entropy_triton  # noqa: PLC0415 (Triton: optional, GPU)

        return linear_logprob_entropy_triton(h, weight, targets, temperature, support, chunk_size, tp_group)

    return linear_logprob_entropy_reference(h, weight, targets, temperature, support, chunk_size, tp_group)
