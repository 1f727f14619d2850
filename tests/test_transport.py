"""Trajectory transport: a batch's columns in one buffer (written from the agent loop's lists, read
as views of a message) hold every field as the records built directly do, byte for byte; damaged
buffers are refused by name; file queue and MPI (real mpirun, 2 and 3 ranks; one message per
batch) deliver batches intact, in order."""

from __future__ import annotations

import dataclasses
import shutil
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from snowcat.stages.agent import (
    FIELDS,
    WIRE_VERSION,
    BatchBuffers,
    Budget,
    EpisodeJob,
    Trajectory,
    TrajectoryBatch,
    encode,
    run_batch,
    run_episodes,
    trajectory,
)
from snowcat.stages.agent.envs import Step
from snowcat.stages.agent.trajectory import WIRE_MAGIC, regroup, segments, unpack
from snowcat.stages.rlcore.transport import FileQueueTransport, TransportError
from tests.conftest import mpirun

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(params=["compiled", "python"])
def reader(request, monkeypatch):
    """Each reading test twice: the check compiled (stages/agent/_wire.c, which the test install builds)
    and the Python checks alone (an install without a C compiler)."""
    if request.param == "python":
        monkeypatch.setattr(trajectory, "_scan_compiled", None)
    assert trajectory.compiled_check() == request.param
    return request.param


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


def agent_records(k: int, n: int | None = None) -> list[dict]:
    """Batch k's records as the agent loop holds them when its episodes end (`stages.agent.loop._record`):
    the per-token fields Python lists, the routes an array; records 0-2 one episode in three
    segments (its context, a summary the policy wrote, the context after it)."""
    records = [
        dict(
            {k: v for k, v in vars(t).items() if k != "earlier"},
            **{
                name: getattr(t, name).tolist()
                for name in ("token_ids", "loss_mask", "rollout_logprobs", "support_lengths", "support_ids")
            },
        )
        for t in make_batch(k, n)
    ]
    for segment, (r, kind) in enumerate(zip(records[:3], ("context", "summary", "context"))):
        r.update(segment=segment, segment_kind=kind, group_id=0, attempt=0)
    if len(records) > 3:  # a teacher rollout's episode (rl.teacher_rollouts): marked through the wire
        records[-1]["source"] = "teacher"
    return records


def directly(records: list[dict]) -> list[Trajectory]:
    """The same episodes built record by record, as `run_episodes` builds them."""
    return regroup([Trajectory(**r) for r in records])


def expected_columns(trajs: list[Trajectory]) -> dict[str, np.ndarray]:
    """Every field as the batch format lays it out (FIELDS: concatenated per-token values, offsets,
    per-record scalars, utf-8 strings), computed here from the records themselves."""
    records = [r for t in trajs for r in segments(t)]

    def cat(values, dtype):
        return np.concatenate([np.zeros(0, dtype), *(np.asarray(v, dtype).reshape(-1) for v in values)])

    def offsets(lengths):
        return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)

    strings = [s.encode() for r in records for s in (r.task_id, r.domain, r.detail)]
    per_record = {
        name: [getattr(r, name) for r in records]
        for name in ("group_id", "attempt", "policy_version", "prompt_len", "reward", "segment")
    }
    cols = {
        **{
            name: cat([getattr(r, name) for r in records], FIELDS[name][0])
            for name in ("token_ids", "loss_mask", "rollout_logprobs", "support_lengths", "support_ids")
        },
        "route_width": cat([0 if r.routes is None else r.routes.shape[1] for r in records], np.int64),
        "routes": cat([r.routes for r in records if r.routes is not None], np.int16),
        "token_offsets": offsets([len(r) for r in records]),
        **{name: cat(v, FIELDS[name][0]) for name, v in per_record.items()},
        "status": cat([("ok", "truncated", "invalid_action", "infra_error").index(r.status) for r in records], np.uint8),
        "segment_kind": cat([("context", "summary").index(r.segment_kind) for r in records], np.uint8),
        "source": cat([("policy", "teacher").index(r.source) for r in records], np.uint8),
        "turns": cat([r.turn_boundaries for r in records], np.int64).reshape(-1, 2),
        "turn_offsets": offsets([len(r.turn_boundaries) for r in records]),
        "strings": np.frombuffer(b"".join(strings), np.uint8),
        "string_offsets": offsets([len(s) for s in strings]),
    }
    return {name: cols[name] for name in FIELDS}


