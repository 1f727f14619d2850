"""snowcat doctor / onboard: unit checks here, live checks against the local Slurm cluster (cluster mark)."""

import dataclasses
import getpass
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from snowcat.pipeline import doctor
from snowcat.pipeline.doctor import FAIL, PASS, WARN, Check
from snowcat.slurm import limits
from snowcat.slurm.site import Partition, SiteProfile, list_sites, load_site
from snowcat.stages.agent import trajectory

FAKE_APPTAINER_DIR = Path(__file__).parent / "fake_apptainer"


def local_profile():
    """The profile of the local test cluster, as B's slurm/sites/local.yaml describes it."""

    return load_site("local")


@pytest.mark.parametrize(
    "text, minutes",
    [("1:00:00", 60), ("2-00:00:00", 2880), ("30", 30), ("2-12", 3600), ("infinite", None), ("48:00:00", 2880), ("0:30", 1)],
)
def test_slurm_time_limits(text, minutes):
    assert limits.minutes(text) == minutes


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
        "default_partition": "gpu",  # none of the profile's partitions exist: a live one is the default
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
    limits_checks = {"limits.max_nodes", "limits.max_time", "limits.memory", "limits.cores", "limits.array_size"}
    assert limits_checks | {"limits.requeue", "limits.submit", "budget"} <= names


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


# ----------------------------------------------------------------------- live limits: parsing and checks

# `scontrol -o show partition` / `show node` as a JUWELS-Booster-like cluster prints them (abridged).
PARTITIONS = (
    "PartitionName=booster AllowGroups=ALL Default=NO QoS=normal DefaultTime=NONE MaxNodes=384 MaxTime=1-00:00:00 "
    "Nodes=jwb[0001-0936] State=UP TotalCPUs=89856 TotalNodes=936 MaxMemPerNode=UNLIMITED\n"
    "PartitionName=develbooster AllowGroups=ALL QoS=N/A MaxNodes=UNLIMITED MaxTime=02:00:00 Nodes=jwb[0001-0004] "
    "State=UP TotalNodes=4 MaxMemPerNode=400000\n"
)
NODES = (
    "NodeName=jwb0001 Arch=x86_64 CoresPerSocket=24 CPUTot=96 Gres=gpu:4 OS=Linux 4.18.0-513 #1 SMP Tue RealMemory=515000 "
    "MemSpecLimit=10000 Sockets=2 ThreadsPerCore=2 Partitions=booster,develbooster Reason=being fixed [root@2024]\n"
    "NodeName=jwb0002 Arch=x86_64 CoresPerSocket=24 CPUTot=96 RealMemory=512000 Sockets=2 Partitions=booster\n"
)
QOS = {"normal": (64, 24), "devel": (None, 2)}


def booster_live(**values) -> limits.LiveLimits:
    fields = dict(
        cluster="juwels",
        max_array_size=501,
        requeue=True,
        user="alice",
        account="cjsc",
        partitions=limits.partition_limits(PARTITIONS, NODES, QOS),
        qos=QOS,
        associations=(limits.Association("cjsc", qos=("normal",), max_submit=None),),
    )
    return limits.LiveLimits(**{**fields, **values})


