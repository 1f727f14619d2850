"""Trajectory transfer over MPI typed buffers against a raw mpi4py buffer of the same size.

    snowcat bench transport [--batches 8,64,256,1024] [--repeats 20] [--json FILE]

Starts itself as two ranks under `mpirun -n 2` with the environment the local executor gives an
RL stage (Open MPI's TCP transport, `OMPI_MCA_btl=self,tcp`). Rank 1 is the rollout rank, rank 0
the trainer. For each batch size (trajectories per batch), `--repeats` times each, in turn:
  - `message`: the batch's typed message over `MPITransport` -- `send_message` of the buffer
    `stages.agent.encode` made of it (a typed, versioned header and every field, encoded once
    beforehand) on rank 1, `recv_message` on rank 0 (probe, allocate, receive): what the transport
    itself adds to moving the bytes (its handshake, probe and allocation);
  - `typed`: the whole trip from records to records, `send_batch` (encode + send) on rank 1 and
    `recv_batch` (receive + `decode` into Trajectory objects) on rank 0;
  - `raw`: one `comm.Send` of a uint8 buffer of the same byte count into a preallocated `Recv`.
Each is timed on rank 1 from the send until rank 0's 1-byte acknowledgement arrives (the same
extra message in every row), and reports the median and `raw / message`, `raw / typed` (1.0: no
cost beyond moving the bytes), and the same for the fastest of each row: on a machine other
processes load, a transfer that waited for a core takes tens of ms in any row, so where many did
the medians compare those waits and the minimums what the transfers cost. `encode` and `decode`
of the same batch are also timed alone: with the message row they account for the typed row.

The trajectories are shaped like agent episodes of the demo model: 256-2048 tokens, a prompt and
three model turns, rollout logprobs, the router replay of 4 MoE layers x top-2 (int16), sampled
from the full distribution (no support ids), a task id, domain and detail string.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys

import numpy as np

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_json
from snowcat.stages.agent import Trajectory

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_btl": "self,tcp"}
ROUTE_WIDTH = 4 * 2  # demo-tiny: 4 MoE layers x top-2 experts


def make_batch(n: int, seed: int, min_tokens: int = 256, max_tokens: int = 2048) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(min_tokens, max_tokens + 1))
        prompt = length // 4
        cuts = sorted(rng.choice(np.arange(prompt + 1, length), size=5, replace=False).tolist())
        turns = [(prompt, cuts[0]), (cuts[1], cuts[2]), (cuts[3], cuts[4])]  # model turns; tool output between
        mask = np.zeros(length, np.uint8)
        for s, e in turns:
            mask[s:e] = 1
        out.append(
            Trajectory(
                task_id=f"repo-task-{seed}-{i:05d}",
                group_id=i // 8,
                attempt=i % 8,
                policy_version=seed,
                token_ids=rng.integers(0, 32768, length),
                loss_mask=mask,
                rollout_logprobs=np.where(mask > 0, -rng.exponential(1.0, length), 0.0),
                reward=float(rng.random() < 0.4),
                status="ok",
                turn_boundaries=turns,
                domain="repo",
                prompt_len=prompt,
                detail="tests passed" if i % 2 else "2 of 5 tests failed",
                routes=rng.integers(0, 8, (length, ROUTE_WIDTH)),
            )
        )
    return out


CHILD = r"""
import json, statistics, sys, time
import numpy as np
from mpi4py import MPI
from snowcat.benchmarks.transport import make_batch
from snowcat.stages.agent import decode, encode
from snowcat.stages.rlcore.transport import MPITransport

