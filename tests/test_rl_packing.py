"""RL's padded rows are packed for the forward pass: the same logprobs, entropies, gradients and
routes as the padded forward, in the batch's own layout."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from snowcat.stages.model import PRESETS, MoEForCausalLM
from snowcat.stages.rlcore.objective import route_agreement, sampled_logprobs
from snowcat.stages.rollout import SamplingParams
from snowcat.stages.train.packing import Repacked

MICRO = PRESETS["test-micro"]


def test_repacked_rows_round_trip_and_keep_the_tokens_order():
    lengths = torch.tensor([5, 9, 2, 10, 1, 7, 3])
    T = 10
    x = torch.arange(len(lengths) * T).view(-1, T) + 1
    real = torch.arange(T)[None, :] < lengths[:, None]
    x = torch.where(real, x, 0)
    pack = Repacked.of(lengths, T)
    packed = pack.pack(x)
    assert packed.shape == (1, 37) and torch.equal(packed[0], x[real])  # no padding; row-major order kept
    assert torch.equal(pack.unpack(packed, 0), x)
    # a segment per padded row, positions as they were there
    assert torch.equal(pack.unpack(pack.segment_ids, -1)[real], torch.arange(len(lengths))[:, None].expand(-1, T)[real])
    assert torch.equal(pack.unpack(pack.position_ids, -1), torch.where(real, torch.arange(T), -1))
    routes = torch.arange(len(lengths) * T * 4).view(len(lengths), T, 4)  # trailing dimensions travel along
    assert torch.equal(pack.unpack(pack.pack(routes), -1)[real], routes[real])


def padded_batch(B=9, T=24, seed=0):
    """Right-padded rows of different lengths; a prompt (no target) before each row's sampled tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, T + 1, (B,), generator=g)
    lengths[0] = T  # one full row
    ids = torch.randint(1, MICRO.vocab_size, (B, T), generator=g)
    pos = torch.arange(T)[None, :]
    prompt = torch.randint(1, 4, (B, 1), generator=g)
    targets = torch.where((pos >= prompt) & (pos < lengths[:, None] - 1), ids.roll(-1, 1), -1)
    ids = torch.where(pos < lengths[:, None], ids, 0)
    layers = sum(MICRO.is_moe_layer(i) for i in range(MICRO.num_layers))
    routes = torch.randint(0, MICRO.num_experts, (B, T, layers * MICRO.experts_per_token), generator=g)
    routes[:, ::4] = -1  # some tokens route themselves
    routes = torch.where(pos[..., None] < lengths[:, None, None], routes, -1)
    return {"input_ids": ids, "targets": targets, "lengths": lengths, "routes": routes}


@pytest.mark.parametrize(
    "params,replay",
    [
        (SamplingParams(temperature=1.0, max_tokens=8), False),
        (SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=8), False),  # supports rebuilt row-major
        (SamplingParams(temperature=1.0, max_tokens=8), True),
    ],
)
def test_packed_forward_equals_the_padded_one(params, replay):
    torch.manual_seed(0)
    model = MoEForCausalLM(dataclasses.replace(MICRO, max_position_embeddings=64))
    batch = padded_batch()
    padded = {k: v for k, v in batch.items() if k != "lengths"}  # without lengths: the padded forward

    def run(b):
        model.zero_grad()
        logp, ent, out = sampled_logprobs(model, b, params, replay=replay)
        (logp * torch.linspace(0.5, 1.5, logp.numel()).view_as(logp)).sum().backward()
        return logp.detach(), ent.detach(), out, {n: p.grad.clone() for n, p in model.named_parameters()}

    lp, ent, out, grads = run(batch)
    lp_ref, ent_ref, out_ref, grads_ref = run(padded)
    sel = batch["targets"] >= 0
    assert sel.sum() > 50 and lp.shape == lp_ref.shape
    torch.testing.assert_close(lp[sel], lp_ref[sel], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(ent[sel], ent_ref[sel], atol=2e-5, rtol=1e-4)
    assert (lp[~sel] == 0).all()
    real = torch.arange(lp.shape[1])[None, :] < batch["lengths"][:, None]
    assert torch.equal(out.routes[real], out_ref.routes[real])
    agreement = route_agreement(out.routes, batch["routes"])
    assert agreement == route_agreement(out_ref.routes, batch["routes"])
    for n, g in grads_ref.items():
        if "router" in n or n.endswith("gate.weight"):  # the router losses are not part of this sum
            continue
        torch.testing.assert_close(grads[n], g, atol=1e-5, rtol=1e-4, msg=n)