def test_scontrol_and_sacctmgr_output_parse_into_live_limits():
    parts = limits.partition_limits(PARTITIONS, NODES, QOS)
    booster, devel = parts["booster"], parts["develbooster"]
    # MaxNodes, at most the partition's nodes; the smallest node's memory less MemSpecLimit (MiB -> GiB).
    assert (booster.max_nodes, booster.max_time_min, booster.mem_gb) == (384, 1440, (515000 - 10000) // 1024)
    assert (booster.cores_per_node, booster.cpus_per_node, booster.qos, booster.max_submit, booster.max_jobs) == (
        48,
        96,
        "normal",
        64,
        24,
    )
    # UNLIMITED MaxNodes is the partition's size; MaxMemPerNode caps the node memory; no QoS: no limits.
    assert (devel.max_nodes, devel.max_time_min, devel.mem_gb, devel.qos, devel.max_submit) == (
        4,
        120,
        400000 // 1024,
        None,
        None,
    )
    records = limits.parse_records(NODES)
    assert records[0]["OS"] == "Linux 4.18.0-513 #1 SMP Tue" and records[0]["Reason"] == "being fixed [root@2024]"
    assert limits.parse_config("MaxArraySize            = 1001\nJobRequeue = 0\n") == {"MaxArraySize": "1001", "JobRequeue": "0"}
    assert limits.parse_qos("normal|40|20\ngh||\n") == {"normal": (40, 20), "gh": (None, None)}
    assocs = limits.parse_associations("c1|proj||normal,long|long|30|\nc2|other||normal|||\nc1|proj|gh|gh||5|2\n", "c1")
    assert [a.account for a in assocs] == ["proj", "proj"]  # other clusters' associations left out
    assert assocs[0].job_qos() == "long" and assocs[0].max_submit == 30 and assocs[1].partition == "gh"
    assert limits.Association("x", qos=("gh",)).job_qos() == "gh"
    assert limits.Association("x", qos=("normal", "long")).job_qos() == "normal"
    assert limits.Association("x", qos=("a", "b")).job_qos() is None
    assert limits.minutes("UNLIMITED") is None and limits.minutes("2-12:30:00") == 3630


def test_submit_limit_is_the_tightest_known_and_names_its_source():
    vista = load_site("tacc-vista")  # gh: max_submit_jobs 40 in the profile; gg: none here (the profile has 40)
    vista = dataclasses.replace(
        vista, partitions={**vista.partitions, "gg": dataclasses.replace(vista.partitions["gg"], max_submit_jobs=None)}
    )
    live = limits.LiveLimits(
        account="A-ccsc",
        partitions={"gh": limits.PartitionLimits(qos="gh", max_submit=50), "gg": limits.PartitionLimits()},
        qos={"gh": (50, 20), "normal": (None, None)},
        associations=(limits.Association("A-ccsc", qos=("normal", "gh"), max_submit=45),),
    )
    assert limits.submit_limit(vista, "gh", live) == (40, "site profile tacc-vista: partitions.gh.max_submit_jobs")
    assert limits.submit_limit(vista, "gg", live) == (45, "sacctmgr: association A-ccsc MaxSubmitJobs")
    tight = dataclasses.replace(live, qos={"gh": (12, 20), "normal": (None, None)})
    tight = dataclasses.replace(tight, partitions={"gh": limits.PartitionLimits(qos="gh", max_submit=12)})
    assert limits.submit_limit(vista, "gh", tight) == (12, "sacctmgr: QoS gh of partition gh MaxSubmitPU")
    deaf = limits.LiveLimits(errors=("sacctmgr show qos: Connection refused",))
    assert limits.submit_limit(vista, "gh", deaf)[0] == 40  # the profile alone when sacctmgr does not answer
    none, why = limits.submit_limit(vista, "gg", deaf)
    assert none is None and "sacctmgr did not answer (sacctmgr show qos: Connection refused)" in why
    per_user = dataclasses.replace(live, associations=(limits.Association("A-ccsc", qos=("gh",)),))
    assert limits.submit_limit(vista, "gg", per_user) == (50, "sacctmgr: QoS gh (of association A-ccsc) MaxSubmitPU")


def test_limit_checks_fail_with_fixes_and_onboard_writes_a_profile_that_passes(tmp_path):
    site = load_site("jsc-juwels-booster")
    live = booster_live()
    checks = {c.name: c for c in doctor.check_node_limits(site, live)}
    checks |= {c.name: c for c in (doctor.check_array_size(site, live), doctor.check_requeue(site, live))}
    checks["limits.submit"] = doctor.check_submit_limits(site, live)
    memory = checks["limits.memory"]
    assert memory.status == FAIL and "'booster' allows 493 GiB per node, the profile says 512" in memory.detail
    assert "set partitions.booster.mem_gb: 493" in memory.fix and "set partitions.develbooster.mem_gb: 390" in memory.fix
    assert checks["limits.max_nodes"].status == PASS and checks["limits.max_time"].status == PASS
    assert checks["limits.cores"].status == PASS  # 48 cores (96 CPUs with hyperthreads)
    assert checks["limits.array_size"].status == FAIL and checks["limits.array_size"].fix == "set max_array_size: 501"
    assert checks["limits.requeue"].status == PASS  # chained jobs: nothing relies on requeue
    submit = checks["limits.submit"]
    assert submit.status == WARN and "MaxJobsPU 24" in submit.detail  # the QoS of the partition and of the association
    assert submit.fix == "set partitions.booster.max_submit_jobs: 64; set partitions.develbooster.max_submit_jobs: 64"
    assert "alice/cjsc: 64 jobs (sacctmgr: QoS normal (of association cjsc) MaxSubmitPU), 24 running" in submit.detail

    override = doctor.onboard(site, tmp_path / "runs", list(checks.values()), user="alice", env={})
    path = doctor.write_override({"base": "jsc-juwels-booster", **override}, tmp_path / "site.yaml")
    fixed = load_site(path)
    assert fixed.partitions["booster"].mem_gb == 493 and fixed.max_array_size == 501
    assert fixed.partitions["booster"].max_submit_jobs == 64 and fixed.partitions["booster"].gpus_per_node == 4
    again = [
        *doctor.check_node_limits(fixed, live),
        doctor.check_array_size(fixed, live),
        doctor.check_submit_limits(fixed, live),
    ]
    assert {c.name: c.status for c in again} == {c.name: PASS for c in again}

    # Overstated nodes, walltime and cores fail too; requeue relied on where the scheduler does not requeue warns.
    big = dataclasses.replace(
        site,
        requeue_allowed=True,
        partitions={
            "booster": dataclasses.replace(site.partitions["booster"], max_nodes=1000, max_time_min=2880, cpus_per_node=96)
        },
    )
    named = {c.name: c for c in doctor.check_node_limits(big, live)}
    assert named["limits.max_nodes"].fix == "set partitions.booster.max_nodes: 384"
    assert named["limits.max_time"].fix == "set partitions.booster.max_time_min: 1440"
    assert named["limits.cores"].fix == "set partitions.booster.cpus_per_node: 48"
    assert doctor.check_requeue(big, dataclasses.replace(live, requeue=False)).status == WARN
    # Nothing readable: a warning that says why, never a pass.
    deaf = limits.LiveLimits(errors=("scontrol show config: Unable to contact slurm controller",))
    for check in (*doctor.check_node_limits(site, deaf), doctor.check_array_size(site, deaf), doctor.check_requeue(site, deaf)):
        assert check.status == WARN and "Unable to contact" in check.detail, check
    assert doctor.check_submit_limits(site, deaf).status == WARN
    half = limits.LiveLimits(qos=QOS, errors=("scontrol show partition: timed out",))  # sacctmgr answered, scontrol not
    assert doctor.check_submit_limits(site, half).status == WARN and "timed out" in doctor.check_submit_limits(site, half).detail


def _tool(bindir: Path, name: str, script: str) -> None:
    path = bindir / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)


