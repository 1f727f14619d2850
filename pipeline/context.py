"""What a stage sees while it runs: its config, its inputs, its output dir, its place in the job.

A stage module `stages/<kind>.py` exposes `Config` (a dataclass, the stage's typed config section)
and `run(ctx: StageContext) -> dict` (headline metrics). The stage runner builds the context from
the run directory alone, so the same stage runs identically under the local executor, inside a
Slurm job, or re-run by hand: `python -m snowcat.stages RUN_DIR STAGE [--item I]`.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class CheckpointSignal:
    """Set when the scheduler warns that the job will end soon (SIGUSR2 from `--signal`, SIGTERM).

    A long stage polls `ctx.checkpoint_due()` between steps, saves atomically, and returns early by
    raising `ctx.Preempted`; the runner then exits with PREEMPTED_EXIT_CODE so the executor knows
    to requeue or continue the stage instead of marking it failed.
    """

    def __init__(self) -> None:
        self._event = threading.Event()

    def install(self, signals: tuple[int, ...] = (signal.SIGUSR2, signal.SIGTERM)) -> None:
        for sig in signals:
            signal.signal(sig, lambda *_: self._event.set())

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


class Preempted(Exception):
    """Raised by a stage after it saved a checkpoint because its job is about to end."""


# Exit code of a stage process that checkpointed and wants to be continued (not a failure).
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL


@dataclass
class StageContext:
    name: str  # stage name in the config, e.g. "eval_sft"
    kind: str  # stage kind, e.g. "evaluate"
    config: Any  # this stage's typed config section (DictConfig over the stage's Config dataclass)
    run_config: Any  # the whole resolved run config (read-only)
    run_dir: Path
    out_dir: Path  # where this stage (or this fan-out item) writes its outputs
    inputs: dict[str, Path]  # needed stage name -> its output dir (fan-out: the stage root)
    seed: int  # derived from the run seed, the stage name and the fan-out item
    item: dict[str, Any] | None = None  # this fan-out element's values, e.g. {"checkpoint": "sft"}
    item_index: int | None = None
    rank: int = 0
    world_size: int = 1
    role: str | None = None  # hetjob component / MPI role, e.g. "trainer" or "rollout"
    local_rank: int = 0
    signal: CheckpointSignal = field(default_factory=CheckpointSignal)
    staged: dict[str, Path] = field(default_factory=dict)  # pre-staged artefacts by name (offline sites)
    _reporter: Any = field(default=None, repr=False)

    Preempted = Preempted

    def progress(self, done: int, total: int, *, unit: str = "steps", phase: str | None = None, **numbers: float) -> None:
        """Report progress (e.g. `ctx.progress(step, steps, loss=0.41, **{"tok/s": 1900})`): shown by the
        live view and `snowcat status`, and logged every 30 s. Only rank 0 reports; call it freely."""
        if self._reporter is None:
            from .unitprogress import PROGRESS_FILE, ProgressReporter

            self._reporter = ProgressReporter(Path(self.out_dir) / PROGRESS_FILE, self.name, enabled=self.rank == 0)
        self._reporter(done, total, unit=unit, phase=phase, **numbers)

    def checkpoint_due(self) -> bool:
        """True once the scheduler has announced the end of this job (save now, then raise Preempted)."""
        return self.signal.is_set()

    @property
    def threads(self) -> int:
        return int(os.environ.get("SLURM_CPUS_PER_TASK") or os.cpu_count() or 1)
