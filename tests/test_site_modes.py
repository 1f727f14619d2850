"""The local Slurm cluster under a real site's rules (`snowcat cluster up --as tacc-vista`, `--as
jsc-juwels-booster`): Slurm itself refuses what TACC refuses (job_submit/lua, QOS caps in slurmdbd,
requeue off, whole nodes), `snowcat site detect` reads back the limits that were configured, and
snowcat runs the demo's DAG under each site's rules: a chained continuation, an RL hetjob in one MPI
world, `snowcat resume` and `snowcat audit`. One reconfiguration per site (a restart of slurmctld and
the two slurmds; the tests are grouped by site), and back to the cluster's own rules after each: the
other cluster tests share it."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from snowcat.pipeline.rundir import RunDir
from snowcat.slurm import cluster, detect
from snowcat.slurm.site import load_site
from tests.conftest import write_config
from tests.test_slurm import _why, wait_status

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def site_rules(slurm_cluster, request):
    """The cluster under the rules of site `request.param` (parametrized indirectly: pytest runs the
    tests of one site together, so each site is configured once)."""
    info = cluster.up(slurm_cluster.root, site=request.param)
    try:
        yield info
    finally:
        cluster.up(slurm_cluster.root)  # its own rules again: partitions cpu/gpu, requeue on, no filter, QOS deleted


def _sbatch(env, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["sbatch", "--parsable", *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("site_rules", ["tacc-vista"], indirect=True)
def test_the_cluster_as_tacc_vista_refuses_what_vista_refuses_and_runs_the_rest(site_rules, slurm_env, tmp_path, monkeypatch):
    vista = site_rules
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


# The demo's DAG (configs/demo.yaml) at toy size: seconds of work per stage, so that what is measured
# is the site's rules at work. The torch engine samples (both profiles say vLLM for GPU nodes; its
# CPU build starts in ~20 s here). SFT has work enough to be stopped mid-run; probe and RL keep their
# default continuations (3), which Vista queues up front and JUWELS gates.
DEMO_DAG = """\
name: sitedemo
seed: 11
stages:
  tasks:
    kind: tasks
    domains:
      closure: {count: 60, val_count: 12, dev_count: 8, difficulties: [1, 2]}
      arith: {count: 60, val_count: 12, dev_count: 8, difficulties: [2]}
  sft:
    kind: sft
    needs: [tasks]
    model: demo-tiny
    tokenizer_vocab_size: 320
    seq_len: 64
    batch_rows: 4
    steps: 80             # a few seconds of steps: the notice after the second lands mid-run
    warmup_steps: 2
    save_every: 0          # a checkpoint only on the notice
    threads: 1
    eval_tasks: 4
    eval_max_new_tokens: 8
    resume: {strategy: chain, max_continuations: 1}
  probe:
    kind: probe
    needs: [tasks, sft]
    limit: 8
    attempts: 2
    band_max_pass: 2
    engine: torch
  select:
    kind: select
    needs: [tasks, probe]
    min_pass: 0            # whatever the toy SFT solves: RL needs tasks, not a useful band
    max_pass: 2
  rl:
    kind: rl
    needs: [tasks, sft, select]
    updates: 2
    tasks_per_update: 2
    attempts: 2
    max_tokens: 8
    lag: 1
    eval_every: 2
    eval_tasks: 4
    eval_attempts: 1
    save_every: 2
    threads: 1
    engine: torch
    resources:
      components:          # one hetjob, one MPI world: rank 0 trains, rank 1 rolls out
        trainer: {nodes: 1, tasks_per_node: 1}
        rollout: {nodes: 1, tasks_per_node: 1}
  eval:
    kind: evaluate
    needs: [tasks, sft, rl]
    checkpoints: ["sft:final", "rl:final"]
    limit: 8
    attempts: 1
    pass_k: [1]
    max_tokens: 8
    bootstrap_samples: 100
    engine: torch
  export:
    kind: export
    needs: [rl]
    probe_rows: 2
    probe_len: 16
    max_new_tokens: 8
  card:
    kind: card
    needs: [tasks, sft, probe, select, rl, eval, export]
