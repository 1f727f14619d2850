"""Group-relative advantages. `rewards` is [groups, attempts]: row g holds the attempts at one task.

Every estimator returns a tensor of the same shape. Rewards are treated as constants (no grad).
`group_advantages` takes a batch as columns (group id, reward, valid per attempt), groups possibly
ragged; `episode_advantages` takes records, several of which may be one attempt (an episode whose
context a summary rewrote is one record per context: one member of its group, not several).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import get_args

import torch

from snowcat.pipeline.errors import UserError
from snowcat.stages.config import Estimator

INFRA_ERROR = "infra_error"


def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6, unbiased: bool = False) -> torch.Tensor:
    """(r - mean) / (std + eps) per group.

    std is the population std (divide by n) unless `unbiased`: with n = 2 and rewards {0, 1} the
    advantages are exactly +-1 (up to eps), and a group with equal rewards gets zeros.
    """
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True, unbiased=unbiased) if rewards.shape[-1] > 1 else torch.zeros_like(mean)
    return (rewards - mean) / (std + eps)


def dr_grpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: r - mean, no std division (the length normaliser lives in the loss aggregation)."""
    return rewards - rewards.mean(dim=-1, keepdim=True)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO: r_i - mean_{j != i} r_j. A group of one attempt has no baseline: zero."""
    n = rewards.shape[-1]
    if n < 2:
        return torch.zeros_like(rewards)
    total = rewards.sum(dim=-1, keepdim=True)
    return rewards - (total - rewards) / (n - 1)


def rloo_n_advantages(rewards: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """RLOO-N: RLOO over the valid attempts only; infrastructure failures are neutral.

    `valid` [groups, attempts] is False for attempts whose status is `infra_error`. Those get zero
    advantage and are left out of the other attempts' baselines (their reward is meaningless); the
    caller also drops them from the loss mask (`valid[:, :, None]`) so they carry no loss at all.
    A group with fewer than two valid attempts has no baseline and gets zeros.
    """
    valid = valid.to(torch.bool)
    r = torch.where(valid, rewards, torch.zeros_like(rewards))
    k = valid.sum(dim=-1, keepdim=True).to(rewards.dtype)
    baseline = (r.sum(dim=-1, keepdim=True) - r) / (k - 1).clamp(min=1)
    adv = r - baseline
    return torch.where(valid & (k >= 2), adv, torch.zeros_like(adv))


def valid_from_status(status: Sequence[Sequence[str]]) -> torch.Tensor:
    """[groups][attempts] trajectory statuses -> bool mask, False where status is `infra_error`."""
    return torch.tensor([[s != INFRA_ERROR for s in group] for group in status], dtype=torch.bool)


ESTIMATORS = get_args(Estimator)


def compute_advantages(
    estimator: str, rewards: torch.Tensor, valid: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """Dispatch by name (the RL stage's config value). Only `rloo_n` uses `valid`."""
    if estimator == "grpo":
        return grpo_advantages(rewards, eps=eps)
    if estimator == "dr_grpo":
        return dr_grpo_advantages(rewards)
    if estimator == "rloo":
        return rloo_advantages(rewards)
    if estimator == "rloo_n":
        return rloo_n_advantages(rewards, valid if valid is not None else torch.ones_like(rewards, dtype=torch.bool))
    raise UserError(f"unknown advantage estimator {estimator!r}; expected one of {', '.join(ESTIMATORS)}")


def group_advantages(
    group_ids: Sequence[int], rewards: Sequence[float], valid: Sequence[bool], estimator: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantage [N], valid [N] as a bool tensor) for N attempts given as columns (their group, reward,
    and whether they are valid: not an infrastructure failure), in their order; 0 where not valid.

    Groups may be ragged (a lost attempt). `rloo_n` takes them padded with invalid attempts, which
    it ignores; the other estimators are computed group by group over each group's valid attempts
    alone (padding, or an infrastructure failure's reward, would enter their group means and
    standard deviations); a group of fewer than two valid attempts gets advantage 0."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, gid in enumerate(group_ids):
        groups[gid].append(i)
    ids = sorted(groups)
    width = max(len(v) for v in groups.values())
    padded = torch.zeros(len(ids), width, dtype=torch.float64)
    mask = torch.zeros(len(ids), width, dtype=torch.bool)
    for g, gid in enumerate(ids):
        for a, i in enumerate(groups[gid]):
            padded[g, a] = rewards[i]
            mask[g, a] = valid[i]
    if estimator == "rloo_n":
        adv = compute_advantages(estimator, padded, mask)
    else:
        adv = torch.zeros_like(padded)
        for g, gid in enumerate(ids):
            members = [a for a, i in enumerate(groups[gid]) if valid[i]]
            if len(members) > 1:
                adv[g, members] = compute_advantages(estimator, padded[g, members].unsqueeze(0))[0]
    out = torch.zeros(len(group_ids), dtype=torch.float64)
    for g, gid in enumerate(ids):
        for a, i in enumerate(groups[gid]):
            out[i] = adv[g, a]
    trainable = torch.tensor(list(valid))
    return torch.where(trainable, out, torch.zeros_like(out)).float(), trainable


def episode_advantages(
    group_ids: Sequence[int], episodes: Sequence, rewards: Sequence[float], valid: Sequence[bool], estimator: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantage [N], valid [N]) for N records given as columns, `episodes[i]` naming record i's
    episode within its group (its attempt). An episode is one attempt whatever its number of records:
    its reward and validity enter `group_advantages` once, and every one of its records gets the
    episode's advantage. ValueError where records of one episode disagree on the reward or validity."""
    heads: dict[tuple, int] = {}  # (group, episode) -> its first record
    of = []  # record -> its episode's first record
    for i, key in enumerate(zip(group_ids, episodes)):
        h = heads.setdefault(key, i)
        if rewards[i] != rewards[h] or bool(valid[i]) != bool(valid[h]):
            raise ValueError(f"records {h} and {i} of episode {key[1]} in group {key[0]} disagree on its reward or validity")
        of.append(h)
    place = {h: j for j, h in enumerate(heads.values())}
    firsts = list(heads.values())
    adv, trainable = group_advantages(
        [group_ids[h] for h in firsts], [rewards[h] for h in firsts], [valid[h] for h in firsts], estimator
    )
    index = torch.tensor([place[h] for h in of], dtype=torch.long)
    return adv[index], trainable[index]
