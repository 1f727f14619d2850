"""Where a torch process group meets, from the environment alone: srun (plain job, with and without the
executor's MASTER_ADDR/PORT), torchrun's variables, a hetjob component (Slurm's HET_GROUP names and the older PACK_GROUP
ones), mpirun and ibrun-like launchers. The Slurm variables are those the local cluster gave a
2-node job and a 2 + 1 hetjob step (Slurm 22.05). Then a real mpirun world forms a gloo group
(its address agreed over MPI) and all-reduces."""

from __future__ import annotations

import json
import os
import shutil
import textwrap

import pytest

from snowcat.stages.train.rendezvous import RendezvousError, from_env, rendezvous
from tests.conftest import mpirun

SRUN = {  # task 1 of `sbatch -N 2 --ntasks-per-node=1`, `srun ...`
    "SLURM_JOB_ID": "1453",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
}
HET_STEP = {  # rank 1 of `srun --het-group=0,1` in a hetjob of 2 tasks (component 0) + 1 task (component 1)
    "SLURM_JOB_ID": "1451",
    "SLURM_HET_SIZE": "2",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_NTASKS": "3",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "PMIX_RANK": "1",
    **{
        f"SLURM_{k}_HET_GROUP_{c}": v
        for c, (ids, nodes, n) in enumerate([("1451", "n1", "2"), ("1452", "n2", "1")])
        for k, v in (("JOB_ID", ids), ("JOB_NODELIST", nodes), ("NTASKS", n))
    },
}


def test_srun_job_meets_on_its_first_node_with_the_site_suffix_and_a_port_per_job():
    assert from_env(SRUN) == (1, 2, 0, "n1", 21453)
    assert from_env(SRUN, addr_suffix="i") == (1, 2, 0, "n1i", 21453)  # JSC: the InfiniBand name
    exported = {**SRUN, "MASTER_ADDR": "jwb0001i", "MASTER_PORT": "29500"}  # the executor's batch script
    assert from_env(exported, addr_suffix="i") == (1, 2, 0, "jwb0001i", 29500)


def test_torchrun_variables_name_the_rank_first():
    """torchrun (or a spawned worker, or a process that joined a group here) sets RANK, WORLD_SIZE,
    LOCAL_RANK: they say who is who, also under srun, where SLURM_PROCID numbers the launchers."""
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}
    assert from_env(torchrun) == (3, 4, 1, "n1", 29500)
    assert from_env({**SRUN, **torchrun}) == (3, 4, 1, "n1", 29500)


def test_a_hetjob_component_is_a_group_of_its_own():
    assert from_env(HET_STEP, component=0) == (1, 2, 1, "n1", 21451)
    rollout = {**HET_STEP, "SLURM_PROCID": "2", "PMIX_RANK": "2", "SLURM_LOCALID": "0"}
    assert from_env(rollout, component=1) == (0, 1, 0, "n2", 21452)
    # the job's MASTER_ADDR names component 0's first node: a component group does not use it
    assert from_env({**rollout, "MASTER_ADDR": "n1", "MASTER_PORT": "21451"}, component=1)[3:] == ("n2", 21452)
    with pytest.raises(RendezvousError, match="rank 2 is not in hetjob component 0"):
        from_env(rollout, component=0)
    packed = {k.replace("HET_GROUP", "PACK_GROUP"): v for k, v in HET_STEP.items()}  # Slurm < 20.02
    assert from_env(packed, component=0) == (1, 2, 1, "n1", 21451)
    with pytest.raises(RendezvousError, match="component 0"):
        from_env(SRUN, component=0)
    # the whole step: one world over both components, meeting on the first node
    assert from_env(HET_STEP) == (1, 3, 1, "n1", 21451)


def test_mpirun_gives_ranks_but_no_address_and_ibrun_ranks_come_from_mpi_not_slurm():
    mpirun = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}
    assert from_env(mpirun) == (2, 3, 2, None, None)  # rendezvous() asks MPI for them
    with pytest.raises(RendezvousError, match="no MASTER_ADDR/MASTER_PORT, no Slurm job and no MPI communicator"):
        rendezvous(env=mpirun)
    # TACC's ibrun: every rank has SLURM_PROCID=0; MVAPICH / Intel MPI say who is who
    ibrun = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "c001-[001,003]", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}
    assert from_env({**ibrun, "PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1"}) == (3, 4, 1, "c001-001", 20077)
    mv2 = {"MV2_COMM_WORLD_RANK": "2", "MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "0"}
    assert from_env({**ibrun, **mv2}) == (2, 4, 0, "c001-001", 20077)
    assert rendezvous(env={}).world_size == 1  # one process alone needs no one to meet


_WORLD = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch, torch.distributed as dist
    from snowcat.stages.train.rendezvous import init_process_group, rendezvous
    r = rendezvous()  # mpirun's variables name no address: the world's rank 0 gives one over MPI
    init_process_group(r)
    t = torch.tensor([float(r.rank + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()  # (left up, gloo's threads may outlive the interpreter: abort at exit)
    out = {"rank": r.rank, "world": r.world_size, "local": r.local_rank, "addr": r.addr, "sum": t.item()}
    (Path(sys.argv[1]) / f"rank{r.rank}.json").write_text(json.dumps(out))  # (mpirun interleaves stdout)
""")


def test_an_mpirun_world_forms_a_gloo_group_from_its_environment_alone(tmp_path):
    if shutil.which("mpirun") is None:
        pytest.skip("needs OpenMPI's mpirun")
    script = tmp_path / "world.py"
    script.write_text(_WORLD)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    proc = mpirun(2, script, tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["world"], r["local"], r["sum"]) for r in ranks] == [(0, 2, 0, 3.0), (1, 2, 1, 3.0)]
    assert ranks[0]["addr"] == ranks[1]["addr"]  # rank 0's host, broadcast
