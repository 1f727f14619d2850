"""Trajectory transport, rollout ranks -> trainer: `send_batch(k, batch)` / `recv_batch(k) -> batch`.

A batch is a `stages.agent.TrajectoryBatch`: every field one typed column, all of them in one
buffer behind a typed, versioned header (no pickling). The rollout side writes its episodes into
it as it makes their records (`stages.agent.run_batch`), so `send_batch` sends that buffer as it
is; the receiving side reads the message in place (`read_batch` checks it and the batch index;
the columns, and the Trajectory records taken from them, are views of the message). Each
transport moves messages, `send_message(k, buf)` / `recv_message(k) -> buf`; the trainer ranks pass
the received message on as it is (`broadcast_message`) and each reads it.

`MPITransport`: one MPI message per batch, received into one buffer (`BatchBuffers`: memory of an
earlier batch once nothing refers to that batch any more). While the trainer spins (its first 2 ms
of waiting) it has a receive posted for a batch sent at once (up to 2 MiB, on a tag of its own), so
MPI answers that batch's rendezvous as it arrives; otherwise it probes for the batch, learns its
size from the probe and receives it.
Batch k is produced by rollout rank `first_rollout + k % n_rollout` and received by the trainer
(rank 0) in order, which MPI's non-overtaking rule guarantees per sender.

Open MPI moves a large message only while both ranks are inside MPI calls (no progress thread),
so both sides poll, without sleeping while the other side is known to be at work on this batch.
The rollout rank sends a batch of up to 2 MiB at once and polls the send, without sleeping for its
first 2 ms, then backing off until the trainer's word ("receiving batch k", a tiny message) is in
and spinning from then on: a small batch the trainer is waiting for so moves without waiting for
a message first (4-6 us here, on a 30 us transfer). The trainer sends that word only when the
batch has not landed after 1 ms of spinning (the sender has been backing off: the word wakes it),
not as the batch may be arriving: a word crossing a batch on its way halved the transfer (1 MiB in
`bench transport`'s message row: 0.40-0.42 ms against 0.15-0.20 raw in 4 of 4 runs with the word at
the start of every receive, within 3 % of raw in 4 of 4 without it: benchmarks/results/
transport-rounds/compiled-check/word/). A larger batch is announced (a tiny message) and sent once the word is in, which
the trainer sends when the announcement arrives: the rollout rank sleeps until then, and the
trainer is receiving by then. The trainer backs off (sleeping up to 2 ms after its first 2 ms, its
posted receive cancelled) until a batch or an announcement arrives, receives the batch into a
buffer of the size its envelope gives and spins until it is in.
Every wait checks the preemption notice (`should_stop`) and the timeout, at once and then every
millisecond. The transport talks on a duplicate of the world communicator, so its messages never
meet anyone else's.

With several trainer ranks, trainer rank 0 receives each batch and `broadcast_message` hands the
same buffer to the others over the trainer ranks' own communicator: the rollout side stays one
send per batch whatever the number of trainer ranks, and every trainer rank needs the whole batch
anyway (group baselines span rows that different ranks train on).

`FileQueueTransport`: the fallback without MPI (and the single-process mode): the same buffers
as atomic `<dir>/batch_000123.traj` files; the receiver polls until the file appears. Files stay
until the trainer has checkpointed past them (`discard_below`), so a resumed trainer can re-read them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

from snowcat.pipeline.fsio import atomic_write_bytes
from snowcat.stages.agent import BatchBuffers, Trajectory, TrajectoryBatch

_TAG = 17  # a batch sent once the trainer's word is in
_AT_ONCE = 19  # a batch sent at once (up to _AT_ONCE_BYTES): a receive may be posted for it
_READY = 18  # int64 [k]: the trainer is receiving batch k now
_LARGE = 20  # int64 [k]: batch k is larger than _AT_ONCE_BYTES and goes once the trainer's word is in
_UNIT = 8  # the message counts 8-byte units (a batch's buffer is padded to them): Open MPI 4's int counts reach 16 GiB, not 2
_SPIN_S = 2e-3  # how long a wait polls without sleeping before it backs off
_WORD_S = 1e-3  # how long the trainer spins for a batch sent at once before it says it is receiving
_CHECK_S = 1e-3  # how often a wait checks the preemption notice and its timeout
_AT_ONCE_BYTES = 2 << 20  # a batch up to this size goes without waiting for the trainer's word (see above)
_AT_ONCE_UNITS = _AT_ONCE_BYTES // _UNIT


class TransportError(RuntimeError):
    """A batch did not arrive in time, arrived out of order, or the wait was interrupted."""


class Transport(Protocol):
    def source(self, batch_index: int) -> str: ...  # where batch k comes from, for messages

    def send_message(self, batch_index: int, buf: np.ndarray) -> None: ...

    def recv_message(self, batch_index: int) -> np.ndarray: ...

    def send_batch(self, batch_index: int, batch: TrajectoryBatch | list[Trajectory]) -> None: ...

    def recv_batch(self, batch_index: int) -> TrajectoryBatch: ...


def read_batch(batch_index: int, buf: np.ndarray, where: str) -> TrajectoryBatch:
    """The batch in message `buf`, which must be batch `batch_index` (TransportError naming `where`
    it came from otherwise)."""
    try:
        batch = TrajectoryBatch.read(buf)
    except ValueError as e:
        raise TransportError(f"batch {batch_index} from {where}: {e}") from e
    if batch.index != batch_index:
        raise TransportError(f"expected batch {batch_index} from {where}, got batch {batch.index}")
    return batch


class _Codec:
    """`send_batch`/`recv_batch` over a transport's `send_message`/`recv_message`."""

    def send_batch(self, batch_index: int, batch: TrajectoryBatch | list[Trajectory]) -> None:
        """Batch `batch_index`: its buffer as it is, or, given Trajectory records, written into one first."""
        if not isinstance(batch, TrajectoryBatch):
            batch = TrajectoryBatch.of(batch_index, batch)
        elif batch.index != batch_index:
            raise ValueError(f"send batch {batch_index}: the batch was written as batch {batch.index}")
        self.send_message(batch_index, batch.buffer)

    def recv_batch(self, batch_index: int) -> TrajectoryBatch:
        where = self.source(batch_index)  # before the message, not after it
        return read_batch(batch_index, self.recv_message(batch_index), where)


