"""The trajectory record (rollout -> trainer, and the trace), and its MPI-friendly packing.

`token_ids` hold the prompt and every turn exactly as sampled or encoded -- never re-tokenised --
so the trainer scores the very ids the rollout logprobs belong to. `loss_mask` is 1 only on
model-sampled tokens; `rollout_logprobs` is 0 wherever the mask is 0.

A batch travels as its columns (`TrajectoryBatch`): every field of `FIELDS` one flat, typed array
for the whole batch (concatenated tokens + offsets + per-trajectory scalars + one utf-8 byte
buffer for the strings; each field has a fixed dtype and trailing shape, only the leading lengths
vary), all of them in one buffer behind a typed, versioned header: the wire. MPI moves a batch as
that one message, with no pickling and no pass over the records at send time:

    rollout:  batch = TrajectoryBatch.write(k, records)  # each record's lists straight into the columns
              comm.Send(batch.buffer, dest)
    trainer:  msg = comm.Mprobe(src, status=st); buf = np.empty(st.Get_count(MPI.BYTE), np.uint8)
              msg.Recv(buf); batch = TrajectoryBatch.read(buf)  # checked; batch[i]: a Trajectory of views

The agent loop writes its episodes into a batch as it makes their records (`run_batch`), so the
rollout side's one conversion of each episode's token lists is the writing itself. The reader
checks the batch as a whole (header, offsets, counts, status codes) and makes a record only when
it is asked for: one copy of the bytes on each side (out of the rollout's lists, out of the socket).
`pack`/`unpack` (the columns as separate arrays, e.g. for `np.savez`) and `encode`/`decode` (a
list of Trajectory objects to a message and back) are the same batch for callers with records.

Segments. An episode whose context was rewritten (a context policy replaced older turns by a summary:
stages/agent/context.py) is several records, each one context and what was sampled in it: the record
`run_episodes` returns for the job is its last, and `earlier` holds the others in order (`segment`
0, 1, ...; `segment_kind` "context", or "summary" for the policy writing a summary). Every record
carries the episode's status and reward. `segments(t)` / `flatten(trajs)` give the records one by
one (what a trainer scores: each is its own sequence); `pack` and `encode` send them flat and
`unpack` and `decode` put the episodes back together.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

STATUSES = ("ok", "truncated", "invalid_action", "infra_error")
# what a record of an episode holds: a stretch of turns in one context, or the policy writing a summary
SEGMENT_KINDS = ("context", "summary")
# who played the episode: the policy being trained, or the fixed teacher of `rl.teacher_rollouts`
# (its episodes join their task's group; docs/recipes.md "Teacher rollouts in RL groups")
SOURCES = ("policy", "teacher")

# name -> (dtype, trailing shape); the order is the wire order. First the columns of one entry
# per record (or per record and one more: offsets), whose layout depends on the record count alone
# (a reader computes it once per count), the int64 ones the reader checks first; then the columns
# whose lengths vary with the records' contents.
FIELDS: dict[str, tuple[np.dtype, tuple[int, ...]]] = {
    "token_offsets": (np.dtype(np.int64), ()),  # [N+1]: trajectory i is tokens[off[i]:off[i+1]]
    "turn_offsets": (np.dtype(np.int64), ()),  # [N+1]
    "string_offsets": (np.dtype(np.int64), ()),  # [3N+1]
    "route_width": (np.dtype(np.int64), ()),  # per trajectory: moe layers * k, 0 = no routes recorded
    "segment": (np.dtype(np.int64), ()),  # the record's place in its episode (0: the opening's context)
    "group_id": (np.dtype(np.int64), ()),
    "attempt": (np.dtype(np.int64), ()),
    "policy_version": (np.dtype(np.int64), ()),
    "prompt_len": (np.dtype(np.int64), ()),
    "reward": (np.dtype(np.float64), ()),
    "status": (np.dtype(np.uint8), ()),  # index into STATUSES
    "segment_kind": (np.dtype(np.uint8), ()),  # index into SEGMENT_KINDS
    "source": (np.dtype(np.uint8), ()),  # index into SOURCES
    "token_ids": (np.dtype(np.int32), ()),  # all trajectories' tokens, concatenated
    "loss_mask": (np.dtype(np.uint8), ()),
    "rollout_logprobs": (np.dtype(np.float32), ()),
    "support_lengths": (np.dtype(np.int32), ()),  # per token: how many kept ids the engine reported
    "support_ids": (np.dtype(np.int32), ()),  # all tokens' kept ids, concatenated
    "routes": (np.dtype(np.int16), ()),  # all trajectories' [L, width] routes, flattened and concatenated
    "turns": (np.dtype(np.int64), (2,)),  # all (start, end) spans, concatenated
    "strings": (np.dtype(np.uint8), ()),  # utf-8 of task_id_0, domain_0, detail_0, task_id_1, ...
}


@dataclass
class Trajectory:
    task_id: str
    group_id: int
    attempt: int
    policy_version: int
    token_ids: np.ndarray  # int32 [L]: prompt + all turns, exactly as sampled / encoded
    loss_mask: np.ndarray  # uint8 [L]: 1 only on model-sampled tokens
    rollout_logprobs: np.ndarray  # float32 [L]: logprob under the sampling distribution, 0 where mask 0
    reward: float
    status: str  # one of STATUSES
    turn_boundaries: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of model turns
    domain: str = ""
    prompt_len: int = 0
    detail: str = ""  # why it ended (verifier detail, infra cause): for traces, not for training
    # The engine's kept support of each sampled token under top-k/top-p/greedy: token j could have
    # been drawn from support_ids[sum(support_lengths[:j]) : ...]. Length 0 = full distribution or
    # not known (the trainer then rebuilds it from its own logits).
    support_lengths: np.ndarray | None = None  # int32 [L]
    support_ids: np.ndarray | None = None  # int32 [sum(support_lengths)]
    # The experts the engine routed each token to (router replay): int16 [L, moe layers * k], -1
    # where a token was not fed to the engine; None when not recorded (dense model, vLLM on CPU).
    routes: np.ndarray | None = None
    # An episode in several contexts (see the module docstring): this record's place in it, what it
    # holds, and (on the episode's last record only) the records before it, oldest first.
    segment: int = 0
    segment_kind: str = "context"
    earlier: tuple = ()
    source: str = "policy"  # one of SOURCES: who sampled the episode (its rollout_logprobs are that model's)
    # The episode's seconds as the agent loop played it (stages/agent/loop.py, "Timing"): volatile,
    # so never sent, compared or written with the record; None where not played here.
    timing: dict[str, float] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = np.asarray(self.token_ids, dtype=np.int32)
        self.loss_mask = np.asarray(self.loss_mask, dtype=np.uint8)
        self.rollout_logprobs = np.asarray(self.rollout_logprobs, dtype=np.float32)
        lengths = np.zeros(len(self.token_ids)) if self.support_lengths is None else self.support_lengths
        self.support_lengths = np.asarray(lengths, dtype=np.int32)
        self.support_ids = np.asarray(() if self.support_ids is None else self.support_ids, dtype=np.int32)
        self.turn_boundaries = [(int(s), int(e)) for s, e in self.turn_boundaries]
        if self.status not in STATUSES:
            raise ValueError(f"trajectory {self.task_id}: status {self.status!r} not in {STATUSES}")
        if self.segment_kind not in SEGMENT_KINDS:
            raise ValueError(f"trajectory {self.task_id}: segment_kind {self.segment_kind!r} not in {SEGMENT_KINDS}")
        if self.source not in SOURCES:
            raise ValueError(f"trajectory {self.task_id}: source {self.source!r} not in {SOURCES}")
        self.earlier = tuple(self.earlier)
        if self.earlier and (
            [t.segment for t in self.earlier] + [self.segment] != list(range(len(self.earlier) + 1))
            or any(t.earlier for t in self.earlier)
        ):
            raise ValueError(f"trajectory {self.task_id}: earlier records are not segments 0..{self.segment - 1} in order")
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.rollout_logprobs) != n or len(self.support_lengths) != n:
            raise ValueError(
                f"trajectory {self.task_id}: {n} tokens but {len(self.loss_mask)} mask entries "
                f", {len(self.rollout_logprobs)} logprobs and {len(self.support_lengths)} support lengths"
            )
        if self.routes is not None:
            self.routes = np.asarray(self.routes, dtype=np.int16)
            if self.routes.ndim != 2 or len(self.routes) != n:
                raise ValueError(f"trajectory {self.task_id}: routes of shape {self.routes.shape} for {n} tokens")
        if int(self.support_lengths.sum()) != len(self.support_ids):
            raise ValueError(
                f"trajectory {self.task_id}: support lengths sum to {self.support_lengths.sum()}, {len(self.support_ids)} ids"
            )

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def trainable(self) -> bool:
        """Whether the trainer should learn from it: infrastructure failures carry no signal."""
        return self.status != "infra_error"

    @property
    def passed(self) -> bool:
        """Full credit: what probe, select and RL count as a pass (partial credit is reward only)."""
        return self.reward >= 1.0

    def __eq__(self, other) -> bool:  # arrays compare by value
        if not isinstance(other, Trajectory):
            return NotImplemented
        scalars = (
            "task_id",
            "group_id",
            "attempt",
            "policy_version",
            "reward",
            "status",
            "turn_boundaries",
            "domain",
            "prompt_len",
            "detail",
            "segment",
            "segment_kind",
            "earlier",
            "source",
        )
        return (
            all(getattr(self, k) == getattr(other, k) for k in scalars)
            and all(
                np.array_equal(getattr(self, k), getattr(other, k))
                for k in ("token_ids", "loss_mask", "rollout_logprobs", "support_lengths", "support_ids")
            )
            and (self.routes is None) == (other.routes is None)
            and (self.routes is None or np.array_equal(self.routes, other.routes))
        )


def segments(t: Trajectory) -> list[Trajectory]:
    """The records of `t`'s episode, oldest first (one, unless a context policy rewrote its context)."""
    return [*t.earlier, t]


