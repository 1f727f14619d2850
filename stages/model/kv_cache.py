"""Preallocated key/value cache for generation, one write position per batch row."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    k: torch.Tensor  # [layers, batch, kv_heads, max_len, head_dim]
    v: torch.Tensor
    lengths: torch.Tensor  # [batch] int64: filled slots per row; the next forward writes from here

    @classmethod
    def allocate(cls, cfg, batch: int, max_len: int, dtype=torch.float32, device="cpu") -> KVCache:
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        return cls(
            k=torch.zeros(shape, dtype=dtype, device=device),
            v=torch.zeros(shape, dtype=dtype, device=device),
            lengths=torch.zeros(batch, dtype=torch.long, device=device),
        )

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def truncate(self, lengths: torch.Tensor | list[int]) -> None:
        """Forget slots beyond `lengths` per row (e.g. after prefilling right-padded prompts of
        different lengths: the padding slots are overwritten by the next tokens, never attended)."""
        lengths = torch.as_tensor(lengths, dtype=torch.long, device=self.lengths.device)
        if (lengths > self.lengths).any():
            raise ValueError("truncate() can only shorten rows")
        self.lengths.copy_(lengths)

    def select_rows(self, rows: torch.Tensor) -> KVCache:
        """A cache holding only `rows` (drop finished sequences from a decoding batch)."""
        return KVCache(self.k[:, rows], self.v[:, rows], self.lengths[rows].clone())
