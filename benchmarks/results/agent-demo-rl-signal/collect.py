"""What RL's own per-update metrics say of the agent-demo runs (docs/agents.md, "Why RL has so little
to work with"): per run, the mean of the first and of the last 5 updates of the training reward,
the sampling entropy (nats per token), the share of groups without signal and the KL to SFT, and
the means of every 5 updates in turn; and each update's KL and gradient norm (where one update's KL
stands out, docs/rl.md on the k3 clamp).

    python collect.py NAME=RUN_DIR... > signal.json

RUN_DIR: a run directory of `snowcat bench demo` (its stages/rl/metrics_history.jsonl)."""

import json
import sys
from pathlib import Path

KEYS = ("reward/mean", "entropy", "groups/no_signal_frac", "loss/kl")
PER_UPDATE = ("loss/kl", "grad_norm")


def mean(rows: list[dict], key: str) -> float:
    return round(sum(r[key] for r in rows) / len(rows), 4)


def summary(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "stages" / "rl" / "metrics_history.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    return {
        "updates": len(rows),
        **{
            k: {
                "first_5": mean(rows[:5], k),
                "last_5": mean(rows[-5:], k),
                "by_5": [mean(rows[i : i + 5], k) for i in range(0, len(rows), 5)],
            }
            for k in KEYS
        },
        "per_update": {k: [round(r[k], 4) for r in rows] for k in PER_UPDATE},
    }


if __name__ == "__main__":
    runs = dict(arg.split("=", 1) for arg in sys.argv[1:])
    print(json.dumps({name: summary(Path(d)) for name, d in runs.items()}, indent=1))
