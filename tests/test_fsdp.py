"""The fsdp backend (torch FSDP2: ZeRO-3) on CPU (gloo), alone and with the experts sharded over the
same 2 ranks (ZeRO-3 + EP): DDP's losses, gradient norms and weights; the RL loss's gradients of one
process; checkpoints in the torch backend's layout that resume on another number of ranks (2 -> 1,
1 -> 2) with the same weights, optimizer state and data position; and the SFT stage end to end.

One process pair and one single process run side by side; the single rank writes its checkpoint
before the pair resumes from it, and waits for the pair's. The single process trains with the torch
backend and resumes the pair's checkpoint with fsdp on a group of itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_sft import make_ctx as sft_ctx
from test_sft import tasks_dir  # noqa: F401 (fixture)
from test_train import toy_examples
from test_train_distributed import join_gloo
from test_zero3 import (
    CFG,
    LOSS_CFG,
    MICRO,
    OPTIM,
    PARAMS,
    STEPS,
    WEIGHT_ATOL,
    load_checkpoint_tensors,
    one_and_two_ranks,
    rl_batch,
)

import snowcat.stages.sft as sft
from snowcat.stages.model import MoEForCausalLM
from snowcat.stages.model.expert_parallel import expert_parameters
from snowcat.stages.rlcore.objective import make_loss_fn
from snowcat.stages.train import OptimConfig, PackedLoader, load_checkpoint, make_backend, save_checkpoint
from snowcat.stages.train.loss import sft_loss

LAYOUTS = {"ddp": ("torch", 1), "fsdp": ("fsdp", 1), "fsdp_ep": ("fsdp", 2)}


def _fresh(name: str, rank: int, world: int, ep: int = 1, cfg=CFG, optim=OPTIM):
    torch.manual_seed(0)
    backend = make_backend(name, MoEForCausalLM(cfg), optim, expert_parallel=ep)
    # 2 micro-batches per rank: FSDP reduces only after the last one (set_requires_gradient_sync)
    return backend, PackedLoader(toy_examples(), 32, 0, batch_rows=4, seed=0, rank=rank, world_size=world, micro_batches=2)


def _train(backend, loader, save_at=None, path=None) -> tuple[list[float], list[float]]:
    losses, norms = [], []
    while backend.step < STEPS:
        stats = backend.train_step(loader.next(), sft_loss)
        t = torch.stack([stats.sums["nll_sum"], torch.tensor(stats.tokens)])
        if dist.get_world_size() > 1:
            dist.all_reduce(t)
        losses.append(float(t[0] / t[1]))
        norms.append(stats.grad_norm)
        if backend.step == save_at:
            save_checkpoint(path, backend, client_state={"loader": loader.state_dict()})
    return losses, norms


def _tree_bytes(root: Path, only: tuple[str, ...] | None = None) -> dict[str, bytes]:
    """{relative path: bytes} of every file under `root` (or under its entries `only`)."""
    tops = [root / name for name in only] if only else [root]
    files = [f for top in tops for f in ([top] if top.is_file() else sorted(top.rglob("*"))) if f.is_file()]
    return {str(f.relative_to(root)): f.read_bytes() for f in files}


def _weights(backend) -> dict[str, torch.Tensor]:
    with backend.full_params():
        return {n: p.detach().clone() for n, p in backend.model.named_parameters()}


def _resume(path: Path, rank: int, world: int, ep: int, resaved: Path) -> dict:
    """Load a checkpoint written on another number of ranks (and backend), save its trainer state
    again, train on."""
    backend, loader = _fresh("fsdp", rank, world, ep)
    client = load_checkpoint(path, backend)
    loader.load_state_dict(client["loader"])
    position, loaded = loader.state_dict(), _weights(backend)
    backend.save_state(resaved)
    losses, _ = _train(backend, loader)
    return {"loader": position, "loaded": loaded, "losses": losses, "final": _weights(backend)}


def _rl_grads(rank: int, world: int) -> dict:
    """One micro-batch per rank through the RL loss under fsdp + EP=2: the summed loss, the whole
    gradient of every FSDP-sharded weight and this rank's rows of the expert weights' (reduced as a
    step reduces them; no clipping)."""
    backend, _ = _fresh("fsdp", rank, world, ep=2, cfg=MICRO, optim=OptimConfig(grad_clip=0.0))
    loss, _ = make_loss_fn(PARAMS, LOSS_CFG)(backend.wrapped, rl_batch(list(range(rank, 4, world))), 0, 1)
    backend._backward(loss)
    backend._clip()
    total = loss.detach().clone()
    dist.all_reduce(total)
    experts = expert_parameters(backend.model)
    grads = {n: (p.grad if n in experts else p.grad.full_tensor()).detach().clone() for n, p in backend.model.named_parameters()}
    return {"loss": float(total) / world, "grads": grads, "experts": sorted(experts)}


def _work(rank, world, port, tmp, tasks, one_saved, two_saved) -> dict:
    join_gloo(rank, world, port)
    out: dict = {}
    if world == 1:
        backend, loader = _fresh("torch", rank, world)
        out["losses"], _ = _train(backend, loader, save_at=2, path=tmp / "one" / "step_2")
        out["final"] = _weights(backend)
        one_saved.set()
        two_saved.wait()
        out["resumed"] = _resume(tmp / "two" / "step_2", rank, world, 1, tmp / "two_on_one")
        return out
    for layout, (name, ep) in LAYOUTS.items():
        backend, loader = _fresh(name, rank, world, ep)
        saving = {"save_at": 2, "path": tmp / "two" / "step_2"} if layout == "fsdp_ep" else {}
        out[layout] = (*_train(backend, loader, **saving), _weights(backend))
        if layout == "fsdp":
            out["head_elements"] = backend.model.lm_head.weight.to_local().numel()
    if rank == 0:
        two_saved.set()
    one_saved.wait()
    out["resumed"] = _resume(tmp / "one" / "step_2", rank, world, 2, tmp / "one_on_two")
    out["rl"] = _rl_grads(rank, world)
    ctx = sft_ctx(tmp / "sft_fsdp_ep", tasks, eval_tasks=2, backend="fsdp", expert_parallel=2, activation_checkpointing=True)
    ctx.rank, ctx.world_size, ctx.local_rank = rank, world, rank
    sft.run(ctx)
    return out


def _single_process_rl() -> dict:
    torch.manual_seed(0)
    model = MoEForCausalLM(MICRO)
    loss, _ = make_loss_fn(PARAMS, LOSS_CFG)(model, rl_batch([0, 1, 2, 3]), 0, 1)
    loss.backward()
    return {"loss": float(loss.detach()), "grads": {n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_with_and_without_expert_parallelism_matches_ddp_and_resumes_across_rank_counts(tmp_path, tasks_dir):  # noqa: F811
    results = one_and_two_ranks(_work, tmp_path, tasks_dir)
    one, two, other = results[(1, 0)], results[(2, 0)], results[(2, 1)]

    # ZeRO-3 and ZeRO-3 + EP on 2 ranks follow DDP: losses, clipped norms, weights (only the
    # reduction order differs); both ranks see the same losses; a rank holds half the LM head
    ddp_losses, ddp_norms, ddp_final = two["ddp"]
    for layout in ("fsdp", "fsdp_ep"):
        losses, norms, final = two[layout]
        assert losses == pytest.approx(ddp_losses, rel=1e-5) and norms == pytest.approx(ddp_norms, rel=1e-5)
        assert other[layout][0] == losses
        assert sorted(final) == sorted(ddp_final)
        for n, w in ddp_final.items():
            torch.testing.assert_close(final[n], w, rtol=1e-4, atol=WEIGHT_ATOL)
    assert two["head_elements"] * 2 == CFG.vocab_size * CFG.hidden_size
    assert one["losses"] == pytest.approx(ddp_losses, rel=1e-5)  # the same global batches on 1 rank

    for writer, resumer, resaved, written in (
        (two["fsdp_ep"], one["resumed"], "two_on_one", "two"),  # fsdp + EP on 2 ranks -> fsdp on 1
        ((one["losses"], None, one["final"]), two["resumed"], "one_on_two", "one"),  # torch on 1 -> fsdp + EP on 2
    ):
        saved = load_checkpoint_tensors(tmp_path / written / "step_2")
        assert all(torch.equal(resumer["loaded"][n], saved[n]) for n in saved)
        assert resumer["loader"] == {"epoch": 0, "index": 2}  # global batches taken, whatever the ranks
        # the same trainer state, byte for byte, from either backend on any number of ranks
        assert _tree_bytes(tmp_path / resaved) == _tree_bytes(
            tmp_path / written / "step_2" / "trainer_state", only=("optimizer.pt", "moments")
        )
        assert resumer["losses"] == pytest.approx(writer[0][2:], rel=1e-5)
        for n, w in writer[2].items():
            torch.testing.assert_close(resumer["final"][n], w, rtol=1e-4, atol=WEIGHT_ATOL)

    # the RL loss (top-k/top-p, router losses) under ZeRO-3 + EP = one process with the whole batch
    single = _single_process_rl()
    for rank, got in ((0, two["rl"]), (1, other["rl"])):
        assert got["loss"] == pytest.approx(single["loss"], rel=1e-5)
        for n, g in single["grads"].items():
            if n in got["experts"]:  # this rank's rows of the experts
                rows = g.shape[0] // 2
                g = g[rank * rows : (rank + 1) * rows]
            torch.testing.assert_close(got["grads"][n], g, rtol=1e-4, atol=1e-7)

    # the SFT stage with backend: fsdp, expert_parallel: 2 (activation checkpointing on) on 2 ranks:
    # one torch process's loss curve; whole weights in its checkpoints; evaluated from final/
    sft.run(sft_ctx(tmp_path / "sft_torch", tasks_dir, eval_tasks=2))
    curves = [
        [r["loss"] for r in map(json.loads, (tmp_path / run / "sft" / "metrics_history.jsonl").read_text().splitlines())]
        for run in ("sft_fsdp_ep", "sft_torch")
    ]
    assert len(curves[0]) == 6 and curves[0] == pytest.approx(curves[1], rel=1e-3)
    ckpts = tmp_path / "sft_fsdp_ep" / "sft" / "checkpoints"
    final, last = load_checkpoint_tensors(ckpts / "final"), load_checkpoint_tensors(ckpts / "step_000006")
    assert all(torch.equal(final[n], last[n]) for n in last)
    reference = load_checkpoint_tensors(tmp_path / "sft_torch" / "sft" / "checkpoints" / "final")
    assert sorted(final) == sorted(reference) and all(final[n].shape == reference[n].shape for n in reference)
    metrics = json.loads((tmp_path / "sft_fsdp_ep" / "sft" / "metrics.json").read_text())
    assert metrics["num_params"] == sum(t.numel() for t in final.values()) and "val_greedy_pass@1/arith" in metrics