def expected_wire(k: int, trajs: list[Trajectory]) -> bytes:
    """The message: int64 header (magic, version, k, field count, lengths), then each field's bytes
    padded with zeros to 8."""
    cols = expected_columns(trajs)
    head = np.array([WIRE_MAGIC, WIRE_VERSION, k, len(FIELDS), *(len(c) for c in cols.values())], np.int64).tobytes()
    return head + b"".join(c.tobytes() + bytes(-c.nbytes % 8) for c in cols.values())


@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_a_batch_written_from_the_agent_loops_lists_holds_what_the_records_built_directly_hold(k, reader):
    records = agent_records(k)
    trajs = directly(records)
    written = TrajectoryBatch.write(k, records)
    # the same bytes: the layout, every field's values and dtype, the padding zeroed
    assert written.buffer.tobytes() == expected_wire(k, trajs) == encode(k, trajs).tobytes()
    for name, want in expected_columns(trajs).items():
        got = written.column(name)
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want), name
    # the same records: the lists written into the columns, and the message read back as views
    read = TrajectoryBatch.read(written.buffer.tobytes())
    for batch in (written, read):
        assert batch.index == k and len(batch) == len(trajs) and batch.n_records == len(records)
        assert batch == trajs and list(batch) == trajs
        assert (
            [t.source for t in batch]
            == [t.source for t in trajs]
            == ["policy"] * (len(trajs) - 1) + ["teacher"] * (len(records) > 3)
        )


def test_reading_a_message_gives_views_of_it_and_makes_each_trajectory_when_asked(reader):
    records = agent_records(1)
    buf = TrajectoryBatch.write(1, records).buffer.copy()
    batch = TrajectoryBatch.read(buf)
    assert all(np.shares_memory(batch.column(name), buf) for name in FIELDS if len(batch.column(name)))
    first = batch[0]
    assert batch[0] is first and batch[-1] is batch[len(batch) - 1]  # made once, when first asked for
    assert batch[1:3] == directly(records)[1:3]
    with pytest.raises(IndexError):
        batch[len(batch)]
    assert [r.segment for r in segments(first)] == [0, 1, 2] and first.earlier[1].segment_kind == "summary"
    for t in batch:
        arrays = [t.token_ids, t.loss_mask, t.rollout_logprobs, t.support_lengths] + ([t.routes] if t.routes is not None else [])
        assert all(np.shares_memory(a, buf) for a in arrays if a.size)  # views of the message, no copy
    buf[batch.column("token_ids").ctypes.data - buf.ctypes.data] ^= 1  # the first token id, in the message itself
    assert first.earlier[0].token_ids[0] == records[0]["token_ids"][0] ^ 1  # record 0's first id


def _damage(change, n: int = 5):
    """A message of batch 1 of n records changed by `change(buf, batch)` (the batch's columns are views of buf)."""
    buf = TrajectoryBatch.write(1, agent_records(1, n)).buffer.copy()
    change(buf, TrajectoryBatch.read(buf))
    return buf


def _set(name, i, value):
    return lambda buf, b: b.column(name).__setitem__(i, value)


def _header(i, value):
    return lambda buf, b: buf[: 8 * (4 + len(FIELDS))].view(np.int64).__setitem__(i, value)


def _more_turn_offsets_fewer_turns(buf, b):  # the header's counts disagree, its total size does not
    head = buf[: 8 * (4 + len(FIELDS))].view(np.int64)
    head[4 + list(FIELDS).index("turn_offsets")] += 2
    head[4 + list(FIELDS).index("turns")] -= 1  # 16 bytes each, as two more offsets


def _cut_the_u_umlaut(buf, b):  # task ids end in "ü" (2 bytes): the first one's end moved into it
    b.column("string_offsets")[1] -= 1