sizes, repeats = [int(s) for s in sys.argv[1].split(",")], int(sys.argv[2])
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
transport = MPITransport(comm, timeout_s=300)
ack = np.zeros(1, np.uint8)
index = 0  # batch index: every transfer over the transport is the next batch, as in RL
kinds = ("typed", "message", "raw")
rows = []
for n in sizes:
    trajs = make_batch(n, seed=n)
    wire = encode(0, trajs)  # the one message: header + every field
    nbytes = wire.nbytes
    raw = np.random.default_rng(n).integers(0, 256, nbytes, dtype=np.uint8) if rank == 1 else np.empty(nbytes, np.uint8)
    times = {k: [] for k in (*kinds, "encode", "decode")}
    for r in range(repeats + 1):  # the first round warms every path up and is not counted
        for kind in kinds[r % 3 :] + kinds[: r % 3]:  # each row goes first, second and last in turn
            comm.Barrier()
            if rank == 1:
                t0 = time.perf_counter()
                if kind == "typed":
                    transport.send_batch(index, trajs)
                elif kind == "message":
                    transport.send_message(index, wire)
                else:
                    comm.Send(raw, dest=0, tag=3)
                comm.Recv(ack, source=0, tag=4)
                if r:
                    times[kind].append(time.perf_counter() - t0)
            else:
                # as in RL, the trainer still holds one batch (the other row's) while it receives
                if kind == "typed":
                    got = None
                    got = transport.recv_batch(index)
                elif kind == "message":
                    message = None
                    message = transport.recv_message(index)
                else:
                    comm.Recv(raw, source=1, tag=3)
                comm.Send(ack, dest=1, tag=4)
            index += kind != "raw"
    # where the typed row's time goes beyond the message: encoding (rank 1's work) and decoding (rank 0's), timed alone
    for _ in range(repeats):
        t0 = time.perf_counter()
        encoded = encode(index, trajs)
        t1 = time.perf_counter()
        decode(encoded)
        times["encode"].append(t1 - t0)
        times["decode"].append(time.perf_counter() - t1)
    if rank == 0:
        intact = got == trajs and np.array_equal(message, wire)
        comm.send(intact, dest=1)
    else:
        intact = comm.recv(source=0)
        med = {k: statistics.median(v) for k, v in times.items()}
        low = {k: min(v) for k, v in times.items()}
        rows.append({
            "trajectories": n,
            "tokens": int(sum(len(t) for t in trajs)),
            "bytes": nbytes,
            "median_s": {k: round(v, 6) for k, v in med.items()},
            "times_s": {k: [round(x, 6) for x in times[k]] for k in kinds},
            **{f"{k}_gb_per_s": round(nbytes / med[k] / 1e9, 3) for k in kinds},
            "ratio_raw_over_message": round(med["raw"] / med["message"], 3),
            "ratio_raw_over_typed": round(med["raw"] / med["typed"], 3),
            "min_s": {k: round(v, 6) for k, v in low.items()},
            "ratio_of_minimums_message": round(low["raw"] / low["message"], 3),
            "ratio_of_minimums_typed": round(low["raw"] / low["typed"], 3),
            "received_equal": bool(intact),
        })
if rank == 1:
    print(json.dumps(rows), flush=True)
"""


def run_ranks(sizes: list[int], repeats: int) -> list[dict]:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise UserError("snowcat bench transport: needs Open MPI's mpirun on PATH")
    cmd = [mpirun, "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable, "-c", CHILD]
    env = {**os.environ, **MPI_ENV, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run([*cmd, ",".join(map(str, sizes)), str(repeats)], capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"mpirun failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="snowcat bench transport", description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="8,64,256,1024", help="trajectories per batch, comma-separated")
    ap.add_argument("--repeats", type=int, default=20, help="timed transfers of each row per batch size (median reported)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.batches.split(",")]
    load_before = os.getloadavg()
    rows = run_ranks(sizes, args.repeats)
    load_after = os.getloadavg()
    print(f"2 ranks under mpirun, {MPI_ENV['OMPI_MCA_btl']} transport, median of {args.repeats} (ms; ratio: raw / row)")
    print(
        f"{'trajs':>6} {'tokens':>8} {'MiB':>7} {'raw':>7} {'message':>8} {'ratio':>6} {'typed':>7} {'ratio':>6}"
        f"  {'encode':>7} {'decode':>7}   fastest: {'raw':>6} {'message':>8} {'ratio':>6} {'typed':>7} {'ratio':>6}"
    )
    for r in rows:
        med, low = ({k: v * 1e3 for k, v in r[key].items()} for key in ("median_s", "min_s"))
        print(
            f"{r['trajectories']:>6} {r['tokens']:>8} {r['bytes'] / 2**20:>7.2f} {med['raw']:>7.2f} {med['message']:>8.2f} "
            f"{r['ratio_raw_over_message']:>6.2f} {med['typed']:>7.2f} {r['ratio_raw_over_typed']:>6.2f}"
            f"  {med['encode']:>7.2f} {med['decode']:>7.2f}   {'':9}{low['raw']:>6.2f} {low['message']:>8.2f} "
            f"{r['ratio_of_minimums_message']:>6.2f} {low['typed']:>7.2f} {r['ratio_of_minimums_typed']:>6.2f}"
            + ("" if r["received_equal"] else "  RECEIVED BATCH DIFFERS")
        )
    print(f"load average before / after: {load_before[0]:.2f} / {load_after[0]:.2f} ({os.cpu_count()} cpus)")
    if args.json:
        atomic_write_json(
            args.json,
            {
                "benchmark": "transport",
                "what": __doc__.splitlines()[0],
                "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
                "mpi": {"launcher": "mpirun -n 2 --oversubscribe --bind-to none", **MPI_ENV},
                "load_average_1min": {"before": load_before[0], "after": load_after[0]},
                "repeats": args.repeats,
                "rows": rows,
                "command": " ".join(["snowcat", "bench", "transport", *(argv if argv is not None else sys.argv[1:])]),
            },
        )
    return 0 if all(r["received_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
