"""The local Slurm cluster under a real site's rules (`snowcat cluster up --as tacc-vista`): Slurm
itself refuses what TACC refuses (job_submit/lua, QOS caps in slurmdbd, requeue off, whole nodes),
and `snowcat site detect` reads back the limits that were configured. One reconfiguration for the
whole module (a restart of slurmctld and the two slurmds), and back to the cluster's own rules at
the end: the other cluster tests share it."""

from __future__ import annotations

import subprocess

import pytest

from snowcat.slurm import cluster, detect
from snowcat.slurm.site import load_site

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def vista(slurm_cluster):
    info = cluster.up(slurm_cluster.root, site="tacc-vista")
    try:
        yield info
    finally:
        cluster.up(slurm_cluster.root)  # its own rules again: partitions cpu/gpu, requeue on, no filter, QOS deleted


def _sbatch(env, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["sbatch", "--parsable", *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_the_cluster_as_tacc_vista_refuses_what_vista_refuses_and_runs_the_rest(vista, slurm_env, tmp_path, monkeypatch):
    site = load_site("tacc-vista")
    assert vista.site == "tacc-vista" and vista.partitions == tuple(site.partitions)
    env = slurm_env
    quiet = ("-o", "/dev/null", "--wrap", "true")

    # Options TACC's scheduler does not accept: refused at submit, with the rule named.
    mem = _sbatch(env, "--mem=1G", *quiet)
    assert mem.returncode != 0 and "TACC Vista: --mem is not available" in mem.stderr
    gres = _sbatch(env, "--gres=gpu:1", *quiet)
    assert gres.returncode != 0 and "--gres, --gpus and --gpus-per-task are not supported" in gres.stderr

    # gh-dev's QOS: 3 jobs queued per user (qlimits MaxSubmit); the 4th is refused by slurmdbd's limits.
    held = [_sbatch(env, "-p", "gh-dev", "--hold", *quiet) for _ in range(3)]
    assert all(p.returncode == 0 for p in held), [p.stderr for p in held]
    fourth = _sbatch(env, "-p", "gh-dev", "--hold", *quiet)
    subprocess.run(["scancel", *(p.stdout.strip() for p in held)], env=env, timeout=30, check=True)
    assert fourth.returncode != 0 and "QOSMaxSubmitJobPerUserLimit" in fourth.stderr

    # A small job and its afterok successor run; inside the first, sbatch is refused (compute node).
    nested = tmp_path / "nested.out"
    first = _sbatch(
        env, "-p", "gh", "-t", "5", "-o", "/dev/null", "--wrap", f"sbatch --wrap true > {nested} 2>&1; echo rc=$? >> {nested}"
    )
    assert first.returncode == 0, first.stderr
    second = _sbatch(env, "-p", "gh", "-t", "5", f"--dependency=afterok:{first.stdout.strip()}", "--wait", *quiet, timeout=180)
    assert second.returncode == 0, second.stderr
    text = nested.read_text()
    assert "TACC Vista: sbatch is not available on compute nodes" in text and "rc=1" in text

    # What `snowcat site detect` reads back is what was configured from the profile.
    monkeypatch.setenv("SLURM_CONF", str(vista.slurm_conf))
    draft = detect.detect("vista-here")
    assert draft.values["requeue_allowed"] is False and draft.values["exclusive_nodes"] is True
    assert draft.values["sbatch_on_compute"] is False and draft.values["max_array_size"] == site.max_array_size
    assert draft.values["default_partition"] == "gh"
    keys = ("max_nodes", "max_time_min", "max_submit_jobs", "max_running_jobs", "max_nodes_per_user")
    for name, part in site.partitions.items():
        got = draft.values["partitions"][name]
        assert {k: got.get(k) for k in keys} == {k: getattr(part, k) for k in keys}, name
        assert set(got["sources"]) == set(keys)
    written = detect.write_draft(draft, tmp_path / "draft.yaml")
    assert load_site(written).partitions["gh-dev"].max_running_jobs == 1
