"""What a second process, a stale pid or a damaged file must not be able to corrupt (issue 19):
unit locks, safe cancel, the verified frozen config, lineage, secrets at the door, atomic dirs."""

import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from snowcat.pipeline import config as config_mod
from snowcat.pipeline import procid
from snowcat.pipeline.dag import Unit, build
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_dir, atomic_write_json, read_json, remove_leftovers, verify_manifest, write_manifest
from snowcat.pipeline.rundir import RunDir
from snowcat.slurm.jobside import StageJob
from tests.conftest import TINY, write_config
from tests.test_cli import SLOW, SMALL, _wait_for


@pytest.fixture
def small(tmp_path) -> Path:
    return write_config(tmp_path / "small.yaml", SMALL)


@pytest.fixture
def done_run(snowcat, small, tmp_path) -> Path:
    run_dir = tmp_path / "run"
    snowcat("run", small, "--run-dir", run_dir, check=True)
    return run_dir


def by_hand(run_dir: Path, stage: str) -> subprocess.CompletedProcess:
    """`python -m snowcat.stages RUN STAGE`, as docs/users.md tells a user to re-run one unit."""
    return subprocess.run(
        [sys.executable, "-m", "snowcat.stages", str(run_dir), stage], capture_output=True, text=True, timeout=300
    )


# --- one runner per unit ---------------------------------------------------------------------------


def test_a_unit_held_by_another_runner_is_refused_before_anything_is_written(small, tmp_path):
    run = RunDir.create(config_mod.load(small), tmp_path / "run")
    with run.unit_lock(Unit("tasks")):
        refused = by_hand(run.path, "tasks")
    assert refused.returncode == 2
    assert f"tasks is already being run (pid {os.getpid()} on {os.uname().nodename})" in refused.stderr
    assert run.state() == {"stages": {}} and not (run.path / "state").exists()  # no record written by the refused one
    assert not run.stage_dir("tasks").exists()

    assert by_hand(run.path, "tasks").returncode == 0  # the lock went with its holder
    assert run.is_done(Unit("tasks")) and not run.verify_unit(Unit("tasks"))


@pytest.mark.slow
def test_a_by_hand_unit_while_the_driver_runs_it_is_refused_and_the_run_stays_whole(snowcat, small, tmp_path):
    run_dir = tmp_path / "run"
    driver = snowcat.popen("run", small, *SLOW, "--run-dir", run_dir)
    record = lambda: RunDir(run_dir).record("tasks")  # noqa: E731
    assert _wait_for(lambda: "started" in record())  # the stage process holds the unit now
    second = by_hand(run_dir, "tasks")
    assert second.returncode == 2 and "tasks is already being run" in second.stderr, second.stderr
    assert driver.wait(timeout=300) == 0
    status = snowcat.status(run_dir)
    assert {s["status"] for s in status["stages"].values()} == {"done"}
    assert all(not s["problems"] for s in status["stages"].values())
    assert status["stages"]["tasks"]["attempts"] == 1


# --- cancel signals only this run's live processes --------------------------------------------------


def _decoy() -> subprocess.Popen:
    # its own process group and SIGINT honoured, as a unit's (the local executor resets SIGINT: a
    # test run in the background has it ignored)
    return subprocess.Popen(
        ["sleep", "120"], start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
    )


def _pretend(run_dir: Path, stage: str, **fields) -> None:
    assert RunDir(run_dir).record(stage)  # a record the run made
    RunDir(run_dir).update_stage(stage, **fields)


@pytest.mark.slow
def test_cancel_leaves_alone_a_recycled_pid_and_a_finished_stage(snowcat, done_run):
    recycled, finished = _decoy(), _decoy()
    try:
        old = procid.identify(recycled.pid) | {"start": procid.identify(recycled.pid)["start"] - 1}  # same pid, other process
        _pretend(done_run, "tasks", status="running", group=old)
        _pretend(done_run, "more", group=procid.identify(finished.pid))  # status stays "done"
        atomic_write_json(done_run / ".driver.pid", old)
        assert snowcat("cancel", done_run).returncode == 0
        time.sleep(0.5)
        assert recycled.poll() is None and finished.poll() is None  # neither was signalled
        assert snowcat.status(done_run)["stages"]["more"]["status"] == "done"
    finally:
        for p in (recycled, finished):
            p.kill()
            p.wait()


