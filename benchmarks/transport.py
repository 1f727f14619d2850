"""Trajectory batches over MPI against a raw mpi4py transfer of the same bytes.

    snowcat bench transport [--batches 2,8,32,128,512,2048] [--repeats 20] [--json FILE]

Starts itself as two ranks under `mpirun -n 2` with the environment the local executor gives an
RL stage (Open MPI's TCP transport, `OMPI_MCA_btl=self,tcp`). Rank 1 is the rollout rank, rank 0
the trainer. For each batch size (trajectories per batch: the defaults are 85 KiB to 66 MiB),
`--repeats` times each, in turn:
  - `typed`, the row the transport is judged by: from the rollout side's records being ready to
    the trainer being able to read every trajectory's fields. The records are ready in the
    batch's columns: the agent loop writes them there as it makes them (`stages.agent.run_batch`,
    each episode's token lists converted straight into the columns, where they used to be
    converted into each record's own arrays -- `write` and `arrays` below time the two), so rank
    1's `send_batch` sends the batch's buffer as it is (written, as the rollout writes each batch,
    into the memory of the batch it sent before), and rank 0's `recv_batch` receives it and
    reads it (`TrajectoryBatch.read`: header, offsets and counts checked for the batch as a whole,
    every column a view of the message, every trajectory's fields views it can take);
  - `message`: the same buffer through `MPITransport`'s `send_message` / `recv_message` alone
    (into a reused buffer: a receive posted for it while the trainer spins, for a batch of up to
    2 MiB, else probe and receive; the trainer's "receiving" word only where the sender may be
    backing off): what the transport adds to moving bytes;
  - `raw`: one `comm.Send` of a uint8 buffer of the same byte count into a preallocated `Recv`.
Every row sends bytes written just before its transfer, as the typed row's batch is (the message and
raw rows copy theirs in from a kept copy, untimed): from 4 MiB up, memory just written moves slower
than memory written long ago (raw 4 MiB 930 against 729 us, 66 MiB 17.3 against 13.2 ms, medians of
8 alternating runs: benchmarks/results/transport-rounds/hot-source/), so a raw row sending
long-written bytes would compare the typed row with a transfer in another state. Each is timed on
rank 1 from the send until rank 0's 1-byte acknowledgement arrives (the same extra message in every
row), and reports the median and `raw / typed`, `raw / message` (1.0: no cost beyond moving the
bytes), and the same for the fastest of each: on a machine other processes load, a transfer that
waited for a core takes tens of ms in any row.

Timed alone on rank 1 (rank 0 idle), to show where the time goes and that the judged row starts
where it should: `read` (reading a message), `decode` (reading it and making every episode's
Trajectory of views: what the trainer's loop then does), `encode` (a batch written from Trajectory
objects: the pass over the records the send used to make); and, from records as the agent loop
holds them (Python lists per token field), `write` (into a batch's columns, in reused memory: what
`run_batch` does) against `arrays` (into one Trajectory of arrays each: what `run_episodes` does),
median of min(repeats, 5).

The trajectories are shaped like agent episodes of the demo model: 256-2048 tokens, a prompt and
three model turns, rollout logprobs, the router replay of 4 MoE layers x top-2 (int16), sampled
from the full distribution (no support ids), a task id, domain and detail string.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np

from snowcat.benchmarks import revision
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_json
from snowcat.pipeline.provenance import host_state
from snowcat.stages.agent import Trajectory
from snowcat.stages.agent.trajectory import compiled_check

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_btl": "self,tcp"}
ROUTE_WIDTH = 4 * 2  # demo-tiny: 4 MoE layers x top-2 experts
# the code the judged row runs: the batch format, the transport, the agent loop writing batches, this benchmark
MEASURED = (
    "stages/agent/trajectory.py",
    "stages/agent/_wire.c",
    "stages/rlcore/transport.py",
    "stages/agent/loop.py",
    "benchmarks/transport.py",
)


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


def agent_records(trajs: list[Trajectory]) -> list[dict]:
    """The records as the agent loop holds them when an episode ends (`stages.agent.loop._record`):
    the per-token fields Python lists, the routes an array."""
    return [
        dict(
            vars(t),
            token_ids=t.token_ids.tolist(),
            loss_mask=t.loss_mask.tolist(),
            rollout_logprobs=t.rollout_logprobs.tolist(),
            support_lengths=[0] * len(t),
            support_ids=[],
        )
        for t in trajs
    ]


CHILD = r"""
import json, statistics, sys, time
import numpy as np
from mpi4py import MPI
from snowcat.benchmarks.transport import agent_records, make_batch
from snowcat.stages.agent import BatchBuffers, Trajectory, TrajectoryBatch
from snowcat.stages.rlcore.transport import MPITransport

