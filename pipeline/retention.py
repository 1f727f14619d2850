"""Checkpoint retention: keep the best few, the last few and the pinned ones; delete the rest, on record.

The ledger `<checkpoints>/retention.json` lists every checkpoint ever registered (step, metric value)
and every deletion (step, metric, reason, time). A deletion is written to the ledger *before* the
directory is removed, so a crash in between leaves a record, and the next `Retention` finishes it.
Invariants, whatever the policy: the best checkpoint by the metric among all registered ones, the
latest one (needed to resume) and pinned ones are never deleted. One writer (the trainer's rank 0).

A *preemption* checkpoint (saved on the scheduler's notice at a step the training schedule does not
save) is kept only while it is the latest: the next checkpoint supersedes it, and it never counts
among the last `keep_last` nor competes for best. So a preempted and resumed run keeps the same
checkpoints as an uninterrupted one; its ledger records the preemption checkpoint and its deletion.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_json, read_json

LEDGER = "retention.json"


@dataclass
class RetentionPolicy:
    metric: str = "eval/pass@1"
    mode: str = "max"  # "max" or "min": which direction of the metric is better
    keep_best: int = 1  # >= 1: the best one can never be deleted, so 0 is refused, not ignored
    keep_last: int = 1  # the latest is always kept; keep_last counts it
    pinned: list[int] = field(default_factory=list)  # steps kept regardless (e.g. the SFT hand-off)

    def __post_init__(self) -> None:
        if self.mode not in ("max", "min"):
            raise UserError(f"retention.mode: expected 'max' or 'min', got {self.mode!r}")
        if self.keep_best < 1:
            raise UserError(f"retention.keep_best: must be >= 1 (the best checkpoint is always kept), got {self.keep_best}")
        if self.keep_last < 0:
            raise UserError(f"retention.keep_last: must be >= 0, got {self.keep_last}")


def _value(metrics: Mapping[str, Any], name: str) -> float | None:
    v = metrics.get(name)
    if v is None or isinstance(v, bool):
        return None
    v = float(v)
    return None if math.isnan(v) else v


class Retention:
    """Retention of `<ckpt_dir>/<name.format(step=N)>` directories under a policy."""

    def __init__(self, ckpt_dir: str | os.PathLike, policy: RetentionPolicy, name: str = "step_{step}"):
        self.dir = Path(ckpt_dir)
        self.policy = policy
        self.name = name
        self.ledger_path = self.dir / LEDGER
        self.ledger = read_json(self.ledger_path) or {"checkpoints": {}, "deleted": []}
        self._finish_deletions()

    def path(self, step: int) -> Path:
        return self.dir / self.name.format(step=step)

    # -- queries --------------------------------------------------------------------------------

    def registered(self) -> dict[int, float | None]:
        return {int(s): c["value"] for s, c in self.ledger["checkpoints"].items()}

    def live(self) -> list[int]:
        return sorted(int(s) for s, c in self.ledger["checkpoints"].items() if not c.get("deleted"))

    def preemption(self) -> set[int]:
        """Steps registered as preemption checkpoints (see the module's doc)."""
        return {int(s) for s, c in self.ledger["checkpoints"].items() if c.get("preemption")}

    def _rank(self, steps) -> list[int]:
        """Scheduled steps with a metric value, best first; ties go to the earlier step."""
        sign = -1 if self.policy.mode == "max" else 1
        reg, off = self.registered(), self.preemption()
        return sorted((s for s in steps if reg[s] is not None and s not in off), key=lambda s: (sign * reg[s], s))

    def best(self) -> int | None:
        """Best live checkpoint (None while no checkpoint has a metric value)."""
        ranked = self._rank(self.live())
        return ranked[0] if ranked else None

    def historical_best(self) -> int | None:
        """Best over everything ever registered, deleted ones included; equals best() by construction."""
        ranked = self._rank(self.registered())
        return ranked[0] if ranked else None

    def keep_set(self) -> set[int]:
        """Steps the policy retains among all registered ones."""
        steps = sorted(self.registered())
        scheduled = [s for s in steps if s not in self.preemption()]
        p = self.policy
        keep = set(self._rank(steps)[: p.keep_best]) | set(scheduled[-p.keep_last :] if p.keep_last else [])
        keep |= {s for s in p.pinned if s in self.registered()}
        if steps:
            keep.add(steps[-1])
        return keep

    # -- updates --------------------------------------------------------------------------------

    def register(self, step: int, metrics: Mapping[str, Any], *, preemption: bool = False) -> list[int]:
        """Record checkpoint `step` (its directory must exist) and delete what the policy drops.
        `preemption`: saved on a notice, off the schedule (kept only until the next checkpoint).

        Re-registering a step (a resumed run replaying) updates its metrics. Returns deleted steps.
        """
        step = int(step)
        if not self.path(step).is_dir():
            raise UserError(f"{self.path(step)}: checkpoint directory missing; save it before registering step {step}")
        value = _value(metrics, self.policy.metric)
        entry = {"value": value, "registered_at": time.time()}
        self.ledger["checkpoints"][str(step)] = entry | ({"preemption": True} if preemption else {})
        keep = self.keep_set()
        doomed = [s for s in self.live() if s not in keep]
        best = self.historical_best()
        for s in doomed:
            c = self.ledger["checkpoints"][str(s)]
            c["deleted"] = True
            self.ledger["deleted"].append(
                {
                    "step": s,
                    "metric": self.policy.metric,
                    "value": c["value"],
                    "reason": self._reason(s, best, step),
                    "time": time.time(),
                }
            )
        self.ledger["policy"] = asdict(self.policy)
        atomic_write_json(self.ledger_path, self.ledger)  # record first, then remove
        self._finish_deletions()
        return doomed

    def _reason(self, step: int, best: int | None, newest: int) -> str:
        p = self.policy
        if step in self.preemption():
            return f"preemption checkpoint, superseded by step {newest}"
        value = self.registered()[step]
        what = (
            "no metric value"
            if value is None
            else f"{p.metric}={value:g} not in the best {p.keep_best} ({p.mode}; best step {best})"
        )
        return f"{what}; not among the last {p.keep_last}; not pinned"

    def _finish_deletions(self) -> None:
        """Remove directories the ledger says are deleted (also completes a crash mid-deletion).

        The directory is first renamed to a hidden name, so a half-removed checkpoint never looks
        like a loadable one."""
        for s, c in self.ledger["checkpoints"].items():
            if not c.get("deleted"):
                continue
            path = self.path(int(s))
            doomed = path.with_name(f".{path.name}.deleting")
            if path.exists():
                os.replace(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