# {n}: the batch's record count; {turns}: its turns less one (after _more_turn_offsets_fewer_turns)
DAMAGES = [
    (_header(0, 7), "no magic number"),
    (_header(1, WIRE_VERSION + 1), f"wire format version {WIRE_VERSION + 1} with {len(FIELDS)} fields"),
    (_header(3, len(FIELDS) - 1), f"with {len(FIELDS) - 1} fields"),
    (_header(4 + list(FIELDS).index("reward"), -1), "its header describes -1"),
    (_header(4 + list(FIELDS).index("reward"), 9), "bytes, its header describes"),
    (_header(4 + list(FIELDS).index("strings"), -8), "its header describes -1"),  # a count the records' contents set
    (_header(4 + list(FIELDS).index("token_offsets"), 0), "bytes, its header describes"),
    (_header(4 + list(FIELDS).index("loss_mask"), 0), "bytes, its header describes"),
    (_set("token_offsets", 2, 10**6), "token_offsets is not {n+1} non-decreasing offsets"),
    (_set("token_offsets", -1, 0), "token_offsets is not {n+1} non-decreasing offsets"),
    (_more_turn_offsets_fewer_turns, "turn_offsets is not {n+1} non-decreasing offsets from 0 to {turns}"),
    (_set("turn_offsets", 1, 10**6), "turn_offsets is not"),
    (_set("turn_offsets", -1, 0), "turn_offsets is not"),
    (_set("string_offsets", 4, 0), "string_offsets is not {3n+1} non-decreasing"),
    (_set("string_offsets", 0, 1), "string_offsets is not"),
    (_set("support_lengths", 0, 1), "support_lengths do not add up"),
    (_set("support_lengths", -1, 1), "support_lengths do not add up"),
    (lambda buf, b: b.column("support_lengths")[:2].__iadd__(np.array([-1, 1], np.int32)), "support_lengths do not add up"),
    (_set("route_width", 0, 5), "route widths do not add up"),
    (_set("route_width", -1, -4), "route widths do not add up"),
    (_set("status", 3, 4), "a status index beyond 3"),
    (_set("status", -1, 255), "a status index beyond 3"),
    (_set("segment_kind", 0, 2), "a segment kind index beyond 1"),
    (_set("source", 1, 2), "a source index beyond 1"),
    (_set("source", -1, 9), "a source index beyond 1"),
    (_set("segment", 0, 1), "record 0 is segment 1 after 0 of its episode"),
    (_set("segment", 2, 3), "record 2 is segment 3 after 2 of its episode"),
    (_set("segment", -1, 2), "record {n-1} is segment 2 after 1 of its episode"),
    (_set("strings", 0, 0xFF), "strings are not utf-8"),
    (_cut_the_u_umlaut, "strings are not utf-8 where cut at their offsets"),
]


@pytest.mark.parametrize("n", [5, 80])
@pytest.mark.parametrize("change, message", DAMAGES)
def test_a_damaged_message_is_refused_naming_what_does_not_fit(change, message, n, reader):
    """Every check, on a batch of a few records and on one of many (one path reads both)."""
    turns = len(TrajectoryBatch.write(1, agent_records(1, n)).column("turns")) - 1
    for key, value in {"{n+1}": n + 1, "{3n+1}": 3 * n + 1, "{n-1}": n - 1, "{turns}": turns}.items():
        message = message.replace(key, str(value))
    buf = _damage(change, n)
    with pytest.raises(ValueError, match=message):
        TrajectoryBatch.read(buf)


