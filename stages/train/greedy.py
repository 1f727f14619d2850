"""Batched greedy decoding with the KV cache: a quick held-out check inside training stages.

(The sampling engine with temperature/top-k/top-p and exact logprobs is `stages.rollout`.)
"""

from __future__ import annotations

import torch

from snowcat.stages.model import KVCache


@torch.no_grad()
def greedy_generate(
    model, prompts: list[list[int]], max_new_tokens: int, stop_id: int, pad_id: int, batch_size: int = 64
) -> list[list[int]]:
    model.eval()
    cfg = model.config
    device = next(model.parameters()).device
    out: list[list[int]] = []
    for lo in range(0, len(prompts), batch_size):
        chunk = prompts[lo : lo + batch_size]
        lens = torch.tensor([len(p) for p in chunk], device=device)
        T = int(lens.max())
        ids = torch.full((len(chunk), T), pad_id, dtype=torch.long, device=device)
        for i, p in enumerate(chunk):
            ids[i, : len(p)] = torch.tensor(p)
        cache = KVCache.allocate(cfg, len(chunk), T + max_new_tokens, dtype=torch.float32, device=device)
        hidden = model(ids, kv_cache=cache).hidden
        cache.truncate(lens)  # right padding: rows continue from their own prompt end
        rows = torch.arange(len(chunk), device=device)
        nxt = model.logits(hidden[rows, lens - 1]).argmax(-1)
        gen = [[] for _ in chunk]
        done = torch.zeros(len(chunk), dtype=torch.bool, device=device)
        for _ in range(max_new_tokens):
            for i in (~done).nonzero().flatten().tolist():
                gen[i].append(int(nxt[i]))
            done |= nxt == stop_id
            if bool(done.all()):
                break
            nxt = model.logits(model(nxt[:, None], kv_cache=cache).hidden[:, -1]).argmax(-1)
        out += [g[:-1] if g and g[-1] == stop_id else g for g in gen]
    return out
