import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

from snowcat.stages.rlcore import transport as T

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
tr = T.MPITransport(comm, timeout_s=300)
c = tr.comm
n = int(sys.argv[1]) if len(sys.argv) > 1 else 87000
buf = np.zeros(n // 8, np.int64)
room = np.zeros(2 << 17, np.int64)
ack = np.zeros(1, np.uint8)
I64 = MPI.INT64_T
idx = 0


def row(kind):
    global idx
    c.Barrier()
    if rank == 1:
        buf[:] += 1
        t0 = time.perf_counter()
        if kind == "raw":
            c.Send([buf, I64], 0, T._AT_ONCE)
        elif kind in ("msg", "sendreal"):
            tr.send_message(idx, buf.view(np.uint8))
        else:
            r = c.Isend([buf, I64], 0, T._AT_ONCE)
            while not r.Test():
                pass
        c.Recv(ack, 0, 4)
        idx += kind != "raw"
        return time.perf_counter() - t0
    else:
        if kind == "raw":
            c.Recv([room, I64], 1, T._AT_ONCE)
        elif kind in ("msg", "recvreal"):
            tr.recv_message(idx)
        else:
            r = c.Irecv([room, I64], 1, T._AT_ONCE)
            while not r.Test():
                pass
        c.Send(ack, 1, 4)
        idx += kind != "raw"


kinds = ["raw", "msg", "sendreal", "recvreal"]
t = {k: [] for k in kinds}
for i in range(200):
    for k in kinds[i % 4 :] + kinds[: i % 4]:
        x = row(k)
        if rank == 1 and i:
            t[k].append(x)
if rank == 1:
    print(n, {k: round(statistics.median(v) * 1e6, 1) for k, v in t.items()})
