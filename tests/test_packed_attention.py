"""Packed rows attend within each document without a T×T mask; activation checkpointing changes nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from snowcat.stages.model import PRESETS, MoEForCausalLM
from snowcat.stages.model.attention import Documents, document_attention
from snowcat.stages.train.loss import sft_loss
from snowcat.stages.train.packing import Example, pack_rows

MICRO = PRESETS["test-micro"]
# documents of different lengths; 40-token rows leave padding (segment -1) in some of them
LENGTHS = [12, 7, 20, 3, 9, 25, 16]


def make(seed=0, **changes):
    torch.manual_seed(seed)
    return MoEForCausalLM(dataclasses.replace(MICRO, **changes))


def packed_batch(lengths=LENGTHS, seq_len=40, vocab=MICRO.vocab_size, seed=1):
    g = torch.Generator().manual_seed(seed)
    docs = [Example(torch.randint(0, vocab, (n,), generator=g).tolist(), [1] * n) for n in lengths]
    return pack_rows(docs, seq_len, pad_id=0)


def dense_document_mask(segment_ids):
    """The construction the model used before: a [B, 1, T, T] block-diagonal causal mask."""
    T = segment_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return ((segment_ids[:, :, None] == segment_ids[:, None, :]) & causal).unsqueeze(1)


def test_documents_are_runs_of_equal_segment_ids_padding_included():
    seg = torch.tensor([[0, 0, 0, 1, 1, -1], [0, 0, 0, 0, 0, 0]])
    docs = Documents.from_segments(seg)
    assert docs.bounds == (0, 3, 5, 6, 12)  # a row's start always starts a document
    assert docs.cu_seqlens.dtype == torch.int32 and docs.max_len == 6


# short documents (padded into batches) and long ones (batched with their equals, unpadded)
@pytest.mark.parametrize("lengths,seq_len", [(LENGTHS, 40), ([300, 30, 300, 45, 2], 700)])
def test_document_attention_equals_sdpa_with_the_dense_mask_forward_and_backward(lengths, seq_len):
    batch = packed_batch(lengths, seq_len)
    seg = batch["segment_ids"]
    B, T = seg.shape
    assert (seg == -1).any() and (seg.max(dim=1).values >= 2).any()  # padding, rows of several documents
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, T, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_document_mask(seg), enable_gqa=True)
    # tokens first, flattened over rows: the layout of the packed path
    flat = [t.transpose(1, 2).reshape(B * T, t.shape[1], 8) for t in (q, k, v)]
    out = document_attention(*flat, Documents.from_segments(seg)).view(B, T, 4, 8).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    w = torch.randn(ref.shape, generator=g)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_packed_rows_equal_each_document_run_alone_logprobs_and_gradients():
    batch = packed_batch()
    model = make()
    seg = batch["segment_ids"]
    out = model(batch["input_ids"], segment_ids=seg, targets=batch["targets"])
    (out.logprobs * (batch["targets"] >= 0)).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    documents = 0
    for r in range(seg.shape[0]):
        for s in range(int(seg[r].max()) + 1):
            at = (seg[r] == s).nonzero().squeeze(1)
            ids = batch["input_ids"][r, at][None]
            alone = model(ids, targets=torch.cat([ids[:, 1:], ids.new_full((1, 1), -1)], dim=1))
            alone.logprobs[:, :-1].sum().backward()  # grads accumulate: the sum over documents
            torch.testing.assert_close(out.hidden[r, at], alone.hidden[0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(out.logprobs[r, at[:-1]], alone.logprobs[0, :-1], atol=1e-5, rtol=1e-4)
            documents += 1
    assert documents == len(LENGTHS)
    for n, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)


class LargestTensors(TorchDispatchMode):
    """Records every op whose output holds at least `limit` elements (autograd's backward ops too:
    the engine carries the mode into its threads)."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.seen = limit, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() >= self.limit:
                self.seen.append((str(func), tuple(t.shape)))
        return out


T_LONG = 2048
LONG = dict(vocab_size=64, hidden_size=16, num_heads=4, num_kv_heads=2, head_dim=8, moe_intermediate_size=16)


def long_packed_batch():
    # the longest document is big enough that attention scores over it alone (heads·L² > T²) would be caught
    batch = packed_batch(lengths=[1400, 300, 200, 100], seq_len=T_LONG, vocab=LONG["vocab_size"])
    assert (batch["segment_ids"] == -1).sum() == 48
    return batch


def test_the_recorder_catches_the_dense_mask_construction():
    batch = long_packed_batch()
    with LargestTensors(T_LONG * T_LONG) as rec:
        dense_document_mask(batch["segment_ids"])
    assert rec.seen  # so the test below can fail


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_forward_and_backward_allocate_nothing_t_by_t(checkpointing):
    batch = long_packed_batch()
    model = make(**LONG)
    model.set_activation_checkpointing(checkpointing)
    with LargestTensors(T_LONG * T_LONG) as rec:
        loss, _ = sft_loss(model, batch, num_tokens_total=T_LONG, num_micro=1)
        loss.backward()
    assert rec.seen == []
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("replay", [False, True])
def test_activation_checkpointing_gives_the_same_loss_gradients_and_router_outputs(replay):
    batch = packed_batch()
    model = make()
    routes = None
    if replay:  # forced experts travel through the checkpointed call; some tokens route themselves
        with torch.no_grad():
            routes = (model(batch["input_ids"], segment_ids=batch["segment_ids"]).routes + 1) % MICRO.num_experts
        routes = routes.reshape(*routes.shape[:2], -1)
        routes[:, ::3] = -1

    def step(on):
        model.zero_grad()
        model.set_activation_checkpointing(on)
        out = model(batch["input_ids"], segment_ids=batch["segment_ids"], targets=batch["targets"], routes=routes)
        loss = -(out.logprobs * (batch["targets"] >= 0)).sum() + out.aux_loss + out.z_loss
        loss.backward()
        return loss.detach(), out, {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, out, grads = step(False)
    loss_ckpt, out_ckpt, grads_ckpt = step(True)
    torch.testing.assert_close(loss_ckpt, loss, atol=0, rtol=0)
    assert torch.equal(out_ckpt.routes, out.routes)
    for key in ("expert_load", "dropped_fraction", "aux_loss", "z_loss"):
        torch.testing.assert_close(out_ckpt.router_stats[key], out.router_stats[key], atol=0, rtol=0)
    for n, g in grads.items():
        torch.testing.assert_close(grads_ckpt[n], g, atol=1e-6, rtol=1e-5, msg=n)
