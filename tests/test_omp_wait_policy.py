"""The local executor lets a stage's OpenMP threads spin-wait only when they have the machine's cores
to themselves (pipeline/executors/local.py `owns_cores`): spinning beside another busy process cost a
demo SFT step ~2x, sleeping at once cost it ~1.9x on the idle machine (benchmarks/results/omp-wait.json)."""

from __future__ import annotations

import os

import pytest

from snowcat.pipeline.config import load
from snowcat.pipeline.dag import Unit, build
from snowcat.pipeline.executors.local import LocalExecutor
from snowcat.pipeline.rundir import RunDir


def executor(tmp_path, *, max_parallel: int, sft: str) -> LocalExecutor:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"name: omp\nexecutor: {{kind: local, max_parallel: {max_parallel}}}\n"
        f"stages:\n  tasks: {{kind: tasks}}\n  sft: {{kind: sft, needs: [tasks], {sft}}}\n"
    )
    config = load(cfg)
    return LocalExecutor(RunDir.create(config, tmp_path / "run"), build(config), config)


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # CI exports PASSIVE for the whole suite
    monkeypatch.setattr(os, "cpu_count", lambda: 2)


@pytest.mark.parametrize(
    ("max_parallel", "sft", "spins"),
    [
        (1, "threads: 0", True),  # one rank using every core, nothing beside it: the demo's SFT
        (1, "threads: 2", True),
        (1, "threads: 1, resources: {tasks_per_node: 2}", True),  # two ranks of one thread: one core each
        (1, "threads: 0, resources: {tasks_per_node: 2}", False),  # two ranks of two threads on two cores
        (1, "threads: 3", False),  # more threads than cores
        (2, "threads: 0", False),  # another stage may run beside it
    ],
)
def test_threads_spin_only_on_cores_of_their_own(tmp_path, two_cores, max_parallel, sft, spins):
    ex = executor(tmp_path, max_parallel=max_parallel, sft=sft)
    env = ex._env(Unit("sft"))
    assert ex.owns_cores(Unit("sft")) is spins
    assert env.get("OMP_WAIT_POLICY") == (None if spins else "PASSIVE")


@pytest.mark.parametrize("max_parallel", [1, 2])
def test_a_users_own_policy_is_kept(tmp_path, two_cores, monkeypatch, max_parallel):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    ex = executor(tmp_path, max_parallel=max_parallel, sft="threads: 0")
    assert ex._env(Unit("sft"))["OMP_WAIT_POLICY"] == "ACTIVE"
