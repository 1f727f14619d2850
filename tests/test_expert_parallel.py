"""Expert parallelism on gloo ranks (CPU): a sharded MoE computes what the unsharded one does.

Each spawned rank builds the unsharded model from the same seed in-process as the reference, so
every comparison is against one process holding all experts. fp32 throughout; tolerances cover
only summation order (a shard's GEMM sees the copies of several ranks at once).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from snowcat.pipeline.errors import UserError
from snowcat.stages.model import PRESETS, MoEForCausalLM, hf_state_dict, load_hf_state_dict, load_model_dir, save_model_dir
from snowcat.stages.model.expert_parallel import (
    check_expert_parallel,
    clip_grad_norm_,
    exclude_experts_from_ddp,
    expert_parallel_groups,
    expert_parameters,
    full_experts,
    gather_shards,
    reduce_expert_grads,
    shard_experts,
)
from snowcat.stages.train.optim import OptimConfig, build_optimizer

# test-micro: 2 MoE layers of 4 experts, top-2, with a shared expert
MICRO = PRESETS["test-micro"]
TOL = dict(rtol=1e-5, atol=1e-6)  # fp32, summation order only
# after one AdamW step: its first update is ~lr * g/|g| per element, so a gradient of ~1e-9 that
# differs in rounding moves by up to ~1e-6 (seen on embedding rows); a wrong gradient moves by ~lr
LR = 1e-2
STEP_TOL = dict(rtol=0.0, atol=1e-3 * LR)
ROWS, T = 2, 12  # per rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(seed: int, rows: int = ROWS) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MICRO.vocab_size, (rows, T + 1), generator=g)
    return {"input_ids": ids[:, :-1], "targets": ids[:, 1:]}


def _model(cfg=MICRO, seed=0) -> MoEForCausalLM:
    torch.manual_seed(seed)
    return MoEForCausalLM(cfg)


def _loss(model, batch, routes=None, scale=1.0):
    cfg = getattr(model, "module", model).config
    out = model(batch["input_ids"], targets=batch["targets"], routes=routes)
    loss = -out.logprobs.sum() * scale + cfg.router_aux_loss_coef * out.aux_loss + cfg.router_z_loss_coef * out.z_loss
    return loss, out


def _max_diff(a, b) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def _close(a, b) -> bool:
    return bool(torch.allclose(a, b, **TOL))


def _grads_match(ref, model, ep) -> bool:
    """Non-expert gradients as the reference's; each shard's as the reference's rows summed over the EP group."""
    ref_params = dict(ref.named_parameters())
    experts = expert_parameters(model)
    ok = True
    for name, p in model.named_parameters():
        g = ref_params[name].grad
        if name in experts:
            g = g.clone()
            dist.all_reduce(g, group=ep.group)
            g = g[p.shape[0] * ep.rank : p.shape[0] * (ep.rank + 1)]
        ok &= _close(p.grad, g)
    return ok


def _compare(ref, model, ep, batch, routes=None) -> tuple[float, bool, bool]:
    """(max logprob difference, hidden states close, gradients close) of one forward/backward."""
    ref.zero_grad(), model.zero_grad()
    loss_ref, o_ref = _loss(ref, batch, routes)
    loss, o = _loss(model, batch, routes)
    loss_ref.backward(), loss.backward()
    return _max_diff(o.logprobs, o_ref.logprobs), _close(o.hidden, o_ref.hidden), _grads_match(ref, model, ep)


def _ep_forward_backward(ep, rank) -> dict:
    """EP=2 against the unsharded model on each rank's own tokens: outputs and gradients."""
    ref, model = _model(), shard_experts(_model(), ep)
    batch = _batch(seed=rank)
    # every copy routed to rank 0's experts: rank 1 receives nothing, yet joins every all-to-all
    k, layers = MICRO.experts_per_token, MICRO.num_layers
    starved = torch.tensor([0, 1] * layers).expand(ROWS, T, layers * k)
    out = {"shard_shape": tuple(model.model.layers[0].mlp.experts.gate_up_proj.shape)}
    out["routed"] = _compare(ref, model, ep, batch)
    out["starved"] = _compare(ref, model, ep, batch, starved)
    # recomputed in backward: the all-to-alls run again there, in the same order on every rank
    model.set_activation_checkpointing(True)
    out["checkpointed"] = _compare(ref, model, ep, batch)
    out["checkpointed_starved"] = _compare(ref, model, ep, batch, starved)
    return out


def _round_trip(ep, rank, tmp) -> dict:
    """Full (HF) layout out of a sharded model and back into one with other weights: exact."""
    ref, model = _model(), shard_experts(_model(), ep)
    with full_experts(model):
        full = hf_state_dict(model)
        if rank == 0:
            save_model_dir(os.path.join(tmp, "ep"), model)
        with pytest.raises(RuntimeError, match="cannot run inside full_experts"):
            model(_batch(seed=rank)["input_ids"])
    out = {
        "gathered_exact": full.keys() == hf_state_dict(ref).keys()
        and all(torch.equal(full[k], v) for k, v in hf_state_dict(ref).items())
    }
    other = shard_experts(_model(seed=1), ep)
    with full_experts(other):
        load_hf_state_dict(other, full)
    out["loaded_exact"] = all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), model.state_dict().values()))
    dist.barrier()
    saved, _, _ = load_model_dir(os.path.join(tmp, "ep"))
    out["saved_exact"] = all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), ref.state_dict().values()))
    return out


