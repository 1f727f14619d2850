"""RL estimators and losses as pure torch functions (no model, no I/O), unit-tested by hand.

`advantages`: per-attempt advantages for a batch of groups (GRPO, Dr. GRPO, RLOO, RLOO-N), padded
or as columns of possibly ragged groups (`group_advantages`), or of records several of which may
be one episode (`episode_advantages`: a summarised episode).
`loss`: the policy loss with truncated importance sampling, optional PPO clipping, KL (k3) and
entropy terms, three aggregation modes; `mismatch_stats` for the engine-vs-trainer check.
Definitions and choices: docs/rl-algorithms.md.
"""

from snowcat.stages.algorithms.advantages import (
    ESTIMATORS,
    compute_advantages,
    dr_grpo_advantages,
    episode_advantages,
    group_advantages,
    grpo_advantages,
    rloo_advantages,
    rloo_n_advantages,
    valid_from_status,
)
from snowcat.stages.algorithms.loss import (
    AGGREGATIONS,
    K3_MAX,
    PolicyLossConfig,
    aggregate,
    masked_mean,
    mismatch_stats,
    policy_loss,
)

__all__ = [
    "AGGREGATIONS",
    "ESTIMATORS",
    "K3_MAX",
    "PolicyLossConfig",
    "aggregate",
    "compute_advantages",
    "dr_grpo_advantages",
    "episode_advantages",
    "group_advantages",
    "grpo_advantages",
    "masked_mean",
    "mismatch_stats",
    "policy_loss",
    "rloo_advantages",
    "rloo_n_advantages",
    "valid_from_status",
]
