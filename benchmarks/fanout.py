"""What a wide fan-out costs the scheduler and the run directory, measured side by side.

    snowcat bench fanout [--sizes 10,1000] [--statuses 3] [--json FILE]

For a pipeline `tasks -> sft (fan-out N, resumable, chained continuations) -> last`:

1. the submission each site profile would send: sbatch calls, jobs (each array task and each
   continuation counts, as MaxSubmit counts them) per partition against the profile's submit limit,
   and whether snowcat refuses it before queueing anything;
   (JSC as it is, where a job queues its own successor, and as if it could not);
2. on JSC's profile, a real submission to a TEST DOUBLE scheduler (tests/fake_slurm: nothing runs;
   it answers sbatch/sacct/scancel/squeue from a JSON file, so this measures snowcat's side only):
   sbatch calls, then `snowcat status` K times: its wall time, scheduler calls and run-directory
   files it rewrote per call, and the ratio of N=max to N=min.

Numbers from a live cluster's controller are not part of this (the local cluster would run the jobs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from snowcat.pipeline import config, dag
from snowcat.pipeline.fsio import atomic_write_json
from snowcat.pipeline.rundir import RunDir
from snowcat.slurm.executor import SlurmExecutor
from snowcat.slurm.limits import LiveLimits, submit_limit
from snowcat.slurm.plan import Job

FAKE = Path(__file__).resolve().parent.parent / "tests" / "fake_slurm"
# (profile, overrides): JSC as it is (a job queues its successor) and as if its compute nodes could not
# call sbatch (continuations queued up front, as at TACC), Vista and Frontera (no arrays).
SITES = (
    ("jsc-juwels-booster", ()),
    ("jsc-juwels-booster", ("site.sbatch_on_compute=false",)),
    ("tacc-vista", ()),
    ("tacc-frontera", ()),
)

PIPELINE = """
name: fanout
seed: 1
stages:
  tasks:
    kind: tasks
  sft:
    kind: sft
    needs: [tasks]
    fan_out: {{replica: {parts}}}
  last:
    kind: tasks
    needs: [sft]
