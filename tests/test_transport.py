"""Trajectory transport: file queue and MPI (real mpirun, 2 and 3 ranks; one message per batch) deliver batches intact, in order."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest

from snowcat.stages.agent import Trajectory
from snowcat.stages.rlcore.transport import FileQueueTransport, ReceiveBuffers, TransportError
from tests.conftest import mpirun

REPO = Path(__file__).resolve().parent.parent


def make_batch(k: int, n: int | None = None) -> list[Trajectory]:
    """Deterministic, varied trajectories for batch k (ragged lengths, every status, unicode, the
    engine's kept support or none, router replay or none; batch 3 is empty, batch 5 large enough
    for Open MPI's rendezvous protocol)."""
    n = n if n is not None else {3: 0, 5: 40}.get(k, 5)
    rng = np.random.default_rng(k)
    out = []
    for i in range(n):
        length = int(rng.integers(1, 40 if k != 5 else 2000))
        mask = rng.integers(0, 2, length).astype(np.uint8)
        support = rng.integers(0, 4, length) if i % 3 == 1 else None
        out.append(
            Trajectory(
                task_id=f"task-{k}-{i}-ü",
                group_id=i // 2,
                attempt=i % 2,
                policy_version=max(0, k - 1),
                token_ids=rng.integers(0, 50000, length),
                loss_mask=mask,
                rollout_logprobs=np.where(mask > 0, -rng.random(length), 0.0),
                reward=float(rng.random()),
                status=("ok", "truncated", "invalid_action", "infra_error")[i % 4],
                turn_boundaries=[(0, length)] if i % 5 else [],
                domain="arith" if i % 2 else "closure",
                prompt_len=min(3, length),
                detail="" if i % 2 else f"detail {i}",
                support_lengths=support,
                support_ids=None if support is None else rng.integers(0, 50000, int(support.sum())),
                routes=rng.integers(-1, 8, (length, 4)) if i % 2 == 0 else None,
            )
        )
    return out


def test_file_queue_round_trip_and_discard(tmp_path):
    q = FileQueueTransport(tmp_path / "queue", timeout_s=5)
    for k in range(3):
        q.send_batch(k, make_batch(k))
    assert [q.has(k) for k in range(4)] == [True, True, True, False]
    for k in (2, 0, 1):  # any order: batches are addressed by index
        assert q.recv_batch(k) == make_batch(k)
    q.discard_below(2)
    assert [q.has(k) for k in range(3)] == [False, False, True]
    assert not list((tmp_path / "queue").glob(".*"))  # no temp files left behind


def test_file_queue_refuses_a_damaged_or_misplaced_batch_naming_the_file(tmp_path):
    q = FileQueueTransport(tmp_path / "queue", timeout_s=5)
    q.send_batch(1, make_batch(1))
    shutil.copy(q.path(1), q.path(2))  # batch 1's bytes where batch 2 belongs
    with pytest.raises(TransportError, match=r"expected batch 2 from .*batch_000002.traj, got batch 1"):
        q.recv_batch(2)
    data = q.path(1).read_bytes()
    q.path(4).write_bytes(data[:-8])  # cut short
    with pytest.raises(TransportError, match=r"batch 4 from .*batch_000004.traj: .*its header describes"):
        q.recv_batch(4)
    assert q.recv_batch(1) == make_batch(1)


def test_file_queue_missing_batch_times_out_naming_it(tmp_path):
    q = FileQueueTransport(tmp_path / "queue", timeout_s=0.2)
    with pytest.raises(TransportError, match="batch_000007.traj: batch 7 did not arrive"):
        q.recv_batch(7)
    q = FileQueueTransport(tmp_path / "queue", timeout_s=60, should_stop=lambda: True)
    with pytest.raises(TransportError, match="interrupted"):
        q.recv_batch(7)


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_receive_buffers_reuse_memory_only_once_no_view_of_it_is_alive():
    buffers = ReceiveBuffers(keep=2)
    first = buffers.take(1000)
    view = first.view(np.uint8)[8:64]  # what decoded trajectories hold
    view[:] = 7
    first_at = _address(first)
    del first
    second = buffers.take(1000)
    assert _address(second) != first_at  # the first is still seen through `view`
    second_at = _address(second)
    del second
    again = buffers.take(900)  # the second is free: its memory again, no new pages
    assert _address(again) == second_at and len(again) == 900
    again[:] = -1
    bigger = buffers.take(5000)  # larger than any kept and `again` in use: fresh memory
    assert len(bigger) == 5000 and _address(bigger) not in (first_at, second_at)
    bigger[:] = -1
    bigger_at = _address(bigger)
    assert (view == 7).all()  # the first was never handed out while its view lived
    del view, again, bigger
    # all free now; keep=2 let the first go when `bigger` came, so the second serves first
    assert _address(buffers.take(1000)) == second_at
    assert _address(buffers.take(4000)) == bigger_at


_MPI_CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from mpi4py import MPI
    from tests.test_transport import make_batch
    from snowcat.stages.rlcore.transport import MPITransport
    comm = MPI.COMM_WORLD
    t = MPITransport(comm, timeout_s=60)
    n = 7
    if comm.Get_rank() == 0:
        held = {}
        for k in range(n):
            if k in (2, 5):
                time.sleep(0.5)  # a trainer still busy: the batch waits for it, then moves
            got = t.recv_batch(k)
            assert got == make_batch(k), f"batch {k} differs"
            assert all(a.policy_version == max(0, k - 1) for a in got)
            if k % 3 == 0:
                held[k] = got  # kept past later receives: their buffer must not be written again
            del got
        assert all(held[k] == make_batch(k) for k in held), "a later batch overwrote one still held"
        print("TRAINER-OK", n, flush=True)
    else:
        for k in range(n):
            if t.owner(k) == comm.Get_rank():
                t.send_batch(k, make_batch(k))
""")


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs OpenMPI's mpirun")
@pytest.mark.parametrize("ranks", [2, 3])
def test_mpi_transport_delivers_batches_in_order(tmp_path, ranks):
    script = tmp_path / "child.py"
    script.write_text(_MPI_CHILD)
    proc = mpirun(ranks, script, REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TRAINER-OK 7" in proc.stdout
