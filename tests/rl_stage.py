"""What the RL tests' stage processes and MPI ranks import: the test verifier (named in configs as
`tests.rl_stage:parity_verify`), the small RL stage config and its standalone context. A module of
its own, so that every rank that starts imports this, not a test module with its fixtures and
imports (tests.test_rl: pytest, matplotlib, the conftest; 0.4 s of CPU a process)."""

from __future__ import annotations

from pathlib import Path

from snowcat.pipeline.context import StageContext
from snowcat.stages.taskgen import Verdict

SMALL = dict(
    updates=6,
    tasks_per_update=4,
    attempts=4,
    max_tokens=8,
    lag=1,
    eval_every=3,
    eval_tasks=8,
    eval_attempts=1,
    save_every=2,
    keep_last=1,
    threads=1,
    verifier="tests.rl_stage:parity_verify",
)


def parity_verify(task, text: str) -> Verdict:
    """A test reward that a random model earns about half the time, so advantages are not all zero."""
    passed = len(text) % 2 == 0
    return Verdict(float(passed), passed, "even length" if passed else "odd length")


def make_ctx(
    inputs: Path, run_dir: Path, *, rank: int = 0, world: int = 1, cls: type[StageContext] = StageContext, **over
) -> StageContext:
    role = None if world == 1 else ("trainer" if rank == 0 else "rollout")
    return cls.standalone(
        "rl",
        {**SMALL, **over},
        run_dir=run_dir,
        inputs={"tasks": inputs / "tasks", "sft": inputs / "sft"},
        seed=5,
        rank=rank,
        world_size=world,
        role=role,
    )
