"""Preemption of a multi-rank RL stage (stages/rlcore/preempt.py): when the scheduler's notice
(SIGUSR2) reaches every rank or only some, the trainer finishes its step and its checkpoint while
rollout ranks wait, then every rank leaves with exit code 75 — no rank before the trainer's save,
which in a Slurm hetjob (`srun --kill-on-bad-exit=1`) would get the trainer killed mid-save — and
the resumed run ends with the weights of an uninterrupted one. Real signals, real MPI."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import snowcat.stages.rl as rl
from snowcat.pipeline import config as config_mod
from snowcat.pipeline.context import PREEMPTED_EXIT_CODE
from snowcat.pipeline.dag import Unit, build
from snowcat.pipeline.executors.local import LocalExecutor
from snowcat.pipeline.fsio import sha256_file, verify_manifest
from snowcat.pipeline.rundir import RunDir
from snowcat.pipeline.volatile import strip_volatile
from snowcat.stages.train import latest_checkpoint
from tests.conftest import MPI_ENV, Snowcat, write_config
from tests.test_rl import build_inputs, make_ctx
from tests.test_slurm import on_local_slurm, wait_status

# one worker builds each module fixture (the run before RL and its uninterrupted copy; the stage's
# inputs) once for the two tests that share it; the cluster test is the Slurm group's (conftest)
pytestmark = pytest.mark.xdist_group("rl_preempt")
REPO = Path(__file__).resolve().parent.parent
ENV = {"PYTHONPATH": str(REPO)}  # the stage processes import the test verifier (tests.test_rl)
# Small and quick: a few SFT steps (the model only has to exist), RL with a reward a random model
# earns half the time (so every update moves the weights), checkpoints only at the end and on notice.
CONFIG = """
name: rl-preempt
seed: 7
executor: {kind: local, max_parallel: 1}
stages:
  tasks:
    kind: tasks
    domains:
      closure: {count: 120, val_count: 12, difficulties: [1, 2]}
      arith: {count: 120, val_count: 12, difficulties: [2]}
  sft:
    kind: sft
    needs: [tasks]
    tokenizer_vocab_size: 300
    seq_len: 64
    batch_rows: 4
    steps: 2
    warmup_steps: 0
    threads: 1
    eval_tasks: 0
  rl:
    kind: rl
    needs: [tasks, sft]
    init_from: "sft:final"
    verifier: "tests.rl_stage:parity_verify"
    tasks_per_update: 4
    attempts: 4
    updates: UPDATES
    max_tokens: 8
    eval_every: 0
    save_every: 0
    threads: 1
    timeout_s: 120
    resume: {strategy: requeue}   # on the local cluster (the local executor continues at once anyway)
    resources:
      components:
        trainer: {nodes: 1, tasks_per_node: 1}
        rollout: {nodes: 1, tasks_per_node: ROLLOUTS}
"""
# Not anchored to lines: mpirun forwards each rank's output in chunks, so one rank's line can start
# before another's newline has come (seen in CI: "...(t=…200)[rl] rank 1 rollout: ...").
EVENT = re.compile(r"\[rl\] rank (\d+) (trainer|rollout): (.*?) \(t=(\d+\.\d+)\)")
LEFT = "checkpointed before the end of the job"  # the runner's line for a rank that returns 75


RUN_UPDATES = 6  # the notice comes after update 2, the trainer saves the step in progress: room to spare


def config_text(updates: int = RUN_UPDATES, rollouts: int = 2) -> str:
    return CONFIG.replace("UPDATES", str(updates)).replace("ROLLOUTS", str(rollouts))


def final_sha(run_dir: Path) -> str:
    return sha256_file(run_dir / "stages" / "rl" / "checkpoints" / "final" / "model.safetensors")


def rl_history(run_dir: Path) -> list[dict]:
    """The RL stage's metrics history without its volatile fields (timings, engine counters)."""
    path = run_dir / "stages" / "rl" / "metrics_history.jsonl"
    return [strip_volatile(json.loads(line))[0] for line in path.read_text().splitlines()]


