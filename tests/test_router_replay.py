"""Router replay: the torch engine records the experts every token was routed to, trajectories carry
them (through the transport's typed buffers), and the trainer can route each token to exactly
those experts. The trainer here runs in bf16 against an fp32 engine, as on a GPU, on a MoE whose
router is nearly indifferent, so the two disagree on routing often: replay removes that disagreement
and the part of the logprob gap it caused (the rest is bf16 arithmetic elsewhere)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from snowcat.pipeline.config import stage_config
from snowcat.pipeline.errors import UserError
from snowcat.stages.agent import Trajectory, pack, unpack
from snowcat.stages.algorithms import PolicyLossConfig
from snowcat.stages.model import PRESETS, MoEForCausalLM
from snowcat.stages.rlcore.objective import make_batch, make_loss_fn, route_agreement, sampled_logprobs
from snowcat.stages.rollout import SamplingParams, TorchEngine

PARAMS = SamplingParams(temperature=1.0, max_tokens=10)


@pytest.fixture(scope="module")
def rollout():
    torch.manual_seed(0)
    model = MoEForCausalLM(PRESETS["test-micro"]).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # experts' router rows nearly equal: top-k choices sit close to ties
            w = layer.mlp.gate.weight
            w.copy_(w.mean(dim=0, keepdim=True) + 0.01 * (w - w.mean(dim=0, keepdim=True)))
        model.lm_head.weight.mul_(10.0)  # a peaked next-token distribution: the experts' outputs matter
    prompts = [[(5 * i + j) % 300 + 1 for j in range(6)] for i in range(24)]
    completions = TorchEngine(model).generate(prompts, PARAMS, seed=3)
    trajs = []
    for i, (prompt, c) in enumerate(zip(prompts, completions)):
        n = len(prompt) + len(c.token_ids)
        assert c.routes.shape == (n - 1, 2 * model.config.experts_per_token)  # every fed token, 2 MoE layers
        routes = np.full((n, c.routes.shape[1]), -1, np.int16)
        routes[: n - 1] = c.routes
        trajs.append(
            Trajectory(
                task_id=f"t{i}",
                group_id=i // 2,
                attempt=i % 2,
                policy_version=0,
                token_ids=prompt + c.token_ids,
                loss_mask=[0] * len(prompt) + [1] * len(c.token_ids),
                rollout_logprobs=[0.0] * len(prompt) + c.logprobs,
                routes=routes,
                reward=float(i % 2),
                status="ok",
            )
        )
    return model, unpack(pack(trajs))  # through the transport's typed buffers


def gap(model, batch, replay: bool) -> float:
    sel = batch["mask"] > 0
    with torch.no_grad():
        logp = sampled_logprobs(model, batch, PARAMS, replay=replay)[0]
    return float((logp[sel] - batch["rollout_logprobs"][sel]).abs().mean())


def test_recorded_routes_are_the_routes_the_model_takes(rollout):
    model, trajs = rollout
    batch = make_batch(trajs, pad_id=0, estimator="grpo")
    with torch.no_grad():
        own = model(batch["input_ids"])
        replayed = model(batch["input_ids"], routes=batch["routes"])
    assert float(route_agreement(own.routes, batch["routes"])) == 1.0  # same weights, same fp32 numerics
    torch.testing.assert_close(replayed.hidden, own.hidden, atol=0, rtol=0)  # replaying its own routes changes nothing
    assert gap(model, batch, replay=True) < 1e-5


def test_replay_removes_routing_disagreement_and_shrinks_the_gap_of_a_bf16_trainer(rollout):
    model, trajs = rollout
    trainer = copy.deepcopy(model).to(torch.bfloat16)
    batch = make_batch(trajs, pad_id=0, estimator="grpo")
    with torch.no_grad():
        own = trainer(batch["input_ids"]).routes
        forced = trainer(batch["input_ids"], routes=batch["routes"])
    agreement = float(route_agreement(own, batch["routes"]))
    assert agreement < 0.95, f"bf16 routed like fp32 on {agreement:.1%} of choices: the hazard is not exercised"
    # with replay every recorded token reaches the engine's experts: the bf16 router's own choice is
    # still reported, and the hidden states differ from the unforced ones
    assert not torch.equal(forced.hidden, trainer(batch["input_ids"]).hidden)
    without, with_replay = gap(trainer, batch, replay=False), gap(trainer, batch, replay=True)
    assert with_replay < 0.8 * without, f"mean |dlogp| {without:.4f} without replay, {with_replay:.4f} with"

    # the trainer logs the disagreement it measured, with or without replay: its router's own
    # choices, not the forced ones. (The loss's forward runs under autograd; on a CI machine its bf16
    # routing differed from the no_grad forward's in one choice of 360, hence the tolerance.)
    for replay in (False, True):
        stats = make_loss_fn(PARAMS, PolicyLossConfig(), replay=replay)(trainer, batch, 1, 1)[1]
        assert float(stats["mismatch/route_agreement"]) == pytest.approx(agreement, abs=0.02)


def test_dense_models_and_engines_without_routes_carry_none(rollout):
    _, trajs = rollout
    bare = [Trajectory(**{**t.__dict__, "routes": None}) for t in trajs[:3]]
    assert all(t.routes is None for t in unpack(pack(bare)))
    assert "routes" not in make_batch(bare, pad_id=0, estimator="grpo")


def test_router_replay_with_an_engine_that_cannot_return_routes_is_refused_at_load():
    assert stage_config("rl", {"router_replay": True, "engine": "torch"}).router_replay  # the torch engine records them
    with pytest.raises(UserError, match=r"^stages\.rl\.router_replay: needs engine: torch \(the vLLM engine does not return"):
        stage_config("rl", {"router_replay": True, "engine": "vllm"})
