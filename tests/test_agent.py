"""Trajectory packing, the agent loop with a real (tiny, random) model, and the tool environments."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.agent import FIELDS, STATUSES, Trajectory, allocate, header, pack, unpack


@st.composite
def trajectories(draw):
    n = draw(st.integers(0, 12))
    mask = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
    lps = [-draw(st.floats(0, 20, width=32)) if m else 0.0 for m in mask]
    spans = sorted(draw(st.lists(st.tuples(st.integers(0, n), st.integers(0, n)), max_size=3)))
    return Trajectory(
        task_id=draw(st.text(max_size=12)),
        group_id=draw(st.integers(0, 2**40)),
        attempt=draw(st.integers(0, 64)),
        policy_version=draw(st.integers(0, 10**6)),
        token_ids=draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)),
        loss_mask=mask,
        rollout_logprobs=lps,
        reward=draw(st.floats(0, 1)),
        status=draw(st.sampled_from(STATUSES)),
        turn_boundaries=spans,
        domain=draw(st.sampled_from(["arith", "closure", "ünïcode", ""])),
        prompt_len=draw(st.integers(0, n)),
        detail=draw(st.text(max_size=20)),
    )


@settings(max_examples=60, deadline=None)
@given(st.lists(trajectories(), max_size=5))
def test_pack_round_trip(trajs):
    bufs = pack(trajs)
    assert list(bufs) == list(FIELDS)
    for name, (dtype, tail) in FIELDS.items():
        assert bufs[name].dtype == dtype and bufs[name].shape[1:] == tail
        assert bufs[name].flags.c_contiguous
    assert unpack(bufs) == trajs
    # what a receiver does: allocate from the header alone, fill, unpack
    recv = allocate(header(bufs))
    for name in FIELDS:
        recv[name][...] = bufs[name]
    assert unpack(recv) == trajs


def test_pack_moves_over_mpi_buffers():
    MPI = pytest.importorskip("mpi4py.MPI")
    trajs = [
        Trajectory("arith-d2-x", 7, 1, 3, [5, 6, 7, 8], [0, 0, 1, 1], [0, 0, -0.5, -1.25], 1.0, "ok", [(2, 4)], "arith", 2),
        Trajectory("closure-d1-y", 8, 0, 3, [5, 9], [0, 1], [0, -2.0], 0.0, "truncated", [(1, 2)], "closure", 1),
    ]
    comm = MPI.COMM_SELF
    bufs = pack(trajs)
    reqs = [comm.Isend(header(bufs), dest=0, tag=0)]
    h = np.empty(len(FIELDS), np.int64)
    comm.Recv(h, source=0, tag=0)
    recv = allocate(h)
    for i, name in enumerate(FIELDS, start=1):
        reqs.append(comm.Isend(bufs[name], dest=0, tag=i))
        comm.Recv(recv[name], source=0, tag=i)
    MPI.Request.Waitall(reqs)
    assert unpack(recv) == trajs


def test_trajectory_rejects_bad_shapes_and_status():
    with pytest.raises(ValueError, match="status"):
        Trajectory("t", 0, 0, 0, [1], [1], [0.0], 0.0, "crashed")
    with pytest.raises(ValueError, match="mask"):
        Trajectory("t", 0, 0, 0, [1, 2], [1], [0.0, 0.0], 0.0, "ok")
