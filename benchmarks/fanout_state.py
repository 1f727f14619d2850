"""State records of an N-way fan-out, side by side: what updating every element once writes and costs,
and what reading every record (`RunDir.state()`) costs, for N = 10 and N = 1000.

    snowcat bench fanout_state [--n 10 1000] [--dir DIR] [--json FILE]

A run with a `tasks` stage and an N-way fan-out stage is created (nothing is run). Measured, per N:
  - `update`: every element's record updated once the way `status` reconciles it with sacct (the
    element's record, then its stage's record with the same info), as a process other than the
    unit's runner does: under .state.lock, executor's part;
  - `again`: the same updates repeated (sacct says the same again): nothing may be written;
  - `runner`: every element's runner recording that it started, holding its unit lock (the unit's
    own part, no state lock; the lock itself is not counted);
  - `state`: one `RunDir.state()` (median of 3);
  - `one_json`: `update` as snowcat did it before per-unit records (one state.json, read, changed and
    rewritten whole under the lock for every change), for comparison.
Files written, bytes written and fsyncs are counted by pipeline.fsio (`fsio.IO`); times are wall
clock on whatever filesystem holds DIR (default: a temp dir; point it at Lustre/GPFS to measure one).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from filelock import FileLock

from snowcat.pipeline import config as config_mod
from snowcat.pipeline.dag import build
from snowcat.pipeline.fsio import IO, atomic_write_json, read_json
from snowcat.pipeline.rundir import RunDir, now

CONFIG = """
name: fanout-state
seed: 1
stages:
  tasks:
    kind: tasks
    domains:
      arith: {{count: 10, val_count: 2, difficulties: [1]}}
  fan:
    kind: tasks
    needs: [tasks]
    fan_out: {{replica: [{items}]}}
    domains:
      arith: {{count: 10, val_count: 2, difficulties: [1]}}
"""

COUNTED = ("files_written", "bytes_written", "fsyncs")


def _sacct_info(i: int) -> dict:
    return {
        "state": "RUNNING",
        "reason": None,
        "nodes": f"nid{i:05d}",
        "exit_code": "0:0",
        "partition": "booster",
        "account": "proj",
    }


class _Meter:
    """IO counters and wall time of the block."""

    def __enter__(self):
        self.before = dict(IO)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall_s = time.perf_counter() - self.t0
        self.io = {k: IO[k] - self.before.get(k, 0) for k in COUNTED}

    def row(self) -> dict:
        return self.io | {"wall_s": self.wall_s}


def _one_json_update(run: RunDir, key: str, **fields) -> None:
    """snowcat's update_stage before per-unit records: the whole state.json, under one lock."""
    path = run.path / "state.json"
    with FileLock(run.path / ".state.lock", timeout=60):
        state = read_json(path, {"stages": {}})
        record = state["stages"].setdefault(key, {"status": "pending", "attempts": 0, "job_ids": []})
        record.update(fields)
        atomic_write_json(path, state)


def measure(n: int, root: Path) -> dict:
    """One N: the rows described in the module docstring, each {files_written, bytes_written, fsyncs, wall_s}."""
    where = Path(tempfile.mkdtemp(prefix=f"fanout-{n}-", dir=root))
    try:
        cfg_path = where / "config.yaml"
        cfg_path.write_text(CONFIG.format(items=", ".join(map(str, range(n)))))
        cfg = config_mod.load(cfg_path)
        run = RunDir.create(cfg, where / "run")
        units = build(cfg)["fan"].units
        for u in units:  # as submitted: every element has a record
            run.update_stage(u.key, status="submitted", executor="slurm", own_job_ids=[f"1000_{u.index}"])
        out = {}
        with _Meter() as m:
            for u in units:
                run.update_stage(u.key, status="running", slurm=_sacct_info(u.index))
                run.update_stage("fan", status="running", slurm=_sacct_info(0))
        out["update"] = m.row()
        with _Meter() as m:
            for u in units:
                run.update_stage(u.key, status="running", slurm=_sacct_info(u.index))
                run.update_stage("fan", status="running", slurm=_sacct_info(0))
        out["again"] = m.row()
        runner = dict.fromkeys(COUNTED, 0) | {"wall_s": 0.0}
        for u in units:
            with run.unit_lock(u):
                with _Meter() as m:
                    run.update_stage(u.key, status="running", started=now(), host=f"nid{u.index:05d}")
                runner = {k: runner[k] + v for k, v in m.row().items()}
        out["runner"] = runner
        times = []
        for _ in range(3):
            with _Meter() as m:
                records = len(run.state()["stages"])
            times.append(m.wall_s)
        out["state"] = dict.fromkeys(COUNTED, 0) | {"wall_s": statistics.median(times), "records": records}

        old = RunDir.create(cfg, where / "old")
        for u in units:
            _one_json_update(old, u.key, status="submitted", executor="slurm", own_job_ids=[f"1000_{u.index}"])
        with _Meter() as m:
            for u in units:
                _one_json_update(old, u.key, status="running", slurm=_sacct_info(u.index))
                _one_json_update(old, "fan", status="running", slurm=_sacct_info(0))
        out["one_json"] = m.row() | {"state_json_bytes": (old.path / "state.json").stat().st_size}
        return out
    finally:
        shutil.rmtree(where, ignore_errors=True)


ROWS = {
    "update": "update every element once (status, executor's part)",
    "again": "the same updates again (nothing changed)",
    "runner": "every element's runner records its start",
    "state": "RunDir.state(), every record read",
    "one_json": "update every element once, one state.json (before)",
}


def render(results: dict[int, dict]) -> str:
    ns = sorted(results)
    lo, hi = ns[0], ns[-1]
    lines = [f"{'':52} {'metric':14}" + "".join(f"{f'N={n}':>14}" for n in ns) + f"{f'ratio {hi}/{lo}':>14}"]
    for key, label in ROWS.items():
        for metric in (*COUNTED, "wall_s"):
            values = [results[n][key][metric] for n in ns]
            if metric != "wall_s" and not any(values) and key == "state":
                continue
            ratio = f"{values[-1] / values[0]:.1f}" if values[0] else ("-" if not values[-1] else "inf")
            cells = "".join(f"{v:>14.4f}" if metric == "wall_s" else f"{v:>14d}" for v in values)
            lines.append(f"{label if metric == COUNTED[0] or (key == 'state') else '':52} {metric:14}{cells}{ratio:>14}")
    sizes = "".join(f"{results[n]['one_json']['state_json_bytes']:>14d}" for n in ns)
    lines.append(f"{'size of that state.json at the end':52} {'bytes':14}{sizes}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="snowcat bench fanout_state", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[10, 1000], help="fan-out sizes")
    parser.add_argument("--dir", type=Path, default=None, help="where to create the runs (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args(argv)
    root = args.dir or Path(tempfile.gettempdir())
    results = {n: measure(n, root) for n in args.n}
    print(render(results))
    if args.json:
        atomic_write_json(args.json, {"root": str(root), "results": {str(n): r for n, r in results.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
