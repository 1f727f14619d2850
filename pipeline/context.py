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

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import checkpoint_dir
from snowcat.pipeline.schema import HF_PREFIX, RunConfig, resolve_hf
from snowcat.pipeline.sweep import input_units, ref_unit, unit_path

from .unitprogress import PROGRESS_FILE, ProgressReporter

NOTICE_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
_EARLY_NOTICE = threading.Event()  # a notice that came before any stage context listened
_FIRST_NOTICE: list[int] = []  # the signal of this process's first notice


def _noticed(signum: int) -> None:
    if not _FIRST_NOTICE:
        _FIRST_NOTICE.append(signum)


def first_notice() -> int | None:
    """Which signal this process was first told to end by: SIGUSR2 (the `--signal` notice before a
    walltime), SIGTERM (a cancel: `scancel`, `snowcat cancel`), or None (no signal of its own)."""
    return _FIRST_NOTICE[0] if _FIRST_NOTICE else None


def catch_notice_early() -> None:
    """Keep the scheduler's end-of-job notice from the first moment a job's process runs.

    Slurm sends `--signal` up to a minute before the time it is asked for (its timeout check runs
    periodically), so a short job can be warned while it is still starting. Before the stage's
    own handler is installed, SIGUSR2 would kill the process (its default action), or reach
    submitit's handler, which requeues — refused where `--no-requeue` is set, and the unit's job
    is lost. Caught here, the notice is handed to the stage's CheckpointSignal when it installs.
    """
    for sig in NOTICE_SIGNALS:
        signal.signal(sig, lambda signum, _: (_noticed(signum), _EARLY_NOTICE.set()))


class CheckpointSignal:
    """Set when the scheduler warns that the job will end soon (SIGUSR2 from `--signal`, SIGTERM).

    A long stage polls `ctx.checkpoint_due()` between steps, saves atomically, and returns early by
    raising `ctx.Preempted`; the runner then exits with PREEMPTED_EXIT_CODE so the executor knows
    to requeue or continue the stage instead of marking it failed.
    """

    def __init__(self) -> None:
        self._event = threading.Event()

    def install(self, signals: tuple[int, ...] = NOTICE_SIGNALS) -> None:
        for sig in signals:
            signal.signal(sig, lambda signum, _: (_noticed(signum), self._event.set()))
        if _EARLY_NOTICE.is_set():  # checked after installing: a notice in between sets ours directly
            self._event.set()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


class Preempted(Exception):
    """Raised by a stage after it saved a checkpoint because its job is about to end."""


# Exit code of a stage process that checkpointed and wants to be continued (not a failure).
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL


class Inputs(dict):
    """Needed stage name -> its output directory (a fanned-out stage: the stage's root).

    A stage-input key may name one unit of a fanned-out stage (`select.probe: probe[temperature=0.5]`,
    pipeline/sweep.py): looking that name up gives the unit's directory, so a stage reads
    `ctx.inputs[cfg.probe]` either way. Iterating lists the needed stages only (what provenance
    records). Names a run's config could not resolve were refused when it loaded."""

    def __init__(self, dirs: dict[str, Path], stages: dict[str, Any] | None):
        super().__init__(dirs)
        self._stages = stages

    def unit_dirs(self, value: str) -> list[Path]:
        """The directories `value` names: one, or every unit of a fanned-out stage named alone."""
        stage, indices = input_units(value, self._stages)
        if not dict.__contains__(self, stage):  # dict.__getitem__ would call __missing__ again, endlessly
            raise KeyError(stage)
        return [unit_path(dict.__getitem__(self, stage), i) for i in indices]

    def __missing__(self, key: str) -> Path:
        try:
            dirs = self.unit_dirs(key)
        except (ValueError, KeyError):
            raise KeyError(key) from None
        if len(dirs) != 1:
            raise KeyError(key)
        return dirs[0]

    def __contains__(self, key: object) -> bool:
        if dict.__contains__(self, key):
            return True
        try:
            self[key]
        except KeyError:
            return False
        return True


