"""The Triton kernels against fp32 autograd on full logits: on a GPU when there is one, otherwise on
CPU under TRITON_INTERPRET=1.  Triton reads that variable when it is imported (its own library
functions are decorated then), so on CPU these tests re-run themselves in a subprocess with it set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import snowcat.kernels.triton_fused as module
from snowcat import kernels
from snowcat.kernels import linear_logprob_entropy
from snowcat.kernels.compile_check import compile_kernels
from snowcat.kernels.reference import support_mask
from snowcat.kernels.triton_fused import tile_config
from tests.test_kernels import assert_close_all, make_problem, run_tp, run_with_grads, truth

pytest.importorskip("triton")

ON_GPU = torch.cuda.is_available()
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = pytest.mark.skipif(
    not (ON_GPU or INTERPRETING), reason="runs in the TRITON_INTERPRET=1 subprocess (test_under_interpreter)"
)


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU or INTERPRETING, reason="kernels run directly here")
def test_under_interpreter():
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            __file__,
            "-m",
            "not gpu",
            "-k",
            "not test_under_interpreter and not compile_for_gpus",
        ],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
    )  # under pytest-timeout 900
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1]


@pytest.fixture(scope="module")
def triton_fused():
    assert module.INTERPRETED == (not ON_GPU)
    return module


def device_problem_from(*tensors):
    dev = "cuda" if ON_GPU else "cpu"
    return [t.to(dev) if t is not None else None for t in tensors]


def device_problem(**kw):
    return device_problem_from(*make_problem(**kw))


def run_triton(module, problem, temperature, chunk_size):
    h, w, y, support, g_lp, g_ent = problem
    fn = module.linear_logprob_entropy_triton
    return run_with_grads(
        lambda *a, **k: fn(*a, temperature=temperature, chunk_size=chunk_size, **k), h, w, y, support, g_lp, g_ent
    )


def expected(problem, temperature):
    return [t.cpu() for t in truth(*[t.cpu() if t is not None else None for t in problem], temperature)]


@needs_kernels
@pytest.mark.parametrize("temperature,support_k", [(1.0, 0), (0.7, 0), (1.3, 7)])
def test_triton_fp32(triton_fused, temperature, support_k):
    # vocab 50 with 16-wide tiles and chunks of 16 exercises ragged tiles, V splits and chunking.
    problem = device_problem(n=37, hdim=24, vocab=50, support_k=support_k)
    got = [t.cpu() for t in run_triton(triton_fused, problem, temperature, chunk_size=16)]
    assert_close_all(got, expected(problem, temperature), atol=3e-5, rtol=1e-4)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_low_precision(triton_fused, dtype):
    problem = device_problem(n=37, hdim=24, vocab=50, dtype=dtype, support_k=6)
    got = [t.cpu() for t in run_triton(triton_fused, problem, 0.8, chunk_size=32)]
    assert got[2].dtype == dtype and got[3].dtype == dtype
    want = expected(problem, 0.8)
    # Statistics stay fp32; gradients pass through one dz rounding and come out in bf16/fp16.
    assert_close_all(got[:2], want[:2], atol=1e-4, rtol=1e-4)
    for g, e in zip(got[2:], want[2:]):
        assert (g.double() - e).abs().max() <= 2e-2 * e.abs().max()


@needs_kernels
def test_triton_underflowing_target_probability(triton_fused):
    h, w, _, support, g_lp, g_ent = make_problem(n=12, vocab=40, support_k=30)
    w = w * 60  # logit gaps of hundreds: p_y underflows, d logprob/dz_y stays 1
    y = (h @ w.T).masked_fill(support_mask(support, 0, 40).logical_not(), float("inf")).argmin(1)
    problem = device_problem_from(h, w, y, support, g_lp, g_ent)
    got = [t.cpu() for t in run_triton(triton_fused, problem, 1.0, chunk_size=None)]
    assert (got[0] < -100).sum() >= 8
    assert_close_all(got, expected(problem, 1.0), atol=1e-3, rtol=1e-4)


@needs_kernels
def test_support_bits_match_bool_mask(triton_fused):
    _, _, _, support, _, _ = make_problem(n=20, vocab=50, support_k=9)
    support[0, :3] = torch.tensor([4, 4, 4])  # duplicates must still set one bit
    for start, rows in ((0, 50), (16, 20)):  # the whole vocabulary and one TP shard of it
        bits = triton_fused.support_bits(support, start, rows)
        unpacked = ((bits[:, :, None].int() >> torch.arange(8)) & 1).flatten(1)[:, :rows].bool()
        assert torch.equal(unpacked, support_mask(support, start, rows))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU or INTERPRETING, reason="needs a CUDA GPU (the compiled kernels, not the interpreter)")
@pytest.mark.parametrize("dtype,support_k", [(torch.bfloat16, 0), (torch.bfloat16, 40), (torch.float32, 0)])
def test_triton_on_cuda_with_production_tiles(triton_fused, dtype, support_k):
    """The compiled kernels at a size spanning many production tiles (128 x 128 in bf16, 64 x 64 in fp32;
    the tests above fit in one), and `auto` choosing them for CUDA tensors."""
    problem = device_problem(n=300, hdim=128, vocab=1000, dtype=dtype, support_k=support_k)
    got = [t.cpu() for t in run_triton(triton_fused, problem, 0.9, chunk_size=None)]
    want = expected(problem, 0.9)
    assert_close_all(got[:2], want[:2], atol=2e-4, rtol=1e-4)  # statistics in fp32
    for g, e in zip(got[2:], want[2:]):
        assert (g.double() - e).abs().max() <= 2e-2 * e.abs().max()  # gradients in the input dtype
    h, w, y, support, _, _ = problem
    auto = linear_logprob_entropy(h, w, y, temperature=0.9, support=support)
    torch.testing.assert_close([t.cpu() for t in auto], got[:2], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(INTERPRETING, reason="compiles the real kernels (no GPU needed)")
@pytest.mark.parametrize("arch,shared_limit", [(80, 163 << 10), (90, 227 << 10)])  # A100; H100/H200/GH200
def test_kernels_compile_for_gpus_pipelined_without_spills(arch, shared_limit):
    cfg = tile_config(torch.bfloat16)
    one_stage = (cfg.block_n + cfg.block_v) * cfg.block_h * 2  # an h tile and a W tile, bf16
    reports = compile_kernels(arch, torch.bfloat16)
    assert {(r.kernel, r.support) for r in reports} == {(k, s) for k in ("forward", "backward") for s in (False, True)}
    for r in reports:
        assert r.spill_bytes == 0, r
        assert 2 * one_stage <= r.shared_bytes <= shared_limit, r  # loads software-pipelined, fits the SM


@pytest.mark.skipif(not INTERPRETING, reason="two gloo ranks on CPU tensors: interpreter only")
def test_tensor_parallel_triton_two_gloo_ranks(tmp_path):
    run_tp("triton", tmp_path)  # spawned ranks inherit TRITON_INTERPRET=1


def test_auto_backend_picks_reference_on_cpu(monkeypatch):
    calls = []
    real = kernels.linear_logprob_entropy_reference
    # the dispatcher calls the name it imported from kernels.reference
    monkeypatch.setattr(kernels, "linear_logprob_entropy_reference", lambda *a, **k: calls.append(1) or real(*a, **k))
    h, w, y, _, _, _ = make_problem()
    kernels.linear_logprob_entropy(h, w, y)
    assert calls == [1]