def flatten(trajs: list[Trajectory]) -> list[Trajectory]:
    """Every record of every episode, in order: the sequences a trainer scores, each in the context it
    was sampled in (records of one episode share its group, attempt, status and reward)."""
    return [r if not r.earlier else dataclasses.replace(r, earlier=()) for t in trajs for r in segments(t)]


def regroup(records: list[Trajectory]) -> list[Trajectory]:
    """Inverse of `flatten`: each episode's last record, holding the ones before it in `earlier`."""
    out: list[Trajectory] = []
    pending: list[Trajectory] = []
    for i, r in enumerate(records):
        if r.segment != len(pending) or r.earlier:
            raise ValueError(f"trajectory batch: record {i} is segment {r.segment} after {len(pending)} of its episode")
        pending.append(r)
        if i + 1 == len(records) or records[i + 1].segment == 0:
            last = pending[-1]
            if len(pending) > 1:
                last.earlier = tuple(pending[:-1])
            out.append(last)
            pending = []
    return out


# -- a batch: every field one typed column, all of them in one buffer (the wire) -----------------
#
#   int64 [WIRE_MAGIC, WIRE_VERSION, batch index, len(FIELDS), leading length of each field]
#   then each field's column in FIELDS order, each starting on an 8-byte boundary, the padding
#   zeroed; the whole is a multiple of 8 bytes. A change to FIELDS or to this layout bumps
#   WIRE_VERSION, so a rank of another snowcat version is refused by name instead of misread.

