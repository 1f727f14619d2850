"""Shared fixtures: run the real CLI in a subprocess, as a user would; the small real runs that several
test files share; contexts for one stage outside a run."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from snowcat.pipeline.dag import Unit, build
from snowcat.pipeline.rundir import RunDir
from snowcat.pipeline.runner import make_context
from tests.budget import longest_first, pytest_addoption, pytest_configure  # noqa: F401 (the slow tier's time budget: --budget)
from tests.cluster_fixtures import sbatch, slurm_cluster, slurm_env  # noqa: F401 (fixtures of the local Slurm cluster)

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "configs" / "demo.yaml"
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_btl": "self,tcp",
}  # as root, over loopback TCP


def mpirun(ranks: int, script: Path, *args, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python script args...` as `ranks` ranks of one Open MPI world, output captured; `env`: the
    environment the ranks start from (default this process's), with MPI_ENV and the repository on
    the import path."""
    return subprocess.run(
        ["mpirun", "-n", str(ranks), "--oversubscribe", "--bind-to", "none", sys.executable, str(script), *map(str, args)],
        capture_output=True,
        text=True,
        env={**(os.environ if env is None else env), **MPI_ENV, "PYTHONPATH": str(REPO)},
        timeout=timeout,
        cwd=REPO,
    )


def _run(cmd: list[str], cwd: Path, env: dict | None, timeout: float) -> subprocess.CompletedProcess:
    """Like subprocess.run(capture_output=True, text=True), but a time-out or an interrupted test stops
    the whole process tree (the CLI's stage processes included), not only its first process."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class Snowcat:
    """Runs `snowcat ARGS` (the real CLI entry point) with cwd in a temp dir."""

    def __init__(self, cwd: Path):
        self.cwd = cwd

    def __call__(
        self, *args: str, check: bool = False, env: dict | None = None, timeout: float = 600
    ) -> subprocess.CompletedProcess:
        proc = _run([sys.executable, "-m", "snowcat.pipeline.cli", *map(str, args)], self.cwd, env, timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"snowcat {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def popen(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "snowcat.pipeline.cli", *map(str, args)],
            cwd=self.cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )

    def terminal(
        self, *args: str, env: dict | None = None, timeout: float = 300, columns: int = 200, interrupt_after: str | None = None
    ) -> tuple[int, str]:
        """`snowcat ARGS` on a pseudo-terminal, as a person runs it: rich sees a terminal (live view,
        colours). Returns (exit code, everything it printed). With `interrupt_after`, Ctrl-C is
        typed once that text has been printed."""

        leader, follower = pty.openpty()
        term = {"TERM": "xterm-256color", "COLUMNS": str(columns), "LINES": "50"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "snowcat.pipeline.cli", *map(str, args)],
            cwd=self.cwd,
            stdin=follower,
            stdout=follower,
            stderr=follower,
            start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),  # its controlling terminal
            env={**os.environ, **term, **(env or {})},
        )
        os.close(follower)
        chunks: list[bytes] = []
        deadline = time.monotonic() + timeout
        interrupted = False
        try:
            while time.monotonic() < deadline:
                if select.select([leader], [], [], 0.2)[0]:
                    try:
                        data = os.read(leader, 65536)
                    except OSError:  # EIO: every writer of the terminal has gone
                        break
                    if not data:
                        break
                    chunks.append(data)
                if interrupt_after and not interrupted and interrupt_after.encode() in b"".join(chunks):
                    os.write(leader, b"\x03")  # the terminal turns it into SIGINT for the foreground group
                    interrupted = True
                if proc.poll() is not None and not select.select([leader], [], [], 0.2)[0]:
                    break
            else:
                raise AssertionError(
                    f"snowcat {' '.join(map(str, args))} on a terminal ran past {timeout}s:\n"
                    + b"".join(chunks).decode(errors="replace")[-3000:]
                )
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            os.close(leader)
        return proc.returncode, b"".join(chunks).decode(errors="replace")

    def status(self, run_dir: Path) -> dict:
        return json.loads(self("status", run_dir, "--json", check=True).stdout)


@pytest.fixture(scope="module", autouse=True)
def no_process_group_outlives_its_module():
    """An in-process vLLM engine forms torch.distributed's default group and keeps it (with its own
    handle on it) for the life of the worker process: a later module's DeepSpeed then found a group
    it had not made, without the variables it sets when it makes one, and a later vLLM engine, its
    old handle on a group another test had destroyed. Each module's groups end with it."""
    yield
    if "vllm.distributed.parallel_state" in sys.modules:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory  # noqa: PLC0415 (vLLM tests only)

        cleanup_dist_env_and_memory()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def snowcat(tmp_path: Path) -> Snowcat:
    return Snowcat(tmp_path)


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --- the shared small real runs ----------------------------------------------------------------
#
# Made through the CLI once per session, on first use, and shared by every test that reads one
# (export, audit, card, scan: `full_run`; reproduce: `tiny_run`). A test that changes a run copies
# it first. Each takes minutes on a busy 2-core machine: the tests that use one are marked slow.

# Built at run time so this source file never holds a credential-shaped literal.
PLANTED = {
    "HF_TOKEN": "hf_" + "planted123" + "Q7xZ" * 6,
    "DAYTONA_API_KEY": "dtn_" + "planted" + "k4Rw9" * 5,
}

