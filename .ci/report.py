"""The end of a CI run: wall time per phase, test time per tier, and the 25 slowest tests.

    python3 .ci/report.py PHASES TIMINGS...

PHASES: lines "<phase> <start> <end>", seconds into the run (.ci/test.sh appends one per phase;
phases may overlap: the cluster tier runs in the background); TIMINGS: the
`--timings` files of the pytest runs ({nodeid: [tier, seconds]}, tests/budget.py). Standard
library only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def minutes(s: float) -> str:
    return f"{int(s) // 60:d}:{int(s) % 60:02d}"


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: report.py PHASES [TIMINGS...]", file=sys.stderr)
        return 2
    phases = [
        (name, float(start), float(end))
        for name, start, end in (line.split() for line in Path(argv[1]).read_text().splitlines() if line.strip())
    ]
    timings: dict[str, list] = {}
    for path in argv[2:]:
        if Path(path).is_file():
            timings.update(json.loads(Path(path).read_text()))

    print("\n== CI phases (wall; from - to, minutes into the run) ==")
    for name, start, end in phases:
        print(f"  {name:<16} {minutes(end - start):>7}   {minutes(start):>5} - {minutes(end)}")
    print(f"  {'total':<16} {minutes(max((end for *_, end in phases), default=0)):>7}")

    print("\n== tests per tier (seconds of test time; two workers run side by side) ==")
    for tier in ("unit", "cluster", "slow"):
        secs = [s for t, s in timings.values() if t == tier]
        print(f"  {tier:<8} {len(secs):>4} tests {sum(secs):>8.0f} s")

    slowest = sorted(timings.items(), key=lambda kv: -kv[1][1])
    print("\n== the 25 slowest tests ==")
    for nodeid, (tier, s) in slowest[:25]:
        print(f"  {s:>7.1f} s  {tier:<7}  {nodeid}")
    print("\n== the 10 slowest of the unit tier (no budget checks it: a slow one belongs in `slow`) ==")
    for nodeid, (_, s) in [kv for kv in slowest if kv[1][0] == "unit"][:10]:
        print(f"  {s:>7.1f} s  {nodeid}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
