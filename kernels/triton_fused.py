"""Triton fused linear -> (logprob, entropy): online log-sum-exp over vocabulary tiles.

Forward: one kernel; each program owns BLOCK_N tokens and a slice of the vocabulary ("split"), runs
h @ W_tile^T on tensor cores (bf16/fp16 in, fp32 accumulate) and folds each tile into running
(max, sum exp, sum exp*z, target logit).  The few splits per token are merged in torch; no atomics.
Backward: over vocabulary chunks, a kernel recomputes the chunk's logits and writes dL/dlogits
[N, chunk] in the input dtype; cuBLAS then gives dW[chunk] = dz^T h exactly (no accumulation across
chunks) and dh += dz W[chunk] into an fp32 [N, H] buffer.  FLOPs: 8·N·H·V (the recompute costs one
extra matmul over the 6·N·H·V floor; exact gradients for arbitrary per-token upstream grads need it).

TRITON_INTERPRET=1 (read when this module is imported) runs the kernels on CPU tensors; triton 3.9's
interpreter multiplies bf16 operands of tl.dot as raw uint16 bits, so there they are upcast to fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from snowcat.kernels.reference import combine_stats, finish_outputs, local_targets, support_mask, vocab_shard


@triton.jit
def _scaled_logits(
    h_ptr,
    w_ptr,
    row0,
    col0,
    n_rows,
    n_cols,
    hdim,
    inv_t,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """z tile = h[row0:+BLOCK_N] @ W[col0:+BLOCK_V]^T / T, fp32 accumulation (rows >= n_rows etc. are 0)."""
    r = tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_V)
    k = tl.arange(0, BLOCK_H)
    r_ok = (row0 + r) < n_rows
    c_ok = (col0 + c) < n_cols
    # 64-bit tile base, 32-bit offsets inside the tile: fewer registers than 64-bit index tensors.
    a_ptrs = h_ptr + row0.to(tl.int64) * hdim + (r[:, None] * hdim + k[None, :])
    b_ptrs = w_ptr + col0.to(tl.int64) * hdim + (c[:, None] * hdim + k[None, :])
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, hdim, BLOCK_H):
        k_ok = (k0 + k) < hdim
        a = tl.load(a_ptrs, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=c_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
        a_ptrs += BLOCK_H
        b_ptrs += BLOCK_H
    return acc * inv_t


@triton.jit
def _kept(bits_ptr, row0, col0, n_rows, n_cols, nbytes, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, HAS_SUPPORT: tl.constexpr):
    """Which (token, id) pairs of the tile are valid and in the support: bit (id % 8) of bits[token, id // 8].

    col0 is a multiple of 8, so the tile reads BLOCK_V / 8 whole bytes per token and unpacks them.
    """
    r = row0 + tl.arange(0, BLOCK_N)
    c = col0 + tl.arange(0, BLOCK_V)
    ok = (r < n_rows)[:, None] & (c < n_cols)[None, :]
    if HAS_SUPPORT:
        b = col0 // 8 + tl.arange(0, BLOCK_V // 8)
        byte = tl.load(
            bits_ptr + r.to(tl.int64)[:, None] * nbytes + b[None, :], mask=(r < n_rows)[:, None] & (b < nbytes)[None, :], other=0
        )
        bit = (byte.to(tl.int32)[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1
        ok = ok & (tl.reshape(bit, (BLOCK_N, BLOCK_V)) != 0)
    return ok


@triton.jit
def _fwd_stats_kernel(
    h_ptr,
    w_ptr,
    y_ptr,
    bits_ptr,
    stats_ptr,
    n_rows,
    vocab,
    hdim,
    nbytes,
    inv_t,
    tiles_per_split,
    HAS_SUPPORT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Splits of one token block are adjacent in launch order: programs running together share
    # their h block (and few W tiles), so both stay in L2 while W streams through once per wave.
    split = tl.program_id(0)
    pid_n = tl.program_id(1)
    n_splits = tl.num_programs(0)
    row0 = pid_n * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1)  # local target id, -1 if not on this shard
    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a = tl.zeros((BLOCK_N,), dtype=tl.float32)
    zy = tl.zeros((BLOCK_N,), dtype=tl.float32)
    t0 = split * tiles_per_split
    n_tiles = tl.minimum(t0 + tiles_per_split, tl.cdiv(vocab, BLOCK_V)) - t0
    k_steps = tl.cdiv(hdim, BLOCK_H)
    r = tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_V)
    k = tl.arange(0, BLOCK_H)
    a_base = h_ptr + row0.to(tl.int64) * hdim + (r[:, None] * hdim + k[None, :])
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    # One flat loop over (vocab tile, H step) so the compiler software-pipelines the loads across
    # tile boundaries (a nested inner loop would drain the pipeline at every tile).
    for it in range(0, n_tiles * k_steps):
        col0 = (t0 + it // k_steps) * BLOCK_V
        k0 = (it % k_steps) * BLOCK_H
        k_ok = (k0 + k) < hdim
        h_tile = tl.load(a_base + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_tile = tl.load(
            w_ptr + col0.to(tl.int64) * hdim + (c[:, None] * hdim + k[None, :]) + k0,
            mask=((col0 + c) < vocab)[:, None] & k_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            h_tile = h_tile.to(tl.float32)
            w_tile = w_tile.to(tl.float32)
        acc = tl.dot(h_tile, tl.trans(w_tile), acc, input_precision=PRECISION)
        if it % k_steps == k_steps - 1:  # tile complete: fold it into the running statistics
            cols = col0 + c
            kept = _kept(bits_ptr, row0, col0, n_rows, vocab, nbytes, BLOCK_N, BLOCK_V, HAS_SUPPORT)
            z = tl.where(kept, acc * inv_t, float("-inf"))
            m_new = tl.maximum(m, tl.max(z, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing kept yet
            alpha = tl.exp(m - m_ref)
            e = tl.exp(z - m_ref[:, None])
            s = s * alpha + tl.sum(e, 1)
            a = a * alpha + tl.sum(e * tl.where(kept, z, 0.0), 1)
            # -inf when the target is outside the support: its logprob is then -inf, as it should be.
            zy += tl.sum(tl.where(cols[None, :] == y[:, None], z, 0.0), 1)
            m = m_new
            acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    out = stats_ptr + split.to(tl.int64) * n_rows + rows
    stride = n_splits * n_rows
    tl.store(out, m, mask=row_ok)
    tl.store(out + stride, s, mask=row_ok)
    tl.store(out + 2 * stride, a, mask=row_ok)
    tl.store(out + 3 * stride, zy, mask=row_ok)


@triton.jit
def _grad_logits_kernel(
    h_ptr,
    w_ptr,
    y_ptr,
    bits_ptr,
    lse_ptr,
    ez_ptr,
    glp_ptr,
    gent_ptr,
    dz_ptr,
    n_rows,
    v0,
    v_chunk,
    hdim,
    nbytes,
    inv_t,
    HAS_SUPPORT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GROUP_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Grouped launch order: GROUP_N token blocks sweep the chunk together, so W tiles hit in L2.
    pid = tl.program_id(0)
    blocks_n = tl.cdiv(n_rows, BLOCK_N)
    blocks_v = tl.cdiv(v_chunk, BLOCK_V)
    per_group = GROUP_N * blocks_v
    first_n = (pid // per_group) * GROUP_N
    group_n = tl.minimum(blocks_n - first_n, GROUP_N)
    pid_n = first_n + (pid % per_group) % group_n
    pid_v = (pid % per_group) // group_n

    row0 = pid_n * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    local = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = v0 + local
    col_ok = local < v_chunk
    col0 = v0 + pid_v * BLOCK_V
    z = _scaled_logits(h_ptr, w_ptr, row0, col0, n_rows, v0 + v_chunk, hdim, inv_t, BLOCK_N, BLOCK_V, BLOCK_H, UPCAST, PRECISION)
    kept = _kept(bits_ptr, row0, col0, n_rows, v0 + v_chunk, nbytes, BLOCK_N, BLOCK_V, HAS_SUPPORT)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    ez = tl.load(ez_ptr + rows, mask=row_ok, other=0.0)
    g_lp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)
    g_ent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
    p = tl.exp(tl.where(kept, z - lse[:, None], float("-inf")))  # dropped ids may exceed lse: no overflow
    # d logprob/dz = onehot(y) - p ; d entropy/dz = p * (E_p[z] - z)
    dz = p * (g_ent[:, None] * (ez[:, None] - z) - g_lp[:, None])
    dz += tl.where(kept & (cols[None, :] == y[:, None]), g_lp[:, None], 0.0)
    dz = dz * inv_t
    tl.store(
        dz_ptr + rows.to(tl.int64)[:, None] * v_chunk + local[None, :],
        dz.to(dz_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


INTERPRETED = not isinstance(_fwd_stats_kernel, triton.runtime.JITFunction)


@dataclass(frozen=True)
class TileConfig:
    block_n: int
    block_v: int
    block_h: int
    group_n: int = 8
    num_warps: int = 8
    num_stages: int = 3
    target_programs: int = 528  # forward: at least ~4 programs per H200 SM (132) ...
    min_splits: int = 8  # ... and at least 8 vocabulary splits per token block (see the kernel)

    def launch_options(self) -> dict:
        # FMA contraction stated explicitly: Triton 3.10 changes its default (and 3.9 warns).
        return {"num_warps": self.num_warps, "num_stages": self.num_stages, "enable_fp_fusion": True}


def tile_config(dtype: torch.dtype) -> TileConfig:
    if INTERPRETED:  # every program is numpy on one CPU core: smallest legal tiles
        return TileConfig(16, 16, 16, group_n=2, target_programs=4, min_splits=2)
    if dtype == torch.float32:
        return TileConfig(64, 64, 32, num_warps=4, num_stages=2)
    return TileConfig(128, 128, 64)


def support_bits(support: torch.Tensor, vocab_start: int, vocab_rows: int, chunk_elems: int = 1 << 26) -> torch.Tensor:
    """uint8 [N, ceil(V_local/8)] bitmask of the kept ids: N·V/8 bytes instead of an N·V bool mask.

    Packed from bool masks a few rows at a time (no scatter_add: it has no deterministic CUDA kernel).
    """
    n = support.shape[0]
    nbytes = triton.cdiv(vocab_rows, 8)
    bits = torch.empty(n, nbytes, dtype=torch.uint8, device=support.device)
    shifts = torch.arange(8, dtype=torch.uint8, device=support.device)
    rows = max(1, chunk_elems // (nbytes * 8))
    for lo in range(0, n, rows):
        mask = support_mask(support[lo : lo + rows], vocab_start, vocab_rows)
        mask = torch.nn.functional.pad(mask, (0, nbytes * 8 - vocab_rows))
        bits[lo : lo + rows] = (mask.view(-1, nbytes, 8).to(torch.uint8) << shifts).sum(-1, dtype=torch.uint8)
    return bits


def _kernel_targets(targets, vocab_start, vocab_rows):
    y_local, y_here = local_targets(targets, vocab_start, vocab_rows)
    return torch.where(y_here, y_local, -1).contiguous()


def _precision(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"  # only fp32 inputs read this


class _TritonFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, support, inv_t, v_chunk, tp_group):
        h, weight = h.contiguous(), weight.contiguous()
        start, rows = vocab_shard(weight, tp_group)
        n, hdim = h.shape
        cfg = tile_config(h.dtype)
        y = _kernel_targets(targets, start, rows)
        bits = support_bits(support, start, rows) if support is not None else y  # y: unused placeholder
        blocks_n = triton.cdiv(n, cfg.block_n)
        tiles = triton.cdiv(rows, cfg.block_v)
        want = max(cfg.min_splits, triton.cdiv(cfg.target_programs, blocks_n))
        per_split = triton.cdiv(tiles, min(tiles, want))
        splits = triton.cdiv(tiles, per_split)
        stats = torch.empty(4, splits, n, dtype=torch.float32, device=h.device)
        _fwd_stats_kernel[(splits, blocks_n)](
            h,
            weight,
            y,
            bits,
            stats,
            n,
            rows,
            hdim,
            bits.shape[-1] if support is not None else 0,
            inv_t,
            per_split,
            HAS_SUPPORT=support is not None,
            BLOCK_N=cfg.block_n,
            BLOCK_V=cfg.block_v,
            BLOCK_H=cfg.block_h,
            UPCAST=INTERPRETED and h.dtype == torch.bfloat16,
            PRECISION=_precision(h.dtype),
            **cfg.launch_options(),
        )
        m, s, a, zy = stats
        m_top = m.max(0).values
        scale = torch.exp(m - torch.where(torch.isfinite(m_top), m_top, 0.0))
        lse, ez, zy = combine_stats(m_top, (s * scale).sum(0), (a * scale).sum(0), zy.sum(0), tp_group)
        ctx.save_for_backward(h, weight, targets, support, lse, ez)
        ctx.inv_t, ctx.v_chunk, ctx.tp_group = inv_t, v_chunk, tp_group
        return finish_outputs(lse, ez, zy, targets)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, weight, targets, support, lse, ez = ctx.saved_tensors
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        start, rows = vocab_shard(weight, ctx.tp_group)
        n, hdim = h.shape
        cfg = tile_config(h.dtype)
        y = _kernel_targets(targets, start, rows)
        bits = support_bits(support, start, rows) if support is not None else y
        g_lp = torch.where(targets >= 0, g_lp.float(), 0.0).contiguous()  # ignored targets: constant 0
        g_ent = g_ent.float().contiguous()
        # Whole tiles per chunk: the kernels read the support bitmask a byte (8 ids) at a time.
        v_chunk = (
            triton.cdiv(ctx.v_chunk, cfg.block_v) * cfg.block_v
            if ctx.v_chunk
            else default_vocab_chunk(n, rows, h.element_size(), cfg.block_v)
        )
        dz_buf = torch.empty(n * min(v_chunk, rows), dtype=h.dtype, device=h.device)
        dh = torch.zeros(n, hdim, dtype=torch.float32, device=h.device) if need_dh else None
        dw = torch.empty_like(weight) if need_dw else None
        for v0 in range(0, rows, v_chunk):
            vc = min(v_chunk, rows - v0)
            dz = dz_buf[: n * vc].view(n, vc)
            grid = (triton.cdiv(n, cfg.block_n) * triton.cdiv(vc, cfg.block_v),)
            _grad_logits_kernel[grid](
                h,
                weight,
                y,
                bits,
                lse,
                ez,
                g_lp,
                g_ent,
                dz,
                n,
                v0,
                vc,
                hdim,
                bits.shape[-1] if support is not None else 0,
                ctx.inv_t,
                HAS_SUPPORT=support is not None,
                BLOCK_N=cfg.block_n,
                BLOCK_V=cfg.block_v,
                BLOCK_H=cfg.block_h,
                GROUP_N=cfg.group_n,
                UPCAST=INTERPRETED and h.dtype == torch.bfloat16,
                PRECISION=_precision(h.dtype),
                **cfg.launch_options(),
            )
            if need_dw:
                torch.mm(dz.T, h, out=dw[v0 : v0 + vc])  # whole reduction over tokens in one GEMM
            if need_dh:
                dh += dz @ weight[v0 : v0 + vc]
        if need_dh and ctx.tp_group is not None:
            dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=ctx.tp_group)  # h is replicated over TP
        return (dh.to(h.dtype) if need_dh else None), dw, None, None, None, None, None


def default_vocab_chunk(n_tokens: int, vocab_rows: int, elem_size: int, block_v: int) -> int:
    """Vocabulary ids per backward chunk: keeps the [N, chunk] gradient-of-logits buffer near 256 MiB."""
    chunk = (256 << 20) // max(1, n_tokens * elem_size)
    return max(block_v, min(vocab_rows, chunk // block_v * block_v))


def linear_logprob_entropy_triton(h, weight, targets, temperature=1.0, support=None, chunk_size=None, tp_group=None):
    if not INTERPRETED and not h.is_cuda:
        raise ValueError("kernels: the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 before import)")
    if support is not None:
        support = support.contiguous()
    return _TritonFn.apply(h, weight, targets, support, 1.0 / temperature, chunk_size, tp_group)
