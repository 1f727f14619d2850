"""One rank of a Megatron training run for tests/test_megatron.py, started as torchrun would start it
(RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment):

    python tests/megatron_worker.py OUT MODEL_DIR TP PP EP STEPS [--save-at K] [--from CKPT] [--loss sft|rl]
    python tests/megatron_worker.py --serve     # runs asked for on stdin (see serve)

Trains STEPS optimizer steps of the shared SFT loss (or RL's TIS policy loss, router replay on)
on fixed micro-batches (each data-parallel rank its own rows, as the trainers split them), and
writes OUT/losses.json and, through the backend's checkpoint path, OUT/final (whole weights).
--save-at K: also a resumable checkpoint OUT/ckpt after step K; --from CKPT: start from such a
checkpoint (written under any layout), as a preempted run resumes.

--serve: run after run, each on its ranks, forked from one process that imported megatron-core once
(each rank then a process of its own, with its own gloo group, as torchrun's are): the import is
most of a small run's time, and on a small machine every rank's import runs at once.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing.util
import os
import signal
import socket
import sys
import traceback
from pathlib import Path

# torch is imported where it is used: megatron's checkpoint writer starts a process (a "spawn"
# multiprocessing Manager) that re-imports this file, and each rank that saves pays for that import


def batches(vocab: int, step: int, rows: int = 4, T: int = 13) -> list[dict]:
    """The step's two micro-batches of `rows` rows each (the same on every rank; sliced by DP rank);
    13 tokens: sequence parallelism over two ranks pads them."""
    import torch

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


def main(argv: list[str] | None = None) -> None:
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
    a = ap.parse_args(argv)
    import torch

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
        key = "nll_sum" if a.loss == "sft" else "loss/loss"
        summed = torch.tensor([float(stats.sums[key]), stats.tokens], dtype=torch.float64)
        torch.distributed.all_reduce(summed, group=backend.data_group)  # the whole batch's
        if a.loss == "rl":  # RL's is a token mean per micro-batch: every rank's rows hold as many tokens here
            summed[0] /= backend.data_ranks
        losses.append({"step": stats.step, key: float(summed[0]), "grad_norm": stats.grad_norm, "tokens": float(summed[1])})
        if backend.step == a.save_at:
            save_checkpoint(a.out / "ckpt", backend, tok)
    save_weights(a.out / "final", backend, tok)
    if backend.rank == 0:
        (a.out / "losses.json").write_text(json.dumps(losses))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(args: list[str], rank: int, ranks: int, port: int, log: Path) -> None:
    """In a forked child: rank `rank` of the run, its output to `log`; never returns."""
    code = 1
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: not outlive a killed launcher
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        main(args)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        # what a process's normal exit does for its multiprocessing children: megatron's checkpoint
        # writer started a Manager (and a resource tracker) that would otherwise outlive the rank
        multiprocessing.util._exit_function()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class _Timeout(Exception):
    pass


def _on_alarm(*_):
    raise _Timeout


def run(ranks: int, args: list[str], timeout_s: int) -> str | None:
    """One run on `ranks` ranks forked from this process; None, or why it failed (the failed rank's
    log). A failed or late rank ends the run's others (they would wait on it)."""
    out = Path(args[0])
    (out / "logs").mkdir(parents=True, exist_ok=True)
    port = _free_port()
    children = {}
    for r in range(ranks):
        pid = os.fork()
        if pid == 0:
            _rank(args, r, ranks, port, out / "logs" / f"rank{r}.txt")
        children[pid] = r
    failed, why = None, "failed"
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(timeout_s)
    try:
        while children and failed is None:
            pid, status = os.wait()
            rank = children.pop(pid)
            if os.waitstatus_to_exitcode(status) != 0:
                failed = rank
    except _Timeout:
        failed, why = min(children.values()), f"still running after {timeout_s} s"
    finally:
        signal.alarm(0)
    for pid in children:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if failed is None:
        return None
    log = (out / "logs" / f"rank{failed}.txt").read_text()
    return f"rank {failed} of {ranks} ({' '.join(args[2:])}) {why}:\n{log[-3000:]}"


def serve() -> None:
    """Runs asked for on stdin, one JSON line each ({"ranks": N, "args": [OUT, MODEL_DIR, ...]}),
    one after another; a JSON line on stdout for each: {"error": None or why}. Ends at end of input."""
    # what every rank imports, once, before the fork (not cpu.apply(): each rank patches itself)
    import mbridge  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    from megatron.core.dist_checkpointing.strategies import torch as _  # noqa: F401

    import snowcat.stages.train.checkpoint  # noqa: F401
    import snowcat.stages.train.loss  # noqa: F401
    import snowcat.stages.train.megatron.backend  # noqa: F401

    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stdout carries the replies only
    for line in sys.stdin:
        ask = json.loads(line)
        error = run(ask["ranks"], [str(a) for a in ask["args"]], timeout_s=240)
        replies.write(json.dumps({"error": error}) + "\n")
        replies.flush()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        main()