WIRE_MAGIC = int.from_bytes(b"snowtraj", "little")
WIRE_VERSION = 4  # 2: segment, segment_kind; 3: source; 4: the per-record columns first
_HEAD = 4 + len(FIELDS)
# native order as numpy's int64, any alignment: magic, version, index, field count; each field's length (from _H on)
_HEADER, _H = struct.Struct(f"={_HEAD}q"), 4
_SPECS, _FIELD_INDEX = list(FIELDS.values()), {name: i for i, name in enumerate(FIELDS)}
_N_OFFSETS = _FIELD_INDEX["token_offsets"]
_BYTE = np.dtype(np.uint8)
_UNIT = [dtype.itemsize * int(np.prod(tail, dtype=np.int64)) for dtype, tail in FIELDS.values()]  # bytes per entry

_PER_TOKEN = ("token_ids", "loss_mask", "rollout_logprobs", "support_lengths")
_SCALARS = ("group_id", "attempt", "policy_version", "prompt_len", "reward", "status", "segment", "segment_kind", "source")
# the fields with one entry per record and those with one per token (as many as token_ids)
_PER_RECORD = ("route_width", *_SCALARS)
_COUNTED = (*((k, "trajectories") for k in _PER_RECORD), *((k, "tokens") for k in _PER_TOKEN[1:]))
_NAMES = {"status": STATUSES, "segment_kind": SEGMENT_KINDS, "source": SOURCES}  # coded fields: their index's names
_CODES = {field: {s: i for i, s in enumerate(names)} for field, names in _NAMES.items()}
_HEAD_BYTES = 8 * _HEAD
# The layout a reader computes (`TrajectoryBatch.read`): the first _N_FIXED fields have counts fixed
# by the record count (their layout is cached per count: `_fixed`), the int64 columns checked in
# lists first of them (read as one list); the rest, whose counts the records' contents set, in this
# order with these bytes per entry (the reader's arithmetic for their offsets).
_N_FIXED = _FIELD_INDEX["token_ids"]
_LISTED = ("token_offsets", "turn_offsets", "string_offsets", "route_width", "segment")
_FREE = ("token_ids", "loss_mask", "rollout_logprobs", "support_lengths", "support_ids", "routes", "turns", "strings")
if (
    tuple(FIELDS)[: len(_LISTED)] != _LISTED
    or tuple(FIELDS)[_N_FIXED:] != _FREE
    or _UNIT[_N_FIXED:] != [4, 1, 4, 4, 4, 2, 16, 1]
    or tuple(FIELDS)[_N_FIXED - len(_NAMES) : _N_FIXED] != tuple(_NAMES)
    or any(len(names) & (len(names) - 1) for names in _NAMES.values())  # (the codes' mask: _fixed)
):
    raise AssertionError("trajectory.py: FIELDS no longer has the order TrajectoryBatch.read lays it out in")
# in the header: the lengths not fixed by the record count, and the per-token ones after token_ids (as many)
_FREE_COUNTS = operator.itemgetter(*(_H + _FIELD_INDEX[k] for k in ("token_ids", "support_ids", "routes", "turns", "strings")))
_PER_TOKEN_AT = [_H + _FIELD_INDEX[k] for k in _PER_TOKEN[1:]]


def _field_count_source(i: int, name: str) -> int:
    """Where field `name`'s count is in (*lengths, n, n + 1, 3n + 1) for a batch of n records."""
    if name in _PER_TOKEN:
        return _FIELD_INDEX["token_ids"]
    if name in _PER_RECORD:
        return len(FIELDS)
    return {"token_offsets": len(FIELDS) + 1, "turn_offsets": len(FIELDS) + 1, "string_offsets": len(FIELDS) + 2}.get(name, i)


# the counts a consistent header holds, from (*lengths, n, n + 1, 3n + 1): one tuple comparison checks them all
_CONSISTENT_COUNTS = operator.itemgetter(*(_field_count_source(i, name) for i, name in enumerate(FIELDS)))


def _put_header(buf: np.ndarray, index: int, lengths) -> None:
    """The message's header (the layout above) into the first _HEAD_BYTES of `buf`."""
    buf[:_HEAD_BYTES].view(np.int64)[:] = [WIRE_MAGIC, WIRE_VERSION, index, len(FIELDS), *lengths]


