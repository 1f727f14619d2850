#!/usr/bin/env python3
"""TEST DOUBLE of a Slurm controller's client commands, for tests that need a scheduler's *answers*
(job ids, refusals, sacct rows) without a cluster: `sbatch`, `sacct`, `scancel`, `squeue`, `scontrol
release` and an empty `sacctmgr` on PATH.

Nothing runs: submitted jobs stay PENDING until a test sets their state (`set_state`). State lives in
the JSON file $FAKE_SLURM_STATE. Like Slurm's QoS, sbatch refuses a job that would take this user
past $FAKE_SLURM_MAX_SUBMIT queued jobs (array tasks and hetjob components count one each), and
$FAKE_SLURM_REFUSE_AFTER=N refuses every sbatch call after the N-th (a limit hit mid-DAG).
$FAKE_SLURM_ACCOUNTING_LAG=1 keeps jobs still PENDING out of sacct, as slurmdbd lists a submission
a moment after sbatch returned; squeue (the controller) lists them. $FAKE_SLURM_SQUEUE_DOWN=1 makes
squeue fail as it does when the controller does not answer in time (exit 1, "Socket timed out").
The real behaviour is tested against the local Slurm cluster (tests/test_slurm.py).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
REFUSED = "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy (job submit limit, user's size and/or time limits)"


def _path() -> Path:
    return Path(os.environ["FAKE_SLURM_STATE"])


def load() -> dict:
    p = _path()
    return json.loads(p.read_text()) if p.is_file() else {"next": 1000, "jobs": {}, "calls": []}


def save(state: dict) -> None:
    tmp = _path().with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(_path())


def tasks(state: dict) -> dict[str, dict]:
    """Every schedulable piece by its sacct id: `1000`, `1000_3`, `1000+1`."""
    out = {}
    for jid, job in state["jobs"].items():
        for key, t in job["tasks"].items():
            out[jid + key] = t
    return out


def set_state(job_id: str, new: str, exit_code: str = "0:0", completing: int = 0) -> None:
    """Tests: move a job (`1000`, all its tasks) or one task (`1000_2`) to a state. `completing`: the
    next that many squeue calls still list it COMPLETING, as the controller lists an ended job while
    its processes exit (sacct already gives the end state)."""
    state = load()
    for key, t in tasks(state).items():
        if key == job_id or key.split("_")[0].split("+")[0] == job_id:
            t["state"], t["exit"], t["completing"] = new, exit_code, completing
    save(state)


def set_allocation(job_id: str, elapsed_s: int, nodes: int = 1) -> None:
    """Tests: what sacct reports a job (`1000`, `1000+1`, `1000_2`) was allocated: ElapsedRaw, NNodes."""
    state = load()
    for key, t in tasks(state).items():
        if key == job_id:
            t["elapsed"], t["nodes"] = elapsed_s, nodes
    save(state)


def _options(script: str) -> list[dict[str, str]]:
    comps: list[dict[str, str]] = [{}]
    for line in script.splitlines():
        if line.strip() == "#SBATCH hetjob":
            comps.append({})
            continue
        m = re.match(r"#SBATCH --([\w-]+)(?:=(.*))?$", line.strip())
        if m:
            comps[-1][m.group(1)] = (m.group(2) or "").strip("'\"")
    return comps


def _array(spec: str) -> list[int]:
    out = []
    for part in spec.split("%")[0].split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def sbatch(args: list[str]) -> int:
    state = load()
    script = Path([a for a in args if not a.startswith("-")][-1]).read_text()
    comps = _options(script)
    state["calls"].append(["sbatch", comps[0].get("job-name", "")])
    refuse_after = os.environ.get("FAKE_SLURM_REFUSE_AFTER")
    sbatch_calls = sum(1 for c in state["calls"] if c[0] == "sbatch")
    array = _array(comps[0]["array"]) if "array" in comps[0] else None
    keys = [f"_{i}" for i in array] if array is not None else ([f"+{i}" for i in range(len(comps))] if len(comps) > 1 else [""])
    queued = sum(1 for t in tasks(state).values() if t["state"] not in TERMINAL)
    limit = os.environ.get("FAKE_SLURM_MAX_SUBMIT")
    if (refuse_after and sbatch_calls > int(refuse_after)) or (limit and queued + len(keys) > int(limit)):
        save(state)
        print(REFUSED, file=sys.stderr)
        return 1
    jid = str(state["next"])
    state["next"] += 1
    partition = [c.get("partition", "") for c in comps]
    state["jobs"][jid] = {
        "name": comps[0].get("job-name", ""),
        "dependency": comps[0].get("dependency"),
        "array": comps[0].get("array"),
        "held": "hold" in comps[0],
        "script": script,
        "tasks": {
            k: {"state": "PENDING", "exit": "0:0", "partition": partition[int(k[1:]) if k.startswith("+") else 0]} for k in keys
        },
    }
    save(state)
    print(f"Submitted batch job {jid}")
    return 0


def scancel(args: list[str]) -> int:
    state = load()
    ids = [a for a in args if not a.startswith("-")]
    state["calls"].append(["scancel", *ids])
    everything = tasks(state)
    for target in ids:
        for key, t in everything.items():
            if (key == target or key.split("_")[0].split("+")[0] == target) and t["state"] not in TERMINAL:
                t["state"] = "CANCELLED"
    save(state)
    return 0


def sacctmgr(args: list[str]) -> int:
    """No accounting database: nothing to show (the executor then knows only the profile's limits)."""
    return 0


def scontrol(args: list[str]) -> int:
    """`scontrol release JOB` (a held job may start); `show` answers nothing."""
    state = load()
    state["calls"].append(["scontrol", *args])
    if args[:1] == ["release"] and args[1] in state["jobs"]:
        state["jobs"][args[1]]["held"] = False
    save(state)
    return 0


def sacct(args: list[str]) -> int:
    state = load()
    state["calls"].append(["sacct"])
    save(state)
    ids = args[args.index("-j") + 1].split(",") if "-j" in args else list(state["jobs"])
    fields = args[args.index("-o") + 1].split(",")
    lag = os.environ.get("FAKE_SLURM_ACCOUNTING_LAG") == "1"
    for key, t in tasks(state).items():
        if key.split("_")[0].split("+")[0] not in ids or (lag and t["state"] == "PENDING"):
            continue
        row = {
            "JobID": key,
            "JobName": state["jobs"][key.split("_")[0].split("+")[0]]["name"],
            "State": t["state"],
            "ExitCode": t["exit"],
            "Reason": "Dependency" if t["state"] == "PENDING" else "None",
            "Partition": t["partition"],
            # the allocation, where a test set it (`set_allocation`): what a site charges
            "ElapsedRaw": str(t.get("elapsed", "")),
            "NNodes": str(t.get("nodes", "")),
        }
        print("|".join(row.get(f, "") for f in fields))
    return 0


def squeue(args: list[str]) -> int:
    state = load()
    state["calls"].append(["squeue"])
    if os.environ.get("FAKE_SLURM_SQUEUE_DOWN") == "1":
        save(state)
        print("squeue: error: slurm_load_jobs error: Socket timed out on send/recv operation", file=sys.stderr)
        return 1
    fmt = args[args.index("-o") + 1] if "-o" in args else ""
    for key, t in tasks(state).items():
        shown = t["state"]
        if t.get("completing"):
            t["completing"] -= 1
            shown = "COMPLETING"
        elif shown in TERMINAL:
            continue
        if fmt == "%P":
            print(t["partition"])
        elif fmt == "%i|%T|%r":
            print(f"{key}|{shown}|{'Dependency' if shown == 'PENDING' else 'None'}")
    save(state)
    return 0


def main() -> int:
    name, args = Path(sys.argv[0]).name, sys.argv[1:]
    handlers = {
        "sbatch": sbatch,
        "scancel": scancel,
        "sacct": sacct,
        "squeue": squeue,
        "scontrol": scontrol,
        "sacctmgr": sacctmgr,
    }
    if name not in handlers:
        print(f"fake_slurm: {name} is not faked", file=sys.stderr)
        return 2
    return handlers[name](args)


if __name__ == "__main__":
    sys.exit(main())
