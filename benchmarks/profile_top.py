"""Where a run's processes spent their time, from a py-spy profile: the top functions of each stage.

    py-spy record --subprocesses -r 20 -f raw -o demo.txt -- snowcat run configs/demo.yaml
    snowcat bench profile-top demo.txt [--top 12] [--json FILE]

py-spy's raw format is one line per distinct stack, `frame;frame;...;frame COUNT`, where a
`process PID:"command"` frame marks each process of the tree. Samples are attributed to the
innermost process frame, named by the stage a `python -m snowcat.stages RUN STAGE` command runs (the
two ranks of an MPI stage add up), and each function counts once per sample however often it
recurs in the stack (inclusive time; the entries most samples share, the call path down to the
stage's work, are left out), and the innermost frame of each sample is its self time. Seconds are samples over the sampling rate: CPU time where
py-spy was run without --idle, so a stage of two busy ranks shows about twice its wall time.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

from snowcat.pipeline.fsio import atomic_write_json

PROCESS = re.compile(r'^process \d+:"(?P<cmd>.*)"$')
STAGE = re.compile(r"-m snowcat\.stages \S+ (?P<stage>\S+)")
STAGE_RUN = re.compile(r"^run \(stages/(?P<module>\w+)\.py")  # a stage module's entry, where py-spy named no process
LINE = re.compile(r":\d+\)$")  # a frame's line number: the same function at any line is one entry
COMMON = 0.9  # inclusive entries held by more of a process's samples than this are its call path, not news


def process_name(frame: str) -> str | None:
    """The stage a process frame runs, or its command (shortened); None for a frame that is not one."""
    m = PROCESS.match(frame)
    if m is None:
        return None
    stage = STAGE.search(m["cmd"])
    return stage["stage"] if stage else " ".join(m["cmd"].split()[:3])


def attribute(lines) -> tuple[collections.Counter, dict[str, collections.Counter], dict[str, collections.Counter]]:
    """(samples per process, inclusive and self samples per function within each process)."""
    total: collections.Counter = collections.Counter()
    functions: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    self_time: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        at = max((i for i, f in enumerate(frames) if process_name(f) is not None), default=None)
        if at is None:
            continue
        name, n = process_name(frames[at]), int(count)
        if not STAGE.search(frames[at]):
            name = next((f"{m['module']} (in {name})" for f in frames[at + 1 :] if (m := STAGE_RUN.match(f))), name)
        total[name] += n
        for fn in {LINE.sub(")", f) for f in frames[at + 1 :]}:
            functions[name][fn] += n
        self_time[name][LINE.sub(")", frames[-1])] += n
    return total, functions, self_time


def summary(path: Path, rate: float, top: int) -> dict:
    with open(path) as f:
        total, functions, self_time = attribute(f)

    def rows(counts, n, keep=lambda c: True):
        picked = [(fn, c) for fn, c in counts.most_common() if keep(c)][:top]
        return [{"function": fn, "cpu_s": round(c / rate, 1), "share": round(c / n, 3)} for fn, c in picked]

    return {
        "profile": str(path),
        "rate_hz": rate,
        "processes": {
            name: {
                "cpu_s": round(n / rate, 1),
                "inclusive": rows(functions[name], n, lambda c, n=n: c <= COMMON * n),
                "self": rows(self_time[name], n),
            }
            for name, n in total.most_common()
        },
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="snowcat bench profile-top", description=__doc__.split("\n\n")[0])
    p.add_argument("profile", type=Path, help="a py-spy record -f raw output")
    p.add_argument("--rate", type=float, default=20.0, help="py-spy's sampling rate (-r) in Hz (default 20)")
    p.add_argument("--top", type=int, default=12, help="functions listed per process")
    p.add_argument("--json", help="write the summary here")
    args = p.parse_args(argv)
    if not args.profile.is_file():
        print(f"error: {args.profile}: no such file", file=sys.stderr)
        return 2
    result = summary(args.profile, args.rate, args.top)
    for name, proc in result["processes"].items():
        print(f"\n{name}: {proc['cpu_s']:.1f} s of samples")
        for kind in ("inclusive", "self"):
            for row in proc[kind]:
                print(f"  {kind:9} {row['cpu_s']:7.1f} s {row['share']:6.1%}  {row['function'][:100]}")
    if args.json:
        atomic_write_json(args.json, result)
        print(f"\nwritten: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
