"""What a verifier returns, and the error that marks its own failure (not the model's)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    reward: float  # in [0, 1]; partial credit allowed
    passed: bool
    detail: str


class VerifierError(Exception):
    """The verifier itself failed (crash, time-out): an infrastructure failure, not a model failure."""
