"""What the Slurm executor submits at a real centre, against a TEST DOUBLE scheduler (tests/fake_slurm:
`sbatch`/`sacct`/`scancel`/`squeue` answering from a JSON file; nothing runs): chained continuations
owned per unit, submit limits checked before anything is queued, all-or-nothing submission, arrays
split at MaxArraySize, separate jobs where arrays are not allowed, failure containment. The same
paths on the live local cluster are in tests/test_slurm.py."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from snowcat.pipeline import config
from snowcat.pipeline.dag import Unit, build
from snowcat.pipeline.executors import make_executor
from snowcat.pipeline.fsio import read_json
from snowcat.pipeline.rundir import RunDir
from snowcat.pipeline.runner import run_unit
from snowcat.slurm.jobside import StageJob
from tests.conftest import write_config

FAKE = Path(__file__).parent / "fake_slurm"
_spec = importlib.util.spec_from_file_location("fake_slurm", FAKE / "fake_slurm.py")
fake = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake)

CONFIG = """
name: plans
seed: 3
stages:
  tasks:
    kind: tasks
    resources: {{time_min: 5}}
    domains:
      arith: {{count: 300, val_count: 5, difficulties: [2]}}
  more:
    kind: sft
    needs: [tasks]
    steps: 3
    eval_tasks: 0
    threads: 1
    resources: {{time_min: 5}}
    fan_out: {{replica: {parts}}}
  last:
    kind: tasks
    needs: [more]
    resources: {{time_min: 5}}
    domains:
      arith: {{count: 30, val_count: 5, difficulties: [1]}}
