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
            [sys.executable, "-m", "pipeline.cli", *map(str, args)], cwd=self.cwd, capture_output=True, text=True,
            env={**os.environ, **(env or {})}, timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"snowcat {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def popen(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", *map(str, args)], cwd=self.cwd, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})},
        )

    def status(self, run_dir: Path) -> dict:
        return json.loads(self("status", run_dir, "--json", check=True).stdout)


@pytest.fixture
def snowcat(tmp_path: Path) -> Snowcat:
    return Snowcat(tmp_path)


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


from tests.cluster_fixtures import sbatch, slurm_cluster, slurm_env  # noqa: E402,F401  (the local Slurm cluster)
