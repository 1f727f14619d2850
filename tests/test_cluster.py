"""The local Slurm test cluster really schedules: batch jobs, accounting, arrays, hetjobs with one
PMIx MPI world, cancel, requeue, and a clean restart after a crash."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from snowcat.slurm import cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def _sacct(env: dict, job: str, fields: str = "JobID,State,Account,ExitCode") -> list[list[str]]:
    out = subprocess.run(
        ["sacct", "-j", job, "-X", "-n", "-P", "-o", fields], env=env, capture_output=True, text=True, timeout=30, check=True
    ).stdout
    return [line.split("|") for line in out.splitlines() if line]


def _until(predicate, timeout: float = 60.0, what: str = "condition"):
    """Poll until `predicate()` is truthy (accounting and job state reach slurmdbd asynchronously)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
    return value


def _state(env: dict, job: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True, timeout=30)
    return out.stdout.strip()


def test_batch_job_sees_gpus_and_is_accounted(sbatch, slurm_env, tmp_path):
    out = tmp_path / "job.out"
    job = sbatch(
        "-p",
        "gpu",
        "--gpus-per-node=2",
        "-o",
        str(out),
        "--wrap",
        "echo $SLURMD_NODENAME $CUDA_VISIBLE_DEVICES $SLURM_JOB_ACCOUNT",
        wait=True,
    )
    node, gpus, account = out.read_text().split()
    assert node in cluster.NODES and len(gpus.split(",")) == 2 and account == cluster.ACCOUNT
    rows = _until(lambda: [r for r in _sacct(slurm_env, job) if r[1] == "COMPLETED"], what="sacct COMPLETED")
    assert rows == [[job, "COMPLETED", cluster.ACCOUNT, "0:0"]]


def test_wrong_account_is_refused(slurm_env):
    p = subprocess.run(
        ["sbatch", "--account=not-a-snowcat-account", "--wrap", "true"], env=slurm_env, capture_output=True, text=True, timeout=30
    )
    assert p.returncode != 0 and "account" in p.stderr.lower()


def test_over_max_time_is_refused(slurm_env):
    p = subprocess.run(
        ["sbatch", f"--time={cluster.MAX_TIME_MIN + 1}", "--wrap", "true"],
        env=slurm_env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode != 0 and "time limit" in p.stderr.lower()


def test_array_of_200_tasks_in_one_sbatch(sbatch, slurm_env, tmp_path):
    job = sbatch("--array=0-199", "-o", "/dev/null", "--wrap", f"touch {tmp_path}/$SLURM_ARRAY_TASK_ID", wait=True)
    assert sorted(int(p.name) for p in tmp_path.iterdir()) == list(range(200))
    rows = _until(
        lambda: (r := _sacct(slurm_env, job)) and all(s == "COMPLETED" for _, s, *_ in r) and len(r) == 200 and r,
        what="200 array tasks COMPLETED in sacct",
    )
    assert {r[0] for r in rows} == {f"{job}_{i}" for i in range(200)}


MPI_EXCHANGE = """
import json, os, sys
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
got = None
if rank == size - 1:
    comm.Send(np.arange(8, dtype=np.float64) * (rank + 1), dest=0)
if rank == 0:
    buf = np.empty(8, dtype=np.float64)
    comm.Recv(buf, source=size - 1)
    got = buf.tolist()
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "size": size, "node": os.environ["SLURMD_NODENAME"], "got": got}, f)
"""


def test_hetjob_components_share_one_pmix_mpi_world(sbatch, tmp_path):
    (tmp_path / "x.py").write_text(MPI_EXCHANGE)
    script = tmp_path / "het.sh"
    # --exclusive on both components forces them onto different virtual nodes. stepwatch: this
    # Slurm's srun sometimes hangs after a heterogeneous PMIx step has ended (slurm/stepwatch.py).
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH -N1 -n1 --exclusive --time=2\n"
        "#SBATCH hetjob\n"
        "#SBATCH -N1 -n1 --exclusive --time=2\n"
        f"{sys.executable} -m snowcat.slurm.stepwatch --grace 5 -- "
        f"srun --mpi=pmix --het-group=0,1 {sys.executable} {tmp_path / 'x.py'} {tmp_path}\n"
    )
    # A short --time so that a hung step fails the test in minutes rather than blocking CI.
    sbatch("-o", str(tmp_path / "het.out"), str(script), wait=True, timeout=180)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["size"] for r in ranks] == [2, 2]
    assert {r["node"] for r in ranks} == set(cluster.NODES)
    assert ranks[0]["got"] == [float(i * 2) for i in range(8)]


