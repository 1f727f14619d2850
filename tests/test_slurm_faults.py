"""What the Slurm fault campaign (docs/faults.md) found on the local cluster, kept as tests: `snowcat
cancel` stops a running training job for good (its SIGTERM made the stage checkpoint and the job
requeue itself); a `resume` right after `run` queues nothing twice (it read liveness from
accounting alone, which lists a job a moment after sbatch returns, and queued the whole DAG again)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from snowcat.pipeline.rundir import RunDir
from tests.conftest import write_config
from tests.test_slurm import on_local_slurm, wait_status

pytestmark = pytest.mark.cluster

SFT = """
name: cancel
seed: 3
stages:
  tasks:
    kind: tasks
    resources: {time_min: 5}
    domains:
      closure: {count: 120, val_count: 12, difficulties: [1, 2]}
  sft:
    kind: sft
    needs: [tasks]
    tokenizer_vocab_size: 300
    seq_len: 64
    batch_rows: 4
    steps: 120         # the cancel (a CLI starting up) lands mid-run: ~20 steps in on a loaded machine
    save_every: 0      # the only step checkpoint is the one the cancel's SIGTERM makes
    threads: 1
    eval_tasks: 0
    resources: {time_min: 10}
"""


@pytest.mark.slow
def test_snowcat_cancel_of_a_training_job_is_not_undone_by_a_requeue(snowcat, slurm_env, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", SFT)
    run_dir = tmp_path / "run"
    snowcat("run", cfg, *on_local_slurm(run_dir), env=slurm_env, check=True)
    history = run_dir / "stages" / "sft" / "metrics_history.jsonl"
    deadline = time.monotonic() + 600
    while not (history.is_file() and len(history.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline, "sft never trained"
        time.sleep(0.2)
    job = RunDir.open(run_dir).record("sft")["slurm_job_id"]
    snowcat("cancel", run_dir, env=slurm_env, check=True)

    # A requeue could only come from the job's own processes: once squeue lists the job no more (not
    # running, ending, pending or requeued) none is left to requeue it, and accounting says how it ended.
    deadline = time.monotonic() + 120
    while True:
        listed = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=slurm_env, capture_output=True, text=True)
        states = subprocess.run(
            ["sacct", "-n", "-P", "-X", "--duplicates", "-j", job, "-o", "State"], env=slurm_env, capture_output=True, text=True
        ).stdout.split()
        unlisted = not listed.stdout.strip() and (listed.returncode == 0 or "Invalid job id" in listed.stderr)
        if unlisted and states and "RUNNING" not in states:  # (accounting hears of the end a moment later)
            break
        assert time.monotonic() < deadline, (listed.stdout, states)
        time.sleep(1)
    assert states and not any(s.startswith(("REQUEUED", "PENDING", "RUNNING")) for s in states), states
    record = RunDir.open(run_dir).record("sft")
    assert record["status"] == "cancelled" and not record.get("continuations_used"), record
    checkpoints = sorted(p.name for p in (run_dir / "stages" / "sft" / "checkpoints").glob("step_*"))
    assert len(checkpoints) == 1, checkpoints  # saved on the SIGTERM, mid-run

    snowcat("resume", run_dir, env=slurm_env, check=True)
    status = wait_status(run_dir, {"done", "failed", "cancelled"}, timeout=600)
    assert status["stages"]["sft"]["status"] == "done", status
    assert [json.loads(line)["step"] for line in history.read_text().splitlines()] == list(range(1, 121))


def test_a_resume_right_after_run_queues_nothing_twice(snowcat, slurm_env, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", SFT.replace("steps: 120", "steps: 4"))
    run_dir = tmp_path / "run"
    snowcat("run", cfg, *on_local_slurm(run_dir), env=slurm_env, check=True)
    queued = RunDir.open(run_dir).state()["stages"]
    again = snowcat("resume", run_dir, env=slurm_env, check=True)
    assert "submitted" not in again.stderr, again.stderr
    state = RunDir.open(run_dir).state()["stages"]
    assert {s: state[s]["job_ids"] for s in ("tasks", "sft")} == {s: queued[s]["job_ids"] for s in ("tasks", "sft")}
    assert {s["status"] for s in wait_status(run_dir, {"done", "failed", "cancelled"})["stages"].values()} == {"done"}