@pytest.mark.parametrize("n", [5, 81])
def test_the_padding_after_a_coded_column_is_not_read_as_codes(n, reader):
    """The codes are checked at once with the padding between them (written 0); where the padding is
    not 0 but every code is within its names, each column is checked alone and the batch reads."""
    records = agent_records(1, n)
    buf = TrajectoryBatch.write(1, records).buffer.copy()
    status = TrajectoryBatch.read(buf).column("status")
    at, end = status.ctypes.data - buf.ctypes.data + n, status.ctypes.data - buf.ctypes.data + 8 * (n // 8 + 1)
    assert n % 8 and not buf[at:end].any()
    buf[at:end] = 0xFF
    assert TrajectoryBatch.read(buf) == directly(records)


def routed_alike(k: int, n: int | None = None) -> list[Trajectory]:
    """Batch k with every record routed (width 4) and sampled from the full distribution (no kept
    supports): a batch of one MoE policy, as the benchmark's."""
    return [
        dataclasses.replace(t, support_lengths=None, support_ids=None, routes=np.full((len(t), 4), 3, np.int16))
        for t in make_batch(k, n)
    ]


def _all(name, value):
    return lambda buf, b: b.column(name).__setitem__(slice(None), value)


@pytest.mark.parametrize(
    "change, message",
    [
        (_all("route_width", 5), "route widths do not add up to the"),  # every record alike, and wrong
        (_all("route_width", -4), "route widths do not add up to the"),
        (_set("route_width", 1, 0), "route widths do not add up to the"),  # one record unlike the others
        (_set("support_lengths", -1, 1), "support_lengths do not add up to the 0 support ids"),
        (_set("support_lengths", -2, 1), "support_lengths do not add up to the 0 support ids"),
    ],
)
@pytest.mark.parametrize("k, n", [(1, None), (5, 24), (5, 25)])
def test_a_damaged_batch_of_one_policy_is_refused(change, message, k, n, reader):
    """Records routed alike are checked as one product (width x tokens), support lengths that must all
    be 0 as bytes (one comparison up to 64 KiB, beyond it 8-byte words and the 4 bytes after the last
    where the token count is odd: batch 5 holds more tokens, 27780 and 29043)."""
    trajs = routed_alike(k, n)
    buf = TrajectoryBatch.of(k, trajs).buffer.copy()
    batch = TrajectoryBatch.read(buf)
    assert batch == trajs and (k == 1 or 4 * len(batch.column("token_ids")) > 1 << 16)
    change(buf, batch)
    with pytest.raises(ValueError, match=message):
        TrajectoryBatch.read(buf)


# version 3's order: the per-token columns first (version 4 puts the per-record ones first)
_VERSION_3_ORDER = (
    "token_ids", "loss_mask", "rollout_logprobs", "support_lengths", "support_ids", "route_width", "routes",
    "token_offsets", "group_id", "attempt", "policy_version", "prompt_len", "reward", "status", "segment",
    "segment_kind", "source", "turns", "turn_offsets", "strings", "string_offsets",
)  # fmt: skip


def test_a_message_of_wire_version_3_is_refused_by_name_not_misread(tmp_path, reader):
    """Version 4 moved the per-record columns first: a rank of an older snowcat is refused, naming
    both versions, instead of having its columns read at the wrong places."""
    assert WIRE_VERSION == 4 and sorted(_VERSION_3_ORDER) == sorted(FIELDS)
    cols = expected_columns(directly(agent_records(1)))
    head = np.array([WIRE_MAGIC, 3, 1, len(FIELDS), *(len(cols[k]) for k in _VERSION_3_ORDER)], np.int64).tobytes()
    old = head + b"".join(cols[k].tobytes() + bytes(-cols[k].nbytes % 8) for k in _VERSION_3_ORDER)
    assert len(old) == TrajectoryBatch.write(1, agent_records(1)).buffer.nbytes  # the same size, other places
    with pytest.raises(ValueError, match="wire format version 3 with 21 fields; this snowcat reads version 4 with 21"):
        TrajectoryBatch.read(old)
    queue = FileQueueTransport(tmp_path, timeout_s=5)  # e.g. a batch an older trainer left in the queue
    queue.path(1).write_bytes(old)
    with pytest.raises(TransportError, match="batch 1 from .*batch_000001.traj: trajectory batch: wire format version 3"):
        queue.recv_batch(1)


def test_a_short_padded_or_misaligned_message_is_refused(reader):
    buf = TrajectoryBatch.write(1, agent_records(1)).buffer
    with pytest.raises(ValueError, match="shorter than its"):
        TrajectoryBatch.read(buf[:16])
    for other in (buf[:-8], np.concatenate([buf, np.zeros(8, np.uint8)])):
        with pytest.raises(ValueError, match="its header describes"):
            TrajectoryBatch.read(other)
    assert TrajectoryBatch.read(np.concatenate([np.zeros(3, np.uint8), buf])[3:]) == directly(agent_records(1))  # any alignment
    columns = dict(TrajectoryBatch.write(1, agent_records(1)).columns, reward=np.zeros(2))
    with pytest.raises(ValueError, match="reward has 2 entries for 5 trajectories"):
        unpack(columns)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r: r.update(loss_mask=r["loss_mask"][:-1]), "tokens but .* mask entries"),
        (lambda r: r.update(status="crashed"), "status 'crashed' not in"),
        (lambda r: r.update(segment_kind="notes"), "segment_kind 'notes' not in"),
        (lambda r: r.update(source="oracle"), "source 'oracle' not in"),
        (lambda r: r.update(routes=np.zeros((2, 4), np.int16)), "routes of shape \\(2, 4\\)"),
        (lambda r: r.update(segment=1), "record 3 is segment 1 after 3 of its episode"),
    ],
)
def test_writing_refuses_a_record_that_does_not_fit_naming_it(change, message):
    records = agent_records(1)
    change(records[3])
    with pytest.raises(ValueError, match=message):
        TrajectoryBatch.write(1, records)


