"""The trajectory record (rollout -> trainer, and the trace), and its MPI-friendly packing.

`token_ids` hold the prompt and every turn exactly as sampled or encoded -- never re-tokenised --
so the trainer scores the very ids the rollout logprobs belong to. `loss_mask` is 1 only on
model-sampled tokens; `rollout_logprobs` is 0 wherever the mask is 0.

`pack(trajs)` turns a batch into a few flat, typed numpy arrays (concatenated tokens + offsets +
per-trajectory scalars + one utf-8 byte buffer for the strings): every field has a fixed dtype and
trailing shape (`FIELDS`), only the leading lengths vary (`np.savez` stores them as they are).
`encode(k, trajs)` lays the same fields out in one buffer behind a typed, versioned header, so
MPI moves a batch as one message with no pickling, and `decode(buf)` gives them back:

    sender:   comm.Send(encode(k, trajs), dest)
    receiver: msg = comm.Mprobe(src, status=st); buf = np.empty(st.Get_count(MPI.BYTE), np.uint8)
              msg.Recv(buf); k, trajs = decode(buf)

`unpack` and `decode` check the batch as a whole (offsets, lengths, status codes) and hand out
views of the received buffer: one copy on each side (into the buffer, out of the socket).

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
from dataclasses import dataclass, field

import numpy as np

STATUSES = ("ok", "truncated", "invalid_action", "infra_error")
# what a record of an episode holds: a stretch of turns in one context, or the policy writing a summary
SEGMENT_KINDS = ("context", "summary")

# name -> (dtype, trailing shape); the order is the wire order
FIELDS: dict[str, tuple[np.dtype, tuple[int, ...]]] = {
    "token_ids": (np.dtype(np.int32), ()),  # all trajectories' tokens, concatenated
    "loss_mask": (np.dtype(np.uint8), ()),
    "rollout_logprobs": (np.dtype(np.float32), ()),
    "support_lengths": (np.dtype(np.int32), ()),  # per token: how many kept ids the engine reported
    "support_ids": (np.dtype(np.int32), ()),  # all tokens' kept ids, concatenated
    "route_width": (np.dtype(np.int64), ()),  # per trajectory: moe layers * k, 0 = no routes recorded
    "routes": (np.dtype(np.int16), ()),  # all trajectories' [L, width] routes, flattened and concatenated
    "token_offsets": (np.dtype(np.int64), ()),  # [N+1]: trajectory i is tokens[off[i]:off[i+1]]
    "group_id": (np.dtype(np.int64), ()),
    "attempt": (np.dtype(np.int64), ()),
    "policy_version": (np.dtype(np.int64), ()),
    "prompt_len": (np.dtype(np.int64), ()),
    "reward": (np.dtype(np.float64), ()),
    "status": (np.dtype(np.uint8), ()),  # index into STATUSES
    "segment": (np.dtype(np.int64), ()),  # the record's place in its episode (0: the opening's context)
    "segment_kind": (np.dtype(np.uint8), ()),  # index into SEGMENT_KINDS
    "turns": (np.dtype(np.int64), (2,)),  # all (start, end) spans, concatenated
    "turn_offsets": (np.dtype(np.int64), ()),  # [N+1]
    "strings": (np.dtype(np.uint8), ()),  # utf-8 of task_id_0, domain_0, detail_0, task_id_1, ...
    "string_offsets": (np.dtype(np.int64), ()),  # [3N+1]
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


def _offsets(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))]).astype(np.int64)


def _parts(trajs: list[Trajectory]) -> dict[str, list | np.ndarray]:
    """Each field as the list of pieces to concatenate (or the finished array), in wire order."""
    trajs = flatten(trajs)
    strings = [s.encode() for t in trajs for s in (t.task_id, t.domain, t.detail)]
    return {
        "token_ids": [t.token_ids for t in trajs],
        "loss_mask": [t.loss_mask for t in trajs],
        "rollout_logprobs": [t.rollout_logprobs for t in trajs],
        "support_lengths": [t.support_lengths for t in trajs],
        "support_ids": [t.support_ids for t in trajs],
        "route_width": np.array([0 if t.routes is None else t.routes.shape[1] for t in trajs], np.int64),
        "routes": [t.routes for t in trajs if t.routes is not None],
        "token_offsets": _offsets([len(t) for t in trajs]),
        "group_id": np.array([t.group_id for t in trajs], np.int64),
        "attempt": np.array([t.attempt for t in trajs], np.int64),
        "policy_version": np.array([t.policy_version for t in trajs], np.int64),
        "prompt_len": np.array([t.prompt_len for t in trajs], np.int64),
        "reward": np.array([t.reward for t in trajs], np.float64),
        "status": np.array([STATUSES.index(t.status) for t in trajs], np.uint8),
        "segment": np.array([t.segment for t in trajs], np.int64),
        "segment_kind": np.array([SEGMENT_KINDS.index(t.segment_kind) for t in trajs], np.uint8),
        "turns": np.array([s for t in trajs for s in t.turn_boundaries], np.int64).reshape(-1, 2),
        "turn_offsets": _offsets([len(t.turn_boundaries) for t in trajs]),
        "strings": [np.frombuffer(b"".join(strings), np.uint8)],
        "string_offsets": _offsets([len(s) for s in strings]),
    }


def _length(name: str, part) -> int:
    """Leading length of a field once its pieces are concatenated (flattened to its trailing shape)."""
    if isinstance(part, np.ndarray):
        return len(part)
    tail = int(np.prod(FIELDS[name][1], dtype=np.int64))
    return sum(p.size for p in part) // tail


def _fill(out: np.ndarray, part) -> None:
    """Concatenate a field's pieces straight into `out` (one copy, no intermediate array)."""
    if isinstance(part, np.ndarray):
        out[...] = part
    elif len(out):
        np.concatenate(part, axis=None, out=out.reshape(-1))


