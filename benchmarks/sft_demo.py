"""Measure the SFT demo target: held-out greedy pass@1 after SFT on 2 CPU cores, and its wall time.

    python -m snowcat.benchmarks.sft_demo ROOT [sft overrides key=value ...]   (or: snowcat bench sft_demo ROOT ...)

Generates the demo's task sets into ROOT/tasks (as configs/demo.yaml does: closure depths 1-6,
2-3 digit arith; seed 1234) unless present, runs the sft stage into ROOT/sft with the overrides,
and prints wall time, tokens/s and greedy pass@1 per domain on the val split against the targets
(closure >= 0.60, arith >= 0.30 in under 5 minutes). Set OMP_WAIT_POLICY=PASSIVE on a shared machine.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

import snowcat.stages.sft as sft
from snowcat.pipeline.context import StageContext
from snowcat.stages.taskgen import generate_domain, save_tasks, split_tasks

TARGETS = {"closure": 0.60, "arith": 0.30}
TASKS = [("closure", 2400, 240, [1, 2, 3, 4, 5, 6]), ("arith", 2400, 200, [2, 3])]


def make_tasks(out: Path, seed: int = 1234) -> None:
    rng = np.random.default_rng(seed)
    train, val = [], []
    for domain, count, val_count, diffs in TASKS:
        tr, va = split_tasks(generate_domain(rng, domain, diffs, count), val_count, rng)
        train, val = train + tr, val + va
    save_tasks(out, "train", train)
    save_tasks(out, "val", val)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    root, overrides = Path(argv[0]), argv[1:]
    if not (root / "tasks" / "train.parquet").is_file():
        make_tasks(root / "tasks")
    values = OmegaConf.to_container(OmegaConf.from_dotlist(["eval_tasks=1000", *overrides]))
    ctx = StageContext.standalone("sft", values, run_dir=root, inputs={"tasks": root / "tasks"}, seed=1234)
    t0 = time.perf_counter()
    metrics = sft.run(ctx)
    wall = time.perf_counter() - t0
    report = {"wall_s": round(wall, 1), **metrics}
    for domain, target in TARGETS.items():
        got = metrics.get(f"val_greedy_pass@1/{domain}")
        report[f"meets/{domain}"] = got is not None and got >= target
    report["meets/time"] = wall < 300
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
