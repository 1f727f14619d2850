"""OpenMP's wait policy for a stage's torch threads: the demo's SFT step with OpenMP's default
(spin a while, then sleep) against OMP_WAIT_POLICY=PASSIVE (sleep at once), alone and beside a busy process.

    snowcat bench omp-wait [--steps 12] [--rounds 3] [--json FILE]

Each measurement is a fresh interpreter (OpenMP reads the policy when torch loads) timing `--steps`
optimizer steps of `demo-tiny` as the demo's SFT stage shapes them (16 rows x 256 packed tokens,
documents of 64, token log-probs through the LM head, AdamW; the machine's threads) after 3 warm-up
steps; the two policies alternate within each of `--rounds` rounds. "beside": one busy-looping process
(another user's work, a second stage) runs meanwhile. The local executor leaves the default to a stage
that has the cores to itself and sets PASSIVE otherwise (pipeline/executors/local.py, `owns_cores`):
the last line gives PASSIVE's step time over the default's, alone (above 1: the default is faster)
and beside (below 1: PASSIVE is).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from snowcat.benchmarks import revision
from snowcat.pipeline.fsio import atomic_write_json
from snowcat.pipeline.provenance import host_state

POLICIES = ("default", "PASSIVE")
CHILD = r"""
import json, statistics, sys, time, torch
from snowcat.stages.model.config import PRESETS
from snowcat.stages.model.modeling import MoEForCausalLM
steps = int(sys.argv[1])
torch.manual_seed(0)
model = MoEForCausalLM(PRESETS["demo-tiny"])
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
ids, targets = torch.randint(0, 512, (16, 256)), torch.randint(0, 512, (16, 256))
segments = torch.arange(16 * 256).reshape(16, 256) // 64
times = []
for i in range(steps + 3):
    t0 = time.perf_counter()
    out = model(ids, segment_ids=segments, targets=targets)
    (-out.logprobs.mean() + 0.01 * out.aux_loss).backward()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - t0)
print(json.dumps({"step_s": statistics.median(times[3:]), "threads": torch.get_num_threads()}))
"""


def step_time(policy: str, steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    proc = subprocess.run([sys.executable, "-c", CHILD, str(steps)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark child ({policy}) failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(steps: int, rounds: int, beside: bool) -> dict[str, list[float]]:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if beside else None
    try:
        times: dict[str, list[float]] = {p: [] for p in POLICIES}
        for r in range(rounds):
            for policy in POLICIES[r % 2 :] + POLICIES[: r % 2]:  # each goes first in turn
                times[policy].append(step_time(policy, steps)["step_s"])
        return times
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="snowcat bench omp-wait", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12, help="timed steps per measurement (median reported)")
    ap.add_argument("--rounds", type=int, default=3, help="measurements of each policy per condition")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()[0]
    rows = {}
    for condition in ("alone", "beside"):
        times = measure(args.steps, args.rounds, beside=condition == "beside")
        med = {p: statistics.median(v) for p, v in times.items()}
        rows[condition] = {"step_s": times, "median_s": med, "passive_over_default": round(med["PASSIVE"] / med["default"], 3)}
        print(f"{condition:>6}: default {med['default']:.3f} s/step, PASSIVE {med['PASSIVE']:.3f} s/step (rounds: {times})")
    load_after = os.getloadavg()[0]
    host, rev = host_state(probe_gpu=False), revision(("benchmarks/omp_wait.py", "pipeline/executors/local.py"))
    print(
        f"{host['cpu_model']}, {host['cpu_count']} cpus; commit {(rev['commit'] or '?')[:12]}; "
        f"load average before / after: {load_before:.2f} / {load_after:.2f}"
    )
    if args.json:
        atomic_write_json(
            args.json,
            {
                "benchmark": "omp-wait",
                "what": __doc__.splitlines()[0],
                "machine": {k: host[k] for k in ("hostname", "platform", "cpu_model")} | {"cpus": host["cpu_count"]},
                "revision": rev,
                "load_average_1min": {"before": load_before, "after": load_after},
                "steps": args.steps,
                "rounds": args.rounds,
                "rows": rows,
                "command": " ".join(["snowcat", "bench", "omp-wait", *(argv if argv is not None else sys.argv[1:])]),
            },
        )
    print(
        f"PASSIVE / default step time: alone {rows['alone']['passive_over_default']:.2f}x, "
        f"beside a busy process {rows['beside']['passive_over_default']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
