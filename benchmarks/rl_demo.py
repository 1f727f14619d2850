"""Measure the demo target: does the RL stage raise held-out pass@1 over its SFT init by > 2 paired SE?

    snowcat bench rl_demo ROOT [rl overrides key=value ...]

ROOT holds `tasks/` (train/val parquet, the tasks stage's output) and `sft/` (the sft stage's
output). The RL stage runs as the local executor runs it: `mpirun -n 2` (1 trainer + 1 rollout
rank), into ROOT/rl; then the evaluate stage compares `sft:final` with `rl:final` and `rl:best` on
the whole val split (paired over tasks). Prints wall time, the comparison, and the verdict.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import snowcat.stages.evaluate as ev
from snowcat.pipeline.context import StageContext

REPO = Path(__file__).resolve().parent.parent

_CHILD = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    from omegaconf import OmegaConf
    from snowcat.pipeline.context import StageContext
    import snowcat.stages.rl as rl
    root, over = Path(sys.argv[1]), sys.argv[2:]
    rank, world = int(os.environ.get("OMPI_COMM_WORLD_RANK", 0)), int(os.environ.get("OMPI_COMM_WORLD_SIZE", 1))
    ctx = StageContext.standalone("rl", OmegaConf.to_container(OmegaConf.from_dotlist(over)), run_dir=root,
                                  inputs={"tasks": root / "tasks", "sft": root / "sft"}, seed=4321, rank=rank, world_size=world,
                                  role=("trainer", "rollout")[min(rank, 1)] if world > 1 else None)
    ctx.signal.install()
    print(json.dumps(rl.run(ctx)), flush=True)
""")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__)
        return 2
    root, overrides = Path(argv[0]).resolve(), argv[1:]
    child = root / "rl_child.py"
    child.write_text(_CHILD)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_btl": "self,tcp",
        "SLURM_CPUS_PER_TASK": "1",
    }
    t0 = time.perf_counter()
    proc = subprocess.run(
        ["mpirun", "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable, str(child), str(root), *overrides],
        env=env,
        cwd=REPO,
        text=True,
        capture_output=True,
    )
    rl_s = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"rl failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    print(proc.stdout.strip().splitlines()[-1])
    print(f"rl stage wall time under mpirun -n 2: {rl_s:.0f} s")

    ctx = StageContext.standalone(
        "evaluate",
        {"checkpoints": ["sft:final", "rl:final", "rl:best"]},
        name="eval",
        run_dir=root,
        inputs={"tasks": root / "tasks", "sft": root / "sft", "rl": root / "rl"},
        seed=99,
    )
    t0 = time.perf_counter()
    head = ev.run(ctx)
    print(f"evaluate wall time: {time.perf_counter() - t0:.0f} s")
    for ref in ("rl:final", "rl:best"):
        d, se = head[f"{ref} - sft:final/all/pass@1_diff"], head[f"{ref} - sft:final/all/pass@1_diff_se"]
        print(
            json.dumps(
                {
                    "checkpoint": ref,
                    "sft_pass@1": head["sft:final/all/pass@1"],
                    "rl_pass@1": head[f"{ref}/all/pass@1"],
                    "diff": d,
                    "paired_se": se,
                    "diff_over_se": d / se if se else None,
                    "target_met": bool(se and d > 2 * se),
                    "rl_seconds": round(rl_s),
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