def _layout(lengths) -> list[int]:
    """Byte offset of each field for these leading lengths, then the total size (8-byte aligned).
    (A plain loop: the cheapest form measured, 1.1 us against 1.55 for accumulate over a list or
    over map: a fifth of reading a small batch.)"""
    ends, at = [_HEAD_BYTES], _HEAD_BYTES
    for unit, n in zip(_UNIT, lengths):
        at += (n * unit + 7) & -8
        ends.append(at)
    return ends


def _offsets(lengths) -> list[int]:
    return [0, *itertools.accumulate(lengths)]


_FIXED: dict[int, tuple] = {}  # record count -> `_fixed` of it


def _fixed(n: int) -> tuple:
    """For a batch of n records (cached): the counts of the fields before token_ids; where token_ids
    starts; the _LISTED columns' words (a Struct reading them) and each one's slice of them; where
    the coded columns start (they end where token_ids starts), and the bits that must be 0 there,
    as one little-endian int: every code within its names, the padding 0."""
    out = _FIXED.get(n)
    if out is None:
        counts = _CONSISTENT_COUNTS((*(0,) * len(FIELDS), n, n + 1, 3 * n + 1))[:_N_FIXED]
        *at, start = _layout(counts)  # (the plain loop stops at the last of these counts)
        bounds = _offsets(counts[: len(_LISTED)])
        slices = tuple(map(slice, bounds, bounds[1:]))
        coded = at[_N_FIXED - len(_NAMES)]
        mask = b"".join(bytes([256 - len(names)]) * n + b"\xff" * (-n % 8) for names in _NAMES.values())
        if len(_FIXED) >= 1024:  # (record counts vary little in a run: a bound that is never reached)
            _FIXED.clear()
        listed = struct.Struct(f"={bounds[-1]}q")
        out = _FIXED[n] = (counts, start, listed, slices, coded, int.from_bytes(mask, "little"))
    return out


try:  # the same check compiled (_wire.c): absent where the install had no C compiler
    from snowcat.stages.agent import _wire
except ImportError:
    _wire = None
_WIRE_REVISION = 2  # _wire.c's REVISION this file is written for


def _built_for_this_source(wire) -> bool:
    """Whether `wire` (the compiled module) checks this format: an editable checkout not reinstalled
    after _wire.c or FIELDS changed holds a build of another."""
    return (wire.REVISION, wire.WIRE_VERSION, wire.MAGIC, wire.FIELDS, wire.CODES) == (
        _WIRE_REVISION,
        WIRE_VERSION,
        WIRE_MAGIC,
        tuple(zip(FIELDS, _UNIT)),
        tuple(map(len, _NAMES.values())),
    )


_scan_compiled = _wire.scan if _wire is not None and _built_for_this_source(_wire) else None


def compiled_check() -> str:
    """Which check `TrajectoryBatch.read` runs (`snowcat doctor`, the transport benchmark)."""
    if _wire is None:
        return "python (the compiled check was not built: no C compiler or Python headers at install)"
    if not _built_for_this_source(_wire):
        return f"python ({_wire.__file__} was built from another source: reinstall snowcat)"
    return "compiled" if _scan_compiled is not None else "python"


_ZEROS = bytes(1 << 16)  # what the support lengths of up to 16 Ki tokens are compared with (one memcmp)


def _check_counts(lengths: tuple) -> int:
    """The number of records of a batch of these leading lengths (FIELDS order); ValueError naming
    the first field whose count does not fit the others."""
    n = lengths[_N_OFFSETS] - 1
    if n < 0:
        raise ValueError("trajectory batch: token_offsets is empty")
    if _CONSISTENT_COUNTS((*lengths, n, n + 1, 3 * n + 1)) != lengths:
        count = dict(zip(FIELDS, lengths))
        for name, per in _COUNTED:
            want = n if per == "trajectories" else count["token_ids"]
            if count[name] != want:
                raise ValueError(f"trajectory batch: {name} has {count[name]} entries for {want} {per}")
        for name, of, entries in (("turn_offsets", n, "turns"), ("string_offsets", 3 * n, "strings")):
            if count[name] != of + 1:
                raise _offsets_error(name, of, count[entries])
    return n


def _offsets_error(name: str, count: int, total: int) -> ValueError:
    return ValueError(f"trajectory batch: {name} is not {count + 1} non-decreasing offsets from 0 to {total}")


def _zero_bytes(data: memoryview) -> bool:
    """Whether every byte is 0: one comparison up to 64 KiB, beyond it the largest 8-byte word
    (numpy: 9.4 MB in 0.1 ms, 0.28 as int32's least and largest) and the bytes after the last."""
    if len(data) <= len(_ZEROS):
        return _ZEROS.startswith(data)
    words = len(data) // 8
    return not np.frombuffer(data, np.uint64, words).max() and _ZEROS.startswith(data[8 * words :])


def _check_codes(codes: dict) -> None:
    """ValueError naming the first coded field (of _NAMES) with an index beyond its names; `codes`:
    each field's codes (bytes)."""
    for name, names in _NAMES.items():
        if max(codes[name], default=0) >= len(names):
            raise ValueError(f"trajectory batch: a {name.replace('_', ' ')} index beyond {len(names) - 1}")