@pytest.mark.slow
def test_cancel_stops_a_live_unit_process_of_the_run(snowcat, done_run):
    unit = _decoy()
    try:
        _pretend(done_run, "more", status="running", group=procid.identify(unit.pid))
        (done_run / "stages" / "more" / "DONE").unlink()
        assert snowcat("cancel", done_run).returncode == 0
        assert unit.wait(timeout=10) == -signal.SIGINT
        assert snowcat.status(done_run)["stages"]["more"]["status"] == "cancelled"
    finally:
        unit.kill()
        unit.wait()


def test_process_identity_does_not_match_a_reused_pid():
    me = procid.identify()
    assert procid.alive(me)
    assert not procid.alive(me | {"start": me["start"] + 1})
    assert not procid.alive({"pid": me["pid"], "host": me["host"]})  # a bare pid is never trusted
    gone = subprocess.Popen(["true"])
    ident = procid.identify(gone.pid)
    gone.wait()
    assert ident is None or not procid.alive(ident)


# --- the frozen config ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_truncated_frozen_config_is_refused_not_resumed(snowcat, done_run):
    config = done_run / "config.yaml"
    text = config.read_text()
    config.write_text(text[: text.index("  more:")])  # still valid YAML: a run of one stage
    for command in ("resume", "status", "audit"):
        proc = snowcat(command, done_run)
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        assert f"{config}: differs from the config frozen at creation" in proc.stderr
    config.write_text(text)
    assert "all 2 stages done" in snowcat("resume", done_run, check=True).stderr


@pytest.mark.slow
def test_a_damaged_run_json_is_a_clear_error(snowcat, done_run):
    (done_run / "run.json").write_text('{"run_id": "run", "crea')
    proc = snowcat("status", done_run)
    assert proc.returncode == 2 and f"{done_run / 'run.json'}: damaged" in proc.stderr


# --- lineage -------------------------------------------------------------------------------------


def _rewrite_upstream(run_dir: Path) -> None:
    """tasks' outputs change and it is marked done again, as a re-run with other results would."""
    run = RunDir.open(run_dir)
    val = run_dir / "stages" / "tasks" / "val.parquet"
    val.write_bytes(val.read_bytes() + b"\0")
    run.mark_done(Unit("tasks"), run.metrics(Unit("tasks")), {})


@pytest.mark.slow
def test_a_changed_upstream_makes_downstream_stale_audit_fail_and_resume_recompute(snowcat, done_run):
    before = read_json(done_run / "stages" / "more" / "manifest.json")
    _rewrite_upstream(done_run)
    stages = snowcat.status(done_run)["stages"]
    assert stages["tasks"]["status"] == "done"
    assert stages["more"]["status"] == "stale" and "input tasks changed" in stages["more"]["problems"][0]

    audit = json.loads(snowcat("audit", done_run, "--json").stdout)
    lineage = [c for c in audit["checks"] if c["check"] == "lineage"]
    assert not audit["ok"] and [c["subject"] for c in lineage if not c["ok"]] == ["more"]

    resumed = snowcat("resume", done_run, check=True)
    assert "re-running it" in resumed.stderr
    stages = snowcat.status(done_run)["stages"]
    assert {s["status"] for s in stages.values()} == {"done"}
    assert stages["tasks"]["attempts"] == 1 and stages["more"]["attempts"] == 2
    (aside,) = (done_run / "stale").iterdir()  # the old outputs are kept, not deleted
    assert read_json(aside / "manifest.json") == before
    assert all(c["ok"] for c in json.loads(snowcat("audit", done_run, "--json").stdout)["checks"] if c["check"] == "lineage")


@pytest.mark.slow
def test_a_deleted_upstream_is_recomputed_and_so_is_everything_downstream(snowcat, done_run):
    shutil.rmtree(done_run / "stages" / "tasks")
    cfg = RunDir.open(done_run).config()
    assert RunDir.open(done_run).stale_stages(build(cfg)) == {"more": "input tasks changed since it ran"}
    snowcat("resume", done_run, check=True)
    stages = snowcat.status(done_run)["stages"]
    assert {s["status"] for s in stages.values()} == {"done"} and stages["more"]["attempts"] == 2


# --- secrets are refused at the door -------------------------------------------------------------


