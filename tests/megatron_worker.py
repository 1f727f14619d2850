"""One rank of a Megatron training run for tests/test_megatron.py, started as torchrun would start it
(RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment):

    python tests/megatron_worker.py OUT MODEL_DIR TP PP EP STEPS [--save-at K] [--from CKPT] [--loss sft|rl]

Trains STEPS optimizer steps of the shared SFT loss (or RL's TIS policy loss, router replay on)
on fixed micro-batches (each data-parallel rank its own rows, as the trainers split them), and
writes OUT/losses.json and, through the backend's checkpoint path, OUT/final (whole weights).
--save-at K: also a resumable checkpoint OUT/ckpt after step K; --from CKPT: start from such a
checkpoint (written under any layout), as a preempted run resumes.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch


def batches(vocab: int, step: int, rows: int = 4, T: int = 13) -> list[dict]:
    """The step's two micro-batches of `rows` rows each (the same on every rank; sliced by DP rank);
    13 tokens: sequence parallelism over two ranks pads them."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(2):
        ids = torch.randint(0, vocab, (rows, T), generator=g)
        targets = torch.randint(0, vocab, (rows, T), generator=g)
        targets[:, :3] = -1  # a prompt: no loss there
        seg = torch.zeros(rows, T, dtype=torch.long)
        seg[:, T // 2 :] = 1  # two packed documents per row
        mask = (targets >= 0).float()
        routes_k = torch.randint(0, 4, (rows, T, 2 * 2), generator=g)
        out.append(
            {
                "input_ids": ids,
                "targets": targets,
                "segment_ids": seg,
                "mask": mask,
                "rollout_logprobs": -torch.rand(rows, T, generator=g) * 3,
                "advantages": torch.randn(rows, generator=g),
                "routes": routes_k,
            }
        )
    return out


def rows_of(mb: dict, rank: int, ranks: int) -> dict:
    n = mb["input_ids"].shape[0]
    lo, hi = rank * n // ranks, (rank + 1) * n // ranks
    return {k: v[lo:hi] for k, v in mb.items()}


def rl_loss():
    from snowcat.stages.algorithms import PolicyLossConfig
    from snowcat.stages.rlcore.objective import make_loss_fn
    from snowcat.stages.rollout import SamplingParams

    params = SamplingParams(temperature=1.0)
    return make_loss_fn(params, PolicyLossConfig(), replay=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("tp", type=int)
    ap.add_argument("pp", type=int)
    ap.add_argument("ep", type=int)
    ap.add_argument("steps", type=int)
    ap.add_argument("--save-at", type=int, default=0)
    ap.add_argument("--from", dest="start", type=Path)
    ap.add_argument("--loss", choices=("sft", "rl"), default="sft")
    a = ap.parse_args()
    torch.manual_seed(0)
    from snowcat.stages.train.checkpoint import load_checkpoint, save_checkpoint, save_weights
    from snowcat.stages.train.loss import sft_loss
    from snowcat.stages.train.megatron import Layout, MegatronBackend
    from snowcat.stages.train.optim import OptimConfig

    optim = OptimConfig(lr=1e-2, warmup_steps=1, total_steps=a.steps, grad_clip=0.5)
    layout = Layout(a.tp, a.pp, a.ep)
    backend, tok = MegatronBackend.from_model_dir(a.start or a.model_dir, optim, layout)
    if a.start:
        load_checkpoint(a.start, backend)
    loss_fn = sft_loss if a.loss == "sft" else rl_loss()
    losses = []
    while backend.step < a.steps:
        mbs = [
            rows_of(mb, backend.data_rank, backend.data_ranks) for mb in batches(backend.model.config.vocab_size, backend.step)
        ]
        stats = backend.train_step(mbs, loss_fn)
        key = "nll_sum" if a.loss == "sft" else "loss/loss"  # RL's: a mean, compared at one data-parallel rank
        summed = torch.tensor([float(stats.sums[key]), stats.tokens], dtype=torch.float64)
        if a.loss == "sft":
            torch.distributed.all_reduce(summed, group=backend.data_group)  # the whole batch's
        losses.append({"step": stats.step, key: float(summed[0]), "grad_norm": stats.grad_norm, "tokens": float(summed[1])})
        if backend.step == a.save_at:
            save_checkpoint(a.out / "ckpt", backend, tok)
    save_weights(a.out / "final", backend, tok)
    if backend.rank == 0:
        (a.out / "losses.json").write_text(json.dumps(losses))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