def test_writing_refuses_support_ids_that_do_not_belong_to_their_record():
    records = agent_records(1)  # record 4 has kept supports, record 0 none
    assert records[4]["support_ids"] and not records[0]["support_ids"]
    records[0]["support_ids"] = records[4]["support_ids"][:1]  # the batch's total still adds up
    records[4]["support_ids"] = records[4]["support_ids"][1:]
    with pytest.raises(ValueError, match="trajectory task-1-0-ü: support lengths sum to 0, 1 ids"):
        TrajectoryBatch.write(1, records)


# ---------------------------------------------------------------- the agent loop writes the batch


@dataclasses.dataclass(frozen=True)
class _Params:  # what the loop reads of SamplingParams
    max_tokens: int = 6
    stop_ids: tuple = ()


class _Engine:
    """Completions drawn from each request's seed: some stop, some are cut; kept supports and routes."""

    def generate_seeded(self, prompts, params, seeds):
        out = []
        for prompt, seed in zip(prompts, seeds):
            rng = np.random.default_rng(seed)
            n = int(rng.integers(1, params.max_tokens + 1))
            stop = bool(rng.random() < 0.6)
            ids = rng.integers(3, 50, n).tolist()[: n - stop] + [1] * stop  # 1: the end-of-turn id
            out.append(
                SimpleNamespace(
                    token_ids=ids,
                    logprobs=(-rng.random(n)).tolist(),
                    finish_reason="stop" if stop else "length",
                    support=[rng.integers(0, 50, int(rng.integers(0, 3))).tolist() for _ in range(n)],
                    routes=rng.integers(-1, 8, (len(prompt) + n - 1, 4)).astype(np.int16),
                )
            )
        return out


class _Env:
    """Two turns with an observation between, then a reward of its own."""

    parallel = False

    def prompt(self, task):
        return [2] * (2 + len(task.task_id) % 3)

    def reset(self, task):
        return {"turns": 0}

    def step(self, task, state, ids):
        state["turns"] += 1
        return Step(done=state["turns"] == 2, observation=[5, 6, 7], reward=len(ids) / 10, detail="own reward")

    def finish(self, state):
        pass

    def note(self, text):
        return [8, 9]


