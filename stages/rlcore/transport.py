"""Trajectory transport, rollout ranks -> trainer: `send_batch(k, trajs)` / `recv_batch(k) -> trajs`.

`MPITransport`: one MPI message per batch, the buffer `stages.agent.encode` makes (a typed,
versioned header and every field's array, no pickling). The receiver probes for it, learns its
size from the probe, receives it into one buffer and `decode`s the trajectories as views of it.
Batch k is produced by rollout rank `first_rollout + k % n_rollout` and received by the trainer
(rank 0) in order, which MPI's non-overtaking rule guarantees per sender.

Open MPI moves a large message only while both ranks are inside MPI calls (no progress thread),
so both sides poll, and poll without sleeping while the other side is known to be at work on
this batch: the trainer says "ready for batch k" (a tiny message) when it starts to receive; the
rollout rank spins once it has that word, and after its first 2 ms backs off (sleeping up to
2 ms) while the trainer is still busy training; the trainer backs off the same way until the
batch's envelope arrives, then spins until the batch is in.
Every wait checks the preemption notice (`should_stop`) and the timeout. The transport talks on
a duplicate of the world communicator, so its messages never meet anyone else's.

With several trainer ranks, trainer rank 0 receives each batch and `broadcast_batch` hands the same
buffer to the others over the trainer ranks' own communicator: the rollout side stays one
send per batch whatever the number of trainer ranks, and every trainer rank needs the whole batch
anyway (group baselines span rows that different ranks train on).

`FileQueueTransport`: the fallback without MPI (and the single-process mode): atomic
`<dir>/batch_000123.npz` files; the receiver polls until the file appears. Files stay until the
trainer has checkpointed past them (`discard_below`), so a resumed trainer can re-read them.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

from snowcat.pipeline.fsio import atomic_write_bytes
from snowcat.stages.agent import FIELDS, Trajectory, decode, encode, pack, unpack

_TAG = 17  # a batch
_READY = 18  # int64 [k]: the trainer is receiving batch k now
_UNIT = 8  # the message counts 8-byte units (encode pads to them): Open MPI 4's int counts reach 16 GiB, not 2
_SPIN_S = 2e-3  # how long a wait polls without sleeping before it backs off


class TransportError(RuntimeError):
    """A batch did not arrive in time, arrived out of order, or the wait was interrupted."""


class Transport(Protocol):
    def send_batch(self, batch_index: int, trajs: list[Trajectory]) -> None: ...

    def recv_batch(self, batch_index: int) -> list[Trajectory]: ...


def _wait(
    done: Callable[[], bool],
    timeout_s: float,
    should_stop: Callable[[], bool] | None,
    what: str,
    busy: Callable[[], bool] = lambda: False,
) -> None:
    """Poll `done()` until true. Without sleeping for the first `_SPIN_S` and whenever `busy()`
    (the peer is moving this message: Open MPI progresses it only inside our calls), otherwise
    sleeping 50 us doubling to 2 ms (a peer that is busy elsewhere costs no CPU)."""
    start = time.monotonic()
    deadline, pause = start + timeout_s, 5e-5
    while not done():
        if should_stop is not None and should_stop():
            raise TransportError(f"{what}: interrupted (preemption)")
        now = time.monotonic()
        if now > deadline:
            raise TransportError(f"{what}: no progress after {timeout_s:.0f}s")
        if now - start > _SPIN_S and not busy():
            time.sleep(pause)
            pause = min(2e-3, pause * 2)


def _as_units(buf: np.ndarray, what: str) -> np.ndarray:
    if len(buf) // _UNIT > 2**31 - 1:
        raise TransportError(
            f"{what}: {len(buf) / 2**30:.1f} GiB in one message, over MPI's 16 GiB; send fewer trajectories per batch"
        )
    return buf.view(np.int64)


def rollout_owner(batch_index: int, first_rollout: int, n_rollout: int) -> int:
    """Rollout rank that produces batch `batch_index` (round robin over the rollout ranks)."""
    return first_rollout + batch_index % n_rollout


class MPITransport:
    def __init__(
        self,
        comm,
        trainer_rank: int = 0,
        first_rollout: int = 1,
        n_rollout: int | None = None,
        timeout_s: float = 3600.0,
        should_stop: Callable[[], bool] | None = None,
    ):
        # its own communicator (collective: every rank of `comm` builds its MPITransport at once), so
        # that no other receive on `comm` can match a batch or a ready word, e.g. one left over
        # when a small batch went out before the trainer's word arrived
        self.comm = comm.Dup()
        self.trainer_rank = trainer_rank
        self.first_rollout = first_rollout
        self.n_rollout = n_rollout if n_rollout is not None else comm.Get_size() - first_rollout
        if self.n_rollout < 1:
            raise ValueError(f"MPITransport needs at least one rollout rank (world size {comm.Get_size()})")
        self.timeout_s = timeout_s
        self.should_stop = should_stop
        self._ready = np.empty(1, np.int64)
        self._hello = None

    def owner(self, batch_index: int) -> int:
        return rollout_owner(batch_index, self.first_rollout, self.n_rollout)

    def _trainer_ready(self, batch_index: int) -> bool:
        """Whether the trainer has said it is receiving `batch_index` (consumes its words; a word
        for an earlier batch, left over when that batch went out eagerly, is dropped)."""
        from mpi4py import MPI  # noqa: PLC0415

        while self.comm.Iprobe(source=self.trainer_rank, tag=_READY):
            self.comm.Recv([self._ready, MPI.INT64_T], source=self.trainer_rank, tag=_READY)
            if int(self._ready[0]) >= batch_index:
                return True
        return False

    def send_batch(self, batch_index: int, trajs: list[Trajectory]) -> None:
        from mpi4py import MPI  # noqa: PLC0415 (importing mpi4py initialises MPI: only in ranks that use it)

        what = f"send batch {batch_index}"
        buf = _as_units(encode(batch_index, trajs), what)
        req = self.comm.Isend([buf, MPI.INT64_T], dest=self.trainer_rank, tag=_TAG)
        ready = False

        def busy() -> bool:
            nonlocal ready
            ready = ready or self._trainer_ready(batch_index)
            return ready

        _wait(req.Test, self.timeout_s, self.should_stop, what, busy)

    def recv_batch(self, batch_index: int) -> list[Trajectory]:
        from mpi4py import MPI  # noqa: PLC0415 (importing mpi4py initialises MPI: only in ranks that use it)

        src = self.owner(batch_index)
        what = f"receive batch {batch_index} from rank {src}"
        # kept on self (with its buffer) until done, also when this wait is interrupted
        self._hello = hello = self.comm.Isend([np.array([batch_index], np.int64), MPI.INT64_T], dest=src, tag=_READY)
        status, probed = MPI.Status(), []

        def arrived() -> bool:
            msg = self.comm.Improbe(source=src, tag=_TAG, status=status)
            if msg is not None:
                probed.append(msg)
            return msg is not None

        _wait(arrived, self.timeout_s, self.should_stop, what)
        buf = np.empty(status.Get_count(MPI.INT64_T), np.int64)
        req = probed[0].Irecv([buf, MPI.INT64_T])
        _wait(lambda: MPI.Request.Testall([req, hello]), self.timeout_s, self.should_stop, what, busy=lambda: True)
        try:
            got, trajs = decode(buf)
        except ValueError as e:
            raise TransportError(f"{what}: {e}") from e
        if got != batch_index:
            raise TransportError(f"expected batch {batch_index} from rank {src}, got batch {got}")
        return trajs


def broadcast_batch(
    group, trajs: list[Trajectory] | None, *, timeout_s: float, abort: Callable[[], bool] | None = None
) -> list[Trajectory] | None:
    """Rank 0 of `group` (the trainer ranks' communicator) gives its batch to every rank of it:
    the size of its `encode`d buffer (0: none), then the buffer in one Bcast. None on every rank
    when rank 0 has none (its wait was cut short by a preemption notice). `abort()` true ends a
    rank's wait with TransportError (rank 0 failed)."""
    root = group.Get_rank() == 0
    size = np.zeros(1, np.int64)
    if root and trajs is not None:
        buf = _as_units(encode(0, trajs), "broadcast batch")
        size[0] = len(buf)
    request = group.Ibcast(size, root=0)
    _wait(request.Test, timeout_s, abort, "batch from trainer rank 0")
    if not size[0]:
        return None
    if not root:
        buf = np.empty(int(size[0]), np.int64)
    group.Bcast(buf, root=0)
    return trajs if root else decode(buf)[1]


class FileQueueTransport:
    def __init__(
        self,
        root: str | os.PathLike,
        timeout_s: float = 3600.0,
        poll_s: float = 0.05,
        should_stop: Callable[[], bool] | None = None,
    ):
        self.root = Path(root)
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.should_stop = should_stop

    def path(self, batch_index: int) -> Path:
        return self.root / f"batch_{batch_index:06d}.npz"

    def has(self, batch_index: int) -> bool:
        return self.path(batch_index).is_file()

    def send_batch(self, batch_index: int, trajs: list[Trajectory]) -> None:
        buf = io.BytesIO()
        np.savez(buf, **pack(trajs))
        atomic_write_bytes(self.path(batch_index), buf.getvalue())

    def recv_batch(self, batch_index: int) -> list[Trajectory]:
        path = self.path(batch_index)
        deadline = time.monotonic() + self.timeout_s
        while not path.is_file():
            if self.should_stop is not None and self.should_stop():
                raise TransportError(f"receive batch {batch_index}: interrupted (preemption)")
            if time.monotonic() > deadline:
                raise TransportError(f"{path}: batch {batch_index} did not arrive within {self.timeout_s:.0f}s")
            time.sleep(self.poll_s)
        with np.load(path) as z:
            return unpack({name: z[name] for name in FIELDS})

    def discard_below(self, batch_index: int) -> None:
        """Remove batches < batch_index (consumed and covered by a checkpoint)."""
        if not self.root.is_dir():
            return
        for p in self.root.glob("batch_*.npz"):
            if int(p.stem.split("_")[1]) < batch_index:
                p.unlink(missing_ok=True)
