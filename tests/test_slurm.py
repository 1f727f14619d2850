"""The Slurm executor against the live local cluster (`snowcat cluster up`): dependency chains,
arrays, hetjobs in one MPI world, walltime continuation by requeue and by chained jobs, failures
noticed promptly, resume, and rendering for every site profile."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from snowcat.pipeline import config, dag
from snowcat.pipeline.cli import status_record
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import read_json, sha256_file
from snowcat.pipeline.rundir import RunDir
from snowcat.slurm import cluster
from snowcat.slurm.executor import SlurmExecutor
from snowcat.slurm.hetjob import parse_job_id
from snowcat.slurm.site import list_sites, load_site
from tests.conftest import write_config

TASKS = """
name: {name}
seed: 5
stages:
  tasks:
    kind: tasks
    resources: {{time_min: 5}}
    domains:
      closure: {{count: 120, val_count: 20, difficulties: [1, 2]}}
      arith: {{count: 120, val_count: 20, difficulties: [2]}}
  more:
    kind: tasks
    needs: [tasks]
    resources: {{time_min: 5}}
    fan_out: {{replica: [a, b, c]}}
    domains:
      arith: {{count: 50, val_count: 5, difficulties: [3]}}
"""

HETJOB = """
name: fabric
stages:
  fabric:
    kind: mpi_check
    require_roles_on_distinct_hosts: true
    resources:
      time_min: 5
      components:
        trainer: {nodes: 1, tasks_per_node: 1, cpus_per_task: 2}
        rollout: {nodes: 1, tasks_per_node: 2}
"""

pytestmark = pytest.mark.cluster


def on_local_slurm(run_dir) -> tuple:
    """The options that send a run to the local test cluster."""
    return ("--executor", "slurm", "--site", "local", "--run-dir", run_dir)


# Big enough that the tasks stage runs for a while (seconds to minutes on 2 shared cores).
# ~10 s of work: a scancel right after the stage is seen running must land before it writes DONE
# (at ~2 s it sometimes did not, and the unit cancelled then finished within KillWait was done)
SLOW_TASKS = ["stages.tasks.domains.closure.count=200000", "stages.tasks.domains.closure.val_count=50"]


def _recorded(run_dir: Path, graph, stage: str | None) -> set[str]:
    """The stages' statuses as their jobs recorded them (no reconciliation with the scheduler)."""
    run = RunDir.open(run_dir)
    return {run.stage_status(graph, n, verify=False)[0] for n in graph.nodes if stage in (None, n)}


def wait_status(run_dir: Path, want: set[str], timeout: float = 300, stage: str | None = None) -> dict:
    """What `snowcat status --json` says once every stage (or `stage`) is in `want`, asked in this
    process (the command costs a second of CPU a call; its output is the same record). Asked when
    the records the jobs write say so, and every 10 s for what only the scheduler knows (a job that
    died without a word: a failing test's case, so it may wait); the records are read twice a second."""
    deadline = time.monotonic() + timeout
    graph = dag.build(RunDir.open(run_dir).config())
    status, asked = {}, -1e9
    while time.monotonic() < deadline:
        since = time.monotonic() - asked
        if since >= 10 or (since >= 2 and _recorded(run_dir, graph, stage) <= want):
            status, asked = json.loads(json.dumps(status_record(RunDir.open(run_dir)), default=str)), time.monotonic()
            states = {s["status"] for n, s in status["stages"].items() if stage in (None, n)}
            if states <= want:
                return status
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {want}: {status}")


