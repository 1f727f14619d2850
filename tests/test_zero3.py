"""DeepSpeed ZeRO-3 on CPU (gloo): the SFT loss curve of DDP, checkpoints that resume on another number
of ranks (2 -> 1 and 1 -> 2) with the same weights, optimizer state and data position, and the RL
loss (top-k/top-p, so the kept support is rebuilt inside forward) with the single-process loss and
gradients.

One process pair and one single process run side by side (DeepSpeed's start-up is the cost); the
single rank writes its checkpoint before the pair resumes from it, and waits for the pair's.
Every parameter is sharded (persistence_threshold=0): the tiny model's would otherwise all stay whole.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_sft import make_ctx as sft_ctx
from test_sft import tasks_dir  # noqa: F401 (fixture)
from test_train import MICRO, toy_examples
from test_train_distributed import _free_port, join_gloo

import snowcat.stages.sft as sft
from snowcat.stages.algorithms import PolicyLossConfig
from snowcat.stages.model import MoEForCausalLM, hf, load_model_dir
from snowcat.stages.rlcore.objective import make_loss_fn
from snowcat.stages.rollout import SamplingParams
from snowcat.stages.train import OptimConfig, PackedLoader, load_checkpoint, make_backend, save_checkpoint
from snowcat.stages.train.backend import leave_distributed
from snowcat.stages.train.loss import sft_loss

REPO = Path(__file__).resolve().parent.parent
STEPS = 3
OPTIM = OptimConfig(lr=1e-2, warmup_steps=2, total_steps=STEPS)
# 1 and 2 ranks group a step's rows into different micro-batches; the router losses are per
# micro-batch, so they are off where the two are compared (as in test_train's accumulation test)
CFG = dataclasses.replace(MICRO, router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
PARAMS = SamplingParams(temperature=0.7, top_k=12, top_p=0.9, max_tokens=8)
LOSS_CFG = PolicyLossConfig(tis_cap=2.0)
# Weights after STEPS AdamW updates where only the summation order differs: Adam divides each update
# by the gradient's running RMS, so where a gradient is tiny a rounding-level difference in it
# becomes a visible one in the step (seen: 2.6e-6 on one of 8192 expert weights, at lr 1e-2)
WEIGHT_ATOL = 1e-5

pytest.importorskip("deepspeed")


def rl_batch(rows: list[int]) -> dict[str, torch.Tensor]:
    """A fixed RL batch (4 trajectories of 12 tokens, the first 4 a prompt); `rows` of it. Half the
    sampled tokens carry a recorded kept support (the target among 6 ids), the rest must be rebuilt."""
    g = torch.Generator().manual_seed(7)
    B, T, K = 4, 12, 6
    ids = torch.randint(20, CFG.vocab_size, (B, T + 1), generator=g)
    targets = ids[:, 1:].clone()
    targets[:, :4] = -1
    support = torch.randint(0, CFG.vocab_size, (B, T, K), generator=g)
    support[..., 0] = targets.clamp(min=0)
    support[(targets < 0) | (torch.rand(B, T, generator=g) < 0.5)] = -1
    batch = {
        "input_ids": ids[:, :-1],
        "targets": targets,
        "mask": (targets >= 0).float(),
        "rollout_logprobs": -torch.rand(B, T, generator=g),
        "support": support,
        "advantages": torch.randn(B, generator=g),
        "trainable": torch.ones(B, dtype=torch.bool),
    }
    return {k: v[rows] for k, v in batch.items()}


def _fresh(name: str, rank: int, world: int, cfg=CFG):
    torch.manual_seed(0)
    options = {"zero_stage": 3, "persistence_threshold": 0} if name == "deepspeed" else {}
    backend = make_backend(name, MoEForCausalLM(cfg), OPTIM, **options)
    return backend, PackedLoader(toy_examples(), 32, 0, batch_rows=4, seed=0, rank=rank, world_size=world)


def _global_loss(stats) -> float:
    t = torch.stack([stats.sums["nll_sum"], torch.tensor(stats.tokens)])
    if dist.get_world_size() > 1:
        dist.all_reduce(t)
    return float(t[0] / t[1])


def _train(backend, loader, save_at=None, path=None) -> list[float]:
    out = []
    while backend.step < STEPS:
        out.append(_global_loss(backend.train_step(loader.next(), sft_loss)))
        if backend.step == save_at:
            save_checkpoint(path, backend, client_state={"loader": loader.state_dict()})
    return out


def _weights(backend) -> dict[str, torch.Tensor]:
    with backend.full_params():
        return {n: p.detach().clone() for n, p in backend.model.named_parameters()}


def _resume(path: Path, world: int, rank: int, resaved: Path) -> dict:
    """Load a checkpoint written on another number of ranks, save its trainer state again, train on."""
    backend, loader = _fresh("deepspeed", rank, world)
    client = load_checkpoint(path, backend)
    loader.load_state_dict(client["loader"])
    loaded = _weights(backend)
    backend.save_state(resaved)
    return {"loader": loader.state_dict(), "loaded": loaded, "losses": _train(backend, loader), "final": _weights(backend)}


def _rl_grads(rank: int, world: int) -> dict:
    """One micro-batch per rank through the RL loss: the summed loss and the whole gradients."""
    from deepspeed.utils import safe_get_full_grad  # noqa: PLC0415 (worker only)

    backend, _ = _fresh("deepspeed", rank, world, cfg=MICRO)
    loss, _ = make_loss_fn(PARAMS, LOSS_CFG)(backend.wrapped, rl_batch(list(range(rank, 4, world))), 0, 1)
    backend._backward(loss)
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {n: safe_get_full_grad(p).detach().clone() for n, p in backend.model.named_parameters()}
    return {"loss": float(total) / world, "grads": grads}


def _worker(work, rank, world, port, tmp, tasks, queue, one_saved, two_saved):
    try:
        out = work(rank, world, port, Path(tmp), Path(tasks), one_saved, two_saved)
        leave_distributed()
        buf = io.BytesIO()  # by value: shared tensors would vanish with this process
        torch.save(out, buf)
        queue.put(((world, rank), buf.getvalue()))
    except BaseException:  # say so at once: the other processes would wait for this one
        queue.put(((world, rank), {"error": traceback.format_exc()}))
        raise


def _work(rank, world, port, tmp, tasks, one_saved, two_saved) -> dict:
    join_gloo(rank, world, port)
    out: dict = {}
    if world == 1:
        backend, loader = _fresh("deepspeed", rank, world)
        out["losses"] = _train(backend, loader, save_at=2, path=tmp / "one" / "step_2")
        out["final"] = _weights(backend)
        one_saved.set()
        two_saved.wait()
        out["resumed"] = _resume(tmp / "two" / "step_2", world, rank, tmp / "two_on_one")
    else:
        backend, loader = _fresh("torch", rank, world)
        out["ddp"] = _train(backend, loader)
        out["ddp_final"] = _weights(backend)
        backend, loader = _fresh("deepspeed", rank, world)
        out["losses"] = _train(backend, loader, save_at=2, path=tmp / "two" / "step_2")
        out["head_elements"] = backend.model.lm_head.weight.numel()
        if rank == 0:
            two_saved.set()
        out["final"] = _weights(backend)
        one_saved.wait()
        out["resumed"] = _resume(tmp / "one" / "step_2", world, rank, tmp / "one_on_two")
        out["rl"] = _rl_grads(rank, world)
        for run, keys in (
            ("sft_zero3", {"backend": "deepspeed", "zero_stage": 3}),
            ("sft_ep", {"expert_parallel": 2, "activation_checkpointing": True}),  # torch backend
        ):
            ctx = sft_ctx(tmp / run, tasks, eval_tasks=2, **keys)
            ctx.rank, ctx.world_size, ctx.local_rank = rank, world, rank
            sft.run(ctx)
    return out


def _single_process_rl() -> dict:
    """The same RL batch in one process, as one micro-batch: the 2 ranks balance their routers over
    the whole batch (balance_router_over), and with equal token counts the ranks' mean of their
    token means is the batch's, so 2 ranks of 2 rows train as 1 rank of 4."""
    torch.manual_seed(0)
    model = MoEForCausalLM(MICRO)
    loss, _ = make_loss_fn(PARAMS, LOSS_CFG)(model, rl_batch([0, 1, 2, 3]), 0, 1)
    loss.backward()
    return {"loss": float(loss.detach()), "grads": {n: p.grad for n, p in model.named_parameters()}}


