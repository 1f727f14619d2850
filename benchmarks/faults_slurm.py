"""The fault campaign's part on the local Slurm cluster: `snowcat bench faults --slurm`.

    snowcat bench faults --slurm [--faults 28] [--seed 19] [--timeout 300] [--kinds a,b,...] [--json FILE]

The pipelines of the local part (configs/faults.yaml; configs/faults-rl.yaml, whose RL stage is a
heterogeneous job: trainer and rollout components in one MPI world) submitted with `--executor
slurm --site local` to the cluster `snowcat cluster up` started ($SNOWCAT_CLUSTER_ROOT). The faults
are a scheduler's: a stage's job process SIGKILLed (at a random instant, while it saves a checkpoint,
while it publishes weights, one MPI rank of the hetjob), the preemption notice (`scancel
--signal=USR2`), `scancel` of a job, a node dying (its slurmd and every process of its jobs), damaged
files, a second `snowcat resume` or a by-hand unit while a job runs, the submitting `snowcat run`
SIGKILLed, `snowcat cancel`. Each faulted run is recovered as a user would, `snowcat resume` and
waiting for its jobs, and judged as benchmarks/faults.py judges the local part, against an
uninterrupted Slurm run. What Slurm adds to the columns:

  hangs        the run's jobs not all ended --timeout seconds after a command (then cancelled)
  killed       also one decoy job per node (a `sleep` submitted before the fault; the node a fault
               killed takes its decoy with it, which is not counted)
  orphans      a job of the run still queued or running 30 s after the run is done, or a process of
               its jobs alive once they all ended
  two_writers  also two jobs of one unit running at the same time (sacct)

A fault's jobs and processes are told from everybody else's by their working directory: every
command of a fault starts in the fault's own directory, which Slurm records as the job's WorkDir.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from snowcat.benchmarks import faults
from snowcat.benchmarks.faults import Fault, done_units, last_output, stage_graph, wait, wait_for
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import read_json
from snowcat.slurm import cluster
from snowcat.slurm.hetjob import parse_job_id

RESULTS = faults.REPO / "benchmarks" / "results" / "faults-slurm.json"
ON_SLURM = ("--executor", "slurm", "--site", "local")
KINDS = (
    "kill_job_process",
    "kill_ckpt_save",
    "preempt_usr2",
    "usr2_other_stage",
    "scancel_job",
    "kill_slurmd",
    "damaged_file",
    "concurrent_driver",
    "by_hand_unit",
    "kill_submit",
    "cancel_run",
    "kill_mpi_rank",
    "kill_weight_publish",
    "preempt_rl_usr2",
)
RL_KINDS = ("kill_mpi_rank", "kill_weight_publish", "preempt_rl_usr2")  # the RL stage, a hetjob
GRACE_S = 30.0  # a done run's jobs may take this long to leave the queue before they count as orphans


# --- the cluster's side -----------------------------------------------------------------------------


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return {}
    return dict(x.split("=", 1) for x in raw.split("\0") if "=" in x)


def _cwd(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[1])


@dataclass
class Proc:
    """A stage's process in a job: what runs one rank of a unit (submitit's `_submit` under srun)."""

    pid: int
    stage: str
    rank: int
    job: str
    node: str


def job_processes(workdir: Path) -> list[Proc]:
    """The stage processes of jobs started in `workdir`, rank 0 first."""
    out = []
    for pid, _, argv in faults._proc_table():
        # python -u -m submitit.core._submit FOLDER; not srun, nor the stepwatch a hetjob's srun runs under
        if "-m" not in argv or argv[argv.index("-m") + 1 :][:1] != ["submitit.core._submit"]:
            continue
        if _cwd(pid) != str(workdir):
            continue
        env = _environ(pid)
        rank = env.get("PMIX_RANK") or env.get("SLURM_PROCID") or "0"
        folder = argv[argv.index("submitit.core._submit") + 1]  # <run>/slurm/<stage>
        out.append(Proc(pid, Path(folder).name, int(rank), env.get("SLURM_JOB_ID", ""), env.get("SLURMD_NODENAME", "")))
    return sorted(out, key=lambda p: (p.stage, p.rank))


def processes_in(workdir: Path) -> list[tuple[int, list[str]]]:
    """Every live process working in `workdir` (a job's batch script, srun, the stage, mpirun, ...)."""
    return [(pid, argv) for pid, _, argv in faults._proc_table() if _cwd(pid) == str(workdir)]


def squeue(workdir: Path) -> list[dict]:
    """Jobs queued or running that were submitted from `workdir` (hetjob components one row each)."""
    done = subprocess.run(["squeue", "-h", "-o", "%i|%T|%Z|%j|%N|%r"], capture_output=True, text=True, timeout=60)
    rows = []
    for line in done.stdout.splitlines():
        parts = line.split("|")
        if len(parts) == 6 and parts[2] == str(workdir):
            rows.append(dict(zip(("id", "state", "workdir", "name", "nodes", "reason"), parts)))
    return rows


def sacct(workdir: Path, since: float) -> list[dict]:
    """Every job (each requeue of it too) submitted from `workdir` since `since` (epoch seconds)."""
    start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(since - 120))
    done = subprocess.run(
        ["sacct", "-X", "-n", "-P", "--duplicates", "-S", start, "-o", "JobID,JobName,State,WorkDir,Start,End"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    rows = []
    for line in done.stdout.splitlines():
        parts = line.split("|")
        if len(parts) == 6 and parts[3] == str(workdir):
            rows.append(dict(zip(("id", "name", "state", "workdir", "start", "end"), parts)))
    return rows


def overlapping(rows: list[dict]) -> list[str]:
    """Two jobs of one unit (same job name; a hetjob's components are one job) running at once; each
    run of a requeued job is a span of its own."""
    spans = []
    for r in rows:
        if r["start"] not in ("Unknown", "None", ""):  # else it never started
            end = r["end"] if r["end"] not in ("Unknown", "None", "") else "9999"
            spans.append((r["name"], parse_job_id(r["id"])["job"], r["start"], end))  # ISO times compare as strings
    found = set()
    for name, job, start, end in spans:
        for name2, job2, start2, end2 in spans:
            if name == name2 and job < job2 and start < end2 and start2 < end:
                found.add(f"{name}: jobs {job} and {job2} ran at the same time")
    return sorted(found)


class _Jobs:
    """Stands in for the driver process of the local part: 'ended' once the run's jobs have all ended
    (squeue asked at most once a second)."""

    def __init__(self, camp: SlurmCampaign, run: Path):
        self.camp, self.run, self.checked, self.ended = camp, run, 0.0, False

    def poll(self) -> int | None:
        if time.monotonic() - self.checked >= 1.0:
            self.checked = time.monotonic()
            self.ended = not squeue(self.camp.workdir(self.run))
        return 0 if self.ended else None


# --- the campaign -----------------------------------------------------------------------------------


class SlurmCampaign(faults.Campaign):
    rl_kinds = RL_KINDS
    run_args = ON_SLURM

    def __init__(self, args, root: Path, config: Path, rl_config: Path | None = None):
        super().__init__(args, root, config, rl_config)
        self.info = cluster.up()  # idempotent: the cluster at $SNOWCAT_CLUSTER_ROOT, started if needed
        os.environ.update(self.info.env)  # squeue/sbatch here and in every command started
        (root / "decoys").mkdir(parents=True, exist_ok=True)
        self.decoy_jobs: dict[str, str] = {}  # node -> job id
        self.killed_nodes: set[str] = set()
        self.since: float = time.time()

    # -- hooks of the local part --

    @classmethod
    def unready(cls) -> str | None:
        try:
            cluster.up()
        except UserError as e:
            return f"--slurm needs the local cluster (`snowcat cluster up`): {str(e).splitlines()[0]}"
        return None

    def workdir(self, run: Path) -> Path:
        return run.parent

    def finished(self, run: Path) -> bool:
        try:
            stages = stage_graph(run)
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return all((run / "stages" / s / "DONE").is_file() for s in stages)

    def settle(self, run: Path) -> str | None:
        """Wait until no job of the run is queued or running (a done run's for at most GRACE_S: what
        is left then is counted as orphaned); past the time-out its jobs are cancelled."""
        wd, deadline, done_at = self.workdir(run), time.monotonic() + self.timeout, None
        while True:
            rows = squeue(wd)
            if not rows:
                return None
            if self.finished(run):
                done_at = done_at or time.monotonic()
                if time.monotonic() - done_at > GRACE_S:
                    return None
            if time.monotonic() > deadline:
                subprocess.run(["scancel", *sorted({parse_job_id(r["id"])["job"] for r in rows})], capture_output=True)
                return f"jobs {', '.join(r['id'] + ' ' + r['state'] for r in rows)} still queued or running after {self.timeout:.0f}s"
            time.sleep(1.0)

    def before(self, f: Fault) -> None:
        """A decoy job on each node, running before the fault: a cancel or a cleanup must spare it."""
        self.since, self.killed_nodes = time.time(), set()
        self.decoy_jobs = {}
        for node in self.info.nodes:
            done = subprocess.run(
                ["sbatch", "--parsable", "-J", "snowcat-faults-decoy", "-w", node, "-t", "60", "--no-requeue", "-o", "/dev/null"]
                + ["-D", str(self.root / "decoys"), "--wrap", "sleep 100000"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            if done.returncode != 0:
                raise RuntimeError(f"cannot submit a decoy job: {done.stderr.strip()}")
            self.decoy_jobs[node] = done.stdout.strip().split(";")[0]
        running = lambda: all(self._job_state(j) == "RUNNING" for j in self.decoy_jobs.values())  # noqa: E731
        if not wait_for(running, 120, poll=0.5):
            raise RuntimeError(f"the decoy jobs {self.decoy_jobs} never started")

    def after(self, f: Fault) -> None:
        for node, job in self.decoy_jobs.items():
            state = self._job_state(job)
            if state != "RUNNING" and node not in self.killed_nodes:
                f.problems["killed"].append(f"decoy job {job} on {node}: {state or 'gone'}")
        subprocess.run(["scancel", *self.decoy_jobs.values()], capture_output=True)
        wd = self.workdir(f.run)
        rows = squeue(wd)  # counted in the verdict already; nothing may run into the next fault
        if rows:
            subprocess.run(["scancel", *sorted({parse_job_id(r["id"])["job"] for r in rows})], capture_output=True)
            wait_for(lambda: not squeue(wd), 60, poll=1.0)
        for pid, _ in processes_in(wd):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.killed_nodes:
            cluster.up(self.info.root)  # restarts the dead slurmd (idempotent otherwise)

    def describe(self) -> dict:
        version = subprocess.run(["sinfo", "-V"], capture_output=True, text=True).stdout.strip()
        return {
            "cluster": {
                "slurm": version,
                "nodes": list(self.info.nodes),
                "what": "snowcat's local test cluster (slurm/cluster.py): two virtual nodes on this machine, "
                "SlurmdTimeout 10 s, KillWait 2 s, requeued jobs held 10 s",
            }
        }

    # -- verdict: the local part's, and what only a scheduler leaves behind --

    def verdict(self, f: Fault) -> None:
        super().verdict(f)
        wd = self.workdir(f.run)
        for r in squeue(wd):
            f.problems["orphans"].append(f"job {r['id']} ({r['name']}, {r['state']}) still queued or running after the run")
        if not squeue(wd):
            procs = processes_in(wd)
            f.problems["orphans"] += [
                f"process {pid} ({' '.join(argv)[:120]}) alive after every job ended" for pid, argv in procs
            ]
        rows = sacct(wd, self.since)
        f.problems["two_writers"] += overlapping(rows)
        f.params["jobs"] = {}  # what became of each job, by stage: the evidence of what the fault did
        for r in rows:
            if "+" not in r["id"] or r["id"].endswith("+0"):
                f.params["jobs"].setdefault(r["name"].rsplit("-", 1)[-1], []).append(f"{r['id']} {r['state'].split()[0]}")

    # -- helpers of the kinds --

    @staticmethod
    def _job_state(job: str) -> str:
        done = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=60)
        return done.stdout.strip().split("\n")[0] if done.returncode == 0 else ""

    def submit(self, f: Fault) -> None:
        """`snowcat run CONFIG --executor slurm --site local`: it exits once the whole DAG is queued."""
        cmd = ("run", str(self.refs[f.ref].config), *ON_SLURM, "--run-dir", str(f.run))
        rc = wait(self.cli(f.run, *cmd, log=f.log), self.timeout)
        if rc != 0:
            raise RuntimeError(f"the submission failed ({rc}): {last_output(f.log)}")

    def wait_out(self, f: Fault, what: str) -> None:
        """Until the jobs the fault hit have ended (or been requeued and finished)."""
        hang = self.settle(f.run)
        if hang:
            f.problems["hangs"].append(f"{what}: {hang}")
        self.check_torn(f, what)

    def running(self, f: Fault, stage: str | None = None, ranks: int = 1, within: float = 60) -> list[Proc]:
        """The stage processes of the run (of `stage`; `ranks` of them), waiting `within` seconds
        for them; [] when the run (or that stage) ended first."""

        def found():
            procs = [p for p in job_processes(self.workdir(f.run)) if stage in (None, p.stage)]
            if len(procs) >= ranks:
                return procs
            over = self.finished(f.run) or (stage is not None and (f.run / "stages" / stage / "DONE").is_file())
            return "ended" if over else []

        procs = wait_for(found, within, poll=0.1)
        return procs if isinstance(procs, list) else []

    def sleep_instant(self, f: Fault, rng: random.Random) -> None:
        f.params["at_s"] = round(rng.uniform(1.0, 0.9 * self.refs[f.ref].wall), 2)
        time.sleep(f.params["at_s"])

    def _hit(self, f: Fault, rng: random.Random, action, stage: str | None = None) -> None:
        """Submit, wait a random instant (of the run; of `stage`'s work when given), apply
        `action(proc)` to the stage process running then."""
        self.submit(f)
        if stage is None:
            self.sleep_instant(f, rng)
        else:
            self.running(f, stage, within=self.timeout)
            ran = json.loads((self.refs[f.ref].path / "stages" / stage / "metrics.json").read_text())["duration_s"]
            f.params["at_s"] = round(rng.uniform(0, 0.8 * float(ran)), 2)  # after its process started
            time.sleep(f.params["at_s"])
        procs = self.running(f, stage)
        f.done_before = done_units(f.run)
        if not procs:
            f.notes.append("no stage process was running (the run had finished)")
        else:
            f.params |= {"stage": procs[0].stage, "job": procs[0].job}
            action(procs[0])
        self.wait_out(f, "after the fault")

    @staticmethod
    def _kill(pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    # -- kinds on configs/faults.yaml --

    def kill_job_process(self, f: Fault, rng: random.Random) -> None:
        """SIGKILL of the stage process of the job running at a random instant."""
        self._hit(f, rng, lambda p: self._kill(p.pid))

    def preempt_usr2(self, f: Fault, rng: random.Random) -> None:
        """The notice a walltime or a preempting job sends (`--signal=USR2@margin`), to the SFT job at
        a random instant of its work: it checkpoints and requeues itself."""
        self._hit(f, rng, lambda p: subprocess.run(["scancel", "--signal=USR2", p.job], capture_output=True), stage="sft")

    def usr2_other_stage(self, f: Fault, rng: random.Random) -> None:
        """The same notice to a stage that does not checkpoint (tasks or evaluate): it must finish as
        it would have, nothing recorded wrong (its helper processes get the signal too)."""
        stage = rng.choice(["tasks", "eval"])
        self._hit(f, rng, lambda p: subprocess.run(["scancel", "--signal=USR2", p.job], capture_output=True), stage=stage)

    def scancel_job(self, f: Fault, rng: random.Random) -> None:
        """`scancel` of the running stage's job (SIGTERM, then SIGKILL after KillWait)."""
        self._hit(f, rng, lambda p: subprocess.run(["scancel", p.job], capture_output=True))

    def kill_ckpt_save(self, f: Fault, rng: random.Random) -> None:
        """SIGKILL of the SFT job's process while its n-th checkpoint is built under a temp name."""
        nth = rng.randint(1, 7)
        f.params["save"] = nth
        self.submit(f)
        state, seen = self.wait_for_staging(_Jobs(self, f.run), f.run / "stages" / "sft" / "checkpoints", nth)
        f.done_before = done_units(f.run)
        targets = [p for p in job_processes(self.workdir(f.run)) if p.stage == "sft"] if state == "hit" else []
        if not targets:
            f.notes.append(f"only {len(seen)} checkpoint saves seen")
        else:
            f.params["during"] = sorted(seen)[-1]
            for p in targets:
                self._kill(p.pid)
        self.wait_out(f, "after the kill")

    def kill_slurmd(self, f: Fault, rng: random.Random) -> None:
        """The node of the running stage dies: its slurmd and every process of its jobs, at once."""

        def die(p: Proc) -> None:
            node = p.node
            f.params["node"] = node
            pid = int((self.info.root / "run" / f"slurmd-{node}.pid").read_text().split()[0])
            victims = [pid]
            logs = str(self.info.root / "log")  # this cluster's slurmstepd work there
            for q, _, _ in faults._proc_table():
                env = _environ(q)
                if env.get("SLURMD_NODENAME") == node and env.get("SLURM_CONF") == self.info.env["SLURM_CONF"]:
                    victims.append(q)
                    parent = _ppid(q)
                    if parent and _cwd(parent) == logs:
                        victims.append(parent)
            self.killed_nodes.add(node)
            for q in dict.fromkeys(victims):
                self._kill(q)
            # the controller declares the node down after SlurmdTimeout: the job ends NODE_FAIL or is requeued
            wait_for(lambda: self._job_state(p.job) != "RUNNING", 120, poll=1.0)
            cluster.up(self.info.root)  # the node comes back (ReturnToService=2)

        self._hit(f, rng, die)

    def damaged_file(self, f: Fault, rng: random.Random) -> None:
        """A copy of the reference with a file damaged: an output, a retained checkpoint's, a manifest."""
        how = rng.choice(["corrupt_output", "corrupt_checkpoint", "corrupt_manifest"])
        f.params["damage"] = how
        getattr(self, how)(f, rng)

    def concurrent_driver(self, f: Fault, rng: random.Random) -> None:
        """A second `snowcat resume` while the run's jobs are queued or running: no unit gets two jobs."""
        self.submit(f)
        self.sleep_instant(f, rng)
        f.done_before = done_units(f.run)
        alive = squeue(self.workdir(f.run))
        f.params["jobs_alive"] = len(alive)
        if not alive:
            f.notes.append("the run had finished")
        f.params["second_rc"] = wait(self.cli(f.run, "resume", str(f.run), log=f.log), self.timeout)
        if f.params["second_rc"] is None:
            f.problems["hangs"].append("the second driver ran past the time-out")
        names = [r["name"] for r in squeue(self.workdir(f.run)) if "+" not in r["id"] or r["id"].endswith("+0")]
        f.problems["two_writers"] += [
            f"{n}: {names.count(n)} jobs queued at once" for n in sorted(set(names)) if names.count(n) > 1
        ]
        self.wait_out(f, "after both drivers")

    def by_hand_unit(self, f: Fault, rng: random.Random) -> None:
        """`python -m snowcat.stages RUN sft` while the job's sft process holds the unit: it must stand aside."""
        self.submit(f)
        logs = f.run / "slurm" / "sft"
        started = lambda: any("sft (sft) rank 0" in p.read_text(errors="replace") for p in logs.glob("*_log.out"))  # noqa: E731
        job = self.running(f, "sft") and wait_for(lambda: started() or self.finished(f.run), 120, poll=0.1)
        f.params["delay_s"] = round(rng.uniform(0, 3), 2)
        time.sleep(f.params["delay_s"])
        f.done_before = done_units(f.run)
        if not job or "sft" in f.done_before:
            f.notes.append("the sft job was not running")
        job_sft = [p.pid for p in job_processes(self.workdir(f.run)) if p.stage == "sft"]
        hand_log = f.dir / "by-hand.log"
        hand = faults._unit_cmd(f.run, "sft", hand_log)

        def overlap() -> bool:  # the by-hand unit began training while the job's sft process lived
            return "sft (sft) rank" in hand_log.read_text(errors="replace") and any(Path(f"/proc/{p}").exists() for p in job_sft)

        both = wait_for(lambda: overlap() or hand.poll() is not None, self.timeout, poll=0.02)
        if both is True and overlap():
            f.problems["two_writers"].append("the by-hand sft unit ran while the job's sft process was running")
        f.params["by_hand_rc"] = wait(hand, self.timeout)
        f.params["by_hand_said"] = last_output(hand_log, 1)[:300]
        self.wait_out(f, "after both")

    def kill_submit(self, f: Fault, rng: random.Random) -> None:
        """SIGKILL of `snowcat run` once it has queued n of the DAG's jobs but not all (its journal,
        polled every 2 ms, lists them), before it recorded any: what it queued must not run on unowned."""
        nth = rng.randint(1, len(stage_graph(self.refs[f.ref].path)) - 1)
        f.params["after_jobs"] = nth
        journal = f.run / "slurm" / "submitting.json"
        proc = self.cli(f.run, "run", str(self.refs[f.ref].config), *ON_SLURM, "--run-dir", str(f.run), log=f.log)
        seen = [0]

        def queued() -> bool:
            seen[0] = len((read_json(journal) or {}).get("queued", [])) if journal.is_file() else 0
            return seen[0] >= nth or proc.poll() is not None

        wait_for(queued, self.timeout, poll=0.002)
        self._kill(proc.pid)
        proc.wait()
        f.done_before = done_units(f.run)
        f.params["journal"] = seen[0]
        if seen[0] < nth:
            f.notes.append(f"the submission ended before its journal listed {nth} jobs")

    def cancel_run(self, f: Fault, rng: random.Random) -> None:
        """`snowcat cancel` at a random instant: the run's jobs end, nobody else's; resume finishes it."""
        self.submit(f)
        self.sleep_instant(f, rng)
        f.done_before = done_units(f.run)
        f.params["cancel_rc"] = wait(self.cli(f.run, "cancel", str(f.run), log=f.log), self.timeout)
        self.wait_out(f, "after the cancel")

    # -- kinds on configs/faults-rl.yaml: a copy of its reference without the rl stage, resumed --

    def _start_rl(self, f: Fault) -> None:
        self.copy_reference(f)
        shutil.rmtree(f.run / "stages" / "rl")
        f.done_before = done_units(f.run)
        rc = wait(self.cli(f.run, "resume", str(f.run), log=f.log), self.timeout)
        if rc != 0:
            raise RuntimeError(f"resume did not submit rl ({rc}): {last_output(f.log)}")

    def _rl_instant(self, f: Fault, rng: random.Random) -> list[Proc]:
        duration = float(json.loads((self.refs["rl"].path / "stages" / "rl" / "metrics.json").read_text())["duration_s"])
        procs = self.running(f, "rl", ranks=2)
        f.params["at_s"] = round(rng.uniform(0.5, duration), 2)
        time.sleep(f.params["at_s"])
        return [p for p in job_processes(self.workdir(f.run)) if p.stage == "rl"] if procs else []

    def kill_mpi_rank(self, f: Fault, rng: random.Random) -> None:
        """SIGKILL of one rank of the RL hetjob: srun ends the other (--kill-on-bad-exit), no hang."""
        rank = rng.randint(0, 1)
        f.params["rank"] = rank
        self._start_rl(f)
        target = [p for p in self._rl_instant(f, rng) if p.rank == rank]
        if not target:
            f.notes.append("the rank had already ended")
        else:
            self._kill(target[0].pid)
        self.wait_out(f, "after the kill")

    def kill_weight_publish(self, f: Fault, rng: random.Random) -> None:
        """SIGKILL of the trainer rank while it writes the n-th weight version for the rollout rank."""
        nth = rng.randint(1, 6)
        f.params["publish"] = nth
        self._start_rl(f)
        state, seen = self.wait_for_staging(_Jobs(self, f.run), f.run / "stages" / "rl" / "weights", nth)
        trainer = [p for p in job_processes(self.workdir(f.run)) if p.stage == "rl" and p.rank == 0] if state == "hit" else []
        if not trainer:
            f.notes.append(f"only {len(seen)} weight publications seen")
        else:
            f.params["during"] = sorted(seen)[-1]
            self._kill(trainer[0].pid)
        self.wait_out(f, "after the kill")

    def preempt_rl_usr2(self, f: Fault, rng: random.Random) -> None:
        """The preemption notice to the RL hetjob: the trainer saves while rollout waits, the job requeues."""
        self._start_rl(f)
        procs = self._rl_instant(f, rng)
        if not procs:
            f.notes.append("the RL job had ended")
        else:
            f.params["job"] = procs[0].job
            subprocess.run(["scancel", "--signal=USR2", procs[0].job], capture_output=True)
        self.wait_out(f, "after the notice")


def main(argv: list[str]) -> int:
    defaults = {"faults": 28, "timeout": 300.0, "json": RESULTS, "root": "/tmp/snowcat-faults-slurm"}
    args = faults.parser(defaults, KINDS, RL_KINDS).parse_args(argv)
    return faults.campaign(args, argv, SlurmCampaign, KINDS, part="slurm")
