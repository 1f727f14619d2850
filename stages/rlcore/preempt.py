"""Preemption across the RL stage's ranks: the trainer saves, rollout ranks wait, then all leave.

The scheduler's notice (SIGUSR2 from `--signal`, SIGTERM) is delivered per process, so it may reach
any subset of the ranks, and in a Slurm hetjob every rank runs in one `srun --kill-on-bad-exit=1`
step: the first rank that exits non-zero gets the others killed. A rollout rank that left as soon as
it saw the notice killed the trainer in the middle of its checkpoint. So:

    rollout rank sees the notice  ──NOTICE──►  trainer (as if it had seen the notice itself)
    trainer sees it (or a NOTICE) ──STOP────►  every rollout rank: stop producing, wait
    trainer finishes its step, saves its checkpoint (atomic), raises Preempted, and at its exit —
    after its runner's bookkeeping (the unit's state; on Slurm the requeue) —
                                  ──BYE─────►  every rollout rank: leave now (Preempted, exit 75)
    normal end:                   ──END─────►  every rollout rank: the stage is done, exit 0
    trainer failed:               ──FAILED──►  every rollout rank: fail too (exit 1)

Rollout ranks thus never exit before the trainer is done with its checkpoint and its own exit
path, whichever rank saw the notice. A rollout rank polls for the trainer's word wherever it waits
(weights, sending a batch, after its last batch); one in the middle of generating a batch answers
when that batch is done. Every wait is bounded by `rl.timeout_s`: without a word from the trainer a
rollout rank leaves with Preempted (if it was told to stop or saw the notice) or returns (after its
last batch: exiting 0 never gets the trainer killed). The messages are tiny (eager) sends on tags of
their own, in the MPI world whatever the trajectory transport is; a single process (world size 1)
has no ranks to coordinate and saves and raises Preempted as before.

With several trainer ranks (data parallel), rank 0 speaks for them: ranks 1..T-1 forward their notice
to it and hear its words as rollout ranks do (`RolloutControl` with role "trainer"), and all trainer
ranks agree on the notice at the top of every step (`TrainerSignal` over their communicator: one
all-reduce of a flag), so they save the same step together and none leaves before rank 0's BYE.
"""

from __future__ import annotations

import atexit
import time
from dataclasses import dataclass

import numpy as np

NOTICE_TAG, CONTROL_TAG = 23, 29
STOP, BYE, END, FAILED = 1, 2, 3, 4
WORDS = {STOP: "stop", BYE: "bye", END: "end", FAILED: "failed"}
SEND_WAIT_S = 30.0  # bound on completing a control send (they are eager: in practice immediate)


def log(rank: int, role: str, text: str) -> None:
    """One line in the unit's log, with a wall-clock time (`t=`) to order the ranks' events."""
    print(f"[rl] rank {rank} {role}: {text} (t={time.time():.3f})", flush=True)


def _complete(requests: list, timeout_s: float) -> bool:
    from mpi4py import MPI  # noqa: PLC0415 (importing mpi4py initialises MPI: only in ranks that use it)

    deadline = time.monotonic() + timeout_s
    while not MPI.Request.Testall(requests):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


class TrainerSignal:
    """`ctx.signal` for a trainer rank of a multi-rank run. `local()`: this rank's view (rank 0: its
    own notice or another rank's NOTICE, and the first time it reads set every other rank is told to
    stop; ranks 1..T-1: their own notice or rank 0's STOP). With several trainer ranks (`group`, their
    communicator) each read is collective: the flag all-reduced, so every trainer rank stops at the
    same step; `on_agreed()` then runs (rank 0: tell the others to stop, if a peer saw it first)."""

    def __init__(self, own, local, group=None, on_agreed=None):
        self.own, self.local, self.group, self.on_agreed = own, local, group, on_agreed

    def is_set(self) -> bool:
        if self.group is None:
            return self.local()
        from mpi4py import MPI  # noqa: PLC0415

        agreed = bool(self.group.allreduce(int(self.local()), op=MPI.MAX))
        if agreed and self.on_agreed is not None:
            self.on_agreed()
        return agreed

    def set(self) -> None:
        self.own.set()

    def install(self, *args, **kwargs) -> None:
        self.own.install(*args, **kwargs)


