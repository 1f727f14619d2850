"""Failure counts quoted in docs/agents.md ("What the SFT models get wrong"), from the kept eval
trajectories of agent-demo runs (stages/eval/trajectories/<ref>.parquet):
    python count.py NAME=RUN_DIR... > counts.json
Per checkpoint: episodes, passed, failed, failed episodes whose tool results say "no such file",
passed ones that did, and per task how both attempts went; for a run with both checkpoints, the
paired SE of the RL - SFT pass@1 difference and its projection to more attempts per task (the
between-task part of the variance kept, the within-task part divided by the attempts)."""

import json
import sys

import numpy as np
import pandas as pd

out = {}
for arg in sys.argv[1:]:
    name, run = arg.split("=", 1)
    frames = {}
    for ref in ("sft_final", "rl_final"):
        d = pd.read_parquet(f"{run}/stages/eval/trajectories/{ref}.parquet")
        missing = d.tool_results.apply(lambda r: any("no such file" in x for x in r))
        passed = d.reward >= 1
        per_task = d.groupby("task_id").reward.sum().value_counts().sort_index()
        out[f"{name}/{ref}"] = {
            "episodes": len(d),
            "passed": int(passed.sum()),
            "failed": int((~passed).sum()),
            "failed_naming_a_missing_file": int((~passed & missing).sum()),
            "passed_naming_a_missing_file": int((passed & missing).sum()),
            "tasks_by_passes": {str(int(k)): int(v) for k, v in per_task.items()},
        }
        frames[ref] = d[["task_id", "attempt", "reward"]]
    m = frames["sft_final"].merge(frames["rl_final"], on=["task_id", "attempt"], suffixes=("_sft", "_rl"))
    g = m.groupby("task_id")
    diff = g.reward_rl.mean() - g.reward_sft.mean()
    k, n = m.groupby("task_id").size().iloc[0], len(diff)
    within = g.reward_sft.var(ddof=1).mean() + g.reward_rl.var(ddof=1).mean()
    between = max(diff.var(ddof=1) - within / k, 0.0)
    out[f"{name}/paired_se"] = {
        "tasks": n,
        "attempts": int(k),
        "se": float(diff.std(ddof=1) / np.sqrt(n)),
        "projected_se_by_attempts": {str(a): float(np.sqrt(between + within / a) / np.sqrt(n)) for a in (2, 4, 6, 8)},
        "projected_se_3x_tasks": float(diff.std(ddof=1) / np.sqrt(3 * n)),
    }
json.dump(out, sys.stdout, indent=1)
print()