def test_a_password_in_an_override_is_refused_and_nothing_is_written(snowcat, small, tmp_path):
    password = "hunter2-but-longer"
    for command in (["run", small, "--run-dir", tmp_path / "run"], ["config", small]):
        proc = snowcat(*command, f"description=data from https://ada:{password}@data.example.org/x")
        assert proc.returncode == 2, proc.stderr
        assert "override description=...: description: holds a credential (url_password)" in proc.stderr
        assert password not in proc.stderr + proc.stdout
    assert not (tmp_path / "run").exists()


def test_a_config_resolving_to_a_secret_variable_is_refused(snowcat, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", SMALL + "description: ${oc.env:MY_API_TOKEN}\n")
    proc = snowcat("run", cfg, "--run-dir", tmp_path / "run", env={"MY_API_TOKEN": "abcdefghijklmnop12345"})
    assert proc.returncode == 2 and "holds the value of the secret variable MY_API_TOKEN" in proc.stderr
    assert "abcdefghijklmnop12345" not in proc.stderr and not (tmp_path / "run").exists()


def test_error_text_recorded_in_state_is_scrubbed(done_run):
    run = RunDir.open(done_run)
    run.update_stage("more", error="OSError: cannot open https://ada:s3cr3t-passw0rd@data.example.org/x")
    text = "".join(p.read_text() for p in (done_run / "state").rglob("*.json"))
    assert "s3cr3t-passw0rd" not in text and "<redacted>" in text


# --- atomic directories --------------------------------------------------------------------------


def test_atomic_dir_replacement_leaves_no_moment_without_the_directory(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_dir(target) as d:
        (d / "v").write_text("0")
    missing, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            if not (target / "v").is_file():
                missing.append(time.monotonic())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for i in range(1, 300):
            with atomic_dir(target) as d:
                (d / "nested").mkdir()
                (d / "nested" / "w").write_text(str(i))
                (d / "v").write_text(str(i))
    finally:
        stop.set()
        watcher.join()
    assert not missing
    assert (target / "v").read_text() == "299" and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_leftovers_of_a_killed_writer_are_cleaned_and_a_half_swapped_dir_put_back(tmp_path):
    root = tmp_path / "unit"
    (root / "checkpoints" / ".step_2.abc.tmp").mkdir(parents=True)  # a save cut short
    (root / ".metrics.json.x1.tmp").write_text("{")  # an atomic write cut short
    (root / "checkpoints" / ".step_1.old").mkdir()  # killed between the two renames of a replacement
    (root / "checkpoints" / ".step_1.old" / "w").write_text("complete")
    (root / "checkpoints" / ".step_3.old").mkdir()  # the replacement finished: only the old copy is left
    (root / "checkpoints" / "step_3").mkdir()
    (root / ".locks").mkdir()  # not a leftover
    removed = remove_leftovers(root)
    assert len(removed) == 4
    assert (root / "checkpoints" / "step_1" / "w").read_text() == "complete"
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["step_1", "step_3"]
    assert sorted(p.name for p in root.iterdir()) == [".locks", "checkpoints"]


def test_resume_cleans_leftovers_in_units_and_done_units_still_verify(snowcat, done_run):
    leftover = done_run / "stages" / "more" / ".train.parquet.zz.tmp"
    leftover.write_bytes(b"half")
    snowcat("resume", done_run, check=True)
    assert not leftover.exists()
    assert {s["status"] for s in snowcat.status(done_run)["stages"].values()} == {"done"}


def test_a_config_error_never_echoes_a_credential(snowcat, small):
    proc = snowcat("config", small, "stages.more.nokey=https://ada:hunter2-but-longer@data.example.org/x")
    assert proc.returncode == 2 and "nokey" in proc.stderr and "hunter2-but-longer" not in proc.stderr


def test_a_scheduler_job_waits_for_a_predecessor_still_being_killed(small, tmp_path):
    """A job resubmitted after scancel may start while the old process lives on (KillWait): the
    Slurm path waits for the lock (bounded) where a runner by hand refuses at once."""
    run = RunDir.create(config_mod.load(small), tmp_path / "run")
    finished = tmp_path / "predecessor-finished"
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from snowcat.pipeline.rundir import RunDir\n"
        "from snowcat.pipeline.dag import Unit\n"
        "with RunDir(sys.argv[1]).unit_lock(Unit('tasks')):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(1.5)\n"
        "    Path(sys.argv[2]).touch()  # the last thing it does while holding the unit\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", script, str(run.path), str(finished)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(UserError, match=r"tasks is already being run \(pid \d+ on .*\); wait for it, or stop it \(waited 0s\)"):
        with run.unit_lock(Unit("tasks"), wait_s=0.2):
            pass
    with run.unit_lock(Unit("tasks"), wait_s=60):
        assert finished.exists()  # acquired only after the predecessor's last step
    assert holder.wait(timeout=30) == 0


def test_a_stale_unit_run_by_hand_is_refused_with_the_remedy(done_run):
    _rewrite_upstream(done_run)
    proc = by_hand(done_run, "more")
    assert proc.returncode == 2
    assert f"more: done, but input(s) tasks changed since; `snowcat resume {done_run}`" in proc.stderr
    assert (done_run / "stages" / "more" / "DONE").is_file()  # nothing was touched


def test_a_nested_manifest_is_part_of_the_unit_and_a_damaged_one_is_a_problem_not_a_crash(tmp_path):
    unit = tmp_path / "unit"
    (unit / "checkpoints" / "step_1").mkdir(parents=True)
    (unit / "checkpoints" / "step_1" / "w.bin").write_bytes(b"weights")
    write_manifest(unit / "checkpoints" / "step_1")
    write_manifest(unit)
    assert not verify_manifest(unit)
    nested = unit / "checkpoints" / "step_1" / "manifest.json"
    nested.write_text('{"files": {}}')  # a checkpoint's own manifest emptied: the unit's manifest sees it
    assert verify_manifest(unit) == [f"{nested}: sha256 differs from manifest"]
    nested.write_bytes(b"\xff{")  # not even JSON: the checkpoint is unverified, nothing raises
    assert verify_manifest(nested.parent) == [f"{nested}: damaged (not a manifest)"]


# --- a notice before the stage is ready ------------------------------------------------------------

EARLY_NOTICE = """\
import os, signal, sys
from snowcat.pipeline.context import catch_notice_early
catch_notice_early()  # what `python -m snowcat.stages` and a Slurm job's StageJob do first
os.kill(os.getpid(), signal.SIGUSR2)  # Slurm's --signal, sent early: the stage has not started yet
from snowcat.pipeline.runner import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_notice_that_comes_before_the_stage_starts_is_kept_not_fatal(tmp_path):
    """Slurm may send `--signal` up to a minute early: a job warned while it is still starting
    checkpoints at its first step boundary and asks to be continued (exit 75), where SIGUSR2's default
    action used to kill it; the continued unit ends with the uninterrupted run's weights."""
    cfg = write_config(tmp_path / "tiny.yaml", TINY.replace("steps: 20", "steps: 4").replace("save_every: 10", "save_every: 0"))
    runs = {}
    for name in ("straight", "warned"):
        runs[name] = RunDir.create(config_mod.load(cfg), tmp_path / name).path
        assert by_hand(runs[name], "tasks").returncode == 0
    assert by_hand(runs["straight"], "sft").returncode == 0

    warned = subprocess.run(
        [sys.executable, "-c", EARLY_NOTICE, str(runs["warned"]), "sft"], capture_output=True, text=True, timeout=300
    )
    assert warned.returncode == 75, warned.stderr[-2000:]
    ckpts = runs["warned"] / "stages" / "sft" / "checkpoints"
    assert (ckpts / "step_000000").is_dir() and not (ckpts / "final").exists()
    assert RunDir.open(runs["warned"]).record("sft")["status"] == "preempted"

    assert by_hand(runs["warned"], "sft").returncode == 0  # the continuation
    final = {r: (runs[r] / "stages" / "sft" / "checkpoints" / "final" / "model.safetensors").read_bytes() for r in runs}
    assert final["warned"] == final["straight"]


def test_the_stage_entry_points_catch_the_notice_before_anything_else():
    """The two ways a stage process starts: the notice handler is the first thing each installs."""
    main = (Path(__file__).resolve().parent.parent / "stages" / "__main__.py").read_text()
    assert main.index("catch_notice_early()") < main.index("from snowcat.pipeline.runner")
    first = next(line.strip() for line in inspect.getsource(StageJob.__call__).splitlines()[1:] if line.strip())
    assert first.startswith("catch_notice_early()")
