"""Where a torch process group meets: rank, world size, local rank and master address/port, from
the launcher's environment alone (srun, a hetjob component, mpirun, ibrun) or over MPI.

    r = rendezvous()                              # the whole job / MPI world, from the environment
    r = rendezvous(component=0)                   # one component of a Slurm hetjob (its own group)
    r = rendezvous(comm=trainer_comm)             # the ranks of an MPI sub-communicator
    init_process_group(r)                         # gloo on CPU, NCCL on GPU; env:// like torchrun

Rank, world and local rank come from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK) where a
launcher set them, then the MPI launcher's (TACC's `ibrun` gives every rank SLURM_PROCID=0), then
Slurm's; with `comm`, from the communicator (local rank: its ranks on this node). The address and port, in this order:
  1. MASTER_ADDR + MASTER_PORT when both are set (the Slurm executor exports them in batch scripts:
     the job's first node with the site's `master_addr_suffix`, port 20000 + job id % 20000) —
     not for a hetjob component, whose group lives on its own nodes;
  2. a Slurm job: the first host of SLURM_JOB_NODELIST (a component's: SLURM_JOB_NODELIST_HET_GROUP_<c>,
     or SLURM_PACK_* before Slurm 20.02) expanded by `scontrol show hostnames`, plus the suffix, and the
     same port formula on the (component's) job id;
  3. over MPI (mpirun outside Slurm): rank 0 of `comm` (without one, of the MPI world the launcher
     started) takes its own hostname and a free port, and broadcasts them.
A node name that does not resolve (the local test cluster's virtual nodes) is replaced by its Slurm
NodeAddr.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from submitit.slurm.slurm import _parse_node_list

MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")
RANK_VARS = ("RANK", *MPI_RANK_VARS, "SLURM_PROCID")
SIZE_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS")
LOCAL_VARS = (
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "MV2_COMM_WORLD_LOCAL_RANK",
    "PMI_LOCAL_RANK",
    "SLURM_LOCALID",
)
HET_PREFIXES = ("HET_GROUP", "PACK_GROUP")  # Slurm >= 20.02 names, then the older ones


class RendezvousError(RuntimeError):
    """The environment does not say where the process group meets."""


@dataclass(frozen=True)
class Rendezvous:
    rank: int
    world_size: int
    local_rank: int
    addr: str
    port: int

    def env(self) -> dict[str, str]:
        """The variables torch's env:// rendezvous (and DeepSpeed) read."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "MASTER_ADDR": self.addr,
            "MASTER_PORT": str(self.port),
        }