def sacct_rows(env, ids: list[str]) -> list[list[str]]:
    out = subprocess.run(
        ["sacct", "-n", "-P", "-X", "-j", ",".join(ids), "-o", "JobID,JobName,State"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line.split("|") for line in out.splitlines() if line]


def test_dag_is_submitted_at_once_with_afterok_chains(snowcat, slurm_env, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", TASKS.format(name="chain"))
    run_dir = tmp_path / "run"
    proc = snowcat("run", cfg, *on_local_slurm(run_dir), env=slurm_env)
    assert proc.returncode == 0, proc.stderr
    state = RunDir(run_dir).state()["stages"]
    tasks_id, more_id = state["tasks"]["job_ids"][0], state["more"]["job_ids"][0]
    # One job per stage, one array for the fan-out, the dependent waits on its input.
    more_script = next((run_dir / "slurm" / "more").glob("*_submission.sh")).read_text()
    assert f"#SBATCH --dependency=afterok:{tasks_id}" in more_script
    assert "#SBATCH --array=0-2" in more_script
    status = wait_status(run_dir, {"done"})
    assert status["stages"]["more"]["units"]["more[2]"]["status"] == "done"
    deadline = time.monotonic() + 60  # DONE is written just before the job itself ends
    expected = {tasks_id, f"{more_id}_0", f"{more_id}_1", f"{more_id}_2"}
    while True:  # accounting records quick array elements a moment apart: wait for all of them
        rows = sacct_rows(slurm_env, [tasks_id, more_id])
        if ({r[0] for r in rows} == expected and all(r[2] == "COMPLETED" for r in rows)) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert {r[0] for r in rows} == expected
    assert all(r[2] == "COMPLETED" for r in rows), rows
    # Nothing left to do: resume submits nothing.
    again = snowcat("resume", run_dir, env=slurm_env)
    assert again.returncode == 0 and "all 2 stages done" in again.stderr


def test_fan_out_of_200_is_one_array_in_one_sbatch(snowcat, slurm_env, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", TASKS.format(name="wide"))
    run_dir = tmp_path / "run"
    # `tasks` runs for a while, so the array waits on it: only the submission is under test.
    snowcat(
        "run",
        cfg,
        *SLOW_TASKS,
        "stages.more.fan_out.replica=[" + ",".join(map(str, range(200))) + "]",
        "stages.more.max_parallel=8",
        *on_local_slurm(run_dir),
        env=slurm_env,
        check=True,
    )
    try:
        state = RunDir(run_dir).state()["stages"]
        assert len(state["more"]["job_ids"]) == 1
        scripts = list((run_dir / "slurm" / "more").glob("*_submission.sh"))
        assert len(scripts) == 1 and "#SBATCH --array=0-199%8" in scripts[0].read_text()
        out = subprocess.run(
            ["squeue", "-h", "-r", "-j", state["more"]["job_ids"][0], "-o", "%i"],
            env=slurm_env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert len(out) == 200
    finally:
        snowcat("cancel", run_dir, env=slurm_env, check=True)
    assert snowcat.status(run_dir)["stages"]["more"]["status"] == "cancelled"


def test_hetjob_components_share_one_mpi_world(snowcat, slurm_env, tmp_path):
    cfg = write_config(tmp_path / "h.yaml", HETJOB)
    run_dir = tmp_path / "run"
    snowcat("run", cfg, *on_local_slurm(run_dir), env=slurm_env, check=True)
    script = next((run_dir / "slurm" / "fabric").glob("*_submission.sh")).read_text()
    # the components' CPUs per task differ: Slurm's MPMD form, each group saying its own
    assert "#SBATCH hetjob" in script and "srun --mpi=pmix --het-group=0 --cpus-per-task=2 --kill-on-bad-exit=1" in script
    assert " : --het-group=1 --cpus-per-task=1 --kill-on-bad-exit=1" in script
    status = wait_status(run_dir, {"done", "failed"})
    assert status["stages"]["fabric"]["status"] == "done", status
    world = read_json(run_dir / "stages" / "fabric" / "world.json")
    assert [r["role"] for r in world["ranks"]] == ["trainer", "rollout", "rollout"]  # still one MPI world
    assert set(world["role_hosts"]["trainer"]).isdisjoint(world["role_hosts"]["rollout"])
    assert status["stages"]["fabric"]["metrics"]["bytes_exchanged"] > 0


def _running_job(run_dir: Path, stage: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = RunDir(run_dir).state()["stages"].get(stage, {})
        if record.get("status") == "running" and record.get("slurm_job_id"):
            return record["slurm_job_id"]
        time.sleep(0.5)
    raise AssertionError(f"{stage} never started running")


@pytest.mark.slow
def test_scancel_of_running_stage_fails_promptly_and_resume_finishes(snowcat, slurm_env, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", TASKS.format(name="scancel"))
    run_dir = tmp_path / "run"
    snowcat("run", cfg, *SLOW_TASKS, *on_local_slurm(run_dir), env=slurm_env, check=True)
    job = _running_job(run_dir, "tasks")
    subprocess.run(["scancel", job], env=slurm_env, check=True)
    status = wait_status(run_dir, {"failed", "cancelled", "done"}, timeout=120, stage="tasks")
    assert status["stages"]["tasks"]["status"] in ("failed", "cancelled")
    # The dependent array can never start (afterok on a cancelled job): it is not an endless wait either.
    snowcat("resume", run_dir, env=slurm_env, check=True)
    status = wait_status(run_dir, {"done"}, timeout=600)
    assert status["stages"]["tasks"]["attempts"] == 2


GATED = """
name: gated
seed: 5
stages:
  tasks:
    kind: tasks
    resources: {time_min: 5}
    domains:
      arith: {count: 40, val_count: 8, difficulties: [2]}
  sft:
    kind: sft
    needs: [tasks]
    model: demo-tiny
    tokenizer_vocab_size: 320
    seq_len: 64
    steps: 2
    resume: {strategy: chain, max_continuations: 1}
"""


def test_a_stage_whose_job_never_ran_leaves_no_held_gate_behind(snowcat, slurm_env, tmp_path):
    """A job cancelled while it waits in the queue never runs the code that cancels the gates of what
    can only fail after it (a held job nothing will release, counted against the user's limits):
    `snowcat status` cancels it once no unit of its stage has a job left."""
    blocker = subprocess.run(  # both nodes taken: the run's first job waits in the queue
        ["sbatch", "--parsable", "-N", "2", "--exclusive", "-t", "5", "-o", "/dev/null", "--wrap", "sleep 300"],
        env=slurm_env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    try:
        run_dir = tmp_path / "run"
        snowcat("run", write_config(tmp_path / "c.yaml", GATED), *on_local_slurm(run_dir), env=slurm_env, check=True)
        state = RunDir(run_dir).state()["stages"]
        gate, tasks = state["sft"]["gate"], state["tasks"]["job_ids"][0]
        subprocess.run(["scancel", tasks], env=slurm_env, check=True, timeout=60)
    finally:
        subprocess.run(["scancel", blocker], env=slurm_env, check=True, timeout=60)
    status = wait_status(run_dir, {"failed", "cancelled"})
    assert status["stages"]["tasks"]["status"] == "cancelled", status["stages"]["tasks"]
    queued = subprocess.run(["squeue", "-h", "-o", "%i %T"], env=slurm_env, capture_output=True, text=True, check=True)
    assert gate not in queued.stdout.split(), queued.stdout


def test_parse_het_and_array_ids():
    assert parse_job_id("123+1") == {"job": "123", "component": 1, "task": None, "step": None}
    assert parse_job_id("77_4")["task"] == "4" and parse_job_id("77_[5-199%8]")["task"] == "[5-199%8]"
    assert parse_job_id("123+0.batch")["step"] == "batch"


# --- rendering for every site profile -------------------------------------------------------------


def _render(site: str, overrides: list[str], stage: str = "tasks") -> str:
    profile = load_site(site)
    part = next(iter(profile.partitions))
    gpu_part = next((p for p, v in profile.partitions.items() if v.gpus_per_node), part)
    cfg = config.load(
        Path(__file__).parent.parent / "configs" / "demo.yaml",
        [
            "executor.kind=slurm",
            "site.account=proj",
            f"stages.tasks.resources.partition={gpu_part}",
            "stages.tasks.resources.gpus_per_node=1",
            "stages.tasks.resources.mem_gb=8",
            *overrides,
        ],
        site=site,
    )

    run = RunDir.create(cfg, Path(tempfile.mkdtemp()) / "r")
    return SlurmExecutor(run, dag.build(cfg), cfg).scripts.render(dag.build(cfg)[stage], "afterok:1")


@pytest.mark.parametrize("site", list_sites())
def test_rendering_never_emits_a_rejected_option(site):
    profile = load_site(site)
    # replicas of tasks are other task sets: the stages reading them name one (pipeline/sweep.py)
    readers = ["sft.tasks_input", "probe.tasks", "select.tasks", "rl.tasks_input", "eval.tasks", "eval_greedy.tasks"]
    one = [f"stages.{key}='tasks[0]'" for key in readers]
    text = _render(site, ["stages.tasks.fan_out.replica=[1,2]", "stages.tasks.resources.nodes=1", *one])
    flags = re.findall(r"^#SBATCH --([a-z-]+)", text, flags=re.M)
    rejected = {o.lstrip("-") for o in profile.rejected_options}
    assert flags and not rejected & set(flags), (site, rejected & set(flags))
    if not profile.arrays_allowed:
        assert "--array" not in text


@pytest.mark.parametrize("site", list_sites())
def test_oversized_requests_are_refused_before_submission(site):
    profile = load_site(site)
    gpu_part = next((p for p, v in profile.partitions.items() if v.gpus_per_node), next(iter(profile.partitions)))
    limits = profile.partitions[gpu_part]
    with pytest.raises(UserError, match="GPUs per node"):
        _render(site, [f"stages.tasks.resources.gpus_per_node={limits.gpus_per_node + 1}"])
    with pytest.raises(UserError, match="walltime"):
        _render(site, [f"stages.tasks.resources.time_min={limits.max_time_min + 1}"])


@pytest.mark.slow
def test_killed_slurmd_fails_the_stage_promptly_and_resume_finishes(snowcat, slurm_env, slurm_cluster, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", TASKS.format(name="nodefail"))
    run_dir = tmp_path / "run"
    # (SLOW_TASKS: the kill lands well within its ~10 s; the resume runs it all again)
    snowcat(
        "run",
        cfg,
        *SLOW_TASKS,
        "stages.tasks.resume.strategy=none",
        *on_local_slurm(run_dir),
        env=slurm_env,
        check=True,
    )
    _running_job(run_dir, "tasks")
    record = RunDir(run_dir).state()["stages"]["tasks"]
    pid = int((slurm_cluster.root / "run" / f"slurmd-{record['node']}.pid").read_text())
    try:
        # The node dies: its slurmd, the job's step daemons and the stage process, all at once.
        os.kill(pid, signal.SIGKILL)
        subprocess.run(["pkill", "-9", "-f", f"slurmstepd: \\[{record['slurm_job_id']}"], check=False)
        os.kill(record["process"]["pid"], signal.SIGKILL)
        # SlurmdTimeout=10 on the local cluster: the node is declared down and the job ends NODE_FAIL.
        status = wait_status(run_dir, {"failed", "done"}, timeout=180, stage="tasks")
        assert status["stages"]["tasks"]["status"] == "failed", status
    finally:
        cluster.up(slurm_cluster.root)  # restarts the dead slurmd
    snowcat("resume", run_dir, env=slurm_env, check=True)
    wait_status(run_dir, {"done"}, timeout=600)


SFT = """
name: {name}
seed: 3
stages:
  tasks:
    kind: tasks
    resources: {{time_min: 5}}
    domains:
      closure: {{count: 300, val_count: 30, difficulties: [1, 2, 3]}}
      arith: {{count: 300, val_count: 30, difficulties: [2]}}
  sft:
    kind: sft
    needs: [tasks]
    threads: 1          # bit-identical results need the same reduction order everywhere
    eval_tasks: 0
    save_every: 0       # checkpoints only when Slurm says the job is about to end
    resources: {{time_min: 1}}
    resume: {{signal_margin_s: 15, max_continuations: 14}}
"""


def _why(run_dir: Path, stage: str) -> str:
    """What a failed stage left to read: its recorded error and the end of each of its job logs."""
    lines = [f"error: {RunDir(run_dir).state()['stages'].get(stage, {}).get('error')}"]
    for log in sorted((run_dir / "slurm" / stage).glob("*_log.*")):
        lines += [f"--- {log.name}", *log.read_text(errors="replace").splitlines()[-30:]]
    return "\n".join(lines)


def _final_weights(run_dir: Path) -> dict[str, str]:
    final = run_dir / "stages" / "sft" / "checkpoints" / "final"
    return {p.name: sha256_file(p) for p in sorted(final.glob("*.safetensors"))}


@pytest.mark.slow
def test_walltime_continuation_by_requeue_and_by_chain_matches_uninterrupted(snowcat, slurm_env, tmp_path):
    """A stage with a 1-minute walltime and more than a minute of training completes through requeue
    and through chained continuation jobs, with final weights identical to an uninterrupted run."""
    cfg = write_config(tmp_path / "sft.yaml", SFT.format(name="walltime"))
    # When the notice comes: slurmctld checks time limits every 30 s (PERIODIC_TIMEOUT, compiled
    # in) and sends `--signal=USR2@m` at the first check at most m + 30 s before the end, so a
    # 1-minute job gets it 30 - m to 60 - m s after it started, and the kill comes at a later check,
    # at least 30 s after the notice. A continuation starts 3-14 s after the check that stopped its
    # predecessor: with m = 15 its notice came at the next check, ~16-26 s later, and on a loaded
    # machine each job trained a step or two (6 requeues for 56 steps); with m = 2, at the one after.
    margin = "stages.sft.resume.signal_margin_s=2"
    # Size the work for this machine: more SFT steps than a 1-minute job trains before its notice (at
    # most 58 s after its start), timed on a short local run. Its fastest step, and 60 s of them: CI
    # runs other tests beside this one, and a run sized by the median step of a loaded moment once
    # finished in one job when the load fell. A loaded job trains for much less: continuations to
    # spare (the walltime is hit either way).
    probe = tmp_path / "probe"
    snowcat("run", cfg, "stages.sft.steps=8", "--run-dir", probe, check=True)
    rows = [json.loads(line) for line in (probe / "stages" / "sft" / "metrics_history.jsonl").read_text().splitlines()]
    step_s = min(r["step_time_s"] for r in rows)
    steps = f"stages.sft.steps={max(50, int(60 / step_s))}"

    runs = {}
    for strategy in ("requeue", "chain"):
        runs[strategy] = tmp_path / strategy
        snowcat(
            "run",
            cfg,
            steps,
            margin,
            f"stages.sft.resume.strategy={strategy}",
            "stages.sft.resume.max_continuations=30",
            *on_local_slurm(runs[strategy]),
            env=slurm_env,
            check=True,
        )
    straight = tmp_path / "straight"
    snowcat("run", cfg, steps, margin, "--run-dir", straight, check=True)
    reference = _final_weights(straight)
    assert reference

    for strategy, run_dir in runs.items():
        status = wait_status(run_dir, {"done", "failed", "cancelled"}, timeout=1500)
        assert status["stages"]["sft"]["status"] == "done", f"{strategy}: {status['stages']['sft']}\n{_why(run_dir, 'sft')}"
        record = RunDir(run_dir).state()["stages"]["sft"]
        assert record.get("continuations_used", 0) >= 1, (strategy, record)  # the walltime was really hit
        assert _final_weights(run_dir) == reference, strategy
    # The chain's unused continuation jobs were cancelled once the stage completed.
    chain = RunDir(runs["chain"]).state()["stages"]["sft"]
    used = chain["continuations_used"]
    leftover = chain["continuations"][used:]
    if leftover:
        rows = sacct_rows(slurm_env, leftover)
        assert all(r[2].startswith("CANCELLED") for r in rows), rows


FAN_OUT_SFT = (
    SFT
    + """\
    fan_out: {{replica: [a, b, c]}}
  last:
    kind: tasks
    needs: [sft]
    resources: {{time_min: 5}}
    domains:
      arith: {{count: 30, val_count: 5, difficulties: [1]}}
"""
)


@pytest.mark.slow
@pytest.mark.parametrize("queued_up_front", [False, True], ids=["job-queues-successor", "continuations-up-front"])
def test_chain_fan_out_with_one_element_preempted_completes_before_downstream_starts(
    snowcat, slurm_env, tmp_path, queued_up_front
):
    """Three SFT elements under the chain strategy; element 1 gets the preemption notice mid-run. It
    checkpoints and continues in a job of its own: one it queues itself (where jobs may call sbatch;
    the next stage waits on the stage's gate, released by the last element), or the continuation
    queued up front (as at TACC), the others' continuations then cancelled by their own elements.
    The downstream stage starts after every element ended."""
    cfg = write_config(tmp_path / "c.yaml", FAN_OUT_SFT.format(name="chainfan"))
    run_dir = tmp_path / "run"
    snowcat(
        "run",
        cfg,
        "stages.sft.steps=16",  # the notice comes after 3: element 1 is mid-run (13 steps, seconds, to go)
        "stages.sft.resources.time_min=20",
        "stages.sft.resume.strategy=chain",
        "stages.sft.resume.max_continuations=2",
        f"site.sbatch_on_compute={not queued_up_front}",
        *on_local_slurm(run_dir),
        env=slurm_env,
        check=True,
    )
    run = RunDir.open(run_dir)
    history = run.unit_dir(dag.Unit("sft", 1)) / "metrics_history.jsonl"
    deadline = time.monotonic() + 600
    while not (history.is_file() and len(history.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline, "element 1 never trained"
        time.sleep(0.2)
    own = run.state()["stages"]["sft[1]"]["own_job_ids"]
    subprocess.run(["scancel", "--signal=USR2", own[0]], env=slurm_env, check=True)

    status = wait_status(run_dir, {"done", "failed", "cancelled"}, timeout=900)
    assert {s["status"] for s in status["stages"].values()} == {"done"}, status
    state = run.state()["stages"]
    assert [state[f"sft[{i}]"].get("continuations_used", 0) for i in range(3)] == [0, 1, 0]
    owned = [state[f"sft[{i}]"]["own_job_ids"] for i in range(3)]
    # An array task cancelled before it ever started has no accounting row of its own: absent = cancelled.
    rows = {r[0]: r[2] for r in sacct_rows(slurm_env, sorted({j.split("_")[0] for ids in owned for j in ids}))}
    if queued_up_front:
        for i, (_, cont1, cont2) in enumerate(owned):
            assert rows.get(cont2, "CANCELLED").startswith("CANCELLED"), (i, rows)
            assert rows.get(cont1, "CANCELLED").startswith("COMPLETED" if i == 1 else "CANCELLED"), (i, rows)
    else:
        assert [len(ids) for ids in owned] == [1, 2, 1]  # only element 1 ever had a second job
        assert rows[owned[1][1]].startswith("COMPLETED"), rows
        gate = sacct_rows(slurm_env, [state["sft"]["gate"]])
        assert gate and gate[0][2].startswith("COMPLETED"), gate  # released by the last element
    assert not any(r.startswith(("PENDING", "RUNNING")) for r in rows.values()), rows
    ended = max(state[f"sft[{i}]"]["ended"] for i in range(3))
    assert state["last"]["started"] >= ended, (state["last"]["started"], ended)


_PROCESS_GROUP = """
import json, os, sys
from pathlib import Path
import torch, torch.distributed as dist
from snowcat.stages.train.rendezvous import init_process_group, rendezvous
r = rendezvous()
init_process_group(r)
t = torch.tensor([float(r.rank + 1)])
dist.all_reduce(t)
dist.destroy_process_group()
out = {"rank": r.rank, "world": r.world_size, "addr": r.addr, "port": r.port, "node": os.environ["SLURMD_NODENAME"], "sum": t.item()}
(Path(sys.argv[1]) / f"rank{r.rank}.json").write_text(json.dumps(out))
"""


def test_two_node_job_forms_a_torch_process_group_from_the_slurm_environment_alone(sbatch, tmp_path):
    """A plain `sbatch -N 2` + `srun` exports no MASTER_ADDR: rank, world, address (the first node;
    here a virtual node, reached at its NodeAddr) and port come from Slurm's variables."""
    script = tmp_path / "group.py"
    script.write_text(_PROCESS_GROUP)
    job = sbatch(
        "-N",
        "2",
        "--ntasks-per-node=1",
        "-t",
        "3",
        f"--output={tmp_path}/%j.out",
        "--wrap",
        f"unset MASTER_ADDR MASTER_PORT; srun {sys.executable} {script} {tmp_path}",
        wait=True,
    )
    ranks = [read_json(tmp_path / f"rank{r}.json") for r in range(2)]
    assert None not in ranks, (tmp_path / f"{job}.out").read_text()
    assert [(r["rank"], r["world"], r["sum"]) for r in ranks] == [(0, 2, 3.0), (1, 2, 3.0)]
    assert [r["node"] for r in ranks] == ["n1", "n2"] and ranks[0]["port"] == 20000 + int(job) % 20000


def test_fan_out_without_arrays_is_separate_jobs_tracked_per_element(snowcat, slurm_env, tmp_path):
    """Sites without job arrays (Frontera): one job per fan-out element, each element's status its own."""
    cfg = write_config(tmp_path / "c.yaml", TASKS.format(name="noarrays"))
    run_dir = tmp_path / "run"
    snowcat(
        "run",
        cfg,
        "site.arrays_allowed=false",
        *on_local_slurm(run_dir),
        env=slurm_env,
        check=True,
    )
    state = RunDir(run_dir).state()["stages"]
    assert len(state["more"]["job_ids"]) == 3
    assert sorted(state[f"more[{i}]"]["own_job_ids"][0] for i in range(3)) == sorted(state["more"]["job_ids"])
    assert not any("--array" in p.read_text() for p in (run_dir / "slurm" / "more").glob("*_submission.sh"))
    status = wait_status(run_dir, {"done"})
    assert {u["status"] for u in status["stages"]["more"]["units"].values()} == {"done"}


DRY = (
    TASKS
    + """\
  train:
    kind: sft
    needs: [tasks]
    fan_out: {{lr: [0.001, 0.002]}}
    resources: {{time_min: 5}}
  fabric:
    kind: mpi_check
    needs: [more, train]
    resources:
      time_min: 5
      components:
        trainer: {{nodes: 1, tasks_per_node: 1}}
        rollout: {{nodes: 1, tasks_per_node: 1}}
"""
)


def _normalized(script: str, ids: dict[str, str]) -> str:
    """A submitted script with its real job ids written as the dry run writes them."""
    for stage, job_id in ids.items():
        script = re.sub(rf"(after(?:ok|any)):{job_id}\b", rf"\1:<job of {stage}>", script)
    return script.replace("'", "")  # a dependency with '<' is quoted by submitit's renderer


def test_dry_run_writes_exactly_the_scripts_a_submission_sends(snowcat, slurm_env, tmp_path):
    """Every job of a plain stage, a job array, a hetjob and a chain of continuations: the dry run's
    scripts equal the submitted ones, job ids apart; the dry run itself writes no run directory."""
    cfg = write_config(tmp_path / "c.yaml", DRY.format(name="dry"))
    run_dir = tmp_path / "run"
    args = (
        cfg,
        "stages.train.resume.strategy=chain",
        "stages.train.resume.max_continuations=2",
        "site.sbatch_on_compute=false",  # continuation jobs queued up front, as at TACC
        *on_local_slurm(run_dir),
    )
    dry = snowcat("run", *args, "--dry-run", env=slurm_env)
    assert dry.returncode == 0, dry.stderr
    where = Path(re.search(r"are in (\S+);", " ".join(dry.stdout.split())).group(1))
    assert not run_dir.exists()
    written = {p.stem: p.read_text() for p in where.glob("*.sbatch")}
    shutil.rmtree(where)
    assert set(written) == {"tasks", "more", "train", "train.continuation1", "train.continuation2", "fabric"}

    snowcat("run", *args, env=slurm_env, check=True)
    try:
        state = RunDir(run_dir).state()["stages"]
        train = state["train"]["job_ids"]  # the array, then its continuation arrays in chain order
        ids = {
            "tasks": state["tasks"]["job_ids"][0],
            "more": state["more"]["job_ids"][0],
            "train": train[0],
            "train.continuation1": train[1],
            "train.continuation2": train[2],
            "fabric": state["fabric"]["job_ids"][0],
        }
        for name, job_id in ids.items():
            folder = run_dir / "slurm" / name.split(".")[0]
            submitted = (folder / f"{job_id}_submission.sh").read_text()
            assert _normalized(submitted, ids) == written[name].replace("'", ""), name
    finally:
        snowcat("cancel", run_dir, env=slurm_env, check=True)


def test_site_local_finds_the_local_cluster_without_its_env_file(snowcat, slurm_cluster, monkeypatch, tmp_path):
    """`snowcat cluster up`, then `--site local` works as the README says: nothing to source first."""
    monkeypatch.delenv("SLURM_CONF", raising=False)
    cfg = write_config(tmp_path / "c.yaml", TASKS.format(name="noenv"))
    run_dir = tmp_path / "run"
    snowcat("run", cfg, *on_local_slurm(run_dir), check=True)
    status = wait_status(run_dir, {"done", "failed"})
    assert {s["status"] for s in status["stages"].values()} == {"done"}, status
    doctor = snowcat("doctor", "--site", "local", "--no-jobs", "--json")
    assert doctor.returncode == 0, doctor.stderr
    checks = {c["name"]: c["status"] for c in json.loads(doctor.stdout)}
    assert checks["slurm"] == "pass" and checks["account"] == "pass"