def _one_step(ep, rank, world) -> dict:
    """EP x DP trainer step (DDP without the shards, expert all-reduce, global clip, AdamW) against
    one process on every rank's tokens; router losses off, as they are per rank by design."""
    cfg = dataclasses.replace(MICRO, router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
    optim = OptimConfig(lr=LR, warmup_steps=0, total_steps=10, grad_clip=0.05)
    batches = [_batch(seed=10 + r) for r in range(world)]
    n_tokens = sum(b["targets"].numel() for b in batches)

    ref = _model(cfg)
    ref_opt, _ = build_optimizer(ref, optim)
    whole = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    _loss(ref, whole, scale=1.0 / n_tokens)[0].backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), optim.grad_clip)

    model = shard_experts(_model(cfg, seed=rank), ep)  # other weights on each rank: DDP must broadcast the rest
    with torch.no_grad():  # ... but the shards must come from the same full weights
        for name, p in expert_parameters(model).items():
            p.copy_(dict(ref.named_parameters())[name][p.shape[0] * ep.rank : p.shape[0] * (ep.rank + 1)])
    exclude_experts_from_ddp(model)
    ddp = DistributedDataParallel(model)
    opt, _ = build_optimizer(model, optim)
    _loss(ddp, batches[rank], scale=world / n_tokens)[0].backward()  # the backends' scaling
    reduce_expert_grads(model, ep)
    norm = clip_grad_norm_(model, optim.grad_clip, ep)
    out = {"clipped": float(ref_norm) > optim.grad_clip, "norm_close": _close(norm, ref_norm)}
    out["grads_close"] = _grads_match_after_reduce(ref, model, ep)
    opt.step(), ref_opt.step()
    with full_experts(model):
        out["weights_close"] = all(
            torch.allclose(a, b, **STEP_TOL) for a, b in zip(model.state_dict().values(), ref.state_dict().values())
        )
    # the shards' AdamW moments, gathered whole (as a checkpoint stores them), are the unsharded optimizer's
    shards = {id(p) for p in expert_parameters(model).values()}
    params = [p for g in opt.param_groups for p in g["params"]]
    own, ref_state = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    out["optimizer_state_close"] = own.keys() == ref_state.keys() and all(
        _close(gather_shards(own[i][k], ep.group) if id(params[i]) in shards else own[i][k], ref_state[i][k])
        for i in ref_state
        for k in ("exp_avg", "exp_avg_sq")
    )
    return out


def _grads_match_after_reduce(ref, model, ep) -> bool:
    ref_params = dict(ref.named_parameters())
    experts = expert_parameters(model)
    ok = True
    for name, p in model.named_parameters():
        g = ref_params[name].grad
        if name in experts:
            g = g[p.shape[0] * ep.rank : p.shape[0] * (ep.rank + 1)]
        ok &= _close(p.grad, g)
    return ok


def _worker(rank, world, port, ep_size, scenarios, tmp, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        ep = expert_parallel_groups(ep_size)
        result = {}
        if "forward" in scenarios:
            result["forward"] = _ep_forward_backward(ep, rank)
        if "round_trip" in scenarios:
            result["round_trip"] = _round_trip(ep, rank, tmp)
        if "step" in scenarios:
            result["step"] = _one_step(ep, rank, world)
        dist.destroy_process_group()
        queue.put((rank, result))
    except Exception:
        queue.put((rank, traceback.format_exc()))


def _spawn(world, ep_size, scenarios, tmp) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, ep_size, scenarios, str(tmp), queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    failed = {r: v for r, v in results.items() if isinstance(v, str)}
    assert not failed, next(iter(failed.values()))
    return [results[r] for r in range(world)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """2 gloo ranks, EP=2 (each rank its own tokens, so ep == world and no DP all-reduce of experts)."""
    return _spawn(2, 2, ("forward", "round_trip", "step"), tmp_path_factory.mktemp("ep2"))


@pytest.mark.slow
def test_ep2_equals_unsharded_in_outputs_and_gradients(two_ranks):
    for r in two_ranks:
        f = r["forward"]
        assert f.pop("shard_shape") == (2, 2 * MICRO.moe_intermediate_size, MICRO.hidden_size)  # 2 of 4 experts
        for case, (logprob_diff, hidden_close, grads_close) in f.items():
            assert logprob_diff <= 1e-5, case
            assert hidden_close and grads_close, case


def test_full_layout_round_trip_is_exact(two_ranks):
    for r in two_ranks:
        assert r["round_trip"] == {"gathered_exact": True, "loaded_exact": True, "saved_exact": True}


def test_ep2_training_step_equals_one_process_on_all_tokens(two_ranks):
    for r in two_ranks:
        assert r["step"] == dict.fromkeys(r["step"], True)
    assert set(two_ranks[0]["step"]) >= {"clipped", "norm_close", "grads_close", "weights_close", "optimizer_state_close"}


@pytest.mark.slow  # ~30 s: four ranks on two cores
def test_ep2_times_dp2_training_step_equals_one_process(tmp_path):
    """4 ranks: experts sharded over {0,1} and {2,3}, each shard's gradient all-reduced over {0,2} / {1,3}."""
    for r in _spawn(4, 2, ("step",), tmp_path):
        assert r["step"] == dict.fromkeys(r["step"], True)


def test_experts_not_divisible_by_expert_parallel_is_refused():
    with pytest.raises(UserError, match=r"expert_parallel=3 does not divide num_experts=4"):
        check_expert_parallel(MICRO, 3, 3)
    with pytest.raises(UserError, match=r"expert_parallel=2 does not divide the 3 trainer ranks"):
        check_expert_parallel(MICRO, 2, 3)