def test_the_agent_loop_writes_its_episodes_into_the_batch_it_would_otherwise_return():
    jobs = [EpisodeJob(SimpleNamespace(task_id=f"t{i}-ü", domain="toy"), group_id=i // 2, attempt=i % 2) for i in range(6)]
    args = (
        _Engine(),
        SimpleNamespace(end_of_turn_id=1),
        jobs,
        _Env(),
        _Params(),
        Budget(max_context=24, max_turn_tokens=6, max_turns=3),
    )
    trajs = run_episodes(*args, seed=3, policy_version=2)
    batch = run_batch(9, *args, seed=3, policy_version=2)
    assert {t.status for t in trajs} >= {"ok", "truncated"} and any(len(t.support_ids) for t in trajs)
    assert batch == trajs and batch.index == 9
    assert batch.buffer.tobytes() == encode(9, trajs).tobytes()


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


def test_file_queue_moves_a_written_batch_byte_for_byte(tmp_path):
    q = FileQueueTransport(tmp_path / "queue", timeout_s=5)
    batch = TrajectoryBatch.write(4, agent_records(4))
    q.send_batch(4, batch)
    assert q.path(4).read_bytes() == batch.buffer.tobytes()
    got = q.recv_batch(4)
    assert isinstance(got, TrajectoryBatch) and got == directly(agent_records(4))
    with pytest.raises(ValueError, match="send batch 5: the batch was written as batch 4"):
        q.send_batch(5, batch)


def test_file_queue_missing_batch_times_out_naming_it(tmp_path):
    q = FileQueueTransport(tmp_path / "queue", timeout_s=0.2)
    with pytest.raises(TransportError, match="batch_000007.traj: batch 7 did not arrive"):
        q.recv_batch(7)
    q = FileQueueTransport(tmp_path / "queue", timeout_s=60, should_stop=lambda: True)
    with pytest.raises(TransportError, match="interrupted"):
        q.recv_batch(7)


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_batch_buffers_reuse_memory_only_once_no_view_of_it_is_alive():
    buffers = BatchBuffers(keep=2)
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


def test_a_batch_is_written_into_the_memory_of_one_no_longer_referred_to():
    buffers = BatchBuffers(keep=2)
    first = TrajectoryBatch.write(0, agent_records(1), buffers)
    at = _address(first.buffer)
    record = first[1]
    del first
    second = TrajectoryBatch.write(1, agent_records(1), buffers)  # a record of the first is alive: other memory
    assert _address(second.buffer) != at
    del record
    smaller = agent_records(1)[:3]  # one episode, three segments
    third = TrajectoryBatch.write(2, smaller, buffers)  # nothing refers to the first any more: its memory
    assert _address(third.buffer) == at and third == directly(smaller) and second == directly(agent_records(1))
    assert third.buffer.tobytes() == expected_wire(2, directly(smaller))  # its header, columns and padding, not the old bytes


_MPI_CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from mpi4py import MPI
    from tests.test_transport import make_batch
    from snowcat.stages.agent import TrajectoryBatch
    from snowcat.stages.rlcore.transport import MPITransport, TransportError
    comm = MPI.COMM_WORLD
    t = MPITransport(comm, timeout_s=60)
    n = 9
    batch = lambda k: make_batch(5, n=150) if k in (7, 8) else make_batch(k)  # 7, 8: over 2 MiB, announced, sent once the trainer asks
    if comm.Get_rank() == 0:
        held = {}
        for k in range(n):
            if k in (2, 5, 7):
                time.sleep(0.5)  # a trainer still busy: the batch (7: its announcement) waits for it, then moves
            got = t.recv_batch(k)
            assert got == batch(k), f"batch {k} differs"
            assert got.buffer.tobytes() == TrajectoryBatch.of(k, batch(k)).buffer.tobytes(), f"batch {k}: other bytes"
            assert k in (7, 8) or all(a.policy_version == max(0, k - 1) for a in got)
            assert (k in (7, 8)) == (got.buffer.nbytes > 2 << 20), f"batch {k}: {got.buffer.nbytes} bytes"
            if k % 3 == 0:
                held[k] = got  # kept past later receives: their buffer must not be written again
            del got
        assert all(held[k] == batch(k) for k in held), "a later batch overwrote one still held"
        t.should_stop = lambda: True  # a preemption notice as the trainer starts to receive batch n, never sent
        try:
            t.recv_batch(n)
        except TransportError as e:  # its posted receive cancelled: the ranks still finish MPI cleanly
            assert "interrupted (preemption)" in str(e), e
            print("TRAINER-OK", n, flush=True)
    else:
        for k in range(n):
            if t.owner(k) == comm.Get_rank():  # odd batches written beforehand (as the agent loop does), even ones records
                if k in (6, 8):
                    time.sleep(0.2)  # a rollout still busy: the trainer stops spinning, probes (8: for its announcement)
                t.send_batch(k, TrajectoryBatch.of(k, batch(k)) if k % 2 else batch(k))
""")


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs OpenMPI's mpirun")
@pytest.mark.parametrize("ranks", [2, 3])
def test_mpi_transport_delivers_batches_in_order(tmp_path, ranks):
    script = tmp_path / "child.py"
    script.write_text(_MPI_CHILD)
    proc = mpirun(ranks, script, REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TRAINER-OK 9" in proc.stdout
