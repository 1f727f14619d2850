"""`mpi_check` stage: prove that a multi-role job is one MPI world before a week of queueing.

Every rank reports its role and host; the first rank of each role sends a numpy buffer to the
first rank of every other role (typed buffer `Send`/`Recv`, no pickling) and checks what comes
back. Run it as a hetjob (one component per role) to check that the site's `srun --het-group
--mpi=PLUGIN` gives all components one world — the layout the RL stage relies on. Writes
`world.json` (rank → role, host).
"""

from __future__ import annotations

import json
import os
import socket

import numpy as np

from snowcat.pipeline.context import StageContext
from snowcat.pipeline.fsio import atomic_write_text


def run(ctx: StageContext) -> dict:
    from mpi4py import MPI  # noqa: PLC0415 (importing mpi4py initialises MPI: only in ranks that use it)

    comm = MPI.COMM_WORLD
    if comm.Get_size() != ctx.world_size:
        raise RuntimeError(f"MPI world has {comm.Get_size()} ranks but the launcher said {ctx.world_size}")
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    world = comm.allgather({"rank": comm.Get_rank(), "role": ctx.role, "host": host})
    roles = list(dict.fromkeys(w["role"] for w in world))
    leaders = {role: min(w["rank"] for w in world if w["role"] == role) for role in roles}

    n = int(ctx.config.buffer_elements)
    exchanged = 0
    me = comm.Get_rank()
    for a in roles:
        for b in roles:
            if a == b:
                continue
            src, dst = leaders[a], leaders[b]
            if me == src:
                payload = np.arange(n, dtype=np.float64) * (src + 1)
                comm.Send([payload, MPI.DOUBLE], dest=dst, tag=src)
                echo = np.empty(n, dtype=np.float64)
                comm.Recv([echo, MPI.DOUBLE], source=dst, tag=dst)
                if not np.array_equal(echo, payload * 2):
                    raise RuntimeError(f"rank {src} ({a}) got a wrong echo from rank {dst} ({b})")
                exchanged += 2 * payload.nbytes
            elif me == dst:
                buf = np.empty(n, dtype=np.float64)
                comm.Recv([buf, MPI.DOUBLE], source=src, tag=src)
                comm.Send([buf * 2, MPI.DOUBLE], dest=src, tag=dst)
    exchanged = comm.allreduce(exchanged, op=MPI.SUM)

    role_hosts = {role: sorted({w["host"] for w in world if w["role"] == role}) for role in roles}
    if ctx.config.require_roles_on_distinct_hosts and len(roles) > 1:
        shared = set.intersection(*(set(h) for h in role_hosts.values()))
        if shared:
            raise RuntimeError(f"roles share hosts {sorted(shared)}; expected each component on its own nodes")
    if me == 0:
        atomic_write_text(ctx.out_dir / "world.json", json.dumps({"ranks": world, "role_hosts": role_hosts}, indent=2) + "\n")
    comm.Barrier()
    return {
        "world_size": comm.Get_size(),
        "roles": len(roles),
        "hosts": len({w["host"] for w in world}),
        "bytes_exchanged": exchanged,
    }