def _episode_starts(n: int, segment: list[int]):
    """Index of each episode's first record, and n: every record is segment 0 of its episode or
    the one after the record before it."""
    if not any(segment):  # no context was rewritten: one record per episode
        return range(n + 1)
    starts = []
    for j, s in enumerate(segment):
        if s == 0:
            starts.append(j)
        elif not starts or s != j - starts[-1]:
            raise ValueError(
                f"trajectory batch: record {j} is segment {s} after {j - starts[-1] if starts else 0} of its episode"
            )
    return [*starts, n]


def _text(raw: bytes, string_offsets: Sequence[int]) -> str | list[str]:
    """The strings' utf-8 as one str when ASCII (byte offsets are character offsets), else each string alone."""
    try:
        text = raw.decode()
        if len(text) != len(raw):
            at = string_offsets
            text = [raw[a:b].decode() for a, b in zip(at, at[1:])]
    except UnicodeDecodeError as e:
        raise ValueError(f"trajectory batch: the strings are not utf-8 where cut at their offsets ({e.reason})") from None
    return text


def _fill(column: np.ndarray, pieces: list, at: list[int]) -> None:
    """Each record's piece into its place, column[at[i] : at[i + 1]]: arrays in one concatenation,
    lists one by one, each converted straight into the column (no array of its own)."""
    if pieces and all(isinstance(p, np.ndarray) for p in pieces):
        np.concatenate(pieces, axis=None, out=column, casting="unsafe")  # the dtype conversion Trajectory makes
    else:
        for piece, lo, hi in zip(pieces, at, at[1:]):
            column[lo:hi] = piece


def _scan(buf: np.ndarray) -> tuple:
    """`TrajectoryBatch.read`'s checks of message `buf` (uint8) in Python, what `_wire.scan` returns for
    a batch it accepts: (header, the _LISTED columns as lists, each episode's first record and n or
    None when every record is segment 0, None for the strings); ValueError naming what does not fit."""
    if len(buf) < _HEAD_BYTES:
        raise ValueError(f"trajectory batch: {len(buf)} bytes, shorter than its {_HEAD_BYTES}-byte header")
    head = _HEADER.unpack_from(buf)
    if head[0] != WIRE_MAGIC:
        raise ValueError("trajectory batch: not a snowcat trajectory batch (no magic number)")
    if head[1] != WIRE_VERSION or head[3] != len(FIELDS):
        raise ValueError(
            f"trajectory batch: wire format version {head[1]} with {head[3]} fields;"
            f" this snowcat reads version {WIRE_VERSION} with {len(FIELDS)} (ranks of different snowcat versions?)"
        )
    tokens, n_support, n_routes, n_turns, n_strings = _FREE_COUNTS(head)
    fixed = _FIXED.get(head[_H] - 1)  # (token_offsets: n + 1)
    if (
        fixed is None
        or head[_H : _H + _N_FIXED] != fixed[0]
        or not head[_PER_TOKEN_AT[0]] == head[_PER_TOKEN_AT[1]] == head[_PER_TOKEN_AT[2]] == tokens
        or (tokens | n_support | n_routes | n_turns | n_strings) < 0
    ):  # a record count not seen before, or a header that does not fit: checked field by field
        lengths = head[_H:]
        at = _layout(lengths) if min(lengths) >= 0 else [-1]
        if at[-1] != len(buf):
            raise ValueError(f"trajectory batch: {len(buf)} bytes, its header describes {at[-1]}")
        fixed = _fixed(_check_counts(lengths))
    counts, start, listed, slices, coded, codes_mask = fixed
    # where support_lengths and the strings start, and the end: the columns after token_ids in _FREE's order
    per_token = (4 * tokens + 7) & -8
    at_slen = start + 2 * per_token + ((tokens + 7) & -8)
    at_text = at_slen + per_token + ((4 * n_support + 7) & -8) + ((2 * n_routes + 7) & -8) + 16 * n_turns
    if (end := at_text + ((n_strings + 7) & -8)) != len(buf):
        raise ValueError(f"trajectory batch: {len(buf)} bytes, its header describes {end}")

    n = counts[0] - 1
    # the _LISTED columns, one list (every column starts on an 8-byte boundary; struct reads any alignment)
    listed = list(listed.unpack_from(buf, _HEAD_BYTES))
    tok, turn, str_off, width, segment = map(listed.__getitem__, slices)
    if tok[0] or tok[-1] != tokens or sorted(tok) != tok:
        raise _offsets_error("token_offsets", n, tokens)
    if turn[0] or turn[-1] != n_turns or sorted(turn) != turn:
        raise _offsets_error("turn_offsets", n, n_turns)
    if str_off[0] or str_off[-1] != n_strings or sorted(str_off) != str_off:
        raise _offsets_error("string_offsets", 3 * n, n_strings)
    data = memoryview(buf)
    if n_support:  # kept supports (top-k/top-p sampling): all >= 0 and they add up
        slen = np.ndarray(tokens, np.int32, buf, at_slen)
        if slen.min(initial=0) < 0 or int(slen.sum(dtype=np.int64)) != n_support:
            raise ValueError(f"trajectory batch: support_lengths do not add up to the {n_support} support ids")
    elif not _zero_bytes(data[at_slen : at_slen + 4 * tokens]):  # none at all, the common case: all 0
        raise ValueError("trajectory batch: support_lengths do not add up to the 0 support ids")
    if width.count(w := width[0] if n else 0) == n:  # every record routed by the same model, or none
        routes_fit = w >= 0 and w * tokens == n_routes
    else:
        routes_fit = min(width) >= 0 and sum(map(operator.mul, map(operator.sub, tok[1:], tok), width)) == n_routes
    if not routes_fit:
        raise ValueError(f"trajectory batch: route widths do not add up to the {n_routes} routes entries")
    if int.from_bytes(data[coded:start], "little") & codes_mask:  # a code beyond its names (or padding not 0)
        at = _layout(head[_H:])  # (only to name the field at fault)
        _check_codes({name: data[a : a + n] for name, a in zip(_NAMES, at[_N_FIXED - len(_NAMES) : _N_FIXED])})
    return head, tok, turn, str_off, width, segment, _episode_starts(n, segment) if any(segment) else None, None