def events(log: str) -> list[tuple[int, str, str, float]]:
    """(rank, role, what, time) of the RL stage's preemption lines."""
    return [(int(r), role, what, float(t)) for r, role, what, t in EVENT.findall(log)]


def rank_pids(mpirun_pid: int, world: int, timeout: float = 120) -> dict[int, int]:
    """{rank: pid} of the ranks mpirun started (its children, by OMPI_COMM_WORLD_RANK)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = {}
        for d in Path("/proc").iterdir():
            try:
                stat = (d / "stat").read_text()
                if d.name.isdigit() and int(stat[stat.rindex(")") + 2 :].split()[1]) == mpirun_pid:
                    env = dict(v.split("=", 1) for v in (d / "environ").read_bytes().decode().split("\0") if "=" in v)
                    found[int(env["OMPI_COMM_WORLD_RANK"])] = int(d.name)
            except (OSError, KeyError, ValueError):
                continue
        if len(found) == world:
            return found
        time.sleep(0.05)
    raise AssertionError(f"mpirun {mpirun_pid} did not start {world} ranks")


def reference_from(run_dir: Path, reference: Path, config: Path, overrides: list[str], stages: list[str]) -> Path:
    """A new local run directory of `config` whose `stages` are copies of `run_dir`'s, done: its
    resume re-hashes them and runs only what comes after them (an uninterrupted reference of a later
    stage, from the same inputs, without computing its inputs twice)."""
    RunDir.create(config_mod.load(config, overrides), reference)
    for stage in stages:
        shutil.copytree(run_dir / "stages" / stage, reference / "stages" / stage)
    return reference


def logged_step(history: Path) -> int:
    """The last update in a metrics_history.jsonl being written (-1: none yet)."""
    last = -1
    for line in history.read_text().splitlines() if history.is_file() else []:
        try:
            last = max(last, json.loads(line)["step"])
        except ValueError:  # the line being written
            pass
    return last


def wait_for_step(history: Path, step: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    """Until the trainer has logged update `step` (the notice then comes mid-run)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if logged_step(history) >= step:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the stage ended (exit {proc.returncode}) before update {step}")
        time.sleep(0.02)
    raise AssertionError(f"update {step} never logged")


def assert_coordinated_stop(run_dir: Path, log: str, world: int, updates: int) -> int:
    """The trainer's checkpoint is complete, no rollout rank left before it was saved, every rank
    left through Preempted; returns the checkpointed step."""
    ckpt = latest_checkpoint(run_dir / "stages" / "rl" / "checkpoints")
    assert ckpt is not None and verify_manifest(ckpt) == []
    step = int(ckpt.name.split("_")[1])
    assert 0 < step < updates  # saved on notice (save_every: 0), mid-run
    ev = events(log)
    saved = [t for r, _, what, t in ev if r == 0 and what.startswith(f"preemption: checkpoint of step {step} saved")]
    assert len(saved) == 1, log[-4000:]
    left = {r: t for r, role, what, t in ev if role == "rollout" and "leaving after the trainer's checkpoint" in what}
    assert set(left) == set(range(1, world)), log[-4000:]
    assert min(left.values()) >= saved[0]  # nobody left before the trainer's save was complete
    assert log.count(LEFT) == world  # every rank's runner returned 75
    return step


# --- as the local executor runs the stage: mpirun, 1 trainer + 2 rollout ranks, then `snowcat resume`


