"""Shared fixtures: run the real CLI in a subprocess, as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "configs" / "demo.yaml"


class Snowcat:
    """Runs `snowcat ARGS` (the real CLI entry point) with cwd in a temp dir."""

    def __init__(self, cwd: Path):
        self.cwd = cwd

    def __call__(self, *args: str, check: bool = False, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, "-m", "snowcat.pipeline.cli", *map(str, args)], cwd=self.cwd, capture_output=True, text=True,
            env={**os.environ, **(env or {})}, timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"snowcat {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def popen(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "snowcat.pipeline.cli", *map(str, args)], cwd=self.cwd, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})},
        )

    def terminal(self, *args: str, env: dict | None = None, timeout: float = 300, columns: int = 200,
                 interrupt_after: str | None = None) -> tuple[int, str]:
        """`snowcat ARGS` on a pseudo-terminal, as a person runs it: rich sees a terminal (live view,
        colours). Returns (exit code, everything it printed). With `interrupt_after`, Ctrl-C is
        typed once that text has been printed."""
        import fcntl
        import pty
        import select
        import signal
        import termios
        import time

        leader, follower = pty.openpty()
        term = {"TERM": "xterm-256color", "COLUMNS": str(columns), "LINES": "50"}
        proc = subprocess.Popen([sys.executable, "-m", "snowcat.pipeline.cli", *map(str, args)], cwd=self.cwd,
                                stdin=follower, stdout=follower, stderr=follower, start_new_session=True,
                                preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),  # its controlling terminal
                                env={**os.environ, **term, **(env or {})})
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
                raise AssertionError(f"snowcat {' '.join(map(str, args))} on a terminal ran past {timeout}s:\n"
                                     + b"".join(chunks).decode(errors="replace")[-3000:])
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            os.close(leader)
        return proc.returncode, b"".join(chunks).decode(errors="replace")

    def status(self, run_dir: Path) -> dict:
        return json.loads(self("status", run_dir, "--json", check=True).stdout)


@pytest.fixture
def snowcat(tmp_path: Path) -> Snowcat:
    return Snowcat(tmp_path)


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


from tests.cluster_fixtures import sbatch, slurm_cluster, slurm_env  # noqa: E402,F401  (the local Slurm cluster)
