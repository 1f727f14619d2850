"""stepwatch polls Slurm with backoff (issue 17, "Load"): the interval grows while the step runs, up to
a cap, and is short again once the step has ended, to time the grace period. No cluster: squeue,
sacct and the clock are stand-ins; the hung launcher is a real process (test_cluster.py runs the real
thing on the local Slurm)."""

from __future__ import annotations

import signal
import subprocess
from types import SimpleNamespace

from snowcat.slurm import stepwatch

STEP_ENDS_AT = 3600.0  # seconds of (fake) time the step runs


def test_next_poll_grows_to_the_cap():
    intervals = [5.0]
    while len(intervals) < 20:
        intervals.append(stepwatch.next_poll(intervals[-1], 5.0, 300.0))
    assert intervals[:3] == [5.0, 7.5, 11.25]
    assert max(intervals) == 300.0 and intervals[-1] == 300.0
    assert all(b >= a for a, b in zip(intervals, intervals[1:]))


def test_polls_back_off_while_the_step_runs_and_closely_once_it_ended(monkeypatch, capsys):
    clock = [0.0]
    waits: list[float] = []
    polls: list[float] = []

    class HungLauncher(subprocess.Popen):
        """srun that stays alive after its step ended; waiting with a time-out moves the fake clock."""

        def wait(self, timeout=None):
            if timeout is None:
                return super().wait()
            waits.append(timeout)
            clock[0] += timeout
            raise subprocess.TimeoutExpired(self.args, timeout)

    def work_steps(job):
        polls.append(clock[0])
        return {"0"} if clock[0] < STEP_ENDS_AT else set()

    def recorded_steps(job):
        return {"0": [("COMPLETED", "0:0")]} if clock[0] >= STEP_ENDS_AT else {}

    monkeypatch.setattr(stepwatch, "work_steps", work_steps)
    monkeypatch.setattr(stepwatch, "recorded_steps", recorded_steps)
    monkeypatch.setattr(stepwatch, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(stepwatch, "subprocess", SimpleNamespace(Popen=HungLauncher, TimeoutExpired=subprocess.TimeoutExpired))
    monkeypatch.setattr(stepwatch, "signal", SimpleNamespace(signal=lambda *a: None, SIGKILL=signal.SIGKILL))

    code = stepwatch.watch(["sleep", "600"], "42", grace_s=30.0, poll_s=5.0, max_poll_s=300.0)

    assert code == 0  # the step's exit code as accounting recorded it
    assert "stepwatch: sleep is still running 30 s after step 42.0 ended" in capsys.readouterr().err
    running = [p for p in polls if p < STEP_ENDS_AT]
    assert len(running) < 25  # an hour of the step: 3600 / 2 = 1800 polls before backoff
    assert waits[0] == 5.0 and max(waits) == 300.0
    first_after = min(p for p in polls if p >= STEP_ENDS_AT)
    assert first_after - STEP_ENDS_AT <= 300.0  # the end is noticed within one capped interval
    tail = [w for p, w in zip(polls, waits[1:]) if p >= STEP_ENDS_AT]
    assert tail and set(tail) == {5.0}  # then polled closely through the grace period
    assert clock[0] - first_after <= 30.0 + 5.0  # and stopped once the grace period is over
