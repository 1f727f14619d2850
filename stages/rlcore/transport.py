"""Trajectory transport, rollout ranks -> trainer: `send_batch(k, trajs)` / `recv_batch(k) -> trajs`.

`MPITransport`: buffer Send/Recv of the typed arrays `stages.agent.pack` makes (no pickling); a
small int64 header [batch index, leading length of each buffer] goes first. Batch k is produced
by rollout rank `first_rollout + k % n_rollout` and received by the trainer (rank 0) in order,
which MPI's non-overtaking rule guarantees per sender. Both sides poll non-blocking requests so a
preemption notice is honoured even while a peer is slow.

With several trainer ranks, trainer rank 0 receives each batch and `broadcast_batch` hands the same
typed buffers to the others over the trainer ranks' own communicator: the rollout side stays one
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
from snowcat.stages.agent import FIELDS, Trajectory, allocate, header, pack, unpack

_TAG = 17


class TransportError(RuntimeError):
    """A batch did not arrive in time, arrived out of order, or the wait was interrupted."""


class Transport(Protocol):
    def send_batch(self, batch_index: int, trajs: list[Trajectory]) -> None: ...

    def recv_batch(self, batch_index: int) -> list[Trajectory]: ...


def _wait(requests, timeout_s: float, should_stop: Callable[[], bool] | None, what: str) -> None:
    from mpi4py import MPI  # noqa: PLC0415 (importing mpi4py initialises MPI: only in ranks that use it)

    deadline, pause = time.monotonic() + timeout_s, 1e-5
    while not MPI.Request.Testall(requests):
        if should_stop is not None and should_stop():
            raise TransportError(f"{what}: interrupted (preemption)")
        if time.monotonic() > deadline:
            raise TransportError(f"{what}: no progress after {timeout_s:.0f}s")
        # Open MPI progresses a message only inside a call: poll often at first (a batch mostly
        # arrives within milliseconds; a fixed 2 ms sleep made small batches 10-100x slower than
        # a raw buffer), then back off to 2 ms while a peer is busy
        time.sleep(pause)
        pause = min(2e-3, pause * 2)


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
        self.comm = comm
        self.trainer_rank = trainer_rank
        self.first_rollout = first_rollout
        self.n_rollout = n_rollout if n_rollout is not None else comm.Get_size() - first_rollout
        if self.n_rollout < 1:
            raise ValueError(f"MPITransport needs at least one rollout rank (world size {comm.Get_size()})")
        self.timeout_s = timeout_s
        self.should_stop = should_stop

    def owner(self, batch_index: int) -> int:
        return rollout_owner(batch_index, self.first_rollout, self.n_rollout)

    def send_batch(self, batch_index: int, trajs: list[Trajectory]) -> None:
        bufs = pack(trajs)
        head = np.concatenate([[batch_index], header(bufs)]).astype(np.int64)
        reqs = [self.comm.Isend(head, dest=self.trainer_rank, tag=_TAG)]
        reqs += [self.comm.Isend(bufs[name], dest=self.trainer_rank, tag=_TAG) for name in FIELDS]
        _wait(reqs, self.timeout_s, self.should_stop, f"send batch {batch_index}")

    def recv_batch(self, batch_index: int) -> list[Trajectory]:
        src = self.owner(batch_index)
        head = np.empty(1 + len(FIELDS), np.int64)
        _wait(
            [self.comm.Irecv(head, source=src, tag=_TAG)],
            self.timeout_s,
            self.should_stop,
            f"receive batch {batch_index} from rank {src}",
        )
        if int(head[0]) != batch_index:
            raise TransportError(f"expected batch {batch_index} from rank {src}, got batch {int(head[0])}")
        bufs = allocate(head[1:])
        _wait(
            [self.comm.Irecv(bufs[name], source=src, tag=_TAG) for name in FIELDS],
            self.timeout_s,
            self.should_stop,
            f"receive batch {batch_index} from rank {src}",
        )
        return unpack(bufs)


def broadcast_batch(
    group, trajs: list[Trajectory] | None, *, timeout_s: float, abort: Callable[[], bool] | None = None
) -> list[Trajectory] | None:
    """Rank 0 of `group` (the trainer ranks' communicator) gives its batch to every rank of it:
    a header [has a batch, leading length of each buffer], then one Bcast per buffer. None on
    every rank when rank 0 has none (its wait was cut short by a preemption notice). `abort()`
    true ends a rank's wait with TransportError (rank 0 failed)."""
    root = group.Get_rank() == 0
    head = np.zeros(1 + len(FIELDS), np.int64)
    if root and trajs is not None:
        bufs = pack(trajs)
        head[0], head[1:] = 1, header(bufs)
    _wait([group.Ibcast(head, root=0)], timeout_s, abort, "batch from trainer rank 0")
    if not head[0]:
        return None
    if not root:
        bufs = allocate(head[1:])
    for name in FIELDS:
        group.Bcast(bufs[name], root=0)
    return trajs if root else unpack(bufs)


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