@pytest.fixture(scope="module")
def before_rl(tmp_path_factory) -> tuple[Path, Path]:
    """(a run whose tasks and sft are done, an uninterrupted copy of it run to the end)."""
    if shutil.which("mpirun") is None:
        pytest.skip("needs OpenMPI's mpirun")
    root = tmp_path_factory.mktemp("rl_preempt")
    cfg = write_config(root / "rl.yaml", config_text())
    run = RunDir.create(config_mod.load(cfg), root / "base")
    for stage in ("tasks", "sft"):  # by hand, as docs/users.md runs one unit
        subprocess.run([sys.executable, "-m", "snowcat.stages", str(run.path), stage], check=True, capture_output=True)
    shutil.copytree(run.path, root / "straight", symlinks=True)
    Snowcat(root)("resume", root / "straight", env=ENV, check=True)
    return run.path, root / "straight"


def preempt_local(before_rl, tmp_path: Path, ranks_to_signal) -> tuple[Path, str, int]:
    """Start the RL stage with the local executor's command and environment, send SIGUSR2 to
    `ranks_to_signal(world)` after update 2; (run dir, the stage's log, mpirun's exit code)."""
    run_dir = tmp_path / "run"
    shutil.copytree(before_rl[0], run_dir, symlinks=True)
    run = RunDir.open(run_dir)
    cfg = run.config()
    executor = LocalExecutor(run, build(cfg), cfg)
    unit = Unit("rl")
    world = executor.world_size(executor.dag["rl"])
    log_path = run.log_path(unit)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            executor.command(unit), stdout=log, stderr=subprocess.STDOUT, env={**executor._env(unit), **ENV}, cwd=tmp_path
        )
    try:
        pids = rank_pids(proc.pid, world)
        wait_for_step(run.unit_dir(unit) / "metrics_history.jsonl", 2, proc)
        for rank in ranks_to_signal(world):
            os.kill(pids[rank], signal.SIGUSR2)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return run_dir, log_path.read_text(), code


def resume_matches(run_dir: Path, straight: Path, tmp_path: Path) -> None:
    Snowcat(tmp_path)("resume", run_dir, env=ENV, check=True)
    assert RunDir.open(run_dir).is_done(Unit("rl"))
    assert final_sha(run_dir) == final_sha(straight)
    assert rl_history(run_dir) == rl_history(straight)


@pytest.mark.slow
def test_usr2_to_every_rank_trainer_saves_first_all_exit_75_and_resume_is_bit_identical(before_rl, tmp_path):
    run_dir, log, code = preempt_local(before_rl, tmp_path, lambda world: range(world))
    assert code == PREEMPTED_EXIT_CODE, log[-4000:]
    assert_coordinated_stop(run_dir, log, world=3, updates=RUN_UPDATES)
    assert RunDir.open(run_dir).record("rl")["status"] == "preempted"
    resume_matches(run_dir, before_rl[1], tmp_path)


@pytest.mark.slow
def test_usr2_to_one_rollout_rank_only_stops_every_rank_cleanly(before_rl, tmp_path):
    """Rank 1 alone sees the notice: it tells the trainer, which saves and tells rank 2, which has
    seen nothing; all three leave with 75 after the save, and the run resumes bit-identically."""
    run_dir, log, code = preempt_local(before_rl, tmp_path, lambda world: [1])
    assert code == PREEMPTED_EXIT_CODE, log[-4000:]
    assert_coordinated_stop(run_dir, log, world=3, updates=RUN_UPDATES)
    ev = events(log)
    assert any(r == 0 and "rollout rank 1's notice" in what for r, _, what, _ in ev)
    assert not any(r == 2 and "notice" in what for r, _, what, _ in ev)  # rank 2 learnt it from the trainer
    resume_matches(run_dir, before_rl[1], tmp_path)


# --- the stage by itself: file queue (single process, and two ranks with transport: file) ------------

