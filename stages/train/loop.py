"""The training loop SFT and RL share, and the two things it keeps: checkpoints and the metrics log.

    loop = SomeLoop(ctx, backend, Checkpoints(...), MetricsLog(...), steps=..., save_every=..., eval_every=...)
    loop.train()        # resume-aware: starts at backend.step (restored from the newest checkpoint)

A stage subclasses `TrainLoop` and says where a step's micro-batches come from (`next_batch`), what
its log line holds (`record`) and what a checkpoint must carry to resume (`client_state`); the loop
owns the order of everything else, which reads as a short list of component calls in `train`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from snowcat.pipeline.fsio import atomic_write_text
from snowcat.pipeline.history import History
from snowcat.pipeline.retention import Retention, RetentionPolicy

from .backend import StepStats
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, save_weights, seed_rng, step_name


class Checkpoints:
    """A stage's `checkpoints/`: resumable `step_NNNNNN/` under a retention policy (every deletion on
    the ledger `retention.json`), the trained model in `final/`, and `best` naming the one to use."""

    def __init__(self, root: str | os.PathLike, backend, tokenizer, policy: RetentionPolicy, meta: dict, *, seed: int):
        self.root, self.backend, self.tokenizer, self.meta, self.seed = Path(root), backend, tokenizer, meta, seed
        # one writer: rank 0 keeps the ledger; every rank writes its part of a checkpoint
        self.retention = Retention(self.root, policy, name="step_{step:06d}") if backend.rank == 0 else None
        self.last_saved: int | None = None

    def path(self, step: int) -> Path:
        return self.root / step_name(step)

    def restore(self) -> dict | None:
        """Load the newest verified checkpoint into the backend; its client state, or None for a fresh
        start, whose generators are then seeded (a retry from `initial` must not inherit another path's)."""
        latest = latest_checkpoint(self.root)
        if latest is None:
            seed_rng(self.seed)
            return None
        client = load_checkpoint(latest, self.backend)
        self.last_saved = self.backend.step
        return client

    def save(self, client_state: dict, metrics: dict | None = None, *, preemption: bool = False) -> bool:
        """Collective. Save the current step (once) and register it with retention; False if already saved.
        `preemption`: a step the schedule does not save (retention keeps it only until the next one)."""
        step = self.backend.step
        if self.last_saved == step and self.path(step).is_dir():
            return False
        save_checkpoint(self.path(step), self.backend, self.tokenizer, client_state, meta=self.meta)
        if self.retention is not None:
            self.retention.register(step, metrics or {}, preemption=preemption)
        self.last_saved = step
        return True

    def finish(self, meta: dict) -> str | None:
        """Collective: `final/` (the trained model) and, by rank 0, `best`; returns the name `best`
        points to (None on the other ranks)."""
        save_weights(self.root / "final", self.backend, self.tokenizer, meta={**meta, "step": self.backend.step})
        if self.retention is None:
            return None
        best_step = self.retention.best()
        best = step_name(best_step) if best_step is not None else "final"
        atomic_write_text(self.root / "best", best + "\n")
        return best


class MetricsLog:
    """`metrics_history.jsonl` (one line per step; rank 0) and the run's `history.h5`.

    On resume, lines after the restored step are dropped: they belong to a future that was lost,
    and the resumed run writes them again (history.h5 drops them itself on the next append)."""

    def __init__(self, path: str | os.PathLike, *, restored_step: int | None, stage: str, run_dir, writer: bool = True):
        self.path, self.stage, self.writer = Path(path), stage, writer
        self.records: list[dict] = []
        if restored_step is not None and self.path.is_file():
            self.records = [r for r in map(json.loads, self.path.read_text().splitlines()) if r["step"] <= restored_step]
        self.history = History(run_dir) if writer else None
        self._file = None
        if writer:
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
            self._file = self.path.open("a")

    def append(self, rec: dict) -> None:
        self.records.append(rec)
        if not self.writer:
            return
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        self.history.append(self.stage, rec["step"], {k: v for k, v in rec.items() if k != "step" and _is_number(v)})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


GPU_PEAK = "memory/peak_gpu_allocated_gib"
CPU_PEAK = "memory/peak_rss_gib"


def _peak_rss_bytes() -> int:
    """This process's resident-set high-water mark: VmHWM where /proc has it, since Linux keeps
    getrusage's ru_maxrss across exec (a stage would inherit its launcher's); else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024
    except (OSError, StopIteration):
        import resource  # noqa: PLC0415 (the fallback only)

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def peak_memory(device) -> dict[str, float]:
    """The largest rank's peak memory so far, in GiB, named for what it counts (collective: every
    rank of the backend's group calls it after the same step). On a GPU the device memory torch
    allocated at most (torch.cuda.max_memory_allocated: tensors, not the allocator's cache or the
    CUDA context); on the CPU the process's peak resident set, which also counts the interpreter,
    libraries and whatever the allocator kept. `snowcat plan --compare` puts it beside the plan."""
    on_gpu = getattr(device, "type", "cpu") == "cuda"
    peak = torch.cuda.max_memory_allocated(device) if on_gpu else _peak_rss_bytes()
    value = torch.tensor(float(peak), dtype=torch.float64, device=device if on_gpu else "cpu")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return {GPU_PEAK if on_gpu else CPU_PEAK: round(float(value) / 2**30, 3)}


class TrainLoop:
    """Resume → (preempted? save, stop) → batch → step → record → evaluate? → log → save?, to `steps`.

    The last step is always saved as a resumable checkpoint, so a finished stage can be continued
    (raise `steps` and run again)."""

    unit = "steps"

    def __init__(
        self, ctx, backend, checkpoints: Checkpoints, log: MetricsLog, *, steps: int, save_every: int, eval_every: int = 0
    ):
        self.ctx, self.backend, self.checkpoints, self.log = ctx, backend, checkpoints, log
        self.steps, self.save_every, self.eval_every = steps, save_every, eval_every
        self.train_seconds = 0.0  # of this process's run of the loop (a resumed run counts from its restart)
        self.tokens_processed = 0.0  # input tokens stepped over in that time
        self.margin_warned = False  # said once that a checkpoint outlasts half the preemption notice

    # ---------------------------------------------------------------- what a stage provides

    def next_batch(self, k: int) -> list[dict]:
        """The micro-batches of update k+1 (may raise ctx.Preempted after saving)."""
        raise NotImplementedError

    def loss_fn(self, model, batch: dict, n_tokens: float, n_micro: int):
        raise NotImplementedError

    def record(self, stats: StepStats, batch: list[dict]) -> dict:
        """The log line of a step (besides `step`)."""
        return stats.record()

    def client_state(self) -> dict:
        """What a checkpoint carries besides weights, optimizer and RNG (data position, versions...)."""
        return {}

    def evaluate(self) -> dict:
        return {}

    def after_step(self) -> None:
        """Right after the optimizer step (RL publishes the new weights here)."""

    def progress_numbers(self, rec: dict) -> dict:
        return {"loss": rec.get("loss", float("nan"))}

    # ---------------------------------------------------------------- the loop

    @property
    def step(self) -> int:
        return self.backend.step

    def scheduled(self, step: int) -> bool:
        """Whether an uninterrupted run saves `step` (`train` below); any other save is a preemption's."""
        due = self.steps == step or (self.save_every and step % self.save_every == 0)
        return step > 0 and bool(due or (self.eval_every and step % self.eval_every == 0))

    def save(self, rec: dict | None = None) -> bool:
        t0 = time.perf_counter()
        saved = self.checkpoints.save(self.client_state(), rec, preemption=not self.scheduled(self.step))
        self._check_margin(time.perf_counter() - t0)
        return saved

    def _check_margin(self, seconds: float) -> None:
        """Say so when a checkpoint takes more than half the time the preemption notice leaves (the
        step in progress must finish too): at the end of a job it would be killed half-written."""
        margin = self.ctx.config.resume.signal_margin_s
        if seconds > margin / 2 and not self.margin_warned and self.ctx.rank == 0:
            self.margin_warned = True
            print(
                f"[snowcat] {self.ctx.name}: a checkpoint took {seconds:.1f} s, but the preemption notice comes only "
                f"resume.signal_margin_s={margin} s before the end of a job: raise it to at least {int(2 * seconds) + 1}",
                file=sys.stderr,
                flush=True,
            )

    def _eval_due(self) -> bool:
        return bool(self.eval_every) and (self.step % self.eval_every == 0 or self.step == self.steps)

    def _register_restored(self) -> None:
        """The restored checkpoint, when a process killed between its save and its registration left it
        off the retention ledger: registered as the save would have (its log line's metrics when that
        step was evaluated), or retention never deletes it and the ledger differs from an uninterrupted run's."""
        retention, step = self.checkpoints.retention, self.checkpoints.last_saved
        if retention is None or step is None or step in retention.registered():
            return
        evaluated = bool(self.eval_every) and (step % self.eval_every == 0 or step == self.steps)
        rec = next((r for r in self.log.records if r.get("step") == step), {}) if evaluated else {}
        retention.register(step, rec, preemption=not self.scheduled(step))

    def train(self) -> None:
        ctx, t_start = self.ctx, time.perf_counter()
        self._register_restored()
        try:
            if self.step == 0 and self.eval_every and not self.log.records:  # the initial model's score: row 0
                self.log.append({"step": 0, **self.evaluate()})
            while self.step < self.steps:
                if ctx.checkpoint_due():
                    self.save()
                    raise ctx.Preempted(f"{ctx.name}: checkpointed at step {self.step}")
                batch = self.next_batch(self.step)
                stats = self.backend.train_step(batch, self.loss_fn)
                self.tokens_processed += stats.input_tokens
                self.after_step()
                rec = {"step": self.step, **self.record(stats, batch), **peak_memory(getattr(self.backend, "device", "cpu"))}
                evaluated = self._eval_due()
                if evaluated:
                    rec.update(self.evaluate())
                self.log.append(rec)
                ctx.progress(self.step, self.steps, unit=self.unit, **self.progress_numbers(rec))
                if self.step == self.steps or evaluated or (self.save_every and self.step % self.save_every == 0):
                    self.save(rec if evaluated else None)
            self.save()  # a no-op unless the run resumed at the last step
        finally:
            self.log.close()
            self.train_seconds = time.perf_counter() - t_start