@dataclass
class StageContext:
    name: str  # stage name in the config, e.g. "eval_sft"
    kind: str  # stage kind, e.g. "evaluate"
    config: Any  # this stage's section: its kind's config dataclass (stages/config.py) + the common keys
    run_config: RunConfig | None  # the whole resolved run config, as objects (None: a standalone stage)
    run_dir: Path
    out_dir: Path  # where this stage (or this fan-out item) writes its outputs
    inputs: dict[str, Path]  # needed stage name (or one unit's name) -> its output dir: an `Inputs`
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

    def __post_init__(self) -> None:
        self.inputs = Inputs(dict(self.inputs), self.run_config.stages if self.run_config else None)

    @classmethod
    def standalone(
        cls,
        kind: str,
        values: dict | None = None,
        *,
        run_dir: Path,
        inputs: dict[str, Path] | None = None,
        name: str | None = None,
        out_dir: Path | None = None,
        seed: int = 0,
        **fields: Any,
    ) -> StageContext:
        """A context for one stage outside a run (tests, benchmarks, notebooks): the config typed and
        checked as the runner's is (`stage_config`), `needs` = the inputs' names unless given, and
        out_dir = run_dir/name, created."""
        # the configuration layer sits above the context; only this helper for standalone use needs it
        from snowcat.pipeline.config import stage_config  # noqa: PLC0415

        name = name or kind
        inputs = dict(inputs or {})
        config = stage_config(kind, {"needs": list(inputs), **(values or {})}, name=name)
        out_dir = Path(out_dir) if out_dir is not None else Path(run_dir) / name
        out_dir.mkdir(parents=True, exist_ok=True)
        return cls(
            name=name,
            kind=kind,
            config=config,
            run_config=None,
            run_dir=Path(run_dir),
            out_dir=out_dir,
            inputs=inputs,
            seed=seed,
            **fields,
        )

    def checkpoint(self, ref: str, key: str) -> Path:
        """The directory of a needed stage's checkpoint named "<stage>:<name>" by config key `key`
        (which errors name), or of a Hugging Face checkpoint "hf:<dir>" / "hf:<org/name>" (staged)."""
        where = f"stages.{self.name}.{key}"
        if ref.startswith(HF_PREFIX):
            path = resolve_hf(ref, self.staged)
            if path is None:
                raise UserError(
                    f"{where}: {ref!r} is not staged: run the prestage stage that lists it (compute nodes have no internet)"
                )
            return path
        try:
            stage, index, name = ref_unit(ref, self.run_config.stages if self.run_config else None)
        except ValueError as e:
            raise UserError(f"{where}: {e}") from None
        if stage not in self.inputs:
            raise UserError(f"{where}: {ref!r} names stage {stage!r}, which is not in needs ({', '.join(self.inputs) or 'none'})")
        try:
            return checkpoint_dir(unit_path(self.inputs[stage], index), name)
        except UserError as e:
            raise UserError(f"{where}: {ref!r}: {e}") from None

    def progress(self, done: int, total: int, *, unit: str = "steps", phase: str | None = None, **numbers: float) -> None:
        """Report progress (e.g. `ctx.progress(step, steps, loss=0.41, **{"tok/s": 1900})`): shown by the
        live view and `snowcat status`, and logged every 30 s. Only rank 0 reports; call it freely."""
        if self._reporter is None:
            self._reporter = ProgressReporter(Path(self.out_dir) / PROGRESS_FILE, self.name, enabled=self.rank == 0)
        self._reporter(done, total, unit=unit, phase=phase, **numbers)

    def checkpoint_due(self) -> bool:
        """True once the scheduler has announced the end of this job (save now, then raise Preempted)."""
        return self.signal.is_set()

    @property
    def threads(self) -> int:
        return int(os.environ.get("SLURM_CPUS_PER_TASK") or os.cpu_count() or 1)
