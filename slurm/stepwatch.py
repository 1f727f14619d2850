"""Run a job step's launcher (srun) and end when Slurm says the step ended, even if srun hangs.

Slurm 22.05's srun can hang after a heterogeneous step over PMIx has finished: its backtrace shows
it waiting forever in `pthread_join` inside `pmixp_abort_agent_stop`. On the local test cluster 3 launches in 24 hung this way; the
job then holds its allocation until the time limit, and every `afterok` dependent waits with it.

`python -m snowcat.slurm.stepwatch [--grace S] -- srun ...` runs the launcher as its child and forwards
signals to it. Where srun behaves it is a pass-through: srun's exit status is returned (at once: the
launcher's exit is waited for, not polled). When Slurm no longer lists any work step of this job for
`grace` seconds while the launcher is still alive, it stops the launcher and exits with the steps'
exit code as accounting (sacct) recorded it. Without accounting a hung srun is left to the time
limit (sacct is what says the step ended).

Polling backs off: `squeue --steps` is asked after `--poll` seconds, then each interval 1.5 times the
last, up to `--max-poll` (a day-long hetjob costs a few hundred calls, not 43 000); once accounting
says the step ended while the launcher lives, it polls every `--poll` seconds again to time the
grace period. A hang is therefore stopped at most `max-poll + grace` seconds after its step ended.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from . import commands
from .hetjob import parse_job_id

NOT_WORK_STEPS = {"batch", "extern", "interactive"}
POLL_S = 5.0  # first interval between squeue polls, and the interval while timing the grace period
MAX_POLL_S = 300.0  # the longest interval while the step runs (or has not started)
BACKOFF = 1.5
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT)


def _slurm(argv: list[str]) -> str | None:
    """stdout of a Slurm client command, or None when it fails (the controller may be busy)."""
    reply = commands.query(argv)
    return reply.out if reply.ok else None


def _step(job_id: str) -> str | None:
    try:
        return parse_job_id(job_id)["step"]
    except ValueError:  # a line that is no job id (a warning from the client)
        return None


def work_steps(job: str) -> set[str] | None:
    """Step numbers of `job` that Slurm lists as running (not the batch or extern step)."""
    out = _slurm(["squeue", "--steps", "-h", "-j", job, "-o", "%i"])
    if out is None:
        return None
    steps = {_step(line) for line in out.split()}
    return {s for s in steps if s and s not in NOT_WORK_STEPS}


def exit_status(code: str) -> int:
    """sacct's `ExitCode` (`rc:signal`) as a shell exit status."""
    rc, _, sig = code.partition(":")
    return 128 + int(sig) if sig and int(sig) else int(rc or 1)


def recorded_steps(job: str) -> dict[str, list[tuple[str, str]]]:
    """Work steps of `job` in accounting: step number -> [(state, exit code)], one per het component."""
    out = _slurm(["sacct", "-n", "-P", "-j", job, "-o", "JobID,State,ExitCode"]) or ""
    steps: dict[str, list[tuple[str, str]]] = {}
    for line in out.splitlines():
        if line.count("|") != 2:
            continue
        job_id, state, code = line.split("|")
        step = _step(job_id)
        if step and step not in NOT_WORK_STEPS:
            steps.setdefault(step, []).append((state, code))
    return steps


def _ended(rows: list[tuple[str, str]]) -> bool:
    return not any(state.startswith(("RUNNING", "PENDING", "COMPLETING")) for state, _ in rows)


def _status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode  # killed by signal N: 128 + N, as a shell says


def next_poll(interval: float, poll_s: float, max_poll_s: float) -> float:
    """The interval after `interval` while nothing has ended: grown by BACKOFF, capped."""
    return min(max(interval * BACKOFF, poll_s), max(max_poll_s, poll_s))


def watch(
    command: list[str], job: str | None, grace_s: float = 30.0, poll_s: float = POLL_S, max_poll_s: float = MAX_POLL_S
) -> int:
    before = set(recorded_steps(job)) if job else set()
    children: list[subprocess.Popen] = []
    for sig in FORWARDED:  # installed first: a signal that arrives while the child starts is not lost
        signal.signal(sig, lambda signum, _frame: [c.send_signal(signum) for c in children])
    # Its own session, so that on a hang srun and the helper process it forks are stopped together.
    child = subprocess.Popen(command, start_new_session=True)
    children.append(child)
    if not job:  # not inside a Slurm job: nothing to watch
        return _status(child.wait())
    ended_at: float | None = None
    ours: dict[str, list[tuple[str, str]]] = {}
    interval = poll_s
    while True:
        try:
            return _status(child.wait(timeout=interval))
        except subprocess.TimeoutExpired:
            pass
        running = work_steps(job)
        if running is None or running - before:
            ended_at = None
            interval = next_poll(interval, poll_s, max_poll_s)
            continue
        # Nothing of ours runs: either not started yet or already over; accounting tells which.
        ours = {s: rows for s, rows in recorded_steps(job).items() if s not in before}
        if ours and all(_ended(rows) for rows in ours.values()):
            ended_at = ended_at or time.monotonic()
            interval = poll_s  # the launcher outlives its step: time the grace period closely
            if time.monotonic() - ended_at >= grace_s:
                break
        else:
            ended_at = None
            interval = next_poll(interval, poll_s, max_poll_s)
    names = ", ".join(f"{job}.{s}" for s in sorted(ours))
    print(
        f"stepwatch: {command[0]} is still running {grace_s:.0f} s after step {names} ended "
        f"(Slurm 22.05 hangs this way after heterogeneous PMIx steps); stopping it",
        file=sys.stderr,
        flush=True,
    )
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    return max(exit_status(code) for rows in ours.values() for _, code in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m snowcat.slurm.stepwatch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--grace", type=float, default=30.0, help="seconds srun may outlive its step")
    parser.add_argument("--poll", type=float, default=POLL_S, help="first (and grace-period) seconds between squeue polls")
    parser.add_argument("--max-poll", type=float, default=MAX_POLL_S, help="the longest interval between squeue polls")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- srun ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run (usage: python -m snowcat.slurm.stepwatch -- srun ...)")
    return watch(command, os.environ.get("SLURM_JOB_ID"), args.grace, args.poll, args.max_poll)


if __name__ == "__main__":
    sys.exit(main())
