"""What a verifier returns, and the error that marks its own failure (not the model's)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Verdict:
    reward: float  # in [0, 1]; partial credit allowed
    passed: bool
    detail: str
    # further scores beside the reward, which evaluate averages as it does the reward and reports by
    # name (IFEval's loose accuracy: loose_pass@1, loose_reward); training reads only the reward
    scores: dict[str, float] = field(default_factory=dict, hash=False)


class VerifierError(Exception):
    """The verifier itself failed (crash, time-out): an infrastructure failure, not a model failure."""