"""
OVERRIDES = Path(__file__).resolve().parents[1] / "configs" / "sites"  # <site>-local.yaml: what the local nodes cannot be


def _jobs(env, ids: list[str]) -> dict[str, dict]:
    """sacct's allocation rows of these jobs (hetjob components as `J+0`, `J+1`), by job id."""
    fields = ("jobid", "jobname", "partition", "account", "alloccpus", "nodelist", "state")
    out = subprocess.run(
        ["sacct", "-n", "-P", "-X", "-j", ",".join(ids), "-o", ",".join(fields)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return {row["jobid"]: row for row in (dict(zip(fields, line.split("|"))) for line in out.splitlines() if line)}


@pytest.mark.parametrize("site_rules", ["tacc-vista", "jsc-juwels-booster"], indirect=True)
def test_the_demos_dag_runs_through_snowcat_under_the_sites_rules(site_rules, snowcat, slurm_env, tmp_path):
    """`snowcat run --executor slurm --site <site>-local.yaml` of the demo's DAG on the cluster running
    as that site: a `resume` while it is queued queues nothing twice; SFT, stopped mid-run by the
    notice, continues in a chained job (queued up front at TACC, where compute nodes may not call
    sbatch; queued by the stopped job itself at JSC, behind the stage's gate); RL runs as a hetjob of
    trainer and rollout in one MPI world on the two nodes; every job went where the site's rules put
    it (partition, account, whole nodes); the run passes `snowcat audit`."""
    profile = OVERRIDES / f"{site_rules.site}-local.yaml"
    site = load_site(profile)
    cfg = write_config(tmp_path / "demo.yaml", DEMO_DAG)
    run_dir = tmp_path / "run"
    snowcat("run", cfg, "--executor", "slurm", "--site", profile, "--run-dir", run_dir, env=slurm_env, check=True)
    run = RunDir.open(run_dir)
    queued = {name: (r["job_ids"], r["attempts"]) for name, r in run.state()["stages"].items() if "job_ids" in r}
    snowcat("resume", run_dir, env=slurm_env, check=True)
    assert {name: (r["job_ids"], r["attempts"]) for name, r in run.state()["stages"].items() if name in queued} == queued

    # The notice (SIGUSR2, as Slurm sends it `signal_margin_s` before the walltime) once SFT trains.
    history = run_dir / "stages" / "sft" / "metrics_history.jsonl"
    deadline = time.monotonic() + 600
    while not (history.is_file() and len(history.read_text().splitlines()) >= 2):
        assert time.monotonic() < deadline, f"SFT never trained: {run.state()['stages'].get('sft')}\n{_why(run_dir, 'sft')}"
        time.sleep(0.2)
    first_job = run.record("sft")["own_job_ids"][0]
    # where python runs in the batch step (TACC's launcher), the notice goes to the batch step (B:)
    batch = "--signal=B:USR2@" in (run_dir / "slurm" / "sft" / f"{first_job}_submission.sh").read_text()
    subprocess.run(
        ["scancel", *(["--batch"] if batch else []), "--signal=USR2", first_job], env=slurm_env, check=True, timeout=60
    )

    status = wait_status(run_dir, {"done", "failed", "cancelled"}, timeout=900)
    failed = [name for name, s in status["stages"].items() if s["status"] != "done"]
    assert not failed, "\n".join(f"{name}: {status['stages'][name]}\n{_why(run_dir, name)}" for name in failed)
    state = run.state()["stages"]

    # SFT: stopped once, continued from its checkpoint in a job of its own, every step trained once.
    sft = state["sft"]
    assert sft["continuations_used"] == 1 and sft["own_job_ids"][0] == first_job, sft
    steps = [json.loads(line)["step"] for line in history.read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 80, steps
    successor = sft["own_job_ids"][1]
    if site.sbatch_on_compute:  # JSC: the stopped job queued it (through the account filter); the gate let probe go
        assert sft["continuations"] == [] and successor not in sft["job_ids"], sft
        assert _jobs(slurm_env, [sft["gate"]])[sft["gate"]]["state"] == "COMPLETED"
    else:  # TACC: queued up front by `snowcat run`; nothing was submitted from a compute node
        assert sft["continuations"] == [successor], sft
    assert _jobs(slurm_env, [successor])[successor]["state"] == "COMPLETED"
    # Continuations queued up front that nobody needed (probe's, RL's): cancelled by their units, not
    # left pending against the queue's cap. JSC queues none.
    unused = [j for r in state.values() for j in r.get("continuations", [])[r.get("continuations_used", 0) :]]
    if site.sbatch_on_compute:
        assert unused == [], state
    else:
        ended = _jobs(slurm_env, unused)  # RL's as hetjob components, `J+0` and `J+1`
        assert unused and {j.split("+")[0] for j in ended} == set(unused), (unused, ended)
        # the states alone in the message: the rows' repr is cut before them
        assert all(row["state"].startswith("CANCELLED") for row in ended.values()), {j: r["state"] for j, r in ended.items()}

    # RL: one heterogeneous job, its two components on the two nodes, one MPI world of 2 ranks.
    script = next((run_dir / "slurm" / "rl").glob("*_submission.sh")).read_text()
    assert "#SBATCH hetjob" in script and f"--mpi={site.mpi_plugin} --het-group=0,1" in script
    rl_job = state["rl"]["slurm_job_id"]
    rollout = json.loads((run_dir / "provenance" / "ranks" / "rl.rank1.json").read_text())
    assert (rollout["world_size"], rollout["role"], rollout["slurm"]["job_id"]) == (2, "rollout", rl_job), rollout
    components = _jobs(slurm_env, [rl_job])
    assert sorted(components) == [f"{rl_job}+0", f"{rl_job}+1"], components
    assert sorted(c["nodelist"] for c in components.values()) == ["n1", "n2"], components
    assert json.loads((run_dir / "stages" / "rl" / "metrics.json").read_text())["updates"] == 2

    # Every job where the site's rules put it: its partitions (CPU stages on Vista's gg; the partition's
    # QOS holds Vista's per-queue caps, the job's own QOS stays `normal`), the account, a whole node each.
    ids = sorted({j.split("_")[0] for r in state.values() for j in r.get("own_job_ids", [])})
    deadline = time.monotonic() + 60  # DONE is written just before the job ends: the last stage's row lags
    while True:
        rows = [r for r in _jobs(slurm_env, ids).values() if r["state"] == "COMPLETED" or r["jobid"] == first_job]
        seen = {row["jobname"].removeprefix(f"snowcat-{run.run_id}-") for row in rows}
        if seen >= set(state) or time.monotonic() > deadline:
            break
        time.sleep(1)
    cpu_kinds = {"tasks", "select", "card"}
    for row in rows:
        stage = row["jobname"].removeprefix(f"snowcat-{run.run_id}-")
        want = site.cpu_partition if stage in cpu_kinds and site.cpu_partition else site.default_partition
        assert row["partition"] == want, row
        assert row["account"] == "snowcat" and row["alloccpus"] == str(cluster.CPUS_PER_NODE), row
    assert seen >= set(state), (seen, sorted(state))

    audit = snowcat("audit", run_dir, env=slurm_env)
    assert audit.returncode == 0, audit.stdout[-3000:]
