"""swe_mini repository tasks written out as a SWE-bench-format row set over local git clones, for
`tasks.imports: [{format: swebench, ...}]` (configs/north-star.yaml, docs/north-star.md).

    .venv/bin/python -m snowcat.benchmarks.swe_mini_swebench OUT_DIR [--count N] [--seed S] [--difficulties 1,2]

writes OUT_DIR/swe-mini.jsonl (SWE-bench's columns: instance_id, repo, base_commit,
problem_statement, patch, test_patch, FAIL_TO_PASS, PASS_TO_PASS, version, difficulty) and one clone
per task under OUT_DIR/repos/snowcat__swe-mini-NNN: the buggy package and its visible tests as the
base commit, then the gold fix as a later commit (as a real SWE-bench repository's history holds
the fix: the importer must hand the agent the base commit only, `git archive`, no history). The
hidden tests exist only in the row's `test_patch`. Everything is offline; the tasks are
`stages/taskgen/swe_mini.py`'s, drawn from `--seed`.

The SWE-bench harness specifies no `snowcat/*` repository, so the import names the command:
`test_command: "python3 -m unittest -v {tests}"` (swe_mini's own).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import numpy as np

from snowcat.stages.taskgen import swe_mini
from snowcat.stages.taskgen.repo import patched_paths

DIFFICULTY = {1: "<15 min fix", 2: "15 min - 1 hour", 3: "1-4 hours"}  # SWE-bench Verified's labels
GIT_ENV = {"GIT_AUTHOR_NAME": "snowcat", "GIT_AUTHOR_EMAIL": "snowcat@example.invalid", "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z"}
GIT_ENV |= {
    "GIT_COMMITTER_NAME": "snowcat",
    "GIT_COMMITTER_EMAIL": "snowcat@example.invalid",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
}


def _git(repo: Path, *args: str, stdin: str | None = None) -> str:
    env = os.environ | GIT_ENV
    return subprocess.run(
        ["git", "-C", str(repo), *args], input=stdin, capture_output=True, text=True, check=True, env=env
    ).stdout.strip()


def write_set(out: Path, count: int, seed: int, difficulties: list[int]) -> Path:
    rng = np.random.default_rng(seed)
    repos = out / "repos"
    repos.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(count):
        difficulty = difficulties[i % len(difficulties)]
        statement, gold, meta = swe_mini.generate(rng, difficulty)
        spec = meta["repo"]
        name = f"swe-mini-{i:03d}"
        clone = repos / f"snowcat__{name}"
        if clone.exists():
            subprocess.run(["rm", "-rf", str(clone)], check=True)
        clone.mkdir()
        _git(clone, "init", "-q", "-b", "main")
        for path, text in spec["source"]["files"].items():
            (clone / path).parent.mkdir(parents=True, exist_ok=True)
            (clone / path).write_text(text)
        _git(clone, "add", "-A")
        _git(clone, "commit", "-qm", f"{name}: base")
        base = _git(clone, "rev-parse", "HEAD")
        _git(clone, "apply", "-", stdin=gold)  # the fix, committed after the base (history the agent must not see)
        _git(clone, "commit", "-qam", f"{name}: fix")
        assert patched_paths(gold), name
        rows.append(
            {
                "instance_id": f"snowcat__{name}",
                "repo": f"snowcat/{name}",
                "base_commit": base,
                "problem_statement": statement,
                "patch": gold,
                "test_patch": spec["test_patch"],
                "FAIL_TO_PASS": json.dumps(spec["fail_to_pass"]),
                "PASS_TO_PASS": json.dumps(spec["pass_to_pass"]),
                "version": "0.0",
                "difficulty": DIFFICULTY[difficulty],
                "hints_text": "",
            }
        )
    path = out / "swe-mini.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--count", type=int, default=40)
    ap.add_argument("--seed", type=int, default=20261205)
    ap.add_argument("--difficulties", default="1,2")
    a = ap.parse_args(argv)
    path = write_set(a.out, a.count, a.seed, [int(d) for d in a.difficulties.split(",")])
    print(f"{path}: {a.count} rows; clones under {a.out / 'repos'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