def _wait(
    done: Callable[[], bool],
    timeout_s: float,
    should_stop: Callable[[], bool] | None,
    what: str,
    spin: bool | Callable[[], bool] = False,
) -> None:
    """Poll `done()` until true. Without sleeping for the first `_SPIN_S` and throughout when `spin`
    (the peer is moving this message: Open MPI progresses it only inside our calls), otherwise
    sleeping 50 us doubling to 2 ms (a peer that is busy elsewhere costs no CPU). `spin` may be a
    callable, asked before each sleep: once true, the wait spins from then on. The notice and the
    timeout are checked at once and then every `_CHECK_S`: a rank's `should_stop` polls MPI
    itself, which on every spin would slow the very poll that moves the message."""
    if done():
        return
    start = time.monotonic()
    deadline, pause, check_at = start + timeout_s, 5e-5, start
    while not done():
        now = time.monotonic()
        if now >= check_at:
            if should_stop is not None and should_stop():
                raise TransportError(f"{what}: interrupted (preemption)")
            if now > deadline:
                raise TransportError(f"{what}: no progress after {timeout_s:.0f}s")
            check_at = now + _CHECK_S
        if now - start > _SPIN_S and spin is not True:
            if spin is not False and spin():
                spin = True
                continue
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


class MPITransport(_Codec):
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
        # that no other receive on `comm` can match a batch or a trainer's word, e.g. one left over
        # when its batch went out before the word arrived
        self.comm = comm.Dup()
        self.trainer_rank = trainer_rank
        self.first_rollout = first_rollout
        self.n_rollout = n_rollout if n_rollout is not None else comm.Get_size() - first_rollout
        if self.n_rollout < 1:
            raise ValueError(f"MPITransport needs at least one rollout rank (world size {comm.Get_size()})")
        self.timeout_s = timeout_s
        self.should_stop = should_stop
        from mpi4py import MPI  # noqa: PLC0415 (importing mpi4py initialises MPI: only in ranks that use it)

        self._int64, self._any_tag = MPI.INT64_T, MPI.ANY_TAG
        self._status = MPI.Status()
        self._ready = np.empty(1, np.int64)
        self._word = self._notice = self._sending = self._posted = None
        self.buffers = BatchBuffers()  # where received batches land

    def owner(self, batch_index: int) -> int:
        return rollout_owner(batch_index, self.first_rollout, self.n_rollout)

    def source(self, batch_index: int) -> str:
        return f"rank {self.owner(batch_index)}"

    def _trainer_ready(self, batch_index: int) -> bool:
        """Whether the trainer has said it is receiving `batch_index` (consumes its words; one for
        an earlier batch is dropped)."""
        while self.comm.Iprobe(source=self.trainer_rank, tag=_READY):
            self.comm.Recv([self._ready, self._int64], source=self.trainer_rank, tag=_READY)
            if self._ready[0] >= batch_index:
                return True
        return False

    def send_message(self, batch_index: int, buf: np.ndarray) -> None:
        what = f"send batch {batch_index}"
        units = _as_units(buf, what)
        ready, tag = (lambda: self._trainer_ready(batch_index)), _AT_ONCE
        if self._notice is not None:  # the announcement of an earlier batch: out long ago (eager), freed here
            _wait(self._notice.Test, self.timeout_s, self.should_stop, what, spin=True)
            self._notice = None
        if buf.nbytes > _AT_ONCE_BYTES:
            # announced, and sent only once the trainer receives: TCP moves it only inside both ranks' calls
            self._notice = self.comm.Isend([np.array([batch_index], np.int64), self._int64], dest=self.trainer_rank, tag=_LARGE)
            _wait(ready, self.timeout_s, self.should_stop, what)
            ready, tag = True, _TAG
        # kept on self (the request holds its buffer) until done, also when this wait is interrupted
        self._sending = req = self.comm.Isend([units, self._int64], dest=self.trainer_rank, tag=tag)
        _wait(req.Test, self.timeout_s, self.should_stop, what, spin=ready)
        if ready is not True:
            self._trainer_ready(batch_index)  # its word, if it came, so that words do not pile up

    def recv_message(self, batch_index: int) -> np.ndarray:
        src = self.owner(batch_index)
        what = f"receive batch {batch_index} from rank {src}"
        if self._word is not None:  # the word for the batch before: out long ago (an eager message), freed here
            _wait(self._word.Test, self.timeout_s, self.should_stop, what, spin=True)
            self._word = None
        buf = self._receive_at_once(batch_index, src, what)
        if buf is None:  # not in while the trainer spun: probe for it (sleeping between probes), then receive it
            self._say_receiving(batch_index, src)
            probed = []

            def arrived() -> bool:
                msg = self.comm.Improbe(source=src, tag=self._any_tag, status=self._status)
                if msg is not None:
                    probed.append(msg)
                return msg is not None

            _wait(arrived, self.timeout_s, self.should_stop, what)
            if self._status.Get_tag() == _LARGE:  # a large batch's announcement (the word is out): the batch follows
                probed.pop().Recv([np.empty(1, np.int64), self._int64])
                _wait(arrived, self.timeout_s, self.should_stop, what, spin=True)
            buf = self.buffers.take(self._status.Get_count(self._int64))
            receiving = probed[0].Irecv([buf, self._int64])
            _wait(receiving.Test, self.timeout_s, self.should_stop, what, spin=True)
        return buf.view(np.uint8)

    def _say_receiving(self, batch_index: int, src: int) -> None:
        """The trainer's word for this batch, once (kept on self, with its buffer, until it is out)."""
        if self._word is None:
            self._word = self.comm.Isend([np.array([batch_index], np.int64), self._int64], dest=src, tag=_READY)

    def _receive_at_once(self, batch_index: int, src: int, what: str) -> np.ndarray | None:
        """The batch from `src` if one sent at once arrives while the trainer spins (`_SPIN_S`): a
        receive posted for it before it arrives lets MPI answer the rendezvous itself, where a probe
        returns to Python first (85 KiB: 0.2-0.9 us over a raw transfer, 1.8-3.6 probing first).
        After `_WORD_S` without it the trainer says it is receiving (a sender backing off spins
        then). Only while spinning: MPI moves a matched message only inside a call, and a posted
        receive never says it has matched, so a trainer that backs off to sleep cancels it and
        probes instead. None then, or at once when a large batch is announced (it never takes
        this tag)."""
        room = self.buffers.take(_AT_ONCE_UNITS)
        # kept on self (the request holds its buffer until it completes), also when a wait is interrupted
        self._posted = posted = self.comm.Irecv([room, self._int64], source=src, tag=_AT_ONCE)
        start = time.monotonic()
        word_at, spin_until, state = start + _WORD_S, start + _SPIN_S, []  # state: "in", or "cancelled" once asked to

        def landed() -> bool:
            if posted.Test(self._status):
                state.append("in")
                return True
            if self.comm.Iprobe(src, _LARGE):  # answered at once: the sender waits for the word to send
                self._say_receiving(batch_index, src)
                return True
            now = time.monotonic()
            if now > word_at:
                self._say_receiving(batch_index, src)
            return now > spin_until

        try:
            _wait(landed, self.timeout_s, self.should_stop, what)
            if not state:  # cancelled, unless it has matched a batch meanwhile: that batch completes then
                posted.Cancel()
                state.append("cancelled")
                _wait(lambda: posted.Test(self._status), self.timeout_s, self.should_stop, what, spin=True)
        except TransportError:
            if not state:
                posted.Cancel()  # (not waited for: the sender may be stopping as well)
            raise
        if state[0] == "cancelled" and self._status.Is_cancelled():
            return None
        return room[: self._status.Get_count(self._int64)]