_CHILD = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    sys.path.insert(0, os.environ["PYTHONPATH"])
    from tests.rl_stage import make_ctx
    import snowcat.stages.rl as rl
    inputs, run_dir, over = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    rank, world = int(os.environ.get("OMPI_COMM_WORLD_RANK", 0)), int(os.environ.get("OMPI_COMM_WORLD_SIZE", 1))
    ctx = make_ctx(inputs, run_dir, rank=rank, world=world, **over)
    ctx.signal.install()  # as the runner does: SIGUSR2 and SIGTERM set the notice
    try:
        rl.run(ctx)
    except ctx.Preempted:
        print("rank", rank, "{left}", flush=True)
        sys.exit({code})
""").format(left=LEFT, code=PREEMPTED_EXIT_CODE)
STAGE = {"updates": 16, "save_every": 0, "eval_every": 0, "timeout_s": 120}


@pytest.fixture(scope="module")
def stage_inputs(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(inputs, child script, an uninterrupted single-process run of STAGE)."""
    root = tmp_path_factory.mktemp("rl_preempt_stage")
    build_inputs(root / "inputs")
    script = root / "child.py"
    script.write_text(_CHILD)
    rl.run(make_ctx(root / "inputs", root / "straight", **STAGE))
    return root / "inputs", script, root / "straight"


def _stage_run(stage_inputs, run_dir: Path, over: dict, mpi: bool, signal_ranks: list[int]) -> tuple[str, int]:
    inputs, script, _ = stage_inputs
    cmd = [sys.executable, str(script), str(inputs), str(run_dir), json.dumps(over)]
    env = {**os.environ, **ENV}
    if mpi:
        env |= MPI_ENV
        cmd = ["mpirun", "-n", "2", "--oversubscribe", "--bind-to", "none", *cmd]
    out = run_dir / "out.log"
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        pids = rank_pids(proc.pid, 2) if mpi else {0: proc.pid}
        wait_for_step(run_dir / "rl" / "metrics_history.jsonl", 2, proc)
        for rank in signal_ranks:
            os.kill(pids[rank], signal.SIGUSR2)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return out.read_text(), code


def _stage_sha(run_dir: Path) -> str:
    return sha256_file(run_dir / "rl" / "checkpoints" / "final" / "model.safetensors")


@pytest.mark.slow
def test_single_process_file_queue_usr2_checkpoints_and_resumes_bit_identically(stage_inputs, tmp_path):
    log, code = _stage_run(stage_inputs, tmp_path, STAGE, mpi=False, signal_ranks=[0])
    assert code == PREEMPTED_EXIT_CODE, log[-3000:]
    ckpt = latest_checkpoint(tmp_path / "rl" / "checkpoints")
    assert ckpt is not None and verify_manifest(ckpt) == [] and 0 < int(ckpt.name.split("_")[1]) < STAGE["updates"]
    rl.run(make_ctx(stage_inputs[0], tmp_path, **STAGE))
    assert _stage_sha(tmp_path) == _stage_sha(stage_inputs[2])


@pytest.mark.slow
def test_two_ranks_over_the_file_queue_usr2_to_the_trainer_only_stops_both(stage_inputs, tmp_path):
    """transport: file — the rollout rank never waits on an MPI batch send, and never sees the
    notice: it learns of it from the trainer and leaves after the trainer's save."""
    over = {**STAGE, "transport": "file"}
    log, code = _stage_run(stage_inputs, tmp_path, over, mpi=True, signal_ranks=[0])
    assert code == PREEMPTED_EXIT_CODE, log[-3000:]
    ckpt = latest_checkpoint(tmp_path / "rl" / "checkpoints")
    assert ckpt is not None and verify_manifest(ckpt) == []
    step = int(ckpt.name.split("_")[1])
    ev = events(log)
    saved = [t for r, _, what, t in ev if r == 0 and what.startswith(f"preemption: checkpoint of step {step} saved")]
    left = [
        t
        for r, _, what, t in ev
        if r == 1 and what.startswith(f"preemption: leaving after the trainer's checkpoint of step {step}")
    ]
    assert len(saved) == len(left) == 1 and left[0] >= saved[0], log[-3000:]
    assert not any(r == 1 and "notice" in what for r, _, what, _ in ev)
    assert log.count(LEFT) == 2
    rl.run(make_ctx(stage_inputs[0], tmp_path, **over))  # the rest in one process (bit-identical layouts)
    assert _stage_sha(tmp_path) == _stage_sha(stage_inputs[2])