"""


@pytest.fixture
def scheduler(tmp_path, monkeypatch) -> Path:
    """The fake scheduler on PATH for this process and the CLI it starts; its state file."""
    state = tmp_path / "fake-slurm.json"
    monkeypatch.setenv("PATH", f"{FAKE / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_STATE", str(state))
    monkeypatch.delenv("SLURM_CONF", raising=False)
    for var in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    return state


def _in_job(monkeypatch, job_id: str) -> None:
    """This process as Slurm starts job `job_id` (`123_4`: element 4 of array 123)."""
    job, _, task = job_id.partition("_")
    for var in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(var, raising=False)
    if task:
        monkeypatch.setenv("SLURM_ARRAY_JOB_ID", job)
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", task)
    monkeypatch.setenv("SLURM_JOB_ID", job)


def _config(tmp_path: Path, parts: int = 3) -> Path:
    return write_config(tmp_path / "c.yaml", CONFIG.format(parts=list(range(parts))))


JSC = ("--executor", "slurm", "--site", "jsc-juwels-booster", "site.account=proj")  # chain: requeue not allowed there
PRESUBMITTED = (*JSC, "site.sbatch_on_compute=false")  # as at TACC: continuation jobs queued up front


def _jobs(state_file: Path) -> dict[str, dict]:
    return read_json(state_file)["jobs"]


def _sbatch_calls(state_file: Path) -> list[str]:
    return [c[1] for c in read_json(state_file, {"calls": []})["calls"] if c[0] == "sbatch"]


def _task_states(state_file: Path) -> dict[str, str]:
    return {k: t["state"] for k, t in fake.tasks(read_json(state_file)).items()}


def test_chain_continuations_are_owned_per_element(snowcat, scheduler, tmp_path, monkeypatch):
    """A chain of 3 continuations queued up front: each element records its own element of every array,
    and an element that finishes cancels only its own continuations (it used to cancel every
    element's, so the downstream stage started while elements still ran)."""
    run_dir = tmp_path / "run"
    snowcat("run", _config(tmp_path), *PRESUBMITTED, "--run-dir", run_dir, check=True)
    state = RunDir.open(run_dir).state()["stages"]
    more = state["more"]
    assert len(more["job_ids"]) == 4 and more["continuations"] == more["job_ids"][1:]
    for i in range(3):
        assert state[f"more[{i}]"]["own_job_ids"] == [f"{j}_{i}" for j in more["job_ids"]]
    # the downstream stage waits for the last continuation array to end, not for the first job
    last_dep = _jobs(scheduler)[state["last"]["job_ids"][0]]["dependency"]
    assert last_dep == f"afterany:{more['job_ids'][-1]}"

    assert run_unit(run_dir, "tasks") == 0  # the input, run as its job would
    _in_job(monkeypatch, f"{more['job_ids'][0]}_0")
    StageJob(str(run_dir), "more", "chain", 3)(0)

    states = _task_states(scheduler)
    for cont in more["continuations"]:
        assert states[f"{cont}_0"] == "CANCELLED"
        assert states[f"{cont}_1"] == states[f"{cont}_2"] == "PENDING"
    assert RunDir.open(run_dir).is_done(Unit("more", 0))


def test_failed_unit_cancels_its_continuations_and_every_stage_downstream(snowcat, scheduler, tmp_path, monkeypatch):
    """A unit that fails stops what could only fail after it, and status says why."""
    run_dir = tmp_path / "run"
    snowcat("run", _config(tmp_path), *PRESUBMITTED, "--run-dir", run_dir, check=True)
    state = RunDir.open(run_dir).state()["stages"]
    # `more[1]` starts while its input is not done (e.g. released by afterany after tasks gave up).
    _in_job(monkeypatch, f"{state['more']['job_ids'][0]}_1")
    with pytest.raises(RuntimeError, match="more\\[1\\] failed"):
        StageJob(str(run_dir), "more", "chain", 3)(1)

    states = _task_states(scheduler)
    for cont in state["more"]["continuations"]:
        assert states[f"{cont}_1"] == "CANCELLED"  # its own continuations
        assert states[f"{cont}_0"] == "PENDING"  # other elements keep theirs
    assert {states[k] for k in states if k.split("_")[0] in state["last"]["job_ids"]} == {"CANCELLED"}
    after = RunDir.open(run_dir).state()["stages"]
    assert after["last"]["status"] == "cancelled"
    assert "input more[1] failed" in after["last"]["error"] and "snowcat resume" in after["last"]["error"]
    status = snowcat.status(run_dir)
    assert status["stages"]["last"]["status"] == "cancelled"


def test_submit_limit_refuses_before_anything_is_queued(snowcat, scheduler, tmp_path):
    """A QoS's MaxSubmit (Vista's gh: 40 per user) that the demo DAG's chained continuations would pass
    part-way: on gh, SFT, probe and RL (two hetjob components: 4 jobs) with 3 continuations each and
    3 GPU stages that cannot continue are 19; the CPU stages went to the gg partition. The refusal states the count and names the limit;
    nothing is queued or recorded."""
    demo = Path(__file__).parent.parent / "configs" / "demo.yaml"
    run_dir = tmp_path / "run"
    vista = ("--executor", "slurm", "--site", "tacc-vista", "site.partitions.gh.max_submit_jobs=15")
    proc = snowcat("run", demo, *vista, "--run-dir", run_dir)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    # the plan's site check refuses first (pipeline/plan), naming the queue, the count and the key
    assert "gh: 19 jobs, limit 15" in line and "partitions.gh.max_submit_jobs" in line, line
    assert "nothing was submitted" in line
    assert not _sbatch_calls(scheduler)
    assert not run_dir.exists()  # refused before the run directory was made: nothing half-written

    fewer = [f"stages.{s}.resume.max_continuations=0" for s in ("sft", "probe", "rl")]
    snowcat("run", demo, *fewer, *vista, "--run-dir", tmp_path / "r2", check=True)
    assert len(_sbatch_calls(scheduler)) == 10  # one job per stage


def test_refusal_mid_dag_cancels_what_was_queued_and_resume_submits_each_stage_once(snowcat, scheduler, tmp_path):
    run_dir = tmp_path / "run"
    proc = snowcat("run", _config(tmp_path), *PRESUBMITTED, "--run-dir", run_dir, env={"FAKE_SLURM_REFUSE_AFTER": "3"})
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert "sbatch refused a job" in line and "the 3 job(s) this submission had queued were cancelled" in line, line
    assert set(_task_states(scheduler).values()) == {"CANCELLED"}  # no orphans
    assert not any(r.get("job_ids") for r in RunDir.open(run_dir).state()["stages"].values())
    assert not (run_dir / "slurm" / "submitting.json").exists()

    snowcat("resume", run_dir, check=True)
    live = [j for j in _jobs(scheduler).values() if any(t["state"] == "PENDING" for t in j["tasks"].values())]
    names = sorted(j["name"].rsplit("-", 1)[-1] for j in live)
    # more (SFT): one array + 3 continuation arrays; tasks and last cannot continue from a checkpoint
    assert names == sorted(["tasks", "more", "more", "more", "more", "last"]), names


def test_an_interrupted_submission_is_cancelled_by_the_next(snowcat, scheduler, tmp_path):
    """`launch` killed between two sbatch calls leaves a journal of what it queued; the next launch
    cancels those jobs instead of leaving them unrecorded beside a second copy."""
    run_dir = tmp_path / "run"
    snowcat("run", _config(tmp_path), *JSC, "--run-dir", run_dir, env={"FAKE_SLURM_REFUSE_AFTER": "0"})
    orphan = tmp_path / "orphan.sh"
    orphan.write_text("#!/bin/bash\n#SBATCH --job-name=snowcat-x-tasks\n")
    fake.sbatch([str(orphan)])
    orphan_id = next(iter(_jobs(scheduler)))
    (run_dir / "slurm").mkdir(exist_ok=True)
    (run_dir / "slurm" / "submitting.json").write_text(json.dumps({"queued": [orphan_id]}))
    proc = snowcat("resume", run_dir, check=True)
    assert f"cancelled 1 job(s) an interrupted submission left unrecorded: {orphan_id}" in proc.stderr
    assert _task_states(scheduler)[orphan_id] == "CANCELLED"


def test_fan_out_beyond_max_array_size_is_split_into_arrays(snowcat, scheduler, tmp_path):
    run_dir = tmp_path / "run"
    cfg = _config(tmp_path, parts=25)
    snowcat(
        "run",
        cfg,
        *PRESUBMITTED,
        "site.max_array_size=10",
        "stages.more.resume.max_continuations=1",
        "--run-dir",
        run_dir,
        check=True,
    )
    jobs = _jobs(scheduler)
    arrays = sorted(j["array"].split("%")[0] for j in jobs.values() if j["array"])
    assert arrays == sorted(["0-9", "0-9", "0-4"] * 2), arrays  # three arrays, each with one continuation array
    state = RunDir.open(run_dir).state()["stages"]
    owners = [state[f"more[{i}]"]["own_job_ids"][0] for i in range(25)]
    assert len(set(owners)) == 25
    assert all(int(o.split("_")[1]) < 10 for o in owners)
    last_dep = jobs[state["last"]["job_ids"][0]]["dependency"]
    assert last_dep.count("afterany:") == 3, last_dep  # waits for every array's chain


def test_no_arrays_site_chains_separate_jobs_per_element(snowcat, scheduler, tmp_path):
    """Frontera has no job arrays: every element gets its own job and its own continuation jobs."""
    run_dir = tmp_path / "run"
    snowcat("run", _config(tmp_path), "--executor", "slurm", "--site", "tacc-frontera", "--run-dir", run_dir, check=True)
    assert not any(j["array"] for j in _jobs(scheduler).values())
    state = RunDir.open(run_dir).state()["stages"]
    owned = [state[f"more[{i}]"]["own_job_ids"] for i in range(3)]
    assert all(len(ids) == 4 for ids in owned)
    assert len({j for ids in owned for j in ids}) == 12  # nobody shares a job
    jobs = _jobs(scheduler)
    for ids in owned:
        for prev, cont in zip(ids, ids[1:]):
            assert jobs[cont]["dependency"] == f"afterany:{prev}"


LOGIN = """
name: login
seed: 4
stages:
  prep:
    kind: tasks
    where: login
    domains:
      arith: {count: 40, val_count: 5, difficulties: [1]}
  tasks:
    kind: tasks
    needs: [prep]
    domains:
      arith: {count: 40, val_count: 5, difficulties: [2]}
  report:
    kind: tasks
    where: login
    needs: [tasks]
    domains:
      arith: {count: 40, val_count: 5, difficulties: [3]}
  after:
    kind: tasks
    needs: [report]
    domains:
      arith: {count: 40, val_count: 5, difficulties: [3]}
"""


@pytest.mark.slow
def test_login_stages_run_in_the_submitting_process_before_the_jobs_that_need_them(snowcat, scheduler, tmp_path):
    """`where: login` (JSC's prestage: compute nodes have no internet): run by `run` itself when its
    inputs are done; one that needs a compute stage waits for a later `resume`, with what follows it."""
    run_dir = tmp_path / "run"
    proc = snowcat("run", write_config(tmp_path / "c.yaml", LOGIN), *JSC, "--run-dir", run_dir, check=True)
    run = RunDir.open(run_dir)
    assert run.is_done(Unit("prep", None)) and "running prep on this login node" in proc.stderr
    state = run.state()["stages"]
    assert state["tasks"]["job_ids"] and not state.get("report", {}).get("job_ids")
    assert not state.get("after", {}).get("job_ids")  # held behind the login stage that cannot run yet
    assert "report run(s) on the login node once their inputs are done" in proc.stderr
    assert _jobs(scheduler)[state["tasks"]["job_ids"][0]]["dependency"] is None  # prep is done already

    assert run_unit(run_dir, "tasks") == 0  # the compute job, as Slurm would run it
    proc = snowcat("resume", run_dir, check=True)
    assert RunDir.open(run_dir).is_done(Unit("report", None))
    assert RunDir.open(run_dir).state()["stages"]["after"]["job_ids"]


def test_login_stage_cannot_fan_out(snowcat, tmp_path):
    cfg = write_config(
        tmp_path / "c.yaml",
        LOGIN.replace("    where: login\n    domains", "    where: login\n    fan_out: {replica: [1, 2]}\n    domains", 1),
    )
    proc = snowcat("config", cfg)
    assert proc.returncode == 2 and "stages.prep.where: a login-node stage cannot fan out" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("site", "stage", "partition", "gpus", "cpus"),
    [
        ("tacc-vista", "tasks", "gg", 0, 144),  # CPU kinds on the CPU partition, whole nodes
        ("tacc-vista", "sft", "gh", 1, 72),
        ("jsc-juwels-booster", "select", "booster", 0, 48),  # no CPU partition in the profile
        ("jsc-juwels-booster", "rl", "booster", 4, 48),
        ("local", "sft", "cpu", 0, 1),  # nodes shared: one CPU per task unless asked
    ],
)
def test_resources_default_by_kind_and_site(site, stage, partition, gpus, cpus):
    cfg = config.load(Path(__file__).parent.parent / "configs" / "demo.yaml", ["executor.kind=slurm"], site=site)
    res = cfg.stages[stage].resources
    comps = list(res.components.values()) or [res]
    assert {(c.partition, c.gpus_per_node, c.cpus_per_task) for c in comps} == {(partition, gpus, cpus)}


