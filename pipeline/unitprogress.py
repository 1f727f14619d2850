"""Progress from inside a running unit: step/total and a few headline numbers.

A stage calls `ctx.progress(done, total, ...)` as it works (every step is fine: writes are rate
limited). The reporter keeps `<unit dir>/.progress.json` current (atomically; hidden, so never part
of the unit's manifest) and prints a line to the unit's log every `log_every_s`:

    sft 320/500 steps · loss 0.41 · 1.9k tok/s · ~2 min left

The driver's live view and `snowcat status` read the file, so progress is visible for local runs and
for Slurm jobs alike (the run directory is on the shared filesystem).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .fsio import atomic_write_json

PROGRESS_FILE = ".progress.json"


@dataclass
class UnitProgress:
    label: str  # what is being done, e.g. "sft" or "eval sft:final"
    done: int
    total: int
    unit: str = "steps"
    numbers: dict[str, float] = field(default_factory=dict)  # headline numbers, e.g. {"loss": 0.41, "tok/s": 1900}
    rate: float | None = None  # units per second in this process
    eta_s: float | None = None
    updated: float = 0.0  # unix time of the report

    def line(self) -> str:
        parts = [f"{self.label} {self.done}/{self.total} {self.unit}"]
        parts += [
            f"{name} {_number(value)}" if not name.endswith("/s") else f"{_number(value)} {name}"
            for name, value in self.numbers.items()
        ]
        if self.eta_s is not None and self.done < self.total:
            parts.append(f"~{_duration(self.eta_s)} left")
        return " · ".join(parts)


def _number(value: float) -> str:
    if abs(value) >= 1000:
        return f"{value / 1000:.1f}k"
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.3g}"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(seconds, 1):.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class ProgressReporter:
    """Writes a unit's progress file and log lines; cheap to call on every step."""

    def __init__(
        self,
        path: Path,
        label: str,
        *,
        write_every_s: float = 2.0,
        log_every_s: float = 30.0,
        enabled: bool = True,
        clock=time.monotonic,
    ):
        self.path, self.label, self.enabled = Path(path), label, enabled
        self.write_every_s, self.log_every_s, self.clock = write_every_s, log_every_s, clock
        self._start: tuple[str, int, float] | None = None  # (phase, done, time) when this phase began here
        self._last_write = self._last_log = float("-inf")

    def __call__(self, done: int, total: int, *, unit: str = "steps", phase: str | None = None, **numbers: float) -> None:
        if not self.enabled:
            return
        now = self.clock()
        label = f"{self.label} {phase}" if phase else self.label
        if self._start is None or self._start[0] != label or done < self._start[1]:
            self._start = (label, done, now)  # a resumed unit measures its rate from where it resumed
        _, done0, t0 = self._start
        rate = (done - done0) / (now - t0) if now > t0 and done > done0 else None
        report = UnitProgress(
            label,
            int(done),
            int(total),
            unit,
            {k: float(v) for k, v in numbers.items()},
            rate,
            (total - done) / rate if rate else None,
            time.time(),
        )
        finished = done >= total
        if finished or now - self._last_write >= self.write_every_s:
            atomic_write_json(self.path, asdict(report))
            self._last_write = now
        if finished or now - self._last_log >= self.log_every_s:
            print(f"[progress] {report.line()}", flush=True)
            self._last_log = now


def read_progress(unit_dir: Path) -> UnitProgress | None:
    """The last progress a unit reported, or None (never reported, or unreadable mid-crash)."""
    try:
        data = json.loads((Path(unit_dir) / PROGRESS_FILE).read_text())
        return UnitProgress(**data)
    except (OSError, ValueError, TypeError):
        return None
