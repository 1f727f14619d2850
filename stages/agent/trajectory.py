"""The trajectory record (rollout -> trainer, and the trace), and its MPI-friendly packing.

`token_ids` hold the prompt and every turn exactly as sampled or encoded -- never re-tokenised --
so the trainer scores the very ids the rollout logprobs belong to. `loss_mask` is 1 only on
model-sampled tokens; `rollout_logprobs` is 0 wherever the mask is 0.

`pack(trajs)` turns a batch into a few flat, typed numpy arrays (concatenated tokens + offsets +
per-trajectory scalars + one utf-8 byte buffer for the strings), so MPI moves them with buffer
`Send/Recv` instead of pickling. Every field has a fixed dtype and trailing shape (`FIELDS`); only
the leading lengths vary, and `header(buffers)` / `allocate(header)` carry those to the receiver:

    sender:   bufs = pack(trajs); comm.Send(header(bufs), dest); for name in FIELDS: comm.Send(bufs[name], dest)
    receiver: h = np.empty(len(FIELDS), np.int64); comm.Recv(h, src); bufs = allocate(h)
              for name in FIELDS: comm.Recv(bufs[name], src); trajs = unpack(bufs)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

STATUSES = ("ok", "truncated", "invalid_action", "infra_error")

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


def _offsets(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))]).astype(np.int64)


def pack(trajs: list[Trajectory]) -> dict[str, np.ndarray]:
    """A batch as contiguous typed arrays, keyed and typed as in `FIELDS`."""

    def cat(name, parts):
        dtype, tail = FIELDS[name]
        parts = [np.asarray(p, dtype=dtype).reshape((-1, *tail)) for p in parts]
        return np.ascontiguousarray(np.concatenate(parts) if parts else np.empty((0, *tail), dtype))

    strings = [s.encode() for t in trajs for s in (t.task_id, t.domain, t.detail)]
    out = {
        "token_ids": cat("token_ids", [t.token_ids for t in trajs]),
        "loss_mask": cat("loss_mask", [t.loss_mask for t in trajs]),
        "rollout_logprobs": cat("rollout_logprobs", [t.rollout_logprobs for t in trajs]),
        "support_lengths": cat("support_lengths", [t.support_lengths for t in trajs]),
        "support_ids": cat("support_ids", [t.support_ids for t in trajs]),
        "route_width": np.array([0 if t.routes is None else t.routes.shape[1] for t in trajs], np.int64),
        "routes": cat("routes", [t.routes.reshape(-1) for t in trajs if t.routes is not None]),
        "token_offsets": _offsets([len(t) for t in trajs]),
        "group_id": np.array([t.group_id for t in trajs], np.int64),
        "attempt": np.array([t.attempt for t in trajs], np.int64),
        "policy_version": np.array([t.policy_version for t in trajs], np.int64),
        "prompt_len": np.array([t.prompt_len for t in trajs], np.int64),
        "reward": np.array([t.reward for t in trajs], np.float64),
        "status": np.array([STATUSES.index(t.status) for t in trajs], np.uint8),
        "turns": cat("turns", [np.asarray(t.turn_boundaries, np.int64).reshape(-1, 2) for t in trajs]),
        "turn_offsets": _offsets([len(t.turn_boundaries) for t in trajs]),
        "strings": np.frombuffer(b"".join(strings), dtype=np.uint8).copy(),
        "string_offsets": _offsets([len(s) for s in strings]),
    }
    assert list(out) == list(FIELDS)
    return out


def unpack(buffers: dict[str, np.ndarray]) -> list[Trajectory]:
    """Inverse of `pack`."""
    b = buffers
    tok, turn, sof = b["token_offsets"], b["turn_offsets"], b["string_offsets"]
    raw = b["strings"].tobytes()
    text = [raw[sof[j] : sof[j + 1]].decode() for j in range(len(sof) - 1)]
    sup = _offsets(b["support_lengths"])  # support_ids offset of every token
    width = b["route_width"]
    rof = _offsets([(tok[i + 1] - tok[i]) * width[i] for i in range(len(tok) - 1)])  # routes offset of every trajectory
    trajs = []
    for i in range(len(tok) - 1):
        lo, hi = int(tok[i]), int(tok[i + 1])
        trajs.append(
            Trajectory(
                task_id=text[3 * i],
                group_id=int(b["group_id"][i]),
                attempt=int(b["attempt"][i]),
                policy_version=int(b["policy_version"][i]),
                token_ids=b["token_ids"][lo:hi].copy(),
                loss_mask=b["loss_mask"][lo:hi].copy(),
                rollout_logprobs=b["rollout_logprobs"][lo:hi].copy(),
                support_lengths=b["support_lengths"][lo:hi].copy(),
                support_ids=b["support_ids"][sup[lo] : sup[hi]].copy(),
                routes=b["routes"][rof[i] : rof[i + 1]].reshape(hi - lo, int(width[i])).copy() if width[i] else None,
                reward=float(b["reward"][i]),
                status=STATUSES[int(b["status"][i])],
                turn_boundaries=[tuple(map(int, s)) for s in b["turns"][turn[i] : turn[i + 1]]],
                domain=text[3 * i + 1],
                prompt_len=int(b["prompt_len"][i]),
                detail=text[3 * i + 2],
            )
        )
    return trajs


def header(buffers: dict[str, np.ndarray]) -> np.ndarray:
    """int64 [len(FIELDS)]: the leading length of each buffer, in wire order (send it first)."""
    return np.array([len(buffers[name]) for name in FIELDS], dtype=np.int64)


def allocate(lengths) -> dict[str, np.ndarray]:
    """Empty receive buffers for a batch announced by `header`."""
    return {name: np.empty((int(n), *tail), dtype) for (name, (dtype, tail)), n in zip(FIELDS.items(), lengths)}