def broadcast_message(
    group,
    buf: np.ndarray | None,
    *,
    timeout_s: float,
    abort: Callable[[], bool] | None = None,
    buffers: BatchBuffers,
) -> np.ndarray | None:
    """Rank 0 of `group` (the trainer ranks' communicator) gives its message to every rank of it:
    its size (0: none), then the buffer in one Bcast (the other ranks receive into `buffers`). None
    on every rank when rank 0 has none (its wait was cut short by a preemption notice). `abort()`
    true ends a rank's wait with TransportError (rank 0 failed)."""
    root = group.Get_rank() == 0
    size = np.zeros(1, np.int64)
    if root and buf is not None:
        units = _as_units(buf, "broadcast batch")
        size[0] = len(units)
    request = group.Ibcast(size, root=0)
    _wait(request.Test, timeout_s, abort, "batch from trainer rank 0")
    if not size[0]:
        return None
    if not root:
        units = buffers.take(int(size[0]))
    group.Bcast(units, root=0)
    return units.view(np.uint8)


class FileQueueTransport(_Codec):
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
        return self.root / f"batch_{batch_index:06d}.traj"

    def source(self, batch_index: int) -> str:
        return str(self.path(batch_index))

    def has(self, batch_index: int) -> bool:
        return self.path(batch_index).is_file()

    def send_message(self, batch_index: int, buf: np.ndarray) -> None:
        atomic_write_bytes(self.path(batch_index), buf.data)

    def recv_message(self, batch_index: int) -> np.ndarray:
        path = self.path(batch_index)
        deadline = time.monotonic() + self.timeout_s
        while not path.is_file():
            if self.should_stop is not None and self.should_stop():
                raise TransportError(f"receive batch {batch_index}: interrupted (preemption)")
            if time.monotonic() > deadline:
                raise TransportError(f"{path}: batch {batch_index} did not arrive within {self.timeout_s:.0f}s")
            time.sleep(self.poll_s)
        return np.fromfile(path, np.uint8)

    def discard_below(self, batch_index: int) -> None:
        """Remove batches < batch_index (consumed and covered by a checkpoint)."""
        if not self.root.is_dir():
            return
        for p in self.root.glob("batch_*.traj"):
            if int(p.stem.split("_")[1]) < batch_index:
                p.unlink(missing_ok=True)