class TrainerControl:
    """Rank 0's side: hears the other ranks' notices, tells them to stop, to leave, or that it ended.
    Ranks 1..trainers-1 are the other trainer ranks, the rest rollout ranks."""

    def __init__(self, comm, trainers: int = 1):
        from mpi4py import MPI  # noqa: PLC0415

        self.comm, self.trainers = comm, trainers
        self.others = list(range(1, comm.Get_size()))
        self.stopping = False
        self._notice = np.zeros(1, np.int64)
        self._notice_req = comm.Irecv(self._notice, source=MPI.ANY_SOURCE, tag=NOTICE_TAG)
        self._sends: list = []
        self._bufs: list = []  # kept alive until their sends complete
        self._said_last = False

    def due(self, own: bool, agreed: bool = False) -> bool:
        """Whether to stop; the first time, tell the others. `agreed`: the trainer ranks' all-reduce
        said stop, so if this rank saw nothing, a peer did and its NOTICE (sent before the
        all-reduce) is on the way: wait for it, to name the rank in the log."""
        if self.stopping:
            return True
        if own:
            who = "its own notice"
        elif self._notice_req.Test() or (agreed and _complete([self._notice_req], SEND_WAIT_S)):
            rank = int(self._notice[0])
            who = f"{'trainer' if rank < self.trainers else 'rollout'} rank {rank}'s notice"
        elif agreed:
            who = "another trainer rank's notice"
        else:
            return False
        self.stopping = True
        self._tell(STOP)
        log(0, "trainer", f"preemption ({who}): {self._whom()} told to stop; checkpoint after the step in progress")
        return True

    def _tell(self, word: int, step: int = -1) -> None:
        buf = np.array([word, step], np.int64)
        self._bufs.append(buf)
        self._sends += [self.comm.Isend(buf, dest=r, tag=CONTROL_TAG) for r in self.others]

    def _whom(self) -> str:
        return "rollout ranks" if self.trainers == 1 else "the other trainer ranks and rollout ranks"

    def _last_word(self, word: int, step: int = -1) -> None:
        if self._said_last:
            return
        self._said_last = True
        self._tell(word, step)
        if not _complete(self._sends, SEND_WAIT_S):
            log(0, "trainer", f"{self._whom()} did not take '{WORDS[word]}' within {SEND_WAIT_S:.0f}s")
        if self._notice_req:  # still posted: no rollout rank saw a notice (one that comes now is too late)
            self._notice_req.Cancel()
            self._notice_req.Wait()

    def finished(self) -> None:
        self._last_word(END)

    def failed(self) -> None:
        self._last_word(FAILED)

    def preempted(self, step: int) -> None:
        """The checkpoint of `step` is complete: rollout ranks leave once this process exits, after
        what its runner still does (records the unit; on Slurm requeues the job), so that no rank
        exits before rank 0 and gets it killed (`srun --kill-on-bad-exit`)."""
        log(0, "trainer", f"preemption: checkpoint of step {step} saved; {self._whom()} leave when this rank exits")
        atexit.register(self._bye, step)

    def _bye(self, step: int) -> None:
        self._last_word(BYE, step)
        log(0, "trainer", f"preemption: told {self._whom()} to leave (checkpoint of step {step})")


@dataclass
class TrainerWord:
    word: int
    step: int


class RolloutControl:
    """A rollout rank's side (and that of trainer ranks 1..T-1, `role="trainer"`): forwards its own
    notice to the trainer (rank 0), hears rank 0's words."""

    def __init__(self, comm, ctx, timeout_s: float, role: str = "rollout"):
        self.comm, self.ctx, self.timeout_s, self.role = comm, ctx, timeout_s, role
        self.rank = ctx.rank
        self.told_trainer = False
        self.stop = False  # own notice or the trainer's STOP: produce nothing more
        self.last: TrainerWord | None = None  # BYE, END or FAILED: the trainer's last word
        self._buf = np.zeros(2, np.int64)
        self._rank_buf = np.array([self.rank], np.int64)
        self._req = comm.Irecv(self._buf, source=0, tag=CONTROL_TAG)
        self._sends: list = []

    def _poll(self) -> None:
        while self.last is None and self._req.Test():
            word = TrainerWord(int(self._buf[0]), int(self._buf[1]))
            if word.word == STOP:
                self.stop = True
                self._req = self.comm.Irecv(self._buf, source=0, tag=CONTROL_TAG)
            else:
                self.last = word
        if self.ctx.checkpoint_due() and not self.told_trainer:
            self.told_trainer = True
            if self.last is None and self.stop:
                log(self.rank, self.role, "preemption notice (the trainer has already said stop)")
            elif self.last is None:
                self._sends.append(self.comm.Isend(self._rank_buf, dest=0, tag=NOTICE_TAG))
                log(self.rank, self.role, "preemption notice: told the trainer; producing nothing more")
            self.stop = True

    def stop_requested(self) -> bool:
        """True once this rank saw the notice or the trainer said stop (or left): the `should_stop`
        of every wait of a rollout rank."""
        self._poll()
        return self.stop or self.last is not None

    def trainer_failed(self) -> bool:
        self._poll()
        return self.last is not None and self.last.word == FAILED

    def wait_for_trainer(self) -> TrainerWord | None:
        """The trainer's last word (BYE, END or FAILED), or None after `timeout_s` without it."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._poll()
            if self.last is not None:
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        _complete(self._sends, SEND_WAIT_S)
        if self._req:  # still posted: no last word came
            self._req.Cancel()
            self._req.Wait()
        return self.last
