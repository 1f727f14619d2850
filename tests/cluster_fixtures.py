"""Fixtures for tests that need the local Slurm cluster (slurm/cluster.py); import them in conftest.py.

from cluster_fixtures import slurm_cluster, slurm_env, sbatch  # noqa: F401  (tests/ is on sys.path)
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from snowcat.slurm import cluster


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[cluster.ClusterInfo]:
    """The cluster at $SNOWCAT_CLUSTER_ROOT or <repo>/.cluster: started once for the whole session if
    it is not up, and then stopped when the session ends, failed or interrupted too (one that was
    already up, a developer's, is left up)."""
    was_up = cluster.status()["up"]
    info = cluster.up()
    try:
        yield info
    finally:
        if not was_up:
            cluster.down()


@pytest.fixture
def slurm_env(slurm_cluster, monkeypatch) -> dict[str, str]:
    """This process (and its children) talk to the local cluster: SLURM_CONF is set."""
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    return {**os.environ, **slurm_cluster.env}


@pytest.fixture
def sbatch(slurm_env):
    """sbatch(*args) -> job id; with wait=True blocks until the job ends (sbatch --wait)."""

    def submit(*args: str, wait: bool = False, timeout: float = 300) -> str:
        cmd = ["sbatch", "--parsable", *(["--wait"] if wait else []), *args]
        p = subprocess.run(cmd, env=slurm_env, capture_output=True, text=True, timeout=timeout)
        assert p.returncode == 0, f"{cmd} failed: {p.stderr}"
        return p.stdout.strip().split(";")[0]

    return submit
