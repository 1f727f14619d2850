"""Local executor: stage units as subprocesses on this machine, in dependency order.

Independent units run concurrently up to `executor.max_parallel`. Multi-role stages (hetjob
components on Slurm) run under `mpirun` with the same rank layout. Each unit logs to
`<run>/logs/<unit>.log`. Children die with the driver (PR_SET_PDEATHSIG), so a killed
`snowcat run` leaves no orphan writing into the run directory; `snowcat resume` picks up from the
DONE markers.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from .. import procid
from ..context import PREEMPTED_EXIT_CODE
from ..dag import Unit
from ..progress import Progress
from ..rundir import now
from .base import Executor

_ACTIVE = ("running", "submitted", "pending")

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    os.setpgrp()  # own process group: cancel kills the stage and everything it started
    # A driver started in the background (nohup, `&` in a script) inherits SIGINT ignored, and so
    # would every stage: cancel's SIGINT must reach them.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@dataclass
class _Running:
    unit: Unit
    proc: subprocess.Popen
    log: object
    started: float = field(default_factory=time.monotonic)


class LocalExecutor(Executor):
    name = "local"

    def command(self, unit: Unit) -> list[str]:
        node = self.dag[unit.stage]
        cmd = [sys.executable, "-P", "-m", "snowcat.stages", str(self.run.path), unit.stage]  # -P: see containers.wrap.SAFE_PATH
        if unit.index is not None:
            cmd += ["--item", str(unit.index)]
        world = self.world_size(node)
        mpirun = shutil.which(self.cfg.executor.mpirun)
        if world > 1 and mpirun:
            # One MPI world, ranks in component order (the same layout as srun --het-group=0,1).
            cmd = [mpirun, "-n", str(world), "--oversubscribe", "--bind-to", "none", *cmd]
        return cmd

    def owns_cores(self, unit: Unit) -> bool:
        """Whether the unit's threads (ranks x torch threads) fit this machine's cores with no other unit
        of the run ever beside them (max_parallel 1). Only then may OpenMP threads spin-wait between
        operations, as by default: a demo SFT step took 0.35 s so, 0.67 s with every wait asleep
        (OMP_WAIT_POLICY=PASSIVE), 1.23 s spinning beside one busy process (benchmarks/results/omp-wait.json)."""
        node = self.dag[unit.stage]
        cores = os.cpu_count() or 1
        threads = getattr(node.config, "threads", 0) or cores  # a stage's 0: the job's CPUs (StageContext.threads)
        return int(self.cfg.executor.max_parallel) <= 1 and self.world_size(node) * threads <= cores

    def _env(self, unit: Unit) -> dict:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if not self.owns_cores(unit):  # a user's own OMP_WAIT_POLICY (a shared machine) is kept either way
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when torch loads: set before the process starts
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        env.setdefault("OMPI_MCA_btl", "self,tcp")  # shared memory needs a writable /dev/shm per user
        return env

    def _start(self, unit: Unit) -> _Running:
        log_path = self.run.log_path(unit)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "ab")
        log.write(f"\n===== {now()} {unit.key} attempt =====\n".encode())
        log.flush()
        proc = subprocess.Popen(
            self.command(unit),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self._env(unit),
            preexec_fn=_die_with_parent,
        )
        record = self.run.state()["stages"].get(unit.key, {})
        self.run.update_stage(
            unit.key,
            status="running",
            attempts=record.get("attempts", 0) + 1,
            group=procid.identify(proc.pid),  # the process group cancel stops: pid + start time, never a bare pid
            executor="local",
            submitted=now(),
            job_ids=[f"local:{proc.pid}"],
        )
        return _Running(unit, proc, log)

    def launch(self, stages: list[str]) -> int:
        units = [u for s in stages for u in self.pending_units(self.dag[s])]
        todo = list(units)
        running: list[_Running] = []
        failed: set[str] = set()
        blocked: set[str] = set()
        limit = max(1, int(self.cfg.executor.max_parallel))
        stop = {"signal": None}

        def on_signal(signum, _frame):
            stop["signal"] = signum

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        progress = Progress(self.run, self.dag, stages)
        try:
            with progress:
                while todo or running:
                    if stop["signal"] is not None:
                        self._stop_all(running)
                        for u in todo:
                            self.run.update_stage(u.key, status="cancelled", ended=now())
                        return 130
                    for r in list(running):
                        code = r.proc.poll()
                        if code is None:
                            continue
                        running.remove(r)
                        r.log.close()
                        if code == 0 and self.run.is_done(r.unit):
                            progress.event(r.unit, "done", time.monotonic() - r.started)
                        elif code == PREEMPTED_EXIT_CODE:
                            progress.event(r.unit, "continues", time.monotonic() - r.started)
                            todo.insert(0, r.unit)  # checkpointed on request: continue right away
                        else:
                            if self.run.state()["stages"].get(r.unit.key, {}).get("status") != "failed":
                                self.run.update_stage(r.unit.key, status="failed", ended=now(), exit_code=code)
                            failed.add(r.unit.stage)
                            blocked |= self.dag.downstream(r.unit.stage)
                            progress.failure(r.unit, code, self.run.log_path(r.unit))
                    for u in [u for u in todo if u.stage in blocked]:
                        todo.remove(u)
                    ready = [u for u in todo if all(self._stage_done(n) for n in self.dag[u.stage].needs)]
                    for u in ready[: max(0, limit - len(running))]:
                        todo.remove(u)
                        running.append(self._start(u))
                        progress.event(u, "started")
                    progress.refresh()
                    if running:
                        time.sleep(0.2)
                    elif todo and not ready:
                        break  # waiting on a stage that is neither done nor runnable here
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
        for u in todo:
            self.run.update_stage(u.key, status="pending")
        return 1 if failed or todo else 0

    def _stage_done(self, stage: str) -> bool:
        return all(self.run.is_done(u) for u in self.dag[stage].units)

    def _stop_all(self, running: list[_Running]) -> None:
        # SIGINT, not SIGTERM: a stage treats SIGTERM as "checkpoint due" (Slurm's end-of-job
        # warning) and would finish its step; cancelling means stop now.
        for r in running:
            try:
                os.killpg(r.proc.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        for r in running:
            try:
                r.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(r.proc.pid, signal.SIGKILL)
                r.proc.wait()
            r.log.close()
            self.run.update_stage(r.unit.key, status="cancelled", ended=now())

    def refresh(self) -> None:
        """A unit recorded as running whose process is gone (driver killed) is not running."""
        for key, record in self.run.state()["stages"].items():
            if record.get("executor") == "local" and record.get("status") in ("running", "submitted"):
                if not procid.alive(record.get("group")):
                    self.run.update_stage(key, status="failed", error="process gone (driver killed?)", ended=now())

    def cancel(self) -> list[str]:
        """Stop this run's live processes: the driver, then any unit process left running. Only
        processes whose recorded identity (pid and start time) still matches are signalled; a
        finished unit's recorded pid may belong to someone else by now."""
        cancelled = []
        driver = self.run.driver()
        if driver and driver["pid"] != os.getpid() and procid.alive(driver):
            os.kill(driver["pid"], signal.SIGTERM)  # the driver stops its children and records them
            cancelled.append(f"driver:{driver['pid']}")
        for key, record in self.run.state()["stages"].items():
            if record.get("status") not in _ACTIVE:
                continue
            group = record.get("group")
            if record.get("executor") == "local" and procid.alive(group):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group["pid"], signal.SIGINT)
                cancelled.append(f"local:{group['pid']}")
            self.run.update_stage(key, status="cancelled", ended=now())
        return cancelled