def pack(trajs: list[Trajectory]) -> dict[str, np.ndarray]:
    """A batch as contiguous typed arrays, keyed and typed as in `FIELDS` (every record of every episode)."""
    out = {}
    for name, part in _parts(trajs).items():
        dtype, tail = FIELDS[name]
        out[name] = np.empty((_length(name, part), *tail), dtype)
        _fill(out[name], part)
    return out


def _check(b: dict[str, np.ndarray]) -> int:
    """Number of trajectories in `b` once every offset and length is consistent (ValueError
    naming the field otherwise): checked for the batch at once, so `unpack` need not re-check
    each record."""
    n = len(b["token_offsets"]) - 1

    def offsets(name: str, count: int, total: int) -> None:
        off = b[name]
        if len(off) != count + 1 or off[0] != 0 or off[-1] != total or (np.diff(off) < 0).any():
            raise ValueError(f"trajectory batch: {name} is not {count + 1} non-decreasing offsets from 0 to {total}")

    if n < 0:
        raise ValueError("trajectory batch: token_offsets is empty")
    offsets("token_offsets", n, len(b["token_ids"]))
    for name in (
        "route_width",
        "group_id",
        "attempt",
        "policy_version",
        "prompt_len",
        "reward",
        "status",
        "segment",
        "segment_kind",
    ):
        if len(b[name]) != n:
            raise ValueError(f"trajectory batch: {name} has {len(b[name])} entries for {n} trajectories")
    tokens = len(b["token_ids"])
    for name in ("loss_mask", "rollout_logprobs", "support_lengths"):
        if len(b[name]) != tokens:
            raise ValueError(f"trajectory batch: {name} has {len(b[name])} entries for {tokens} tokens")
    if (b["support_lengths"] < 0).any() or int(b["support_lengths"].sum(dtype=np.int64)) != len(b["support_ids"]):
        raise ValueError(f"trajectory batch: support_lengths do not add up to the {len(b['support_ids'])} support ids")
    width = b["route_width"]
    if (width < 0).any() or int((np.diff(b["token_offsets"]) * width).sum()) != len(b["routes"]):
        raise ValueError(f"trajectory batch: route widths do not add up to the {len(b['routes'])} routes entries")
    if (b["status"] >= len(STATUSES)).any():
        raise ValueError(f"trajectory batch: a status index beyond {len(STATUSES) - 1}")
    if (b["segment_kind"] >= len(SEGMENT_KINDS)).any():
        raise ValueError(f"trajectory batch: a segment kind index beyond {len(SEGMENT_KINDS) - 1}")
    offsets("turn_offsets", n, len(b["turns"]))
    offsets("string_offsets", 3 * n, len(b["strings"]))
    return n


def unpack(buffers: dict[str, np.ndarray]) -> list[Trajectory]:
    """Inverse of `pack`, episodes put back together (`regroup`). The arrays of the records are views
    of `buffers` (disjoint slices, so each record's arrays are its own; they keep the buffers alive)."""
    b = {name: np.asarray(buffers[name], dtype).reshape(-1, *tail) for name, (dtype, tail) in FIELDS.items()}
    n = _check(b)
    tok, turn, sof = (b[k].tolist() for k in ("token_offsets", "turn_offsets", "string_offsets"))
    raw = b["strings"].tobytes()
    chars = raw.decode()
    if len(chars) == len(raw):  # ASCII: byte offsets are character offsets
        text = [chars[sof[j] : sof[j + 1]] for j in range(3 * n)]
    else:
        text = [raw[sof[j] : sof[j + 1]].decode() for j in range(3 * n)]
    spans = list(zip(b["turns"][:, 0].tolist(), b["turns"][:, 1].tolist()))
    ids, mask, lps, slen, sids, routes = (
        b[k] for k in ("token_ids", "loss_mask", "rollout_logprobs", "support_lengths", "support_ids", "routes")
    )
    # support_ids offset of each trajectory's first token (none at all: sampled from the full distribution)
    sup = np.concatenate([[0], np.cumsum(slen, dtype=np.int64)])[tok].tolist() if len(sids) else [0] * (n + 1)
    width = b["route_width"].tolist()
    rof = _offsets(np.diff(b["token_offsets"]) * b["route_width"]).tolist()  # routes offset of each trajectory
    names = ("group_id", "attempt", "policy_version", "prompt_len", "reward", "status", "segment", "segment_kind")
    scalars = zip(*(b[k].tolist() for k in names))
    trajs = []
    for i, (group, attempt, version, prompt, reward, status, segment, kind) in enumerate(scalars):
        lo, hi = tok[i], tok[i + 1]
        # the record without dataclass __init__: `_check` validated the batch as a whole, and
        # re-checking and re-converting every record was a third of unpacking a large batch
        t = object.__new__(Trajectory)
        t.__dict__ = {
            "task_id": text[3 * i],
            "group_id": group,
            "attempt": attempt,
            "policy_version": version,
            "token_ids": ids[lo:hi],
            "loss_mask": mask[lo:hi],
            "rollout_logprobs": lps[lo:hi],
            "reward": reward,
            "status": STATUSES[status],
            "turn_boundaries": spans[turn[i] : turn[i + 1]],
            "domain": text[3 * i + 1],
            "prompt_len": prompt,
            "detail": text[3 * i + 2],
            "support_lengths": slen[lo:hi],
            "support_ids": sids[sup[i] : sup[i + 1]],
            "routes": routes[rof[i] : rof[i + 1]].reshape(hi - lo, width[i]) if width[i] else None,
            "segment": segment,
            "segment_kind": SEGMENT_KINDS[kind],
            "earlier": (),
        }
        trajs.append(t)
    return regroup(trajs)