@pytest.mark.slow
def test_where_jobs_may_queue_their_successor_no_continuation_is_queued_up_front(snowcat, scheduler, tmp_path, monkeypatch):
    """JSC lets a job call sbatch: the fan-out is one array and a held gate; a preempted element queues
    its own next job, and the last element to finish releases the gate the next stage waits on."""
    run_dir = tmp_path / "run"
    snowcat("run", _config(tmp_path), *JSC, "--run-dir", run_dir, check=True)
    run = RunDir.open(run_dir)
    state = run.state()["stages"]
    array, gate = state["more"]["job_ids"], state["more"]["gate"]
    assert len(array) == 1 and not state["more"]["continuations"]
    jobs = _jobs(scheduler)
    assert jobs[gate]["held"] and jobs[state["last"]["job_ids"][0]]["dependency"] == f"afterok:{gate}"
    assert [state[f"more[{i}]"]["own_job_ids"] for i in range(3)] == [[f"{array[0]}_{i}"] for i in range(3)]

    _in_job(monkeypatch, f"{array[0]}_0")
    job = StageJob(str(run_dir), "more", "chain", 3, self_continue=True)
    with pytest.raises(SystemExit) as stopped:
        job._continue(run, Unit("more", 0), 0)  # what the job does once element 0 has checkpointed
    assert stopped.value.code == 75
    own = run.state()["stages"]["more[0]"]["own_job_ids"]
    successor = _jobs(scheduler)[own[-1]]
    assert len(own) == 2 and successor["dependency"] == f"afterany:{array[0]}_0" and not successor["array"]
    assert run.state()["stages"]["more[0]"]["continuations_used"] == 1

    assert run_unit(run_dir, "tasks") == 0
    for i, job_id in ((0, own[-1]), (1, f"{array[0]}_1"), (2, f"{array[0]}_2")):
        _in_job(monkeypatch, job_id)
        assert _jobs(scheduler)[gate]["held"], f"released before element {i} finished"
        job(i)
    assert not _jobs(scheduler)[gate]["held"]  # released by the last element


