"""One small real run (tasks → tiny SFT → evaluate → export → card → scan) through the CLI, built once
per test session and shared by the export, audit, card and scan tests (they copy it before changing it).

It is started with credentials planted in its environment, so the scan test can check that none of
them reaches any file of the run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from filelock import FileLock

REPO = Path(__file__).resolve().parent.parent

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

FULL = TINY + """\
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


def _run(cmd: list[str], cwd: Path, env: dict | None, timeout: float) -> subprocess.CompletedProcess:
    """Like subprocess.run, but a time-out or an interrupted test stops the whole process tree
    (the CLI's stage processes included), not only its first process."""
    proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def snowcat(*args, cwd: Path, env: dict | None = None, timeout: float = 1800) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "snowcat.pipeline.cli", *map(str, args)], cwd, env, timeout)


def module(name: str, *args, cwd: Path = REPO, timeout: float = 1800) -> subprocess.CompletedProcess:
    """`snowcat <name> ARGS`, run from the repository (audit, card, reproduce)."""
    return _run([sys.executable, "-m", "snowcat.pipeline.cli", name, *map(str, args)], cwd, None, timeout)


def make_run(root: Path, config: str, name: str = "run", env: dict | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{name}.yaml").write_text(config)
    proc = snowcat("run", root / f"{name}.yaml", "--run-dir", root / name, cwd=root, env=env)
    if proc.returncode != 0:
        raise AssertionError(f"snowcat run exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-4000:]}")
    return root / name


def shared_run(tmp_path_factory) -> Path:
    """The full tiny run, made once per session (with PLANTED credentials in its environment)."""
    root = tmp_path_factory.getbasetemp() / "tiny-full"
    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root) + ".lock"):
        run = root / "run"
        if not (run / "stages" / "scan" / "DONE").is_file():
            make_run(root, FULL, env=PLANTED)
    return run
