"""The CLI end to end on the local executor: run, status, idempotent re-runs, errors, kill + resume."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from snowcat.pipeline import cli
from snowcat.pipeline.doctor import write_override
from snowcat.pipeline.fsio import read_json, sha256_file
from snowcat.pipeline.rundir import RunDir
from snowcat.stages.registry import KINDS
from tests.conftest import write_config

SMALL = """
name: small
seed: 11
stages:
  tasks:
    kind: tasks
    domains:
      closure: {count: 300, val_count: 30, difficulties: [1, 2, 3]}
      arith: {count: 300, val_count: 30, difficulties: [2]}
  more:
    kind: tasks
    needs: [tasks]
    domains:
      arith: {count: 100, val_count: 10, difficulties: [3]}
"""

# Big enough that the tasks stage runs for several seconds: time to kill it mid-stage.
SLOW = ["stages.tasks.domains.closure.count=40000", "stages.tasks.domains.closure.val_count=100"]


@pytest.fixture
def small(tmp_path) -> Path:
    return write_config(tmp_path / "small.yaml", SMALL)


def _hashes(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): sha256_file(p) for p in sorted((run_dir / "stages").rglob("*.parquet"))}


def test_run_then_status_then_idempotent_rerun(snowcat, small, tmp_path):
    run_dir = tmp_path / "run"
    proc = snowcat("run", small, "--run-dir", run_dir)
    assert proc.returncode == 0, proc.stderr
    status = snowcat.status(run_dir)
    assert status["run_id"] == "run"
    assert {s["status"] for s in status["stages"].values()} == {"done"}
    assert status["stages"]["tasks"]["metrics"]["val"] == 60
    manifest = read_json(run_dir / "stages" / "tasks" / "manifest.json")["files"]
    assert set(manifest) >= {"train.parquet", "val.parquet", "metrics.json"}
    assert (run_dir / "config.yaml").is_file() and (run_dir / "logs" / "tasks.log").is_file()

    again = snowcat("run", small, "--run-dir", run_dir)
    assert again.returncode == 0 and "all 2 stages done" in again.stderr
    assert snowcat.status(run_dir)["stages"]["tasks"]["attempts"] == 1  # nothing re-ran


@pytest.mark.slow
def test_status_is_one_line_per_stage_in_80_columns_and_in_a_log(snowcat, small, tmp_path):
    """An 80-column terminal and a non-TTY log (rich's 80 columns) get one line per stage, no
    line past 80 characters, the named columns whole and metrics too long ending in "…"."""
    run_dir = tmp_path / "run"
    snowcat("run", small, "--run-dir", run_dir, check=True)
    stages = snowcat.status(run_dir)["stages"]
    logged = snowcat("status", run_dir, env={"COLUMNS": "80"}, check=True).stdout
    code, screen = snowcat.terminal("status", run_dir, columns=80)
    assert code == 0
    for text in (logged, re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen)):  # the terminal's colours aside
        lines = text.rstrip("\n").splitlines()
        assert max(len(line.rstrip("\r")) for line in lines) <= 80, text
        rows = [line for line in lines if line.startswith("│")]
        assert [r.split("│")[1].strip() for r in rows] == list(stages), text  # one row each, names whole
        assert any(r.rstrip().rstrip("│").rstrip().endswith("…") for r in rows), text  # the tasks metrics do not fit
    wide = snowcat("status", run_dir, env={"COLUMNS": "250"}, check=True).stdout
    assert "…" not in wide and "val=60" in wide


@pytest.mark.slow
def test_changed_output_is_reported_not_reused(snowcat, small, tmp_path):
    run_dir = tmp_path / "run"
    snowcat("run", small, "--run-dir", run_dir, check=True)
    with open(run_dir / "stages" / "more" / "train.parquet", "ab") as f:
        f.write(b"tampered")
    status = snowcat.status(run_dir)
    assert status["stages"]["more"]["status"] == "modified"
    assert "more/train.parquet" in status["stages"]["more"]["problems"][0]
    assert status["stages"]["tasks"]["status"] == "done"
    proc = snowcat("resume", run_dir)
    assert proc.returncode == 2 and "train.parquet" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_same_seed_same_outputs_across_runs(snowcat, small, tmp_path):
    snowcat("run", small, "--run-dir", tmp_path / "a", check=True)
    snowcat("run", small, "--run-dir", tmp_path / "b", check=True)
    snowcat("run", small, "seed=12", "--run-dir", tmp_path / "c", check=True)
    assert _hashes(tmp_path / "a") == _hashes(tmp_path / "b")
    assert _hashes(tmp_path / "a") != _hashes(tmp_path / "c")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["missing.yaml"], "missing.yaml: config file not found"),
        (["{small}", "stages.tasks.bogus=1"], "stages.tasks.bogus"),
        (["{small}", "seed=notanumber"], "seed"),
        (["{small}", "stages.tasks.needs=[more]"], "cycle in needs"),
        (["{small}", "stages.more.kind=warp"], "unknown stage kind 'warp'"),
        (["{small}", "stages.more.needs=[nowhere]"], "unknown stage 'nowhere'"),
    ],
)
def test_user_errors_one_line_exit_2_nothing_written(snowcat, small, tmp_path, args, fragment):
    args = [a.replace("{small}", str(small)) for a in args]
    proc = snowcat("run", *args, "--run-dir", tmp_path / "run")
    assert proc.returncode == 2
    assert fragment in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".run")]  # no half-built temp dir


def test_config_help_lists_every_stage_kind(capsys):
    # from the registry (stages/registry.py), one line each: name and what it does
    with pytest.raises(SystemExit):
        cli.main(["config", "--help"])
    lines = capsys.readouterr().out.splitlines()
    assert [f"  {k.name:<10} {k.summary}" for k in KINDS.values()] == lines[-len(KINDS) :]


def test_dry_run_writes_nothing(snowcat, small, tmp_path):
    proc = snowcat("run", small, "--dry-run", "--run-dir", tmp_path / "run")
    assert proc.returncode == 0 and "tasks" in proc.stdout and "more" in proc.stdout
    assert not (tmp_path / "run").exists()


def _wait_for(predicate, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_sigkill_mid_stage_then_resume_matches_uninterrupted(snowcat, small, tmp_path):
    killed = tmp_path / "killed"
    proc = snowcat.popen("run", small, *SLOW, "--run-dir", killed)

    def tasks_record() -> dict:
        return RunDir(killed).record("tasks")

    # Inside the stage: its own process records `started` once it has loaded the run and is about to
    # run the stage body (the executor's "running" record, made when it spawns the process, has none).
    assert _wait_for(lambda: tasks_record().get("status") == "running" and "started" in tasks_record())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "stages" / "tasks" / "DONE").exists()

    status = snowcat.status(killed)
    assert status["stages"]["tasks"]["status"] == "failed"  # its process died with the driver
    snowcat("resume", killed, check=True)

    straight = tmp_path / "straight"
    snowcat("run", small, *SLOW, "--run-dir", straight, check=True)
    assert _hashes(killed) == _hashes(straight) and _hashes(killed)
    assert {s["status"] for s in snowcat.status(killed)["stages"].values()} == {"done"}


@pytest.mark.slow
def test_concurrent_driver_is_refused(snowcat, small, tmp_path):
    run_dir = tmp_path / "run"
    first = snowcat.popen("run", small, *SLOW, "--run-dir", run_dir)
    assert _wait_for(lambda: (run_dir / ".driver.pid").exists())
    second = snowcat("resume", run_dir)
    assert second.returncode == 2 and "another snowcat process" in second.stderr
    assert first.wait(timeout=300) == 0
    assert RunDir(run_dir).state()["stages"]["tasks"]["status"] == "done"


@pytest.mark.slow
def test_cancel_stops_a_local_run(snowcat, small, tmp_path):
    run_dir = tmp_path / "run"
    first = snowcat.popen("run", small, *SLOW, "--run-dir", run_dir)
    assert _wait_for(lambda: RunDir(run_dir).record("tasks").get("status") == "running")
    assert snowcat("cancel", run_dir).returncode == 0
    assert first.wait(timeout=60) != 0
    assert snowcat.status(run_dir)["stages"]["tasks"]["status"] == "cancelled"
    snowcat("resume", run_dir, check=True)
    assert {s["status"] for s in snowcat.status(run_dir)["stages"].values()} == {"done"}


@pytest.mark.parametrize("umask", [0o002, 0o027])
def test_run_files_honour_the_umask(snowcat, small, tmp_path, umask):
    """A project group on a shared filesystem reads (audits, reproduces) a colleague's run as far as
    the umask allows; mkstemp/mkdtemp alone would make every file 0600 and directory 0700."""
    old = os.umask(umask)
    try:
        snowcat("run", small, "--run-dir", tmp_path / "run", check=True)
    finally:
        os.umask(old)
    paths = [tmp_path / "run", *(tmp_path / "run").rglob("*")]
    files = [p for p in paths if p.is_file() and not p.name.endswith(".lock")]  # filelock sets its own mode
    dirs = [p for p in paths if p.is_dir()]
    assert len(files) > 10 and len(dirs) > 3
    assert {oct(p.stat().st_mode & 0o777) for p in files} == {oct(0o666 & ~umask)}
    assert {oct(p.stat().st_mode & 0o777) for p in dirs} == {oct(0o777 & ~umask)}


# ----------------------------------------------------------------------- where runs go, site from the environment


ONE_STAGE = """
name: one
stages:
  tasks:
    kind: tasks
    domains:
      arith: {count: 20, val_count: 4, difficulties: [2]}
"""


@pytest.fixture
def one(tmp_path, monkeypatch) -> Path:
    """A one-stage config, in an environment that selects no site, account or storage."""
    for var in ("SNOWCAT_SITE", "SBATCH_ACCOUNT", "PROJECT", "WORK"):
        monkeypatch.delenv(var, raising=False)
    return write_config(tmp_path / "one.yaml", ONE_STAGE)


@pytest.mark.slow
def test_a_run_with_a_site_goes_under_the_profiles_run_root(snowcat, one, tmp_path):
    """No --run-dir: the run lands under the site profile's run_root, its variables expanded here;
    a run_root the config sets wins; an unset variable is one line naming the key and the variable."""
    env = {"PROJECT": str(tmp_path / "project"), "USER": "alice"}
    proc = snowcat("run", one, "--site", "jsc-juwels-booster", "--executor", "local", env=env)
    assert proc.returncode == 0, proc.stderr
    runs = list((tmp_path / "project" / "alice" / "snowcat" / "runs").iterdir())
    assert len(runs) == 1 and (runs[0] / "config.yaml").is_file() and not (tmp_path / "logs").exists()
    assert snowcat.status(runs[0])["stages"]["tasks"]["status"] == "done"

    mine = tmp_path / "mine"
    proc = snowcat("run", one, "run_root=" + str(mine), "--site", "jsc-juwels-booster", "--executor", "local", env=env)
    assert proc.returncode == 0 and len(list(mine.iterdir())) == 1  # the config's run_root wins over the profile's

    proc = snowcat("run", one, "--site", "jsc-juwels-booster", "--executor", "local", env={"USER": "alice"})
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "site jsc-juwels-booster: key run_root" in proc.stderr and "$PROJECT is not set" in proc.stderr
    assert "--run-dir" in proc.stderr and not (tmp_path / "$PROJECT").exists()
    # a dry run needs no site variables: the scripts keep them as placeholders (docs/sites.md)
    dry_args = ("--site", "jsc-juwels-booster", "--executor", "slurm", "--dry-run", "site.account=proj")
    dry = snowcat("run", one, *dry_args, env={"USER": "alice"})
    assert dry.returncode == 0 and "$PROJECT" in " ".join(dry.stdout.split()), dry.stderr
    given = snowcat("run", one, "--site", "jsc-juwels-booster", "--executor", "local", "--run-dir", tmp_path / "r")
    assert given.returncode == 0, given.stderr  # --run-dir needs no run_root


def test_site_and_account_from_the_environment(snowcat, one, tmp_path):
    """$SNOWCAT_SITE is the site when --site is not given (and the config names none); $SBATCH_ACCOUNT
    fills the account the profile and config leave empty; both are said, and recorded in run.json."""
    env = {"SNOWCAT_SITE": "jsc-juwels-booster", "SBATCH_ACCOUNT": "cjsc", "PROJECT": str(tmp_path / "p"), "USER": "alice"}
    dry = snowcat("run", one, "--executor", "slurm", "--dry-run", env=env)
    # JUWELS Booster requires an account: the dry run passes only because $SBATCH_ACCOUNT gave one.
    assert dry.returncode == 0, dry.stderr
    assert "site jsc-juwels-booster (from $SNOWCAT_SITE)" in dry.stderr
    assert "account cjsc (from $SBATCH_ACCOUNT" in dry.stderr
    without = snowcat("run", one, "--executor", "slurm", "--dry-run", env={**env, "SBATCH_ACCOUNT": ""})
    assert without.returncode == 2 and "account is required" in without.stderr

    run_dir = tmp_path / "run"
    snowcat("run", one, "--run-dir", run_dir, env=env, check=True)
    origin = read_json(run_dir / "run.json")["origin"]
    assert origin["site"] == "jsc-juwels-booster" and origin["site_from"] == "$SNOWCAT_SITE"
    assert origin["account_from"] == "$SBATCH_ACCOUNT"
    frozen = (run_dir / "config.yaml").read_text()
    assert "account: cjsc" in frozen and "name: jsc-juwels-booster" in frozen

    # --site wins over $SNOWCAT_SITE; a config that names its own site keeps it.
    shown = snowcat("config", one, "--site", "local", env=env, check=True).stdout
    assert "name: local" in shown and "account: snowcat" in shown  # local names its account: no env fill
    own = write_config(tmp_path / "own.yaml", "defaults:\n  - one.yaml\n  - site: local\n")
    assert "name: local" in snowcat("config", own, env=env, check=True).stdout


def test_onboard_override_is_a_usable_site(snowcat, one, tmp_path):
    """The file `snowcat onboard` writes (its base first) is accepted by --site FILE, by run and config."""
    path = write_override(
        {
            "base": "jsc-juwels-booster",
            "account": "cjsc",
            "run_root": str(tmp_path / "runs"),
            "partitions": {"booster": {"max_nodes": 8}},
        },
        tmp_path / "site.yaml",
    )
    assert "--site " + str(path) in path.read_text()  # the file says how to use it
    shown = snowcat("config", one, "--site", path, check=True).stdout
    assert "account: cjsc" in shown and "max_nodes: 8" in shown and "mpi_plugin: pspmix" in shown
    dry = snowcat("run", one, "--site", path, "--executor", "slurm", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert str(tmp_path / "runs") in "".join(dry.stdout.split())  # the run root the override set (rich may wrap it)


def test_a_command_loads_only_its_own_module():
    """Each command of cli._COMMANDS gets its arguments and code when it is named, and only then:
    `snowcat status` does not pay for the audit's, the card's or the planner's imports."""
    for name, (module, _, command, _) in cli._COMMANDS.items():
        commands = cli.parser([name])._subparsers._group_actions[0].choices
        func = commands[name].get_default("func")
        assert (func.__module__, func.__name__) == ("snowcat.pipeline" + module, command), name
        assert all(commands[other].get_default("func") is None for other in cli._COMMANDS if other != name), name
    code = "import sys, snowcat.pipeline.cli; print(sorted(sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    for module in (
        ".reports.audit",
        ".reports.card",
        ".reports.compare",
        ".reports.behaviour",
        ".doctor",
        ".plan.command",
    ):
        assert f"'snowcat.pipeline{module}'" not in loaded, module
