"""Packing short examples into fixed-length rows, and a resumable, seeded batch iterator.

An example is (ids, loss_mask, domain index). Rows hold whole examples back to back; segment ids
keep attention inside each example, positions restart at 0 per example, and the target of the
last token of an example is -1 (no loss across the boundary). Padding is its own segment.

`Repacked` does the same for a batch that is already right-padded (RL's rows, one per episode
record), for the forward pass only: the caller keeps its [B, T] layout and reads the outputs back in it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Example:
    ids: list[int]
    mask: list[int]
    domain: int = -1


def pack_rows(examples: list[Example], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Greedy first-fit packing in the given order (keeps the shuffle's randomness).
    Examples longer than seq_len are truncated (their tail loses its loss)."""
    rows: list[list[Example]] = []
    room: list[int] = []
    for ex in examples:
        n = min(len(ex.ids), seq_len)
        # first row with room (bounded look-back keeps this linear-ish and order-preserving)
        for r in range(max(0, len(rows) - 16), len(rows)):
            if room[r] >= n:
                rows[r].append(ex)
                room[r] -= n
                break
        else:
            rows.append([ex])
            room.append(seq_len - n)
    R = len(rows)
    input_ids = np.full((R, seq_len), pad_id, dtype=np.int64)
    targets = np.full((R, seq_len), -1, dtype=np.int64)
    segment_ids = np.full((R, seq_len), -1, dtype=np.int64)
    position_ids = np.zeros((R, seq_len), dtype=np.int64)
    domain_ids = np.full((R, seq_len), -1, dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for s, ex in enumerate(row):
            ids = np.asarray(ex.ids[:seq_len], dtype=np.int64)
            mask = np.asarray(ex.mask[:seq_len], dtype=bool)
            n = len(ids)
            input_ids[r, at : at + n] = ids
            # target of token t is token t+1, trained where token t+1 is in the loss mask
            tgt = np.where(mask[1:], ids[1:], -1)
            targets[r, at : at + n - 1] = tgt
            segment_ids[r, at : at + n] = s
            position_ids[r, at : at + n] = np.arange(n)
            domain_ids[r, at : at + n] = ex.domain
            at += n
        position_ids[r, at:] = np.arange(seq_len - at)
    t = torch.from_numpy
    return {
        "input_ids": t(input_ids),
        "targets": t(targets),
        "segment_ids": t(segment_ids),
        "position_ids": t(position_ids),
        "domain_ids": t(domain_ids),
    }


class PackedLoader:
    """Epochs of shuffled, packed rows cut into global batches; state = (epoch, batch index).

    Each optimizer step takes `batch_rows` rows; rank r of W gets rows r::W of it, split into
    `micro_batches` micro-batches. Epoch e is shuffled with seed (seed, e), so resuming from a
    state gives exactly the batches an uninterrupted run would have seen.
    """

    def __init__(
        self,
        examples: list[Example],
        seq_len: int,
        pad_id: int,
        batch_rows: int,
        seed: int,
        micro_batches: int = 1,
        rank: int = 0,
        world_size: int = 1,
    ):
        if batch_rows % (world_size * micro_batches):
            raise ValueError(f"batch_rows={batch_rows} must divide by world_size*micro_batches={world_size * micro_batches}")
        self.examples, self.seq_len, self.pad_id = examples, seq_len, pad_id
        self.batch_rows, self.seed, self.micro = batch_rows, seed, micro_batches
        self.rank, self.world_size = rank, world_size
        self.epoch, self.index = 0, 0
        self._rows: dict | None = None
        self._rows_epoch = -1

    def _epoch_rows(self) -> dict:
        if self._rows_epoch != self.epoch:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.examples))
            self._rows = pack_rows([self.examples[i] for i in order], self.seq_len, self.pad_id)
            self._rows_epoch = self.epoch
        return self._rows

    def batches_per_epoch(self) -> int:
        return self._epoch_rows()["input_ids"].shape[0] // self.batch_rows

    def next(self) -> list[dict]:
        """The micro-batches of this rank for the next optimizer step (drops each epoch's tail)."""
        rows = self._epoch_rows()
        if (self.index + 1) * self.batch_rows > rows["input_ids"].shape[0]:
            self.epoch, self.index = self.epoch + 1, 0
            rows = self._epoch_rows()
            if self.batch_rows > rows["input_ids"].shape[0]:
                raise ValueError(f"batch_rows={self.batch_rows} exceeds the {rows['input_ids'].shape[0]} packed rows of an epoch")
        lo = self.index * self.batch_rows
        mine = torch.arange(lo + self.rank, lo + self.batch_rows, self.world_size)
        self.index += 1
        return [{k: v[idx] for k, v in rows.items()} for idx in mine.chunk(self.micro)]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.index = int(sd["epoch"]), int(sd["index"])


@dataclass(frozen=True)
class Repacked:
    """Right-padded rows [B, T] (row b real in its first `lengths[b]` positions) as one row of their
    real tokens back to back, [1, N], and back. RL's episodes are padded to the longest in the batch:
    about half of a demo batch is padding the forward would compute. One row has none, and costs
    nothing more than several (attention runs per document, whatever the row's length); its tokens
    keep the padded batch's row-major order, so a selection such as `x[mask]` picks them in the same
    order either way."""

    src: torch.Tensor  # int64 [N]: the real tokens' flat positions in [B * T]
    segment_ids: torch.Tensor  # [1, N]: the padded row each token came from
    position_ids: torch.Tensor  # [1, N]: the token's position in its padded row
    shape: tuple[int, int]  # (B, T) of the padded batch

    @classmethod
    def of(cls, lengths: torch.Tensor, width: int) -> Repacked:
        lengths = lengths.clamp(0, width)
        real = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]  # [B, T]
        src = real.reshape(-1).nonzero().squeeze(1)
        rows, positions = src // width, src % width
        return cls(src, rows[None], positions[None], (len(lengths), width))

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> [1, N, ...]"""
        B, T = self.shape
        return x.reshape(B * T, *x.shape[2:]).index_select(0, self.src)[None]

    def unpack(self, y: torch.Tensor, fill) -> torch.Tensor:
        """[1, N, ...] -> [B, T, ...], differentiable; padding positions hold `fill`."""
        B, T = self.shape
        y = y[0]
        return y.new_full((B * T, *y.shape[1:]), fill).index_copy(0, self.src, y).view(B, T, *y.shape[1:])
