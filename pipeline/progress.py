"""Progress display while a run is going: a live table on a terminal, event lines otherwise.

Every cell is a rich `Text` built from data, never markup: a status, an error text or a metric name
with a `[` in it is shown as it is.
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from .dag import Dag, Unit
from .rundir import RunDir
from .unitprogress import read_progress

console = Console(stderr=True, highlight=False)

# Every status a stage or unit record can hold, and the driver's event words.
STYLE = {
    "done": "green",
    "failed": "red",
    "modified": "red",
    "stale": "red",
    "running": "yellow",
    "started": "cyan",
    "continues": "cyan",
    "submitted": "blue",
    "pending": "dim",
    "preempted": "yellow",
    "cancelled": "magenta",
}
LOG_EVERY_S = 60  # progress lines when the output is not a terminal (a log file, CI)


def styled(status: str) -> Text:
    return Text(status, style=STYLE.get(status, ""))


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def progress_lines(run: RunDir, dag: Dag, stage: str) -> list[str]:
    """The progress reported by the stage's units that are not done (see pipeline.unitprogress)."""
    lines = []
    for unit in dag[stage].units:
        if not run.is_done(unit) and (p := read_progress(run.unit_dir(unit))) is not None:
            lines.append(p.line() if unit.index is None else f"[{unit.index}] {p.line()}")
    return lines


class Progress:
    def __init__(self, run: RunDir, dag: Dag, stages: list[str]):
        self.run, self.dag, self.stages = run, dag, stages
        self.t0 = time.monotonic()
        self.live = Live(self._table(), console=console, refresh_per_second=2, transient=True) if console.is_terminal else None
        self._logged: dict[str, str] = {}  # stage -> the progress line last logged
        self._next_log = self.t0 + LOG_EVERY_S

    def __enter__(self):
        if self.live:
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.live:
            self.live.__exit__(*exc)

    def _table(self) -> Table:
        table = Table(title=Text(f"run {self.run.path.name}  ({time.monotonic() - self.t0:.0f}s)"), expand=False)
        for col in ("stage", "kind", "status", "units"):
            table.add_column(col, no_wrap=True)
        table.add_column("progress", overflow="fold")
        for name in self.stages:
            units = self.dag[name].units
            done = sum(self.run.is_done(u) for u in units)
            status, _ = self.run.stage_status(self.dag, name, verify=False)
            lines = progress_lines(self.run, self.dag, name) if status == "running" else []
            table.add_row(
                Text(name), Text(self.dag[name].kind), styled(status), Text(f"{done}/{len(units)}"), Text("\n".join(lines))
            )
        return table

    def refresh(self) -> None:
        if self.live:
            self.live.update(self._table())
            return
        if time.monotonic() < self._next_log:
            return
        self._next_log = time.monotonic() + LOG_EVERY_S
        for name in self.stages:
            if self.run.stage_status(self.dag, name, verify=False)[0] != "running":
                continue
            line = "; ".join(progress_lines(self.run, self.dag, name))
            if line and line != self._logged.get(name):
                console.print(Text.assemble(("progress".rjust(9), "cyan"), f" {line}"))
                self._logged[name] = line

    def event(self, unit: Unit, what: str, seconds: float | None = None) -> None:
        took = f" in {seconds:.1f}s" if seconds is not None else ""
        console.print(Text.assemble((what.rjust(9), STYLE.get(what, "cyan")), f" {unit.key}{took}"))

    def failure(self, unit: Unit, code: int, log: Path) -> None:
        console.print(Text.assemble(("   failed", "red"), f" {unit.key} (exit {code}); last lines of {log}:"))
        console.print(Text(log_tail(log)))
