import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
n = int(sys.argv[1]) if len(sys.argv) > 1 else 87000
buf = np.zeros(n // 8, np.int64)
room = np.zeros(2 << 17, np.int64)
ack = np.zeros(1, np.uint8)
I64 = MPI.INT64_T


def row(kind):
    comm.Barrier()
    if rank == 1:
        buf[:] += 1
        t0 = time.perf_counter()
        if kind == "raw":
            comm.Send([buf, I64], 0, 3)
        elif kind == "wait":
            comm.Isend([buf, I64], 0, 3).Wait()
        else:
            r = comm.Isend([buf, I64], 0, 3)
            while not r.Test():
                pass
        comm.Recv(ack, 0, 4)
        return time.perf_counter() - t0
    else:
        if kind == "raw":
            comm.Recv([room, I64], 1, 3)
        elif kind == "wait":
            comm.Irecv([room, I64], 1, 3).Wait()
        else:
            r = comm.Irecv([room, I64], 1, 3)
            while not r.Test():
                pass
        comm.Send(ack, 1, 4)


kinds = ["raw", "wait", "poll"]
t = {k: [] for k in kinds}
for i in range(200):
    for k in kinds[i % 3 :] + kinds[: i % 3]:
        x = row(k)
        if rank == 1 and i:
            t[k].append(x)
if rank == 1:
    print(n, {k: round(statistics.median(v) * 1e6, 1) for k, v in t.items()})
