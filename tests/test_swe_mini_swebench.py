"""benchmarks/swe_mini_swebench.py: swe_mini tasks as a SWE-bench row set over local clones (the north
star's imported tasks, configs/north-star.yaml) import as SWE-bench rows do: the agent's snapshot is the
base commit without the fix in history, the gold patch passes and the empty patch fails."""

from __future__ import annotations

import json

from snowcat.benchmarks.swe_mini_swebench import write_set
from snowcat.stages.taskgen import verify
from snowcat.stages.taskgen.importers import import_swebench
from snowcat.stages.taskgen.repo import RepoSpec, snapshot_files
from tests.test_importers_sets import needs_sandbox

COMMAND = "python3 -m unittest -v {tests}"  # configs/north-star.yaml's


@needs_sandbox
def test_the_row_set_imports_with_the_base_commit_only_and_its_gold_passes(tmp_path):
    path = write_set(tmp_path / "swe", count=2, seed=3, difficulties=[1])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["instance_id"] for r in rows] == ["snowcat__swe-mini-000", "snowcat__swe-mini-001"]
    tasks = import_swebench(path, tmp_path / "swe" / "repos", test_command=COMMAND, timeout_s=30, memory_mb=512)
    assert len(tasks) == 2
    for task, row in zip(tasks, rows, strict=True):
        spec = RepoSpec.from_task(task)
        # the agent's files are the base commit's: the fix (a later commit) is not among them
        added = [line[1:] for line in row["patch"].splitlines() if line.startswith("+") and not line.startswith("+++")]
        fixed = next(line for line in added if line.strip())  # a line the gold patch adds
        assert not any(fixed.encode() in data for data in snapshot_files(spec).values()), task.task_id
        gold, empty = verify(task, task.answer), verify(task, "")
        assert gold.passed, (task.task_id, gold.detail)
        assert not empty.passed and "FAIL_TO_PASS" in empty.detail, (task.task_id, empty.detail)