"""


def _config(root: Path, n: int, site: str, overrides: tuple[str, ...]):
    path = root / f"fanout-{n}.yaml"
    path.write_text(PIPELINE.format(parts=list(range(n))))
    return config.load(path, ["executor.kind=slurm", "site.account=proj", *overrides], site=site)


def plan(root: Path, n: int, site: str, overrides: tuple[str, ...] = ()) -> dict:
    """The submission a site would get, counted without submitting (the executor's own planning),
    against the profile's submit limits only (no cluster is asked)."""
    cfg = _config(root, n, site, overrides)
    graph = dag.build(cfg)
    ex = SlurmExecutor(RunDir(root / f"plan-{site}-{n}"), graph, cfg)
    jobs: list[Job] = []

    def count(job: Job) -> str:
        jobs.append(job)
        return f"<job of {job.label}>"

    ex.planner(live={}).plan(list(graph.order), count)
    per_partition: dict[str, int] = {}
    for job in jobs:
        for part, k in job.counts().items():
            per_partition[part] = per_partition.get(part, 0) + k
    limits = {p: submit_limit(ex.site, p, live=LiveLimits())[0] for p in per_partition}
    site_limit = ex.site.max_submit_jobs
    refused = any(lim is not None and per_partition[p] > lim for p, lim in limits.items()) or (
        site_limit is not None and sum(per_partition.values()) > site_limit
    )
    return {
        "site": site + "".join(f" {o}" for o in overrides),
        "chain": "continuations queued up front" if not ex.scripts.self_continuing(graph["sft"]) else "job queues its successor",
        "fan_out": n,
        "sbatch_calls": len(jobs),
        "jobs": sum(per_partition.values()),
        "jobs_per_partition": per_partition,
        "limit_per_partition": limits,
        "site_limit": site_limit,
        "largest_array": max((len(j.items) for j in jobs if j.array), default=0),
        "refused_before_submitting": refused,
    }


def _snowcat(*args: str, env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "snowcat.pipeline.cli", *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"snowcat {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return proc


def _mtimes(run_dir: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file() and "slurm" not in p.parts}


def submit_and_status(root: Path, n: int, statuses: int) -> dict:
    """A real `snowcat run` to the test-double scheduler, then `status` K times."""
    state_file = root / f"fake-{n}.json"
    env = {**os.environ, "PATH": f"{FAKE / 'bin'}{os.pathsep}{os.environ['PATH']}", "FAKE_SLURM_STATE": str(state_file)}
    env.pop("SLURM_CONF", None)
    cfg_path = root / f"fanout-{n}.yaml"
    cfg_path.write_text(PIPELINE.format(parts=list(range(n))))
    run_dir = root / f"run-{n}"
    site = ("--executor", "slurm", "--site", "jsc-juwels-booster", "site.account=proj")
    t0 = time.perf_counter()
    _snowcat("run", str(cfg_path), *site, "--run-dir", str(run_dir), env=env)
    submit_s = time.perf_counter() - t0
    calls = json.loads(state_file.read_text())["calls"]
    sbatch_calls = sum(1 for c in calls if c[0] == "sbatch")
    rows = []
    for _ in range(statuses):
        before, calls_before = _mtimes(run_dir), len(json.loads(state_file.read_text())["calls"])
        t0 = time.perf_counter()
        _snowcat("status", str(run_dir), "--json", env=env)
        seconds = time.perf_counter() - t0
        after = _mtimes(run_dir)
        rewritten = sum(1 for k, v in after.items() if before.get(k) != v)
        scheduler_calls = len(json.loads(state_file.read_text())["calls"]) - calls_before
        rows.append({"seconds": round(seconds, 3), "scheduler_calls": scheduler_calls, "files_rewritten": rewritten})
    return {
        "fan_out": n,
        "submit_seconds": round(submit_s, 3),
        "sbatch_calls": sbatch_calls,
        "status": rows,
        "status_median_s": sorted(r["seconds"] for r in rows)[len(rows) // 2],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="snowcat bench fanout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,1000", help="fan-out widths, comma-separated")
    parser.add_argument("--statuses", type=int, default=3, help="`snowcat status` calls per width")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="snowcat-fanout-") as tmp:
        root = Path(tmp)
        plans = [plan(root, n, site, overrides) for site, overrides in SITES for n in sizes]
        print(f"{'site':<52} {'fan-out':>7} {'sbatch':>6} {'jobs':>6}  per partition (limit)  verdict")
        for p in plans:
            parts = ", ".join(f"{k} {v} ({p['limit_per_partition'][k] or '-'})" for k, v in p["jobs_per_partition"].items())
            verdict = "refused before submitting" if p["refused_before_submitting"] else "fits"
            print(f"{p['site']:<52} {p['fan_out']:>7} {p['sbatch_calls']:>6} {p['jobs']:>6}  {parts}  {verdict}")
        runs = [submit_and_status(root, n, args.statuses) for n in sizes]
    print(f"\n{'fan-out':>7} {'sbatch':>6} {'submit s':>9} {'status s':>9} {'sched calls':>11} {'files rewritten':>15}")
    for r in runs:
        last = r["status"][-1]
        print(
            f"{r['fan_out']:>7} {r['sbatch_calls']:>6} {r['submit_seconds']:>9.2f} {r['status_median_s']:>9.2f} "
            f"{last['scheduler_calls']:>11} {last['files_rewritten']:>15}"
        )
    ratio = runs[-1]["status_median_s"] / runs[0]["status_median_s"]
    print(f"\nstatus time, fan-out {sizes[-1]} / fan-out {sizes[0]}: {ratio:.2f}x (same machine, same run of this benchmark)")
    result = {
        "benchmark": "fanout",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "plans": plans,
        "runs": runs,
        "status_time_ratio": round(ratio, 3),
        "command": " ".join(["snowcat", "bench", "fanout", *(argv or sys.argv[1:])]),
    }
    if args.json:
        atomic_write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