sizes, repeats = [int(s) for s in sys.argv[1].split(",")], int(sys.argv[2])
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
transport = MPITransport(comm, timeout_s=300)
ack = np.zeros(1, np.uint8)
index = 0  # batch index: every transfer over the transport is the next batch, as in RL
kinds = ("typed", "message", "raw")
got = message = None
memory = BatchBuffers()  # the rollout side's (stages/rl.py)


def timed(f, n):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        out.append(time.perf_counter() - t0)
    return out


rows = []
for n in sizes:
    trajs = make_batch(n, seed=n)
    wire = TrajectoryBatch.of(0, trajs).buffer  # the message row's buffer
    nbytes = wire.nbytes
    raw = np.random.default_rng(n).integers(0, 256, nbytes, dtype=np.uint8) if rank == 1 else np.empty(nbytes, np.uint8)
    source = {"message": (wire, wire.copy()), "raw": (raw, raw.copy())} if rank == 1 else None  # what rank 1 sends
    times = {k: [] for k in kinds}
    for r in range(repeats + 1):  # the first round warms every path up and is not counted
        for kind in kinds[r % 3 :] + kinds[: r % 3]:  # each row goes first, second and last in turn
            # batch `index` as the agent loop leaves it, written as the rollout writes each batch, into the
            # memory of the one it sent before (not timed: see `write`)
            batch = TrajectoryBatch.of(index, trajs, memory) if rank == 1 and kind == "typed" else None
            if rank == 1 and kind != "typed":  # every row sends bytes written just before, as the typed row's are
                np.copyto(*source[kind])
            if rank == 0:  # the row's previous batch goes (RL drops it once the next is in), the other row's stays
                got = None if kind == "typed" else got
                message = None if kind == "message" else message
            comm.Barrier()
            if rank == 1:
                t0 = time.perf_counter()
                if kind == "typed":
                    transport.send_batch(index, batch)
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
                    got = transport.recv_batch(index)
                elif kind == "message":
                    message = transport.recv_message(index)
                else:
                    comm.Recv(raw, source=1, tag=3)
                comm.Send(ack, dest=1, tag=4)
            index += kind != "raw"
    if rank == 0:
        # the same values and the same bytes arrive
        same = got == trajs and np.array_equal(got.buffer, TrajectoryBatch.of(got.index, trajs).buffer)
        comm.send(bool(same and np.array_equal(message, wire)), dest=1)
        comm.Barrier()  # while rank 1 times the parts alone
        continue
    intact = comm.recv(source=0)
    records, few = agent_records(trajs), min(repeats, 5)
    times |= {
        "read": timed(lambda: TrajectoryBatch.read(wire), repeats),
        "decode": timed(lambda: list(TrajectoryBatch.read(wire)), repeats),
        "encode": timed(lambda: TrajectoryBatch.of(0, trajs), repeats),
        "write": timed(lambda: TrajectoryBatch.write(0, records, memory), few),
        "arrays": timed(lambda: [Trajectory(**rec) for rec in records], few),
    }
    del records
    comm.Barrier()
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}
    rows.append({
        "trajectories": n,
        "tokens": int(sum(len(t) for t in trajs)),
        "bytes": nbytes,
        "median_s": {k: round(v, 7) for k, v in med.items()},  # 0.1 us: a small batch moves in 30
        "times_s": {k: [round(x, 7) for x in times[k]] for k in kinds},
        **{f"{k}_gb_per_s": round(nbytes / med[k] / 1e9, 3) for k in kinds},
        "ratio_raw_over_typed": round(med["raw"] / med["typed"], 3),
        "ratio_raw_over_message": round(med["raw"] / med["message"], 3),
        "min_s": {k: round(v, 7) for k, v in low.items()},
        "ratio_of_minimums_typed": round(low["raw"] / low["typed"], 3),
        "ratio_of_minimums_message": round(low["raw"] / low["message"], 3),
        "ratio_write_over_arrays": round(med["write"] / med["arrays"], 3),
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


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="snowcat bench transport", description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="2,8,32,128,512,2048", help="trajectories per batch, comma-separated")
    ap.add_argument("--repeats", type=int, default=20, help="timed transfers of each row per batch size (median reported)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.batches.split(",")]
    load_before = os.getloadavg()
    rows = run_ranks(sizes, args.repeats)
    check = compiled_check()  # (the ranks import the same build)
    load_after = os.getloadavg()
    host, rev = host_state(probe_gpu=False), revision(MEASURED)
    machine = {k: host[k] for k in ("hostname", "platform", "cpu_model", "memory_bytes")} | {"cpus": host["cpu_count"]}
    print(
        f"2 ranks under mpirun, {MPI_ENV['OMPI_MCA_btl']} transport, median of {args.repeats} (us; ratio: raw / row);"
        f" batch check: {check}"
    )
    print(
        f"{'trajs':>6} {'tokens':>8} {'MiB':>7} {'raw':>8} {'typed':>8} {'ratio':>6} {'message':>8} {'ratio':>6}"
        f"  {'read':>6} {'decode':>7} {'encode':>7}  {'write':>7} {'arrays':>7}   fastest: {'raw':>8} {'typed':>8} {'ratio':>6}"
    )
    for r in rows:
        med, low = ({k: v * 1e6 for k, v in r[key].items()} for key in ("median_s", "min_s"))
        print(
            f"{r['trajectories']:>6} {r['tokens']:>8} {r['bytes'] / 2**20:>7.2f} {med['raw']:>8.1f} {med['typed']:>8.1f} "
            f"{r['ratio_raw_over_typed']:>6.2f} {med['message']:>8.1f} {r['ratio_raw_over_message']:>6.2f}"
            f"  {med['read']:>6.1f} {med['decode']:>7.0f} {med['encode']:>7.0f}  {med['write']:>7.0f} {med['arrays']:>7.0f}"
            f"   {'':9}{low['raw']:>8.1f} {low['typed']:>8.1f} {r['ratio_of_minimums_typed']:>6.2f}"
            + ("" if r["received_equal"] else "  RECEIVED BATCH DIFFERS")
        )
    print(
        f"{host['cpu_model']}, {host['cpu_count']} cpus; commit {(rev['commit'] or '?')[:12]}"
        + (f" + uncommitted {', '.join(rev['uncommitted'])}" if rev["uncommitted"] else "")
        + f"; load average before / after: {load_before[0]:.2f} / {load_after[0]:.2f}"
    )
    if args.json:
        atomic_write_json(
            args.json,
            {
                "benchmark": "transport",
                "what": __doc__.splitlines()[0],
                "machine": machine,
                "revision": rev,
                "mpi": {"launcher": "mpirun -n 2 --oversubscribe --bind-to none", **MPI_ENV},
                "load_average_1min": {"before": load_before[0], "after": load_after[0]},
                "repeats": args.repeats,
                "batch_check": check,
                "rows": rows,
                "command": " ".join(["snowcat", "bench", "transport", *(argv if argv is not None else sys.argv[1:])]),
            },
        )
    judged = ", ".join(f"{_size(r['bytes'])} {r['ratio_raw_over_typed']:.2f}x" for r in rows)
    print(f"raw / typed, median (goal >= 0.8x on each): {judged}")
    return 0 if all(r["received_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
