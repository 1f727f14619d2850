"""snowcat doctor / onboard: unit checks here, live checks against the local Slurm cluster (cluster mark)."""

import dataclasses
import os
from pathlib import Path

import pytest

from snowcat.pipeline import doctor
from snowcat.pipeline.doctor import FAIL, PASS, WARN, Check
from snowcat.slurm.site import Partition, SiteProfile, load_site

FAKE_APPTAINER_DIR = Path(__file__).parent / "fake_apptainer"


def local_profile():
    """The profile of the local test cluster, as B's slurm/sites/local.yaml describes it."""

    return load_site("local")


@pytest.mark.parametrize(
    "text, minutes",
    [("1:00:00", 60), ("2-00:00:00", 2880), ("30", 30), ("2-12", 3600), ("infinite", None), ("48:00:00", 2880), ("0:30", 1)],
)
def test_slurm_time_limits(text, minutes):
    assert doctor._minutes(text) == minutes


def test_run_root_under_home_fails_with_fix(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    checks = {c.name: c for c in doctor.check_run_root(profile(min_free_gb=0), home / "runs", home=str(home))}
    assert checks["run_root.home"].status == FAIL and "$PROJECT" in checks["run_root.home"].fix
    assert not (home / "runs").exists()  # doctor creates nothing
    ok = {
        c.name: c
        for c in doctor.check_run_root(
            profile(min_free_gb=0, shared_fs_required=False), tmp_path / "proj" / "runs", home=str(home)
        )
    }
    assert ok["run_root.home"].status == PASS and ok["run_root.writable"].status == PASS
    assert ok["run_root.shared"].status in (PASS, WARN)  # local disk: fine when the profile allows it
    strict = {c.name: c for c in doctor.check_run_root(profile(min_free_gb=0), tmp_path, home=str(home))}
    if strict["run_root.shared"].status != PASS:
        assert strict["run_root.shared"].status == FAIL and "parallel filesystem" in strict["run_root.shared"].fix


def test_scratch_purge_warning(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    checks = {
        c.name: c
        for c in doctor.check_run_root(
            profile(scratch=str(scratch), scratch_purge_days=10, min_free_gb=0), scratch / "runs", home="/nonexistent"
        )
    }
    assert checks["run_root.purge"].status == WARN and "10 days" in checks["run_root.purge"].detail


def test_apptainer_check(monkeypatch, tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert doctor.check_apptainer(profile(container_runtime="none")).status == WARN
    fail = doctor.check_apptainer(profile(container_runtime="apptainer", container_module="tacc-apptainer"))
    assert fail.status == FAIL and "module load tacc-apptainer" in fail.fix
    monkeypatch.setenv("PATH", f"{FAKE_APPTAINER_DIR}{os.pathsep}/usr/bin{os.pathsep}/bin")
    found = doctor.check_apptainer(profile(container_runtime="apptainer"))
    assert "apptainer version 1.3.6-fake" in found.detail
    assert found.status in (PASS, WARN)  # WARN: no GPU here to prove --nv


def test_staged_check(tmp_path):
    assert doctor.check_staged(None, []).status == PASS
    missing = doctor.check_staged(tmp_path, ["org/model"])
    assert missing.status == FAIL and "'org/model'" in missing.detail and "prestage" in missing.fix


def test_format_prints_fixes_and_onboard_uses_findings(tmp_path):
    checks = [
        Check(
            "account",
            FAIL,
            "account 'x' is not one of u's associations: u, proj1",
            "set account: proj1",
            {"accounts": ["proj1", "u"]},
        ),
        Check(
            "partitions",
            FAIL,
            "partition 'booster' does not exist",
            "pick one of: gpu",
            {"partitions": {"gpu": {"gpus_per_node": 4, "max_time_min": 60, "nodes": 2, "up": True}}},
        ),
        Check("internet", PASS, "a compute node cannot reach pypi.org:443", found={"internet_on_compute": False}),
    ]
    text = doctor.format_checks(checks)
    assert "FAIL  account" in text and "fix: set account: proj1" in text and "2 failed" in text
    override = doctor.onboard(
        profile(account="x", partitions={"booster": Partition(gpus_per_node=4)}), tmp_path / "runs", checks, user="u"
    )
    assert override == {
        "account": "proj1",
        "partitions": {"gpu": {"gpus_per_node": 4, "max_time_min": 60}},
        "run_root": str(tmp_path / "runs"),
        "internet_on_compute": False,
    }
    written = doctor.write_override(override, tmp_path / "override.yaml").read_text()
    assert "account: proj1" in written
    # No run root given: project storage from the environment, never $HOME.
    auto = doctor.onboard(profile(), None, [], user="u", env={"PROJECT": "/p/project/abc", "HOME": "/home/u"})
    assert auto["run_root"] == "/p/project/abc/u/snowcat"


# ----------------------------------------------------------------------- live, on the local cluster


@pytest.mark.cluster
def test_doctor_passes_on_local(slurm_env, tmp_path):
    checks = doctor.run_doctor(local_profile(), tmp_path / "runs", home="/nonexistent-home", job_wait_s=30)
    failed = [f"{c.name}: {c.detail}" for c in checks if c.status == FAIL]
    assert not failed, failed
    names = {c.name for c in checks}
    assert {"slurm", "partitions", "account", "hetjobs", "arrays", "mpi", "apptainer", "run_root.writable", "internet"} <= names


@pytest.mark.cluster
def test_doctor_fails_on_wrong_account_missing_partition_home_run_root(slurm_env, tmp_path):
    site = local_profile()
    real_partition = next(iter(doctor.profile_partitions(site)))
    wrong = _override(site, account="no-such-project", partitions={"no-such-partition": Partition(gpus_per_node=4)})
    home = tmp_path / "home"
    home.mkdir()
    checks = {c.name: c for c in doctor.run_doctor(wrong, home / "runs", home=str(home), jobs=False)}
    assert checks["account"].status == FAIL
    assert "no-such-project" in checks["account"].detail and "set account:" in checks["account"].fix
    assert checks["partitions"].status == FAIL and "'no-such-partition' does not exist" in checks["partitions"].detail
    assert real_partition in checks["partitions"].fix
    assert checks["run_root.home"].status == FAIL and checks["run_root.home"].fix
    # One wrong setting is reported once: the job checks fall back to what exists and still pass.
    assert checks["hetjobs"].status == PASS and checks["arrays"].status == PASS
    text = doctor.format_checks(list(checks.values()))
    assert text.count("fix:") >= 3
    override = doctor.onboard(wrong, tmp_path / "runs", list(checks.values()))
    assert override["account"] in checks["account"].found["accounts"]
    assert real_partition in override["partitions"]


def profile(**values) -> SiteProfile:
    """A site profile for one check: what the test sets, defaults for the rest."""
    return SiteProfile(name="test", default_partition="", **values)


def _override(site: SiteProfile, **values) -> SiteProfile:
    return dataclasses.replace(site, **values)


@pytest.mark.cluster
def test_doctor_requires_an_account_where_the_site_does(slurm_env):
    site = _override(local_profile(), account=None, account_required=True)
    check = doctor.check_account(site, os.environ.get("USER") or __import__("getpass").getuser())
    assert check.status == FAIL and "requires one" in check.detail
    assert "set account: snowcat" in check.fix  # the project account, not the user's own