# --- a Slurm hetjob on the local cluster: preempted mid-run, requeued, finished -----------------------


@pytest.mark.cluster
@pytest.mark.slow
def test_rl_hetjob_on_megatron_preempted_mid_run_requeues_and_finishes_bit_identically(snowcat, slurm_env, tmp_path):
    """`scancel --signal=USR2` sends the notice to every task of the hetjob's step, as Slurm's
    `--signal=USR2@margin` does before the walltime: the trainer saves while the rollout ranks
    wait, the job requeues itself and resumes from that checkpoint to the end, with the weights of
    an uninterrupted local run."""
    # the trainer is megatron's, two ranks under tensor parallelism beside one rollout rank
    # (docs/megatron.md): the layout's checkpoint resumes as the torch backend's does
    text = config_text(updates=6, rollouts=1).replace("    eval_tasks: 0\n", "    eval_tasks: 0\n    backend: megatron\n", 1)
    text = text.replace("    timeout_s: 120\n", "    timeout_s: 120\n    backend: megatron\n    tensor_parallel: 2\n")
    text = text.replace("trainer: {nodes: 1, tasks_per_node: 1}", "trainer: {nodes: 1, tasks_per_node: 2}")
    cfg = write_config(tmp_path / "rl.yaml", text)
    run_dir = tmp_path / "slurm"
    env = {**slurm_env, **ENV}
    snowcat("run", cfg, *on_local_slurm(run_dir), env=env, check=True)
    history = run_dir / "stages" / "rl" / "metrics_history.jsonl"
    deadline = time.monotonic() + 600
    while logged_step(history) < 2:
        assert time.monotonic() < deadline, snowcat.status(run_dir)
        time.sleep(0.05)
    job = RunDir.open(run_dir).record("rl")["slurm_job_id"]
    subprocess.run(["scancel", "--signal=USR2", job], env=env, check=True)

    # meanwhile (it shares the 2 cores): RL uninterrupted, locally, from the same tasks and SFT
    straight = reference_from(run_dir, tmp_path / "straight", cfg, [], ["tasks", "sft"])
    resumed = snowcat("resume", straight, env=ENV, check=True)
    assert "skipping done stages (outputs verified): tasks, sft" in resumed.stderr, resumed.stderr[-3000:]
    status = wait_status(run_dir, {"done", "failed", "cancelled"}, timeout=600)
    assert {s["status"] for s in status["stages"].values()} == {"done"}, status
    record = RunDir.open(run_dir).record("rl")
    assert record.get("continuations_used", 0) == 1, record  # requeued once, by the notice
    assert final_sha(run_dir) == final_sha(straight)
    assert rl_history(run_dir) == rl_history(straight)
    # the per-rank Slurm logs: the trainer's checkpoint was complete before any rollout rank left
    log = "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "slurm" / "rl").glob("*.out")))
    ev = events(log)
    saved = [t for r, _, what, t in ev if r == 0 and "checkpoint of step" in what and "saved" in what]
    left = [t for _, role, what, t in ev if role == "rollout" and "leaving after" in what]
    assert len(saved) == 1 and len(left) == 1, log[-4000:]
    assert all(t >= saved[0] for t in left), log[-4000:]
    assert log.count(LEFT) == 3  # every rank returned 75 (before the requeue's KillWait ran out)
    meta = json.loads((latest_checkpoint(run_dir / "stages" / "rl" / "checkpoints") / "meta.json").read_text())
    assert (meta["backend"], meta["world_size"]) == ("megatron", 2)
    audit = snowcat("audit", run_dir, env=env)
    assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr[-2000:]