def test_a_failed_element_cancels_the_gate_and_the_stages_after_it(snowcat, scheduler, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    snowcat("run", _config(tmp_path), *JSC, "--run-dir", run_dir, check=True)
    state = RunDir.open(run_dir).state()["stages"]
    _in_job(monkeypatch, f"{state['more']['job_ids'][0]}_1")
    with pytest.raises(RuntimeError):
        StageJob(str(run_dir), "more", "chain", 3, self_continue=True)(1)  # its input is not done
    states = _task_states(scheduler)
    assert states[state["more"]["gate"]] == "CANCELLED" and states[state["last"]["job_ids"][0]] == "CANCELLED"
    assert states[f"{state['more']['job_ids'][0]}_0"] == "PENDING"  # the other elements go on

    # resume: the failed element is queued again with a new gate; the running elements keep their jobs
    fake.set_state(f"{state['more']['job_ids'][0]}_1", "FAILED", "1:0")  # as Slurm records the job it ran in
    snowcat("resume", run_dir, check=True)
    after = RunDir.open(run_dir).state()["stages"]
    assert after["more"]["gate"] != state["more"]["gate"]
    assert after["more[0]"]["own_job_ids"] == state["more[0]"]["own_job_ids"]
    assert after["more[1]"]["own_job_ids"] != state["more[1]"]["own_job_ids"]
    new_last = _jobs(scheduler)[after["last"]["job_ids"][-1]]  # job_ids lists every submission, oldest first
    assert new_last["dependency"] == f"afterok:{after['more']['gate']}"


def test_an_image_under_resources_is_refused_naming_where_images_go(snowcat, tmp_path):
    cfg = write_config(
        tmp_path / "c.yaml", LOGIN.replace("    where: login\n    domains", "    resources: {image: /x.sif}\n    domains", 1)
    )
    proc = snowcat("config", cfg)
    assert proc.returncode == 2, proc.stderr
    assert "stages.prep.resources.image: a stage's image is stages.<name>.image" in proc.stderr


def test_a_preemption_notice_longer_than_the_walltime_is_refused(snowcat, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", LOGIN)
    proc = snowcat("config", cfg, "stages.tasks.resources.time_min=1", "stages.tasks.resume.signal_margin_s=60")
    assert proc.returncode == 2, proc.stderr
    assert "stages.tasks.resume.signal_margin_s: 60 s is not less than the walltime (1 min)" in proc.stderr


def test_a_preempted_hetjob_queues_its_successor_as_a_hetjob(snowcat, scheduler, tmp_path, monkeypatch):
    """RL (trainer + rollout components) in the chain form where jobs may call sbatch: the job's own
    successor is the same heterogeneous job, waiting on it."""
    demo = Path(__file__).parent.parent / "configs" / "demo.yaml"
    run_dir = tmp_path / "run"
    snowcat("run", demo, *JSC, "--run-dir", run_dir, check=True)
    run = RunDir.open(run_dir)
    main = run.record("rl")["job_ids"][0]
    assert run.record("rl")["gate"] and len(_jobs(scheduler)[main]["script"].split("#SBATCH hetjob")) == 2
    _in_job(monkeypatch, main)
    with pytest.raises(SystemExit):
        StageJob(str(run_dir), "rl", "chain", 3, self_continue=True)._continue(run, Unit("rl", None), 0)
    successor = _jobs(scheduler)[run.record("rl")["own_job_ids"][-1]]
    assert successor["dependency"] == f"afterany:{main}" and len(successor["tasks"]) == 2  # components +0, +1
    assert "--het-group=0,1" in successor["script"]


def test_a_unit_out_of_continuations_fails_and_stops_what_follows(snowcat, scheduler, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    snowcat("run", _config(tmp_path), *JSC, "stages.more.resume.max_continuations=1", "--run-dir", run_dir, check=True)
    run = RunDir.open(run_dir)
    array, gate = run.record("more")["job_ids"][0], run.record("more")["gate"]
    run.update_stage("more[2]", continuations_used=1)  # it was preempted once already
    _in_job(monkeypatch, f"{array}_2")
    with pytest.raises(RuntimeError, match="out of continuations"):
        StageJob(str(run_dir), "more", "chain", 1, self_continue=True)._continue(run, Unit("more", 2), 0)
    assert run.record("more[2]")["status"] == "failed"
    assert "stopped before its end 2 times; max_continuations=1" in run.record("more[2]")["error"]
    states = _task_states(scheduler)
    assert states[gate] == "CANCELLED" and states[run.record("last")["job_ids"][0]] == "CANCELLED"
    assert len(_jobs(scheduler)) == 4  # tasks, the array, its gate, last: no successor was queued


def test_a_swept_hetjob_stage_is_one_hetjob_per_variant(snowcat, scheduler, tmp_path):
    """Slurm has no arrays of heterogeneous jobs: a sweep of the demo's RL (trainer + rollout
    components) is one hetjob per variant, each its unit's own, and the stages after it wait for all."""
    demo = Path(__file__).parent.parent / "configs" / "demo.yaml"
    run_dir = tmp_path / "run"
    sweep = [
        "stages.rl.fan_out={estimator: [grpo, rloo_n]}",
        "stages.eval.checkpoints=['rl[estimator=grpo]:final', 'rl[estimator=rloo_n]:final']",
        "stages.eval_greedy.checkpoints=['rl[0]:final']",
        "stages.export.checkpoint='rl[1]:best'",
    ]
    snowcat("run", demo, *sweep, *JSC, "--run-dir", run_dir, check=True)
    run = RunDir.open(run_dir)
    jobs = _jobs(scheduler)
    owned = [run.record(f"rl[{i}]")["own_job_ids"] for i in range(2)]
    assert all(len(ids) == 1 for ids in owned) and owned[0] != owned[1]
    for (job_id,) in owned:
        assert not jobs[job_id]["array"] and len(jobs[job_id]["script"].split("#SBATCH hetjob")) == 2
    gate = run.record("rl")["gate"]
    assert f"afterok:{gate}" in jobs[run.record("eval")["job_ids"][0]]["dependency"].split(",")


def test_a_resume_before_accounting_lists_the_jobs_queues_nothing_twice(snowcat, scheduler, tmp_path, monkeypatch):
    """slurmdbd lists a job a moment after sbatch returned; a `resume` in that moment read liveness
    from sacct alone, saw nothing alive and queued the whole DAG again (found by the Slurm fault
    campaign, docs/faults.md). The controller's queue (squeue) counts too."""
    run_dir = tmp_path / "run"
    snowcat("run", _config(tmp_path), *JSC, "--run-dir", run_dir, check=True)
    calls = _sbatch_calls(scheduler)
    monkeypatch.setenv("FAKE_SLURM_ACCOUNTING_LAG", "1")
    again = snowcat("resume", run_dir, check=True)
    assert _sbatch_calls(scheduler) == calls, again.stderr
    assert set(_task_states(scheduler).values()) == {"PENDING"}  # nothing was replaced either


def test_a_stage_that_finishes_while_resume_plans_is_not_queued_again(snowcat, scheduler, tmp_path):
    """A resume right after `run` lists the stages not done; the first may finish before the plan is
    made (a tasks job takes a second). It was queued again, and the next stage replaced because its
    input had been (the local cluster's resume-right-after-run test, in CI). A stage done by the time
    of the plan is skipped: nothing queued, the next stage's jobs kept."""
    run_dir = tmp_path / "run"
    snowcat("run", _config(tmp_path), *JSC, "--run-dir", run_dir, check=True)
    calls = _sbatch_calls(scheduler)
    run = RunDir.open(run_dir)
    cfg = config.load(run.path / "config.yaml")
    dag = build(cfg)
    executor = make_executor("slurm", run, dag, cfg)
    first = next(iter(dag))
    fake.set_state(run.record(first.name)["job_ids"][0], "COMPLETED")
    run.mark_done(first.units[0], {"duration_s": 1.0}, {})  # it ended after the stages to run were listed
    assert executor.launch([n.name for n in dag]) == 0
    assert _sbatch_calls(scheduler) == calls
    assert set(_task_states(scheduler).values()) <= {"PENDING", "COMPLETED"}  # nothing cancelled either


def test_a_resume_that_cannot_tell_whether_jobs_are_queued_submits_nothing(snowcat, scheduler, tmp_path, monkeypatch):
    """Right after `run`, accounting does not list the jobs yet and squeue may time out on a busy
    controller (seen in CI at load 10): "no answer" was taken for "none queued" and the whole DAG
    was queued a second time. Resume now says it cannot tell, exit 2, and submits nothing."""
    run_dir = tmp_path / "run"
    snowcat("run", _config(tmp_path), *JSC, "--run-dir", run_dir, check=True)
    calls = _sbatch_calls(scheduler)
    monkeypatch.setenv("FAKE_SLURM_ACCOUNTING_LAG", "1")
    monkeypatch.setenv("FAKE_SLURM_SQUEUE_DOWN", "1")
    again = snowcat("resume", run_dir)
    assert again.returncode == 2 and "squeue did not answer" in again.stderr and "nothing was submitted" in again.stderr, (
        again.stderr
    )
    assert _sbatch_calls(scheduler) == calls
    monkeypatch.delenv("FAKE_SLURM_SQUEUE_DOWN")  # once the controller answers, the jobs are found queued
    snowcat("resume", run_dir, check=True)
    assert _sbatch_calls(scheduler) == calls


@pytest.mark.slow
def test_a_resume_right_after_a_cancel_waits_for_the_job_to_end_and_queues_it_again(snowcat, scheduler, tmp_path):
    """After scancel, sacct says CANCELLED while squeue still lists the job COMPLETING (its processes
    may be saving a checkpoint). A resume in that moment took the squeue row for a live job and
    queued nothing: the run stood still (tests/test_slurm.py's scancel test, in CI). It waits for the
    job to end, then queues the cancelled stage and what follows it again."""
    run_dir = tmp_path / "run"
    snowcat("run", _config(tmp_path), *JSC, "--run-dir", run_dir, check=True)
    calls, first = _sbatch_calls(scheduler), RunDir.open(run_dir).record("tasks")["job_ids"][0]
    fake.set_state(first, "CANCELLED", completing=2)
    again = snowcat("resume", run_dir, check=True)
    assert f"waiting for jobs {first} to finish ending (COMPLETING)" in again.stderr
    assert len(_sbatch_calls(scheduler)) > len(calls), again.stderr
    assert RunDir.open(run_dir).record("tasks")["job_ids"][-1] != first