def one_and_two_ranks(work, tmp_path: Path, tasks: Path) -> dict:
    """`work(rank, world, port, tmp, tasks, one_saved, two_saved)` (a module-level function; `tasks`:
    the tasks directory) in a single process and a gloo pair, side by side: {(world size, rank):
    what it returned}. The events let each side wait for the other's checkpoint."""
    ctx = mp.get_context("spawn")
    queue, one_saved, two_saved = ctx.Queue(), ctx.Event(), ctx.Event()
    ports = {1: _free_port(), 2: _free_port()}
    procs = [
        ctx.Process(target=_worker, args=(work, r, w, ports[w], str(tmp_path), str(tasks), queue, one_saved, two_saved))
        for w, r in ((1, 0), (2, 0), (2, 1))
    ]
    for p in procs:
        p.start()
    results: dict = {}
    try:
        while len(results) < len(procs):
            key, out = queue.get(timeout=540)
            assert isinstance(out, bytes), f"process {key} (world size, rank) failed:\n{out['error']}"
            results[key] = torch.load(io.BytesIO(out), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        for port in ports.values():  # DeepSpeed's CPU all-reduce leaves a shared-memory buffer per rank
            for leftover in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
                leftover.unlink(missing_ok=True)
    assert all(p.exitcode == 0 for p in procs)
    return results


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zero3_matches_ddp_resumes_across_rank_counts_and_trains_rl_and_sft(tmp_path, tasks_dir):  # noqa: F811
    results = one_and_two_ranks(_work, tmp_path, tasks_dir)
    one, two = results[(1, 0)], results[(2, 0)]

    # ZeRO-3 on 2 ranks follows DDP's loss curve (same rows per rank; only reduction order differs)
    assert two["losses"] == pytest.approx(two["ddp"], rel=1e-5)
    assert results[(2, 1)]["losses"] == two["losses"]
    for n, w in two["ddp_final"].items():
        torch.testing.assert_close(two["final"][n], w, rtol=1e-4, atol=WEIGHT_ATOL)
    assert two["head_elements"] == 0  # outside forward, this rank holds no part of the LM head (1 rank: all)
    # ... and 1 rank's (the same global batches; summation order differs)
    assert one["losses"] == pytest.approx(two["losses"], rel=1e-5)

    for writer, resumer, resaved, written in (
        (two, one["resumed"], "two_on_one", "two"),
        (one, two["resumed"], "one_on_two", "one"),
    ):
        # the checkpoint's weights, optimizer state and data position, on the other number of ranks
        saved = load_checkpoint_tensors(tmp_path / written / "step_2")
        assert all(torch.equal(resumer["loaded"][n], saved[n]) for n in saved)
        assert resumer["loader"] == {"epoch": 0, "index": 2}  # global batches taken, whatever the ranks
        assert (tmp_path / resaved / "optimizer.pt").read_bytes() == (
            tmp_path / written / "step_2" / "trainer_state" / "optimizer.pt"
        ).read_bytes()
        # the continued loss is the uninterrupted run's; so are the weights after it
        assert resumer["losses"] == pytest.approx(writer["losses"][2:], rel=1e-5)
        for n, w in writer["final"].items():
            torch.testing.assert_close(resumer["final"][n], w, rtol=1e-4, atol=WEIGHT_ATOL)

    # the RL loss with top-k/top-p and router losses under ZeRO-3 = one process with the whole batch
    single, zero3 = _single_process_rl(), two["rl"]
    assert zero3["loss"] == pytest.approx(single["loss"], rel=1e-5)
    assert results[(2, 1)]["rl"]["loss"] == zero3["loss"]
    for n, g in single["grads"].items():
        torch.testing.assert_close(zero3["grads"][n], g, rtol=1e-4, atol=1e-7)

    # the SFT stage with backend: deepspeed, zero_stage: 3 on 2 ranks: one process's loss curve
    # (router losses on: the ranks' micro-batches group rows differently), whole weights in final/
    sft.run(sft_ctx(tmp_path / "sft_torch", tasks_dir, eval_tasks=2))
    # ... and so does the SFT stage with its experts sharded over the 2 ranks (expert_parallel: 2,
    # activation checkpointing on), its checkpoints in the whole, unsharded layout
    curves = [
        [r["loss"] for r in map(json.loads, (tmp_path / run / "sft" / "metrics_history.jsonl").read_text().splitlines())]
        for run in ("sft_zero3", "sft_ep", "sft_torch")
    ]
    assert len(curves[0]) == 6 and curves[0] == pytest.approx(curves[2], rel=1e-3)
    assert curves[1] == pytest.approx(curves[2], rel=1e-3)
    for run in ("sft_zero3", "sft_ep"):
        ckpts = tmp_path / run / "sft" / "checkpoints"
        final, last = load_checkpoint_tensors(ckpts / "final"), load_checkpoint_tensors(ckpts / "step_000006")
        assert all(torch.equal(final[n], last[n]) for n in last)
        metrics = json.loads((tmp_path / run / "sft" / "metrics.json").read_text())
        assert metrics["num_params"] == sum(t.numel() for t in final.values()) and "val_greedy_pass@1/arith" in metrics


def load_checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's weights under the model's own parameter names."""
    model, _, _ = load_model_dir(path)
    return {n: p.detach() for n, p in model.named_parameters()}


def test_describe_gives_zero3_a_slice_of_the_whole_training_state_per_rank():
    big = dataclasses.replace(MICRO, vocab_size=100_000, hidden_size=1024)  # counted, never built

    def per_rank(**kw) -> float:
        size, unit = re.search(r"training state ([\d.]+) (MiB|GiB) per rank", hf.describe(big, world_size=4, **kw)).groups()
        return float(size) * (1024 if unit == "GiB" else 1)

    ddp, zero2, zero3 = per_rank(), per_rank(backend="deepspeed", zero_stage=2), per_rank(backend="deepspeed", zero_stage=3)
    assert zero3 == pytest.approx(ddp / 4, rel=0.01)  # weights, gradients and moments all sharded 4 ways
    assert zero3 < zero2 < ddp
    assert "gathered" in hf.describe(big, backend="deepspeed", zero_stage=3, world_size=4)
