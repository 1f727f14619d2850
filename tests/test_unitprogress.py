"""Progress reported from inside a unit: the file the live view and `status` read, and the log lines."""

from __future__ import annotations

from snowcat.pipeline.unitprogress import PROGRESS_FILE, ProgressReporter, UnitProgress, read_progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rate_and_time_left_come_from_this_process_and_writes_are_rate_limited(tmp_path, capsys):
    clock = Clock()
    report = ProgressReporter(tmp_path / PROGRESS_FILE, "sft", write_every_s=2, log_every_s=30, clock=clock)
    report(200, 500, loss=0.5)  # a resumed unit: the rate counts from here, not from step 0
    assert read_progress(tmp_path).done == 200 and read_progress(tmp_path).eta_s is None
    clock.now += 1.0
    report(210, 500, loss=0.45)  # within write_every_s: the file keeps the last written report
    assert read_progress(tmp_path).done == 200
    clock.now += 9.0
    report(300, 500, loss=0.41, **{"tok/s": 1900.0})
    p = read_progress(tmp_path)
    assert (p.done, p.total, p.rate, p.eta_s) == (300, 500, 10.0, 20.0)
    assert p.line() == "sft 300/500 steps · loss 0.41 · 1.9k tok/s · ~20 s left"
    clock.now += 20.0
    report(500, 500, loss=0.3)  # the last report is always written and logged, with no time left
    assert read_progress(tmp_path).line() == "sft 500/500 steps · loss 0.3"
    logged = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[progress]")]
    assert logged == ["[progress] sft 200/500 steps · loss 0.5", "[progress] sft 500/500 steps · loss 0.3"]


def test_a_new_phase_restarts_the_rate(tmp_path):
    clock = Clock()
    report = ProgressReporter(tmp_path / PROGRESS_FILE, "eval", write_every_s=0, clock=clock)
    report(0, 100, unit="episodes", phase="sft:final")
    clock.now += 10
    report(100, 100, unit="episodes", phase="sft:final")
    report(0, 100, unit="episodes", phase="rl:final")
    assert read_progress(tmp_path).line() == "eval rl:final 0/100 episodes"
    clock.now += 5
    report(50, 100, unit="episodes", phase="rl:final", pass_rate=0.25)
    assert read_progress(tmp_path).line() == "eval rl:final 50/100 episodes · pass_rate 0.25 · ~5 s left"


def test_disabled_reporter_writes_nothing_and_unreadable_progress_is_none(tmp_path):
    ProgressReporter(tmp_path / PROGRESS_FILE, "rl", enabled=False)(1, 2)
    assert read_progress(tmp_path) is None
    (tmp_path / PROGRESS_FILE).write_text("{torn")
    assert read_progress(tmp_path) is None


def test_long_runs_read_in_minutes_and_hours():
    assert UnitProgress("rl", 1, 100, "updates", eta_s=600).line() == "rl 1/100 updates · ~10 min left"
    assert UnitProgress("rl", 1, 100, "updates", eta_s=4 * 3600).line() == "rl 1/100 updates · ~4.0 h left"