TINY = """\
name: tiny
seed: 7
description: tasks, tiny SFT, evaluate, export, card, scan (test run)
executor: {kind: local, max_parallel: 1}
stages:
  tasks:
    kind: tasks
    domains:
      closure: {count: 60, val_count: 12, difficulties: [1, 2]}
      arith: {count: 60, val_count: 12, difficulties: [2]}
  sft:
    kind: sft
    needs: [tasks]
    model: demo-tiny
    tokenizer_vocab_size: 320
    seq_len: 64
    batch_rows: 4
    steps: 20
    warmup_steps: 2
    save_every: 10
    threads: 1
    eval_tasks: 4
    eval_max_new_tokens: 8
"""

FULL = (
    TINY
    + """\
  eval:
    kind: evaluate
    needs: [tasks, sft]
    checkpoints: ["sft:initial", "sft:final"]
    limit: 8
    attempts: 2
    pass_k: [1, 2]
    max_tokens: 8
    bootstrap_samples: 100
  export:
    kind: export
    needs: [sft]
    max_shard_mb: 2  # several shards + index, as real exports have
    probe_rows: 2
    probe_len: 16
    max_new_tokens: 8
  card:
    kind: card
    needs: [tasks, sft, eval, export]
  scan:
    kind: scan
    needs: [tasks, sft, eval, export, card]
"""
)

# the tiny run, plus RL and an export of its best checkpoint: the stages whose timings and embedded
# checkpoint hashes made a faithful reproduction of the demo read DIFFERS
TINY_RL = (
    TINY
    + """\
  rl:
    kind: rl
    needs: [tasks, sft]
    updates: 4
    tasks_per_update: 4
    attempts: 4
    max_tokens: 8
    lag: 1
    eval_every: 2
    eval_tasks: 8
    eval_attempts: 1
    save_every: 2
    threads: 1
  export:
    kind: export
    needs: [rl]
    probe_rows: 2
    probe_len: 16
    max_new_tokens: 8
"""
)


SHARED_RUN_TIMEOUT_S = 1800  # the pytest timeout of a test that builds a shared run (pytestmark of its file)


def snowcat_in_repo(*args, timeout: float = SHARED_RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    """`snowcat ARGS` run from the repository, as audit, card and reproduce are run from a checkout."""
    return Snowcat(REPO)(*args, timeout=timeout)


def make_run(root: Path, config: str, name: str = "run", env: dict | None = None) -> Path:
    """`snowcat run` of `config` into root/name (the config saved as root/name.yaml); the run directory."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{name}.yaml").write_text(config)
    Snowcat(root)("run", root / f"{name}.yaml", "--run-dir", root / name, env=env, timeout=SHARED_RUN_TIMEOUT_S, check=True)
    return root / name


@pytest.fixture(scope="session")
def full_run(tmp_path_factory) -> Path:
    """tasks → tiny SFT → evaluate → export → card → scan, started with the PLANTED credentials in its
    environment (the scan test checks that none of them reaches any file of the run)."""
    return make_run(tmp_path_factory.mktemp("shared-full"), FULL, env=PLANTED)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """tasks → tiny SFT → tiny RL → export."""
    return make_run(tmp_path_factory.mktemp("shared-tiny"), TINY_RL)


# --- one stage outside a run -----------------------------------------------------------------


def runner_context(run_dir: Path, stage: str, cfg=None):
    """The context the runner hands `stage` of the run at `run_dir` (its own config unless `cfg`, a
    loaded run config, is given): typed run config included, for stages that read the whole run."""

    run = RunDir.open(run_dir)
    cfg = run.config() if cfg is None else cfg
    return make_context(run, build(cfg)[stage], Unit(stage), cfg)


# --- markers -----------------------------------------------------------------------------------

# A test that uses one of these fixtures must carry the marker: `cluster` keeps the default run off the
# Slurm cluster, `slow` keeps the minutes a shared run takes out of it.
MARKER_OF_FIXTURE = {
    "slurm_cluster": "cluster",
    "slurm_env": "cluster",
    "sbatch": "cluster",
    "full_run": "slow",
    "tiny_run": "slow",
}


@pytest.hookimpl(tryfirst=True)  # before xdist's worker hook, which reads xdist_group to name the groups
def pytest_collection_modifyitems(config, items):
    missing = [
        f"{item.nodeid} (uses {fixture}: mark it {marker})"
        for item in items
        for fixture, marker in MARKER_OF_FIXTURE.items()
        if fixture in getattr(item, "fixturenames", ()) and item.get_closest_marker(marker) is None
    ]
    if missing:
        raise pytest.UsageError("tests without the marker their fixtures need:\n  " + "\n  ".join(missing))
    # Under `pytest -n 2 --dist loadgroup` (CI): the Slurm cluster's tests run one after another on one
    # worker (they share the cluster; test_cluster restarts it), and the tests of a shared run (session
    # fixtures; test_rl_vllm's module run) on one worker, which builds it once. The CPU-bound rest runs
    # beside them.
    for item in items:
        names = getattr(item, "fixturenames", ())
        shared = (
            "vllm_run" if item.path.name == "test_rl_vllm.py" else next((f for f in ("full_run", "tiny_run") if f in names), None)
        )
        group = "slurm" if item.get_closest_marker("cluster") else shared
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    if hasattr(config, "workerinput"):  # an xdist worker: the controller hands out tests in this order
        items[:] = longest_first(items)


def masked_runs(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of 1s in a loss mask: the assistant turns of an encoded conversation."""
    runs, start = [], None
    for j, m in enumerate([*mask, 0]):
        if m and start is None:
            start = j
        if not m and start is not None:
            runs.append((start, j))
            start = None
    return runs