def _int(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        if env.get(name, "").isdigit():
            return int(env[name])
    return None


def slurm_port(job_id: int) -> int:
    """One port per job (as the Slurm executor exports it), so jobs sharing a node do not collide."""
    return 20000 + job_id % 20000


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list, as `scontrol show hostnames` expands it (submitit's parser
    where there is no scontrol, e.g. inside a container)."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return _parse_node_list(nodelist)[0]


def reachable(host: str) -> str:
    """`host` if it resolves, else the NodeAddr Slurm knows it by (virtual nodes on one machine)."""
    try:
        socket.getaddrinfo(host, None)
        return host
    except OSError:
        pass
    try:
        out = subprocess.run(["scontrol", "show", "node", "-o", host], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    m = re.search(r"\bNodeAddr=(\S+)", out)
    if m is None:
        raise RendezvousError(f"master address {host!r} does not resolve, and Slurm knows no node of that name")
    return m.group(1)


def _component(env: Mapping[str, str], component: int) -> tuple[int, int, str, int]:
    """(rank offset, size, node list, job id) of hetjob component `component`."""
    for prefix in HET_PREFIXES:
        sizes = [_int(env, (f"SLURM_NTASKS_{prefix}_{c}",)) for c in range(component + 1)]
        nodelist = env.get(f"SLURM_JOB_NODELIST_{prefix}_{component}")
        job = _int(env, (f"SLURM_JOB_ID_{prefix}_{component}",))
        if None not in sizes and nodelist and job is not None:
            return sum(sizes[:-1]), sizes[-1], nodelist, job
    raise RendezvousError(f"not in a Slurm hetjob with a component {component} (no SLURM_NTASKS_HET_GROUP_{component})")


def from_env(
    env: Mapping[str, str] | None = None,
    *,
    component: int | None = None,
    addr_suffix: str = "",
    hostname: Callable[[str], str] = first_host,
) -> tuple[int, int, int, str | None, int | None]:
    """(rank, world, local rank, addr, port) as the environment gives them; addr/port None where it
    does not (mpirun outside Slurm: `rendezvous(comm=...)` asks MPI)."""
    env = os.environ if env is None else env
    rank = _int(env, RANK_VARS) or 0
    world = _int(env, SIZE_VARS) or 1
    local = _int(env, LOCAL_VARS) or 0
    if component is not None:
        offset, size, nodelist, job = _component(env, component)
        if not offset <= rank < offset + size:
            raise RendezvousError(f"rank {rank} is not in hetjob component {component} (ranks {offset}..{offset + size - 1})")
        return rank - offset, size, local, hostname(nodelist) + addr_suffix, slurm_port(job)
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT", "").isdigit():
        return rank, world, local, env["MASTER_ADDR"], int(env["MASTER_PORT"])
    nodelist, job = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"), _int(env, ("SLURM_JOB_ID",))
    if nodelist and job is not None:
        return rank, world, local, hostname(nodelist) + addr_suffix, slurm_port(job)
    return rank, world, local, None, None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rendezvous(
    comm=None, *, component: int | None = None, addr_suffix: str = "", env: Mapping[str, str] | None = None
) -> Rendezvous:
    """Where this rank's process group meets (see the module docstring); collective over `comm`, or
    over the MPI world when the environment names no address and an MPI launcher started this one."""
    rank, world, local, addr, port = from_env(env, component=component, addr_suffix=addr_suffix)
    if comm is None and addr is None and world > 1 and env is None and any(v in os.environ for v in MPI_RANK_VARS):
        from mpi4py import MPI  # noqa: PLC0415 (an MPI launcher started this world: ask it)

        comm = MPI.COMM_WORLD
    if comm is not None:
        from mpi4py import MPI  # noqa: PLC0415 (importing mpi4py initialises MPI: only where a comm is given)

        rank, world = comm.Get_rank(), comm.Get_size()
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        local = node.Get_rank()
        node.Free()
        if addr is None and rank == 0:
            addr, port = socket.gethostname() + addr_suffix, _free_port()
        addr, port = comm.bcast((addr, port) if rank == 0 else None, root=0)  # one answer for all: rank 0's
    if addr is None:
        if world > 1:
            raise RendezvousError(
                f"rank {rank} of {world}: no MASTER_ADDR/MASTER_PORT, no Slurm job and no MPI communicator to agree on one"
            )
        addr, port = "127.0.0.1", _free_port()
    return Rendezvous(rank, world, local, reachable(addr), port)


_EXPORTED: dict[str, str | None] = {}  # what init_process_group overwrote: the values before it


def init_process_group(r: Rendezvous, device_type: str | None = None) -> None:
    """Join `r`'s group (NCCL on GPU, gloo on CPU), exporting its variables as torchrun would, so that
    DeepSpeed and env:// readers see the same group (until `forget_process_group_env`)."""
    import torch  # noqa: PLC0415 (rendezvous itself is torch-free)
    import torch.distributed as dist  # noqa: PLC0415

    will_export(r.env())
    os.environ.update(r.env())
    if dist.is_initialized():
        return
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=r.rank, world_size=r.world_size)


def will_export(keys) -> None:
    """Remember the current values of `keys`, about to be set for a process group (by us, or by a
    library that sets them itself: DeepSpeed exports its own MASTER_ADDR/PORT), for
    `forget_process_group_env`."""
    for key in keys:
        _EXPORTED.setdefault(key, os.environ.get(key))


def forget_process_group_env() -> None:
    """Put back the variables `init_process_group` exported, once its group is gone: a process that
    goes on (a test worker, a driver) must not hand a dead group's MASTER_PORT to the processes it
    starts next, whose own groups would then all meet on that one port (two concurrent MPI runs
    hung on it)."""
    for key, value in _EXPORTED.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _EXPORTED.clear()
