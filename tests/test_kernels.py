"""Fused linear -> logprob/entropy: the chunked reference against plain fp32 autograd on full logits."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from snowcat.kernels import linear_logprob_entropy
from snowcat.kernels.reference import materialised_reference, support_mask
from snowcat.pipeline.errors import UserError


def make_problem(n=37, hdim=16, vocab=50, dtype=torch.float32, support_k=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, hdim, generator=gen) * 0.7).to(dtype)
    w = (torch.randn(vocab, hdim, generator=gen) * 0.7).to(dtype)
    y = torch.randint(0, vocab, (n,), generator=gen)
    y[3] = -100  # an ignored (padding) position
    support = None
    if support_k:
        support = torch.full((n, support_k), -1, dtype=torch.int64)
        for i in range(n):
            k = int(torch.randint(1, support_k + 1, (1,), generator=gen))
            ids = torch.randperm(vocab, generator=gen)[:k]
            if y[i] >= 0 and not (ids == y[i]).any():
                ids[0] = y[i]  # the sampled token is always inside the sampler's support
            support[i, :k] = ids
    g_lp = torch.randn(n, generator=gen)
    g_ent = torch.randn(n, generator=gen)
    return h, w, y, support, g_lp, g_ent


def run_with_grads(fn, h, w, y, support, g_lp, g_ent, **kw):
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    logp, ent = fn(h, w, y, support=support, **kw)
    (logp * g_lp + ent * g_ent).sum().backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def truth(h, w, y, support, g_lp, g_ent, temperature):
    return run_with_grads(
        lambda *a, **k: materialised_reference(*a, temperature=temperature, **k),
        h.double(),
        w.double(),
        y,
        support,
        g_lp.double(),
        g_ent.double(),
    )


def assert_close_all(got, want, atol, rtol):
    for name, g, e in zip(("logprob", "entropy", "dh", "dW"), got, want):
        torch.testing.assert_close(g.double(), e.double(), atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("support_k", [0, 7])
def test_reference_matches_materialised_fp32(temperature, support_k):
    h, w, y, support, g_lp, g_ent = make_problem(support_k=support_k)
    got = run_with_grads(
        linear_logprob_entropy, h, w, y, support, g_lp, g_ent, temperature=temperature, backend="reference", chunk_size=8
    )
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert got[0][3] == 0  # ignored target
    assert_close_all(got, truth(h, w, y, support, g_lp, g_ent, temperature), atol=2e-5, rtol=1e-4)


def test_target_with_underflowing_probability_keeps_its_gradient():
    # Logit gaps of hundreds: p_y underflows to 0 in fp32, yet d logprob/dz_y = 1 - p_y = 1.
    h, w, _, support, g_lp, g_ent = make_problem(n=12, vocab=40, support_k=30)
    w = w * 60
    y = (h @ w.T).masked_fill(support_mask(support, 0, 40).logical_not(), float("inf")).argmin(1)
    got = run_with_grads(linear_logprob_entropy, h, w, y, support, g_lp, g_ent, backend="reference")
    want = truth(h, w, y, support, g_lp, g_ent, 1.0)
    assert (got[0] < -100).sum() >= 8  # (a token keeping a single id has logprob 0)
    assert_close_all(got, want, atol=1e-3, rtol=1e-4)


def test_truncated_support_renormalises():
    h, w, y, support, _, _ = make_problem(support_k=5)
    logp, ent = linear_logprob_entropy(h, w, y, support=support, backend="reference")
    full_logp, full_ent = linear_logprob_entropy(h, w, y, backend="reference")
    kept = y >= 0
    # Renormalising over fewer ids can only raise the sampled token's logprob.
    assert (logp[kept] >= full_logp[kept] - 1e-6).all()
    assert (logp[kept] > full_logp[kept]).any()
    one_id = (support >= 0).sum(1) == 1
    assert one_id.any() and torch.allclose(ent[one_id], torch.zeros(int(one_id.sum())), atol=1e-6)
    assert (ent <= torch.log((support >= 0).sum(1).float()) + 1e-5).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_low_precision_inputs(dtype):
    h, w, y, support, g_lp, g_ent = make_problem(dtype=dtype, support_k=6)
    got = run_with_grads(
        linear_logprob_entropy, h, w, y, support, g_lp, g_ent, temperature=0.8, backend="reference", chunk_size=10
    )
    assert got[2].dtype == dtype and got[3].dtype == dtype
    # Ground truth from the same rounded inputs; the grads are rounded to bf16/fp16 on the way out.
    assert_close_all(got, truth(h, w, y, support, g_lp, g_ent, 0.8), atol=2e-2, rtol=2e-2)


class _RecordShapes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_reference_never_allocates_n_by_v():
    n, vocab, chunk = 64, 300, 8
    h, w, y, _, g_lp, g_ent = make_problem(n=n, hdim=4, vocab=vocab)
    h.requires_grad_()
    w.requires_grad_()
    with _RecordShapes() as rec:
        logp, ent = linear_logprob_entropy(h, w, y, backend="reference", chunk_size=chunk)
        (logp * g_lp + ent * g_ent).sum().backward()
    # Largest tensor is a chunk of logits (or the weight and its gradient), never n x vocab.
    assert rec.largest == max(chunk * vocab, w.numel())
    assert rec.largest < n * vocab


def tp_worker(rank, world, init_file, backend):
    """One rank of a vocabulary-parallel LM head: holds rows [rank*V/P, (rank+1)*V/P) of W."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # Full vocabulary, then support ids spread over both shards (some tokens keep one shard's only).
        for support_k in (0, 5):
            h, w, y, support, g_lp, g_ent = make_problem(n=29, hdim=12, vocab=48, support_k=support_k, seed=3)
            rows = w.shape[0] // world
            shard = w[rank * rows : (rank + 1) * rows]
            fn = lambda *a, **k: linear_logprob_entropy(  # noqa: E731
                *a, temperature=0.9, backend=backend, chunk_size=16, tp_group=dist.group.WORLD, **k
            )
            got = run_with_grads(fn, h, shard, y, support, g_lp, g_ent)
            want = list(truth(h, w, y, support, g_lp, g_ent, 0.9))
            want[3] = want[3][rank * rows : (rank + 1) * rows]
            assert_close_all(got, want, atol=3e-5, rtol=1e-4)
    finally:
        dist.destroy_process_group()


def run_tp(backend, tmp_path):
    mp.spawn(tp_worker, args=(2, str(tmp_path / "rendezvous"), backend), nprocs=2)


@pytest.mark.slow
def test_tensor_parallel_reference_two_gloo_ranks(tmp_path):
    run_tp("reference", tmp_path)


def test_bad_arguments():
    h, w, y, _, _, _ = make_problem()
    with pytest.raises(UserError, match="temperature"):
        linear_logprob_entropy(h, w, y, temperature=0.0)
    with pytest.raises(UserError, match="backend"):
        linear_logprob_entropy(h, w, y, backend="cuda")
    with pytest.raises(ValueError, match="targets"):
        linear_logprob_entropy(h, w, y.int())
