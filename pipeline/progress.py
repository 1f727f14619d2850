"""Progress display while a run is going: a live table on a terminal, event lines otherwise."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from .dag import Dag, Unit
from .rundir import RunDir

console = Console(stderr=True, highlight=False)

STYLE = {"done": "green", "failed": "red", "running": "yellow", "cancelled": "magenta", "modified": "red"}


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


class Progress:
    def __init__(self, run: RunDir, dag: Dag, stages: list[str]):
        self.run, self.dag, self.stages = run, dag, stages
        self.t0 = time.monotonic()
        self.live = Live(self._table(), console=console, refresh_per_second=2, transient=True) if console.is_terminal else None

    def __enter__(self):
        if self.live:
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.live:
            self.live.__exit__(*exc)

    def _table(self) -> Table:
        table = Table(title=f"run {self.run.path.name}  ({time.monotonic() - self.t0:.0f}s)", expand=False)
        for col in ("stage", "kind", "status", "units"):
            table.add_column(col)
        for name in self.stages:
            units = self.dag[name].units
            done = sum(self.run.is_done(u) for u in units)
            status, _ = self.run.stage_status(self.dag, name, verify=False)
            table.add_row(name, self.dag[name].kind, f"[{STYLE.get(status, '')}]{status}[/]", f"{done}/{len(units)}")
        return table

    def refresh(self) -> None:
        if self.live:
            self.live.update(self._table())

    def event(self, unit: Unit, what: str, seconds: float | None = None) -> None:
        took = f" in {seconds:.1f}s" if seconds is not None else ""
        console.print(f"[{STYLE.get(what, 'cyan')}]{what:>9}[/] {unit.key}{took}")

    def failure(self, unit: Unit, code: int, log: Path) -> None:
        console.print(f"[red]   failed[/] {unit.key} (exit {code}); last lines of {log}:")
        console.print(log_tail(log), markup=False, highlight=False)