class BatchBuffers:
    """Memory for batches' buffers (written on the rollout side, received on the trainer side),
    handed out again once nothing refers to it. Fresh memory costs a page fault per 4 KiB page on
    first touch, and glibc maps every allocation over 32 MiB anew (`bench transport`, 33 MiB
    batches: 0.69-0.91x of a raw transfer with a fresh receive buffer per batch, 0.81-0.99x
    reused; writing a 66 MiB batch: 19.5 ms into fresh memory, 16.2 ms into memory used before).
    A batch, and every trajectory taken from it, holds views of its buffer, so a buffer is reused
    only when no view of it is alive (CPython's reference count says so; a live view only costs
    new memory, never an overwrite). The trainer holds batch k while it receives k+1, the rollout
    side drops a batch once it is sent: two buffers serve either."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._kept: list[np.ndarray] = []

    def take(self, units: int) -> np.ndarray:
        """An uninitialised int64 array of `units`."""
        for buf in self._kept:
            # references: the list, `buf` and getrefcount's argument; any more are views in use
            if len(buf) >= units and sys.getrefcount(buf) == 3:
                return buf[:units]
        # room to grow (episodes vary in length); the slack's pages are touched only by a larger batch
        fresh = np.empty(units + units // 4, np.int64)
        self._kept = [*self._kept, fresh][-self.keep :]
        return fresh[:units]


class TrajectoryBatch(Sequence):
    """A batch of episodes as its columns: each field of `FIELDS` one typed array for the whole
    batch (`column(name)`), all of them in one buffer laid out as the wire (`buffer`: the message
    the transport moves as it is). A sequence of the batch's episodes: `batch[i]` is a Trajectory
    whose arrays are views of the columns, made when first asked for.

    `write` puts records in (the rollout side: each list of an episode's ids converts straight
    into its place in the column, so no pass over the records is left for the send); `read` takes
    a message as it arrived (the header, the offsets and the counts checked for the batch as a
    whole, the columns views of the message). Both give the same records back, and every batch
    is checked by `read`, the one path: `write` reads what it wrote, `columns_of` copies its
    arrays into a message and reads that.

    Reading checks the batch in one compiled call (`_wire.scan`, stages/agent/_wire.c, built at
    install): just after a receive every Python step ran at a third of its speed, and the Python
    checks took 12-16 us of a 2-episode batch's ~65 us transfer there. Where it was not built, or
    for a batch it refuses, the Python checks (`_scan`) run: in lists and byte comparisons read
    straight from the message, numpy only for what is long and uniform (support lengths); they name
    what does not fit. Both accept exactly the same messages (tests/test_wire_check.py). 2 episodes
    read in 2.0 us compiled, 5.2 in Python; 2048 in 0.31 ms."""

    # -- making a batch

    @classmethod
    def read(cls, buf) -> TrajectoryBatch:
        """The batch in message `buf` (any buffer: the columns are views of it); ValueError naming what
        does not fit (another format version, a truncated or padded buffer, inconsistent offsets)."""
        if not isinstance(buf, np.ndarray):
            buf = np.frombuffer(buf, np.uint8)
        elif buf.dtype is not _BYTE or buf.ndim != 1:  # (a received message is one already)
            buf = buf.view(np.uint8).reshape(-1)
        scanned = _scan_compiled(buf) if _scan_compiled is not None else None
        # not built, or a batch it does not accept: the Python checks, which name what does not fit
        head, tok, turn, str_off, width, segment, starts, text = scanned or _scan(buf)
        if starts is None:  # every record segment 0 of its episode
            starts = range(len(tok))
        if text is None:  # not ASCII (or checked in Python): the strings, the last column, str by str
            n_strings = head[-1]
            text = _text(buf[len(buf) - ((n_strings + 7) & -8) :][:n_strings].tobytes(), str_off)

        batch = object.__new__(cls)
        batch.__dict__ = {  # (one dict: the columns, positions and values `_record` uses are made when first used)
            "index": head[2],
            "buffer": buf,
            "_head": head,
            "_starts": starts,
            "_text": text,
            "_tokens": head[_H + _N_FIXED],
            "_columns": {},
            "_where": None,
            "_at": None,
            "_lists": {
                "token_offsets": tok,
                "turn_offsets": turn,
                "string_offsets": str_off,
                "route_width": width,
                "segment": segment,
            },
            "_episodes": [None] * (len(starts) - 1),  # each made when first asked for
        }
        return batch

    @classmethod
    def columns_of(cls, buffers: dict[str, np.ndarray]) -> TrajectoryBatch:
        """The batch of these arrays, keyed and typed as in `FIELDS` (what `pack` gives, e.g. from an
        npz file): copied into one message and read (checked as any message is)."""
        columns = {name: np.asarray(buffers[name], dtype).reshape(-1, *tail) for name, (dtype, tail) in FIELDS.items()}
        lengths = [len(a) for a in columns.values()]
        *at, total = _layout(lengths)
        buf = np.zeros(total, np.uint8)
        _put_header(buf, 0, lengths)
        for a, column in zip(at, columns.values()):
            buf[a : a + column.nbytes] = column.reshape(-1).view(np.uint8)
        return cls.read(buf)

    @classmethod
    def write(cls, index: int, records: Sequence[dict], buffers: BatchBuffers | None = None) -> TrajectoryBatch:
        """Batch `index` of these records, in order, each a Trajectory's fields by name (`vars(t)`,
        or the agent loop's lists: arrays and lists alike), every one written straight into its
        place in the buffer (memory from `buffers`, else fresh). An episode's records are its
        segments 0, 1, ... in turn. ValueError naming the record that does not fit (as Trajectory
        would refuse it)."""
        records = list(records)
        tokens = [len(r["token_ids"]) for r in records]
        routes = [None if r["routes"] is None else np.asarray(r["routes"]) for r in records]
        for r, length, route in zip(records, tokens, routes):
            got = [len(r[k]) for k in _PER_TOKEN[1:]]
            if got != [length] * 3:
                raise ValueError(
                    f"trajectory {r['task_id']}: {length} tokens but {got[0]} mask entries, {got[1]} logprobs and {got[2]} support lengths"
                )
            if route is not None and (route.ndim != 2 or len(route) != length):
                raise ValueError(f"trajectory {r['task_id']}: routes of shape {route.shape} for {length} tokens")
        width = [0 if route is None else route.shape[1] for route in routes]
        support = [len(r["support_ids"]) for r in records]
        turns = [s for r in records for s in r["turn_boundaries"]]
        strings = [s.encode() for r in records for s in (r["task_id"], r["domain"], r["detail"])]
        lengths = dict.fromkeys(FIELDS, len(records))
        lengths.update(dict.fromkeys(_PER_TOKEN, sum(tokens)), token_offsets=len(records) + 1, turn_offsets=len(records) + 1)
        lengths.update(support_ids=sum(support), routes=sum(map(operator.mul, tokens, width)), turns=len(turns))
        lengths.update(strings=sum(map(len, strings)), string_offsets=len(strings) + 1)
        *offsets, total = _layout(lengths.values())
        buf = (np.empty(total // 8, np.int64) if buffers is None else buffers.take(total // 8)).view(np.uint8)
        _put_header(buf, index, lengths.values())
        for name, unit, off, end in zip(FIELDS, _UNIT, offsets, [*offsets[1:], total]):
            buf[off + lengths[name] * unit : end] = 0  # the padding: no stale memory on the wire
        batch = {
            name: np.ndarray((lengths[name], *tail), dtype, buf, off)
            for (name, (dtype, tail)), off in zip(FIELDS.items(), offsets)
        }
        tok = _offsets(tokens)
        for name in _PER_TOKEN:
            _fill(batch[name], [r[name] for r in records], tok)
        _fill(batch["support_ids"], [r["support_ids"] for r in records], _offsets(support))
        _fill(
            batch["routes"], [route for route in routes if route is not None], _offsets(n * w for n, w in zip(tokens, width) if w)
        )
        batch["route_width"][:] = width
        batch["token_offsets"][:] = tok
        for name in _SCALARS:
            codes = _CODES.get(name)
            values = [r[name] for r in records]
            if codes is not None:
                unknown = [v for v in values if v not in codes]
                if unknown:
                    raise ValueError(f"trajectory batch: {name} {unknown[0]!r} not in {tuple(codes)}")
                values = [codes[v] for v in values]
            batch[name][:] = values
        if turns:
            batch["turns"][:] = turns
        batch["turn_offsets"][:] = _offsets(len(r["turn_boundaries"]) for r in records)
        batch["strings"][:] = np.frombuffer(b"".join(strings), np.uint8)
        batch["string_offsets"][:] = _offsets(map(len, strings))
        if any(support):  # each record's support lengths add up to its own ids (reading checks only the total)
            sums = np.diff(np.concatenate([[0], np.cumsum(batch["support_lengths"], dtype=np.int64)])[tok])
            bad = np.flatnonzero(sums != support)
            if len(bad):
                r = records[bad[0]]
                raise ValueError(f"trajectory {r['task_id']}: support lengths sum to {sums[bad[0]]}, {support[bad[0]]} ids")
        return cls.read(buf)  # (checked as the trainer will check it)

    @classmethod
    def of(cls, index: int, trajs: Sequence[Trajectory], buffers: BatchBuffers | None = None) -> TrajectoryBatch:
        """Batch `index` of these episodes (every record of each, `segments`)."""
        return cls.write(index, [vars(r) for t in trajs for r in segments(t)], buffers)

    # -- reading it

    def column(self, name: str) -> np.ndarray:
        """Field `name` for the whole batch (every record's entries, in order): a view of the buffer."""
        out = self._columns.get(name)
        if out is None:  # (checking the batch needs only some columns: each is made when first used)
            if self._where is None:
                self._where = _layout(self._head[_H:])
            i = _FIELD_INDEX[name]
            dtype, tail = _SPECS[i]
            out = self._columns[name] = np.ndarray((self._head[_H + i], *tail), dtype, self.buffer, self._where[i])
        return out

    def _list(self, name: str) -> list:
        """Column `name` as a Python list."""
        out = self._lists.get(name)
        if out is None:
            out = self._lists[name] = self.column(name).tolist()
        return out

    @property
    def columns(self) -> dict[str, np.ndarray]:
        """Every field's column, keyed and typed as in `FIELDS`."""
        return {name: self.column(name) for name in FIELDS}

    @property
    def n_records(self) -> int:
        return len(self.column("token_offsets")) - 1

    def __len__(self) -> int:
        return len(self._episodes)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]  # IndexError beyond the end, negative from the end
        t = self._episodes[i]
        if t is None:
            first, last = self._starts[i], self._starts[i + 1] - 1
            t = self._episodes[i] = self._record(last, tuple(self._record(j) for j in range(first, last)))
        return t

    def __eq__(self, other) -> bool:  # as the list of its episodes
        if not isinstance(other, (TrajectoryBatch, list, tuple)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None

    def __repr__(self) -> str:
        return f"TrajectoryBatch(index={self.index}, episodes={len(self)}, records={self.n_records}, tokens={self._tokens})"

    def _record(self, j: int, earlier: tuple = ()) -> Trajectory:
        """Record j, its arrays views of the columns (disjoint slices: each record's arrays are its
        own). Without dataclass __init__: the batch was checked as a whole."""
        column = self.column
        if self._at is None:
            listed = self._list
            tok, width, support = listed("token_offsets"), listed("route_width"), column("support_lengths")
            self._at = at = {name: listed(name) for name in _SCALARS}
            at.update(tok=tok, turn=listed("turn_offsets"), strings=listed("string_offsets"), width=width)
            at["routes"] = _offsets(map(operator.mul, map(operator.sub, tok[1:], tok), width))
            # where each record's support ids start (none at all: every token sampled from the full distribution)
            at["support"] = (
                np.concatenate([[0], np.cumsum(support, dtype=np.int64)])[tok].tolist() if len(column("support_ids")) else None
            )
        v = self._at
        lo, hi, w, sof = v["tok"][j], v["tok"][j + 1], v["width"][j], v["strings"]
        if isinstance(self._text, str):  # ASCII: byte offsets are character offsets
            task_id, domain, detail = (self._text[a:b] for a, b in zip(sof[3 * j : 3 * j + 3], sof[3 * j + 1 : 3 * j + 4]))
        else:
            task_id, domain, detail = self._text[3 * j : 3 * j + 3]
        sup = (0, 0) if v["support"] is None else v["support"][j : j + 2]
        t = object.__new__(Trajectory)
        t.__dict__ = {
            "task_id": task_id,
            "group_id": v["group_id"][j],
            "attempt": v["attempt"][j],
            "policy_version": v["policy_version"][j],
            "token_ids": column("token_ids")[lo:hi],
            "loss_mask": column("loss_mask")[lo:hi],
            "rollout_logprobs": column("rollout_logprobs")[lo:hi],
            "reward": v["reward"][j],
            "status": STATUSES[v["status"][j]],
            "turn_boundaries": list(map(tuple, column("turns")[v["turn"][j] : v["turn"][j + 1]].tolist())),
            "domain": domain,
            "prompt_len": v["prompt_len"][j],
            "detail": detail,
            "support_lengths": column("support_lengths")[lo:hi],
            "support_ids": column("support_ids")[sup[0] : sup[1]],
            "routes": column("routes")[v["routes"][j] : v["routes"][j + 1]].reshape(hi - lo, w) if w else None,
            "segment": v["segment"][j],
            "segment_kind": SEGMENT_KINDS[v["segment_kind"][j]],
            "earlier": earlier,
            "source": SOURCES[v["source"][j]],
        }
        return t


def pack(trajs: list[Trajectory]) -> dict[str, np.ndarray]:
    """A batch as contiguous typed arrays, keyed and typed as in `FIELDS` (every record of every episode)."""
    return TrajectoryBatch.of(0, trajs).columns


def unpack(buffers: dict[str, np.ndarray]) -> list[Trajectory]:
    """Inverse of `pack`: the episodes, their arrays views of `buffers`."""
    return list(TrajectoryBatch.columns_of(buffers))


def encode(batch_index: int, trajs: list[Trajectory]) -> np.ndarray:
    """Batch `batch_index` as one uint8 buffer (the layout above): what one MPI message carries."""
    return TrajectoryBatch.of(batch_index, trajs).buffer


def decode(buf) -> tuple[int, list[Trajectory]]:
    """(batch index, episodes) of a buffer `encode` made (`TrajectoryBatch.read`)."""
    batch = TrajectoryBatch.read(buf)
    return batch.index, list(batch)
