"""snowcat on the local Slurm cluster as an ordinary user, the way a user of a centre runs it: not
root (nobody, through setpriv, when the tests run as root), with a Python that user may run and the
installed packages (a venv of the system's Python of the same version that adds this checkout's
site-packages: the checkout's own venv may point at an interpreter under /root), a HOME, TMPDIR and
run directory of the user's own, a clean login environment, and the user's association in Slurm's
accounting (as a centre's admin adds it). The demo's DAG runs through: every job is the user's in
sacct, RL's hetjob forms its MPI world across the two nodes, every file of the run is the user's,
and `snowcat status` and `snowcat audit` pass as that user."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest

from snowcat.pipeline.doctor import closed_to_others
from snowcat.pipeline.rundir import RunDir
from snowcat.slurm import cluster
from tests.test_site_modes import DEMO_DAG
from tests.test_slurm import _why

pytestmark = pytest.mark.cluster

USER = "nobody"


def _user_python(home: Path) -> Path:
    """A venv at `home/venv` whose python any user may run, with this checkout's packages: made from
    the first interpreter of this Python's version that anyone may execute (pytest.skip if none)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    candidates = (sys.executable, f"/usr/bin/python{version}", shutil.which(f"python{version}") or "")
    base = next((os.path.realpath(c) for c in candidates if c and os.path.isfile(c) and closed_to_others(c) is None), None)
    if base is None:
        pytest.skip(f"no Python {version} that an ordinary user may run (tried {', '.join(c for c in candidates if c)})")
    site = Path(sysconfig.get_paths()["purelib"])  # this checkout's packages (and its editable install's finder)
    checkout = Path(__file__).resolve().parents[1]
    if closed_to_others(site) or closed_to_others(checkout):
        pytest.skip(f"{site} or {checkout} is not open to other users")
    venv = home / "venv"
    subprocess.run([base, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    (venv / "lib" / f"python{version}" / "site-packages" / "snowcat-installed.pth").write_text(
        f"import site; site.addsitedir({str(site)!r})\n"
    )
    return venv / "bin" / "python"


@pytest.fixture
def ordinary_user(slurm_cluster):
    """(command prefix, uid, home): the user's command line prefix (setpriv to nobody when the tests
    run as root, none otherwise), uid, and a directory of theirs under /tmp (TMPDIR of a CI run is
    root's alone); as root, the user's association on the cluster's account for the test."""
    home = Path(tempfile.mkdtemp(prefix="snowcat-user-", dir="/tmp"))
    env = {**os.environ, **slurm_cluster.env}
    root, added = os.geteuid() == 0, False
    try:
        if not root:  # the cluster's `up` associated this user
            yield [], os.geteuid(), home
            return
        entry = pwd.getpwnam(USER)
        os.chown(home, entry.pw_uid, entry.pw_gid)
        listed = ["sacctmgr", "-n", "-P", "list", "assoc", f"user={USER}", f"account={cluster.ACCOUNT}", "format=user"]
        added = not subprocess.run(listed, env=env, capture_output=True, text=True, check=True, timeout=60).stdout.strip()
        if added:  # as a centre's admin adds a user to a project
            add = ["sacctmgr", "-i", "add", "user", USER, f"account={cluster.ACCOUNT}", f"cluster={cluster.CLUSTER_NAME}"]
            subprocess.run(add, env=env, capture_output=True, check=True, timeout=60)
        yield ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--clear-groups"], entry.pw_uid, home
    finally:
        if added:
            subprocess.run(["sacctmgr", "-i", "delete", "user", USER], env=env, capture_output=True, timeout=60)
        shutil.rmtree(home, ignore_errors=True)


def test_an_ordinary_user_runs_the_demos_dag_on_the_cluster_and_owns_all_of_it(ordinary_user, slurm_cluster):
    prefix, uid, home = ordinary_user
    python = _user_python(home)
    (home / "tmp").mkdir()
    (home / "demo.yaml").write_text(DEMO_DAG)
    for path in (home / "tmp", home / "demo.yaml", *python.parents[1].rglob("*"), python.parents[1]):
        os.lchown(path, uid, -1)
    env = {  # a login shell's environment, nothing of this test process's
        "PATH": f"{python.parent}:/usr/bin:/bin",
        "HOME": str(home),
        "TMPDIR": str(home / "tmp"),
        "LANG": "C.UTF-8",
        **slurm_cluster.env,
        **{k: os.environ[k] for k in ("SNOWCAT_CI_NONCE",) if k in os.environ},  # CI's leftover check finds the jobs' processes
    }

    def snowcat(*args) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*prefix, python, "-m", "snowcat.pipeline.cli", *map(str, args)],
            cwd=home,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )

    run_dir = home / "run"
    # (SFT's 80 steps are the site test's, to be stopped mid-run; here a few will do)
    started = snowcat("run", "demo.yaml", "stages.sft.steps=8", "--executor", "slurm", "--site", "local", "--run-dir", run_dir)
    assert started.returncode == 0, started.stderr[-3000:]
    # asked as the user (a status asked by root would write root's files into the run)
    deadline = time.monotonic() + 900
    while True:
        asked = snowcat("status", run_dir, "--json")
        assert asked.returncode == 0, asked.stderr[-2000:]
        status = json.loads(asked.stdout)
        if {s["status"] for s in status["stages"].values()} <= {"done", "failed", "cancelled"}:
            break
        assert time.monotonic() < deadline, status
        time.sleep(10)
    failed = [name for name, s in status["stages"].items() if s["status"] != "done"]
    assert not failed, "\n".join(f"{name}: {status['stages'][name]}\n{_why(run_dir, name)}" for name in failed)

    # Every job of the run was the user's (hetjob components as J+0, J+1).
    state = RunDir.open(run_dir).state()["stages"]
    ids = sorted({j.split("_")[0] for r in state.values() for j in r.get("own_job_ids", [])})
    rows = subprocess.run(
        ["sacct", "-n", "-P", "-X", "-j", ",".join(ids), "-o", "jobid,user"],
        env={**os.environ, **slurm_cluster.env},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    assert len(rows) >= len(ids) and {row.split("|")[1] for row in rows} == {pwd.getpwuid(uid).pw_name}, rows
    rollout = json.loads((run_dir / "provenance" / "ranks" / "rl.rank1.json").read_text())
    assert (rollout["world_size"], rollout["role"]) == (2, "rollout"), rollout

    # Nothing of the run was written by anyone else (a step that needed root would show here).
    others = [str(p) for p in (run_dir, *run_dir.rglob("*")) if p.lstat().st_uid != uid]
    assert not others, others[:10]

    audit = snowcat("audit", run_dir)
    assert audit.returncode == 0, (audit.stdout[-2000:], audit.stderr[-2000:])
