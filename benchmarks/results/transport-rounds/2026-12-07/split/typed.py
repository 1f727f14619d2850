import statistics
import time

import numpy as np
from mpi4py import MPI

from snowcat.benchmarks.transport import make_batch
from snowcat.stages.agent import BatchBuffers, TrajectoryBatch
from snowcat.stages.rlcore import transport as T

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
tr = T.MPITransport(comm, timeout_s=300)
c = tr.comm
trajs = make_batch(2, seed=2)
wire = TrajectoryBatch.of(0, trajs).buffer
n = wire.nbytes
raw = np.zeros(n // 8, np.int64)
ack = np.zeros(1, np.uint8)
I64 = MPI.INT64_T
mem = BatchBuffers()
idx = 0
inner = []
got = None


def row(kind):
    global idx, got
    batch = TrajectoryBatch.of(idx, trajs, mem) if rank == 1 and kind == "typed" else None
    if rank == 0 and kind == "typed":
        got = None
    c.Barrier()
    if rank == 1:
        if kind == "raw":
            raw[:] += 1
        t0 = time.perf_counter()
        if kind == "raw":
            c.Send([raw, I64], 0, 3)
        elif kind == "msg":
            tr.send_message(idx, wire)
        else:
            tr.send_batch(idx, batch)
        c.Recv(ack, 0, 4)
        idx += kind != "raw"
        return time.perf_counter() - t0
    else:
        if kind == "raw":
            c.Recv([raw, I64], 1, 3)
        elif kind == "msg":
            tr.recv_message(idx)
        else:
            m = tr.recv_message(idx)
            a = time.perf_counter()
            got = T.read_batch(idx, m, "rank 1")
            b = time.perf_counter()
            inner.append(b - a)
        c.Send(ack, 1, 4)
        idx += kind != "raw"


kinds = ["raw", "msg", "typed"]
t = {k: [] for k in kinds}
for i in range(100):
    for k in kinds[i % 3 :] + kinds[: i % 3]:
        x = row(k)
        if rank == 1 and i:
            t[k].append(x)
if rank == 0:
    m = TrajectoryBatch.of(0, trajs).buffer.copy()
    loop = []
    for _ in range(100):
        a = time.perf_counter()
        T.read_batch(0, m, "x")
        loop.append(time.perf_counter() - a)
    print(
        "read after receive",
        round(statistics.median(inner) * 1e6, 2),
        "in a loop",
        round(statistics.median(loop) * 1e6, 2),
        flush=True,
    )
if rank == 1:
    print(n, {k: round(statistics.median(v) * 1e6, 1) for k, v in t.items()}, flush=True)