# -- the wire: one buffer per batch -------------------------------------------------------------
#
#   int64 [WIRE_MAGIC, WIRE_VERSION, batch index, len(FIELDS), leading length of each field]
#   then each field's bytes in FIELDS order, each starting on an 8-byte boundary; the whole is a
#   multiple of 8 bytes. A change to FIELDS or to this layout bumps WIRE_VERSION, so a rank of
#   another snowcat version is refused by name instead of misread.

WIRE_MAGIC = int.from_bytes(b"snowtraj", "little")
WIRE_VERSION = 2  # 2: segment, segment_kind
_HEAD = 4 + len(FIELDS)


# bytes per unit of leading length, per field
_UNIT = [dtype.itemsize * int(np.prod(tail, dtype=np.int64)) for dtype, tail in FIELDS.values()]


def _layout(lengths) -> tuple[list[int], int]:
    """Byte offset of each field for these leading lengths, and the total size (8-byte aligned)."""
    offsets, at = [], 8 * _HEAD
    for unit, n in zip(_UNIT, lengths):
        offsets.append(at)
        at += (int(n) * unit + 7) // 8 * 8
    return offsets, at


def _views(buf: np.ndarray, lengths, offsets) -> dict[str, np.ndarray]:
    """Each field as a typed view of its bytes in `buf` (no copy)."""
    return {
        name: buf[off : off + int(n) * unit].view(dtype).reshape(int(n), *tail)
        for (name, (dtype, tail)), unit, n, off in zip(FIELDS.items(), _UNIT, lengths, offsets)
    }


def encode(batch_index: int, trajs: list[Trajectory]) -> np.ndarray:
    """Batch `batch_index` as one uint8 buffer (the layout above): what one MPI message carries."""
    parts = _parts(trajs)
    lengths = [_length(name, part) for name, part in parts.items()]
    offsets, total = _layout(lengths)
    buf = np.empty(total, np.uint8)
    buf[: 8 * _HEAD].view(np.int64)[:] = [WIRE_MAGIC, WIRE_VERSION, batch_index, len(FIELDS), *lengths]
    for out, part, off, end in zip(_views(buf, lengths, offsets).values(), parts.values(), offsets, [*offsets[1:], total]):
        _fill(out, part)
        buf[off + out.nbytes : end] = 0  # the padding: no stale memory on the wire
    return buf


def decode(buf) -> tuple[int, list[Trajectory]]:
    """(batch index, trajectories) of a buffer `encode` made; ValueError naming what does not fit
    (another format version, a truncated or padded buffer, inconsistent offsets)."""
    buf = buf.view(np.uint8).reshape(-1) if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
    if len(buf) < 8 * _HEAD:
        raise ValueError(f"trajectory batch: {len(buf)} bytes, shorter than its {8 * _HEAD}-byte header")
    head = buf[: 8 * _HEAD].view(np.int64)
    magic, version, batch_index, n_fields = (int(x) for x in head[:4])
    if magic != WIRE_MAGIC:
        raise ValueError("trajectory batch: not a snowcat trajectory batch (no magic number)")
    if version != WIRE_VERSION or n_fields != len(FIELDS):
        raise ValueError(
            f"trajectory batch: wire format version {version} with {n_fields} fields;"
            f" this snowcat reads version {WIRE_VERSION} with {len(FIELDS)} (ranks of different snowcat versions?)"
        )
    lengths = head[4:]
    offsets, total = _layout(lengths) if (lengths >= 0).all() else ([], -1)
    if total != len(buf):
        raise ValueError(f"trajectory batch: {len(buf)} bytes, its header describes {total}")
    return batch_index, unpack(_views(buf, lengths, offsets))