@pytest.mark.parametrize("step_exit", [0, 3])
def test_stepwatch_stops_a_launcher_that_hangs_after_its_step_ended(sbatch, slurm_env, tmp_path, step_exit):
    """The launcher here is a stand-in for the hung srun: a real step runs and ends, then the
    launcher sleeps. The job must end soon after the step, with the step's exit code."""
    script = tmp_path / "hang.sh"
    hanging_launcher = f"srun -n1 bash -c 'exit {step_exit}'; sleep 600"
    script.write_text(
        "#!/bin/bash\n#SBATCH -N1 -n1 --time=3\n"
        f"{sys.executable} -m snowcat.slurm.stepwatch --grace 3 --poll 1 -- bash -c {shlex.quote(hanging_launcher)}\n"
    )
    log = tmp_path / "hang.out"
    job = sbatch("-o", str(log), str(script))
    rows = _until(
        lambda: [r for r in _sacct(slurm_env, job, "JobID,State,ExitCode") if r[1] not in ("PENDING", "RUNNING")],
        timeout=120,
        what="job ended",
    )
    assert rows == [[job, "COMPLETED" if step_exit == 0 else "FAILED", f"{step_exit}:0"]]
    assert "stepwatch: bash is still running" in log.read_text()


def test_stepwatch_passes_exit_status_and_signals_through(tmp_path):
    """Outside a job, or where srun behaves, stepwatch is transparent."""
    run = [sys.executable, "-m", "snowcat.slurm.stepwatch", "--"]
    env = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"}
    assert subprocess.run([*run, "bash", "-c", "exit 5"], env=env, timeout=60).returncode == 5
    started = tmp_path / "started"
    proc = subprocess.Popen([*run, "bash", "-c", f"touch {started}; exec sleep 60"], env=env)
    _until(started.exists, what="child started")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM


def test_scancel_ends_a_running_job(sbatch, slurm_env):
    job = sbatch("-o", "/dev/null", "--wrap", "sleep 300")
    _until(lambda: _state(slurm_env, job) == "RUNNING", what="job RUNNING")
    subprocess.run(["scancel", job], env=slurm_env, check=True, timeout=30)
    _until(lambda: any(r[1].startswith("CANCELLED") for r in _sacct(slurm_env, job)), what="sacct CANCELLED")


def test_requeued_job_runs_again(sbatch, slurm_env, tmp_path):
    log = tmp_path / "restarts"
    job = sbatch("--requeue", "-o", "/dev/null", "--wrap", f"echo ${{SLURM_RESTART_COUNT:-0}} >> {log}; sleep 300")
    _until(lambda: log.exists(), what="first run")
    subprocess.run(["scontrol", "requeue", job], env=slurm_env, check=True, timeout=30)
    _until(lambda: log.read_text().split() == ["0", "1"], timeout=120, what="second run after requeue")
    subprocess.run(["scancel", job], env=slurm_env, check=True, timeout=30)


@pytest.fixture
def second_root():
    # munged wants every directory above its socket world-executable; pytest's tmp_path is 0700.
    root = Path(tempfile.mkdtemp(prefix="snowcat-cluster-test-", dir="/tmp"))
    root.chmod(0o755)
    yield root
    cluster.down(root)
    shutil.rmtree(root, ignore_errors=True)


def test_up_is_idempotent_recovers_from_a_crash_and_down_stops_all(second_root):
    """A second cluster in its own root (other ports), so the shared one keeps running."""
    root = second_root
    info = cluster.up(root)
    pids = cluster.status(root)["daemons"]
    assert cluster.up(root) == info and cluster.status(root)["daemons"] == pids  # nothing restarted

    for name in ("slurmctld", "slurmd-n2"):  # crash: stale pid files stay behind
        os.kill(pids[name], signal.SIGKILL)
    cluster.up(root)
    st = cluster.status(root)
    assert st["up"] and st["daemons"]["slurmd-n1"] == pids["slurmd-n1"]
    assert st["daemons"]["slurmctld"] != pids["slurmctld"] and st["daemons"]["slurmd-n2"] != pids["slurmd-n2"]
    env = {**os.environ, **info.env}
    job = subprocess.run(
        ["sbatch", "--parsable", "--wait", "-o", "/dev/null", "--wrap", "true"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.strip()
    assert job

    running = cluster.status(root)["daemons"].values()
    cluster.down(root)
    st = cluster.status(root)
    assert not st["up"] and not any(st["daemons"].values())
    assert all(_is_dead(pid) for pid in running)
    assert (root / "env.sh").read_text() == f"export SLURM_CONF={root.resolve() / 'etc' / 'slurm.conf'}\n"


def _is_dead(pid: int) -> bool:
    try:  # a zombie is dead too (PID 1 in some containers reaps late)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
