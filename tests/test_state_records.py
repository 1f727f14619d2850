"""Per-unit state records (issue 17, "Load"): each record is its own small files, written atomically
by its own writers; `RunDir.state()` assembles the dict every reader knows; a write that changes
nothing writes nothing; an older run's single state.json is still read."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from snowcat.benchmarks.fanout_state import CONFIG as FAN_OUT  # the benchmark's pipeline: a fan-out of tasks
from snowcat.pipeline import config as config_mod
from snowcat.pipeline.dag import Unit, build
from snowcat.pipeline.fsio import IO, atomic_write_json
from snowcat.pipeline.rundir import RunDir
from tests.conftest import write_config


@pytest.fixture
def fan_run(tmp_path) -> RunDir:
    cfg = config_mod.load(write_config(tmp_path / "fan.yaml", FAN_OUT.format(items=", ".join(map(str, range(50))))))
    return RunDir.create(cfg, tmp_path / "run")


def _files(run: RunDir) -> dict[str, int]:
    return {str(p.relative_to(run.path)): p.stat().st_mtime_ns for p in (run.path / "state").rglob("*") if p.is_file()}


def test_a_record_is_its_own_small_file_and_state_assembles_them(fan_run):
    run = fan_run
    assert run.state() == {"stages": {}} and not (run.path / "state.json").exists()
    run.update_stage("fan", status="submitted", job_ids=["100"], attempts=1)
    for i in range(50):
        run.update_stage(f"fan[{i}]", status="submitted", executor="slurm")
    before = dict(IO)
    run.update_stage("fan[7]", status="running", slurm={"state": "RUNNING", "nodes": "n1"})
    assert IO["files_written"] - before.get("files_written", 0) == 1  # that record's file, nothing else
    assert IO["bytes_written"] - before.get("bytes_written", 0) < 1000
    state = run.state()
    assert set(state) == {"stages"} and len(state["stages"]) == 51
    assert state["stages"]["fan[7]"] == {
        "status": "running",
        "attempts": 0,
        "job_ids": [],
        "executor": "slurm",
        "slurm": {"state": "RUNNING", "nodes": "n1"},
    }
    assert state["stages"]["fan"] == {"status": "submitted", "attempts": 1, "job_ids": ["100"]}
    assert run.record("fan[7]") == state["stages"]["fan[7]"] and run.record("fan[99]") == {}
    run.update_stage("fan", job_ids=["101", "100"])  # added to those recorded, in order, once
    assert run.record("fan")["job_ids"] == ["100", "101"]


def test_a_write_that_changes_nothing_writes_nothing(fan_run):
    run = fan_run
    run.update_stage("fan[3]", status="submitted", slurm={"state": "PENDING", "reason": "Priority"}, job_ids=["5"])
    files, before = _files(run), dict(IO)
    time.sleep(0.01)
    for _ in range(3):  # `status` polled again: sacct says the same
        run.update_stage("fan[3]", status="submitted", slurm={"reason": "Priority", "state": "PENDING"}, job_ids=["5"])
    run.update_stage("fan[4]", status="pending")  # what a record says before anything was set
    assert dict(IO) == before and _files(run) == files
    assert "fan[4]" not in run.state()["stages"]


def test_the_unit_runner_writes_its_own_part_without_the_state_lock(fan_run, tmp_path):
    """The runner (holding the unit's lock) never waits for the lock other writers take: another
    process holds .state.lock for the whole test."""
    run = fan_run
    run.update_stage("fan[1]", status="submitted", executor="slurm", job_ids=["7_1"])
    ready = tmp_path / "held"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time, pathlib; from filelock import FileLock; l = FileLock(sys.argv[1]); l.acquire(); "
            "pathlib.Path(sys.argv[2]).touch(); time.sleep(60)",
            str(run.path / ".state.lock"),
            str(ready),
        ]
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < deadline and holder.poll() is None
            time.sleep(0.05)
        t0 = time.monotonic()
        with run.unit_lock(Unit("fan", 1)):
            run.update_stage("fan[1]", status="running", started="t1", host="n1")
        assert time.monotonic() - t0 < 5  # the executor's writers would wait up to 60 s here
        assert (run.path / "state" / "unit" / "fan[1].json").is_file()
        assert run.record("fan[1]") == {
            "status": "running",
            "attempts": 0,
            "job_ids": ["7_1"],
            "executor": "slurm",
            "started": "t1",
            "host": "n1",
        }
    finally:
        holder.kill()
        holder.wait()
    run.update_stage("fan[1]", status="cancelled")  # not the unit's holder: the executor's part
    assert run.record("fan[1]")["status"] == "cancelled" and run.record("fan[1]")["started"] == "t1"


def test_the_value_set_last_wins_even_when_clocks_disagree(fan_run):
    """A field set in both parts reads as the one set last. A writer stamps after the newest stamp it
    read, so the runner's write after a login-node write made with a clock 1 h ahead still wins."""
    run = fan_run
    part = run.path / "state" / "executor" / "fan[2].json"
    ahead = time.time_ns() + 3600 * 10**9
    atomic_write_json(
        part, {"record": {"status": "submitted", "executor": "slurm"}, "set_ns": {"status": ahead, "executor": ahead}}
    )
    with run.unit_lock(Unit("fan", 2)):
        run.update_stage("fan[2]", status="running")
    assert run.record("fan[2]")["status"] == "running"
    run.update_stage("fan[2]", status="failed", error="exit 1")
    assert run.state()["stages"]["fan[2]"] == {
        "status": "failed",
        "attempts": 0,
        "job_ids": [],
        "executor": "slurm",
        "error": "exit 1",
    }


def test_an_older_runs_state_json_is_still_read_and_never_rewritten(fan_run):
    run = fan_run
    legacy = {
        "stages": {
            "tasks": {"status": "done", "attempts": 2, "job_ids": ["local:9"]},
            "fan[0]": {"status": "failed", "attempts": 1, "job_ids": ["10_0"]},
        }
    }
    (run.path / "state.json").write_text(json.dumps(legacy))
    assert run.state()["stages"] == legacy["stages"]
    run.update_stage("fan[0]", status="submitted", job_ids=["11_0"])
    assert run.record("fan[0]") == {"status": "submitted", "attempts": 1, "job_ids": ["10_0", "11_0"]}
    assert run.record("tasks") == {"status": "done", "attempts": 2, "job_ids": ["local:9"]}
    assert json.loads((run.path / "state.json").read_text()) == legacy


def test_stage_status_reads_only_its_own_record(fan_run):
    run = fan_run
    dag = build(run.config())
    run.update_stage("fan", status="submitted")
    run.update_stage("fan[0]", status="running")
    assert run.stage_status(dag, "fan") == ("submitted", [])
    assert run.stage_status(dag, "tasks") == ("pending", [])
