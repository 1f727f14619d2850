"""Every Slurm client command snowcat runs from its own code, and the other site tools it asks
(doctor's `lfs quota`, `apptainer --version`, the planner's `taccinfo`): one timeout policy, retries
where a retry is safe, and one form for "no answer", so that callers can tell a busy controller from
an empty queue (taking one for the other once resubmitted a whole DAG). A command runs in a session
of its own, and a timeout kills that whole session: a site's shell wrapper would otherwise leave a
child holding the output pipes open, and the caller waiting on them past its timeout.

Queries and scancel are retried when the client says the controller or slurmdbd did not answer.
sbatch is never retried: a submission that timed out may have been queued, and a second one would
queue the job twice (the executor's journal cancels what a refused submission had queued).

Not here: the local test cluster's daemon management (`slurm/cluster.py` starts and stops the
daemons themselves), and the ML library's in-job rendezvous (`stages/train/rendezvous.py` may not
depend on `slurm/`; it asks `scontrol` for host names with its own fallback).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

NOT_FOUND = 127  # the program is not installed (as a shell says it)
CANNOT_RUN = 126  # it is there but cannot be run: not executable, a bad interpreter (as a shell says it)
NO_ANSWER = 124  # it ran past its timeout (as `timeout` says it)
QUERY_TRIES = 3
RETRY_PAUSE_S = 1.0  # doubled after each try
# What a client prints when the controller or slurmdbd is busy or restarting: worth another try.
BUSY = (
    "socket timed out",
    "unable to contact slurm controller",
    "zero bytes were transmitted",
    "resource temporarily unavailable",
    "connection refused",
)


@dataclass(frozen=True)
class Reply:
    argv: tuple[str, ...]
    code: int
    out: str
    err: str

    @property
    def ok(self) -> bool:
        return self.code == 0

    @property
    def busy(self) -> bool:
        """The controller (or accounting) gave no answer: the question is open, not answered "none"."""
        return self.code == NO_ANSWER or (self.code != 0 and any(b in self.err.lower() for b in BUSY))

    def why(self) -> str:
        """The failure in one line, for messages."""
        text = " ".join((self.err or self.out).split())
        return f"`{' '.join(self.argv[:3])}` exited {self.code}: {text[:300] or 'no output'}"


class SlurmCommandError(subprocess.CalledProcessError):
    """A Slurm command that had to succeed did not (a CalledProcessError, so submission code that
    cancels what it queued catches both this and submitit's own failures)."""

    def __str__(self) -> str:
        return " ".join(str(self.stderr or self.output or f"exit {self.returncode}").split())


def run(argv: list[str], *, timeout: float = 60.0, tries: int = 1, env: Mapping[str, str] | None = None) -> Reply:
    """Run one client command; with `tries` > 1, again after a pause while the controller is busy."""
    pause = RETRY_PAUSE_S
    for attempt in range(tries):
        reply = _once(argv, timeout, env)
        if not reply.busy or attempt == tries - 1:
            return reply
        time.sleep(pause)
        pause *= 2
    raise AssertionError("unreachable")


def query(argv: list[str], *, timeout: float = 60.0, env: Mapping[str, str] | None = None) -> Reply:
    """A read-only command (squeue, sacct, sinfo, scontrol show, sacctmgr show): retried while busy."""
    return run(argv, timeout=timeout, tries=QUERY_TRIES, env=env)


def scancel(ids: Iterable[str], env: Mapping[str, str] | None = None) -> Reply | None:
    """Cancel jobs (retried while busy; a job already gone is not an error worth raising)."""
    ids = list(ids)
    return run(["scancel", *ids], tries=QUERY_TRIES, env=env) if ids else None


def release(job_id: str) -> Reply:
    """Let a held job start (a stage's gate)."""
    return run(["scontrol", "release", job_id], tries=QUERY_TRIES)


def sbatch(script: Path) -> str:
    """Submit a batch script; its job id. Never retried (see the module docstring)."""
    reply = run(["sbatch", "--parsable", str(script)], timeout=120)
    match = re.search(r"(\d+)", reply.out)  # `--parsable` prints `123` or `123;cluster`
    if not reply.ok or match is None:
        raise SlurmCommandError(reply.code, "sbatch", reply.out, reply.why())
    return match.group(1)


def _once(argv: list[str], timeout: float, env: Mapping[str, str] | None) -> Reply:
    try:
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            start_new_session=True,
        )
    except FileNotFoundError:
        return Reply(tuple(argv), NOT_FOUND, "", f"{argv[0]}: not found")
    except OSError as e:
        return Reply(tuple(argv), CANNOT_RUN, "", f"{argv[0]}: cannot run: {e.strerror or e}")
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as e:  # the timeout, or Ctrl-C: its own session does not get the terminal's signal
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            proc.communicate(timeout=1)
        except subprocess.TimeoutExpired:  # a child that left the session (setsid) still holds the pipes
            proc.stdout.close()
            proc.stderr.close()
            proc.wait()
        if not isinstance(e, subprocess.TimeoutExpired):
            raise
        return Reply(tuple(argv), NO_ANSWER, "", f"no answer after {timeout:g}s")
    return Reply(tuple(argv), proc.returncode, out, err)