def test_budget_shown_from_the_sites_tool_or_skipped(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    monkeypatch.setattr(doctor, "TACCINFO", str(tmp_path / "no-taccinfo"))
    skipped = doctor.check_budget(profile(account="cjsc"))
    assert skipped.status == doctor.SKIP and "jutil" in skipped.detail and "taccinfo" in skipped.detail
    assert "1 skipped" in doctor.format_checks([skipped]) and doctor.exit_code([skipped]) == 0

    _tool(bindir, "jutil", 'echo "project  budget  used  granted"\necho "cjsc  cjsc  12000  500000"\necho "zam  zam  0  1"\n')
    shown = doctor.check_budget(profile(account="cjsc"))
    assert shown.status == PASS and "jutil: cjsc  cjsc  12000  500000" in shown.detail and "zam" not in shown.detail
    other = doctor.check_budget(profile(account="nope"))
    assert other.status == WARN and "'nope' does not appear" in other.detail
    _tool(bindir, "jutil", 'echo "jutil: not a member of any project" >&2\nexit 3\n')
    failing = doctor.check_budget(profile(account="cjsc"))
    assert failing.status == WARN and "not a member" in failing.detail and failing.fix
    (bindir / "jutil").unlink()
    taccinfo = tmp_path / "taccinfo"
    _tool(tmp_path, "taccinfo", 'echo "| A-ccsc   |  1000 | 2027-03-31 |"\n')
    monkeypatch.setattr(doctor, "TACCINFO", str(taccinfo))
    tacc = doctor.check_budget(profile(account="A-ccsc"))
    assert tacc.status == PASS and tacc.detail.startswith("taccinfo: | A-ccsc")


def test_site_pages_claim_only_what_doctor_checks():
    """docs/sites/NAME.md names, for each unverified profile key, the doctor check that checks it live
    (and says which keys no check covers); every check named is one doctor has."""
    names = {c.name for c in doctor.check_node_limits(load_site("local"), booster_live())}
    names |= {"limits.array_size", "limits.requeue", "limits.submit", "budget", "partitions", "account", "hetjobs"}
    names |= {"arrays", "mpi", "apptainer", "internet", "run_root.purge", "run_root.*"}
    for name in list_sites():
        site = load_site(name)
        page = (Path(__file__).parent.parent / "docs" / "sites" / f"{name}.md").read_text()
        checked = [(key, doctor.checked_by(site, key)) for key in site.unverified]
        assert {c for _, c in checked if c} <= names
        if not site.unverified:
            expected = "Unverified: none."
        else:
            expected = f"Unverified; `snowcat doctor --site {name}` checks these live (the check in brackets): " + (
                ", ".join(f"`{k}` ({c})" for k, c in checked if c) or "none"
            )
            expected += "."
            if any(c is None for _, c in checked):
                expected += " Not checked by doctor (confirm by hand): " + ", ".join(f"`{k}`" for k, c in checked if not c) + "."
        assert expected in page.splitlines(), f"docs/sites/{name}.md: expected the line\n{expected}"
    assert doctor.checked_by(load_site("tacc-vista"), "container_module") is None  # a module name: not checked
    assert doctor.checked_by(load_site("jsc-jupiter"), "container_module") == "apptainer"  # null: apptainer on PATH
    assert doctor.checked_by(load_site("local"), "partitions.gpu.mem_gb") == "limits.memory"


# ----------------------------------------------------------------------- live limits on the local cluster


@pytest.mark.cluster
def test_live_limits_of_the_local_cluster_and_an_overstated_profile(slurm_env, tmp_path, monkeypatch):
    """live_limits reads what slurm/cluster/slurm.conf sets; a profile that overstates nodes, walltime,
    memory, cores and array size fails a named check each with the live value as the fix, and the
    override `snowcat onboard` writes from it (base first) makes `snowcat doctor --site FILE` pass."""
    live = limits.live_limits()
    assert live.cluster == "snowcat" and live.max_array_size == 1001 and live.requeue is True and not live.errors
    assert live.account == "snowcat" and any(a.account == "snowcat" for a in live.associations)
    for name in ("cpu", "gpu"):
        part = live.partitions[name]
        assert (part.max_nodes, part.max_time_min, part.mem_gb, part.cores_per_node, part.nodes) == (2, 60, 7, 8, 2)
    assert "normal" in live.qos

    site = local_profile()
    gpu = dataclasses.replace(site.partitions["gpu"], max_nodes=3, max_time_min=120, mem_gb=64, cpus_per_node=16)
    over = _override(site, partitions={**site.partitions, "gpu": gpu}, max_array_size=5000)
    checks = {c.name: c for c in doctor.run_doctor(over, tmp_path / "runs", home="/nonexistent-home", jobs=False)}
    expected = {
        "limits.max_nodes": "set partitions.gpu.max_nodes: 2",
        "limits.max_time": "set partitions.gpu.max_time_min: 60",
        "limits.memory": "set partitions.gpu.mem_gb: 7",
        "limits.cores": "set partitions.gpu.cpus_per_node: 8",
        "limits.array_size": "set max_array_size: 1001",
    }
    for name, fix in expected.items():
        assert checks[name].status == FAIL and checks[name].fix == fix, checks[name]
    assert checks["limits.requeue"].status == PASS and checks["limits.submit"].status == PASS
    assert checks["budget"].status == doctor.SKIP  # no jutil/sbudget/taccinfo here

    # The same through the CLI: a hand-written override with those values, onboarded and checked again.
    for var in ("SNOWCAT_SITE", "SBATCH_ACCOUNT", "PROJECT", "WORK", "SCRATCH"):
        monkeypatch.delenv(var, raising=False)
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        "base: local\nmax_array_size: 5000\npartitions:\n  gpu: {max_nodes: 3, max_time_min: 120, mem_gb: 64, cpus_per_node: 16}\n"
    )
    cli = [sys.executable, "-m", "snowcat.pipeline.cli"]
    bad = subprocess.run(
        [*cli, "doctor", "--site", mine, "--no-jobs", "--run-root", tmp_path / "runs"], capture_output=True, text=True
    )
    assert bad.returncode == 1 and "FAIL  limits.memory" in bad.stdout and "fix: set partitions.gpu.mem_gb: 7" in bad.stdout
    out = tmp_path / "onboarded.yaml"
    onboard = subprocess.run(
        [*cli, "onboard", "--site", mine, "-o", out, "--no-jobs", "--run-root", tmp_path / "runs"], capture_output=True, text=True
    )
    assert onboard.returncode == 0, onboard.stderr
    written = out.read_text()
    assert "base: local" in written and f"--site {out}" in written
    fixed = load_site(out)
    assert (fixed.max_array_size, fixed.partitions["gpu"].mem_gb, fixed.partitions["gpu"].max_nodes) == (1001, 7, 2)
    assert fixed.partitions["cpu"] == site.partitions["cpu"] and fixed.account == "snowcat"
    good = subprocess.run(
        [*cli, "doctor", "--site", out, "--no-jobs", "--run-root", tmp_path / "runs"], capture_output=True, text=True
    )
    assert good.returncode == 0, good.stdout
    assert all(f"PASS  {name}" in good.stdout for name in expected)
    # Onboarding the override onto itself keeps it an override of local (never its own base).
    again = subprocess.run(
        [*cli, "onboard", "--site", out, "-o", out, "--no-jobs", "--run-root", tmp_path / "runs"], capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr
    assert "base: local" in out.read_text() and load_site(out).partitions["gpu"].mem_gb == 7


@pytest.mark.cluster
def test_submit_limits_read_from_a_qos_and_an_association(slurm_env):
    """A QoS (MaxSubmitPU 3, MaxJobsPU 2) as the default QoS of an association (MaxSubmitJobs 5) of
    this user under an account of its own — names unique to this test, removed afterwards; the
    snowcat account that other tests' jobs use is not touched."""
    tag = f"dr{os.getpid()}{uuid.uuid4().hex[:6]}"
    qos, account, user = f"q{tag}", f"a{tag}", getpass.getuser()

    def sacctmgr(*args: str, check: bool = True) -> None:
        proc = subprocess.run(["sacctmgr", "-i", *args], capture_output=True, text=True, env=slurm_env, timeout=60)
        assert proc.returncode == 0 or not check, proc.stdout + proc.stderr

    try:
        sacctmgr("add", "qos", qos, "MaxSubmitJobsPerUser=3", "MaxJobsPerUser=2")
        sacctmgr("add", "account", account)
        sacctmgr("add", "user", user, f"account={account}", f"qos=normal,{qos}", f"defaultqos={qos}", "maxsubmit=5")
        live = limits.live_limits(account=account)
        assert live.qos[qos] == (3, 2)
        assoc = live.association("cpu")
        assert assoc is not None and (assoc.job_qos(), assoc.max_submit) == (qos, 5)
        assert (live.max_submit_per_user, live.max_jobs_per_user) == (3, 2) and qos in live.max_submit_source
        site = _override(local_profile(), account=account)
        assert limits.submit_limit(site, "cpu", live) == (3, f"sacctmgr: QoS {qos} (of association {account}) MaxSubmitPU")
        cpu = dataclasses.replace(site.partitions["cpu"], max_submit_jobs=2)
        tighter = _override(site, partitions={**site.partitions, "cpu": cpu})
        assert limits.submit_limit(tighter, "cpu", live) == (2, "site profile local: partitions.cpu.max_submit_jobs")
        looser = _override(site, max_submit_jobs=10)
        check = doctor.check_submit_limits(looser, live)
        assert check.status == WARN and "the profile says 10" in check.detail
        assert check.fix == "set partitions.cpu.max_submit_jobs: 3; set partitions.gpu.max_submit_jobs: 3"
        assert limits.live_limits().max_submit_per_user is None  # the default account (snowcat) has no limit
    finally:
        sacctmgr("delete", "user", user, f"account={account}", check=False)
        sacctmgr("delete", "account", account, check=False)
        sacctmgr("delete", "qos", qos, check=False)
    left = subprocess.run(["sacctmgr", "-n", "-P", "show", "qos", "format=name"], capture_output=True, text=True, env=slurm_env)
    assert qos not in left.stdout.split()


def test_megatron_check_says_whether_the_backend_can_run_and_on_which_layers():
    present = doctor.check_megatron({"megatron-core": "0.16.1", "mbridge": "0.15.1"})
    assert present.status == doctor.PASS and "megatron-core 0.16.1" in present.detail and "local layers" in present.detail
    fused = doctor.check_megatron({"megatron-core": "0.16.1", "mbridge": "0.15.1", "transformer-engine": "2.8"})
    assert "Transformer Engine's fused layers" in fused.detail
    absent = doctor.check_megatron({"mbridge": "0.15.1"})
    assert absent.status == doctor.WARN and "megatron-core not installed" in absent.detail and "snowcat[megatron]" in absent.fix


def test_batch_reader_check_says_whether_the_compiled_check_is_in_use(monkeypatch):
    assert doctor.check_batch_reader().status == doctor.PASS  # the test install builds it
    monkeypatch.setattr(trajectory, "_wire", None)
    absent = doctor.check_batch_reader()
    assert absent.status == doctor.WARN and "not built" in absent.detail and "python3-dev" in absent.fix


@pytest.fixture
def open_dir():
    """A folder every user may pass through (pytest's tmp_path is under a folder of mode 700, and
    CI's TMPDIR too): under /tmp itself, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="snowcat-open-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def test_install_check_names_the_folder_that_closes_the_install_to_other_users(open_dir):
    """A venv whose python links to an interpreter under a folder closed to others (pyenv's under
    /root, mode 700) serves its owner only: a job of another user fails its exec."""
    base = open_dir / "base"
    (base / "bin").mkdir(parents=True)
    interpreter = base / "bin" / "python3"
    interpreter.write_text("")
    interpreter.chmod(0o755)
    venv = open_dir / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(interpreter)
    package = open_dir / "site-packages"
    package.mkdir()
    for p in (base, base / "bin", venv.parent, venv, package):
        p.chmod(0o755)
    assert doctor.check_install(str(venv / "python"), package).status == doctor.PASS

    base.chmod(0o700)
    closed = doctor.check_install(str(venv / "python"), package)
    assert closed.status == doctor.WARN and f"{base} (mode 700)" in closed.detail and str(interpreter) in closed.detail
    assert "every user may execute" in closed.fix
    base.chmod(0o755)
    package.chmod(0o750)
    assert (
        f"{package} (mode 750) closes the path to its snowcat package"
        in doctor.check_install(str(venv / "python"), package).detail
    )
