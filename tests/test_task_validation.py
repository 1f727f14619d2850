"""Task validation: each repository task's gold and empty solutions through its own harness (real
verifier, LocalSandbox), the exclusions with their reasons, the cache by task hash, and the tasks
stage keeping only valid tasks."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
from test_importers import harbor, swebench  # noqa: F401 - fixtures

from snowcat.pipeline.context import Preempted, StageContext
from snowcat.stages import tasks as tasks_stage
from snowcat.stages.taskgen import Task, generate_domain, load_tasks
from snowcat.stages.taskgen import validate as validate_mod
from snowcat.stages.taskgen.importers import import_harbor
from snowcat.stages.taskgen.repo import RepoSpec, make_patch
from snowcat.stages.taskgen.validate import check_task, summary, task_hash, validate_tasks

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("git"), reason="verifies in LocalSandbox as root"
)

CODE = "def add(a, b):\n    return a - b\n"
TESTS = "import unittest\nfrom calc import add\n\nclass T(unittest.TestCase):\n    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n"


def _task(
    task_id: str,
    gold: str = "def add(a, b):\n    return a + b\n",
    tests: str = TESTS,
    command: str = "python3 -m unittest -v {tests}",
):
    files = {"calc.py": CODE, "test_calc.py": tests}
    spec = RepoSpec(source={"files": files}, test_command=command, fail_to_pass=["test_calc.T.test_add"], timeout_s=20.0)
    patch = make_patch({"calc.py": CODE.encode()}, {"calc.py": gold.encode()})
    return Task(task_id, "swe", 1, "add() is wrong", patch, "repo", {"repo": spec.to_meta()})


@pytest.mark.slow  # ~10 s on 2 cores: each kind of bad task verified in its own sandbox
def test_each_kind_of_bad_task_is_named_for_what_is_wrong():
    assert check_task(_task("ok")).status == "valid"
    wrong_gold = check_task(_task("wrong-gold", gold="def add(a, b):\n    return a * b\n"))
    assert wrong_gold.status == "gold_fails" and "FAIL_TO_PASS 1/1" in wrong_gold.detail and wrong_gold.gold == [False, False]
    blind = check_task(_task("blind", tests=TESTS.replace("add(2, 3), 5", "add(3, 0), 3")))
    assert blind.status == "empty_passes" and blind.empty == [True, True]
    # SWE-bench's default command in a sandbox with no `python`: the harness, not the model -- never cached
    no_python = check_task(_task("no-python", command="python -m pytest -rA {tests}"))
    assert no_python.status == "infra" and "harness did not start" in no_python.detail
    nothing = dataclasses.replace(_task("no-gold"), answer="")
    assert check_task(nothing).status == "no_gold"


def test_flaky_tests_are_told_apart_from_broken_ones(monkeypatch):
    """Flakiness cannot be made to order in a sandbox, so a TEST DOUBLE of verify_patch replays
    scripted verdicts to the classification (the real verifier runs in the test above)."""
    script = []

    def replay_verdicts_double(task, patch, image=None, solution=""):
        passed = script.pop(0)
        return float(passed), passed, "scripted"

    monkeypatch.setattr(validate_mod, "verify_patch", replay_verdicts_double)
    task = _task("t")
    for verdicts, status in (
        ([True, False, False, False], "flaky"),  # gold passes once in two
        ([True, True, True, False], "flaky"),  # empty passes once in two
        ([True, False, True, False], "valid"),
        ([False, False, False, False], "gold_fails"),
        ([True, True, True, True], "empty_passes"),
    ):
        script[:] = verdicts
        assert check_task(task).status == status, verdicts


def test_verdicts_are_cached_by_task_hash_and_infra_is_tried_again(tmp_path, monkeypatch):
    tasks = [
        _task("ok"),
        _task("wrong-gold", gold="def add(a, b):\n    return 0\n"),
        _task("infra", command="python -m unittest {tests}"),
    ]
    calls = []
    real = validate_mod.verify_patch
    monkeypatch.setattr(validate_mod, "verify_patch", lambda task, *a, **k: calls.append(task.task_id) or real(task, *a, **k))
    first = validate_tasks(tasks, tmp_path / "cache", runs=2, workers=2)
    assert {k: c.status for k, c in first.items()} == {"ok": "valid", "wrong-gold": "gold_fails", "infra": "infra"}
    assert sorted(p.stem for p in (tmp_path / "cache").glob("*.json")) == sorted(task_hash(t) for t in tasks[:2])
    calls.clear()
    renamed = dataclasses.replace(tasks[0], task_id="ok-again")  # same content, another id: the cache holds it
    second = validate_tasks([renamed, *tasks[1:]], tmp_path / "cache", runs=2)
    assert set(calls) == {"infra"}  # only the infrastructure failure ran again
    assert second["ok-again"].status == "valid" and second["ok-again"].task_id == "ok-again"
    assert summary(second) == {"valid": 1, "gold_fails": 1, "empty_passes": 0, "flaky": 0, "no_gold": 0, "infra": 1}
    changed = dataclasses.replace(tasks[0], prompt="add() is still wrong")
    assert task_hash(changed) != task_hash(tasks[0])


def test_a_harbor_task_is_validated_with_its_solution_script(harbor):  # noqa: F811
    task = import_harbor(harbor)
    assert task.answer == "" and check_task(task).status == "valid"  # solve.sh, then tests/test.sh
    broken = dataclasses.replace(task, meta=task.meta | {"solution": "sed -i 's/wrld/wurld/' greet.sh\n"})
    assert check_task(broken).status == "gold_fails"


def test_the_tasks_stage_keeps_only_valid_tasks_and_says_why(tmp_path, swebench):  # noqa: F811
    jsonl, repos, row = swebench
    bad = dict(row, instance_id="acme__calc-2", patch=row["patch"].replace("a + b", "a * b"))
    jsonl.write_text(json.dumps(row) + "\n" + json.dumps(bad) + "\n")
    values = {
        "imports": [
            {"format": "swebench", "path": str(jsonl), "repos_dir": str(repos), "test_command": "python3 -m unittest -v {tests}"}
        ]
    }
    ctx = StageContext.standalone("tasks", values, run_dir=tmp_path, seed=5)
    metrics = tasks_stage.run(ctx)
    assert [t.task_id for t in load_tasks(ctx.out_dir, "train")] == ["acme__calc-1"]
    manifest = json.loads((ctx.out_dir / "validation.json").read_text())
    assert manifest["counts"]["valid"] == 1 and manifest["excluded"]["acme__calc-2"]["status"] == "gold_fails"
    assert metrics["validation/gold_fails"] == 1 and metrics["validation/checked"] == 2 and metrics["swe/train"] == 1


def test_generated_tasks_are_checked_when_asked_and_a_stopped_check_resumes(tmp_path, monkeypatch):
    # one run per solution: what a second run adds (flakiness) is the two tests' above
    validate = {"tasks": "all", "runs": 1}
    values = {"domains": {"swe_mini": {"count": 4, "val_count": 1, "difficulties": [1]}}, "validate": validate}
    ctx = StageContext.standalone("tasks", values, run_dir=tmp_path, seed=3)
    due = iter([False, True])  # preempted after the first check
    monkeypatch.setattr(ctx, "checkpoint_due", lambda: next(due, True))
    monkeypatch.setattr(ctx.config.validate, "workers", 1)
    with pytest.raises(Preempted, match="1 of 4 checked"):
        tasks_stage.run(ctx)
    assert len(list((tmp_path / "cache" / "task-validation").glob("*.json"))) == 1  # the run's verdict cache
    monkeypatch.setattr(ctx, "checkpoint_due", lambda: False)
    metrics = tasks_stage.run(ctx)
    assert metrics["validation/valid"] == 4 and metrics["swe_mini/train"] == 3
    expected = generate_domain(np.random.default_rng(3), "swe_mini", [1], 4)
    assert sorted(t.task_id for t in load_tasks(ctx.out_dir, "train") + load_tasks(ctx.out_dir, "val")) == sorted(
        t.task_id for t in expected
    )


ARRAY_RUN = """\
name: validate-array
executor: {{kind: local}}
stages:
  validate: {{kind: validate, fan_out: {{shard: [0, 1]}}}}
  tasks:
    kind: tasks
    needs: [validate]
    imports: [{{format: swebench, path: {jsonl}, repos_dir: {repos}, test_command: "python3 -m unittest -v {{tests}}"}}]
"""


@pytest.mark.slow
def test_a_validate_array_checks_the_imports_before_the_tasks_stage_which_only_filters(tmp_path, swebench, snowcat):  # noqa: F811
    """Two array elements split the imported tasks by content hash and check them into the run's
    cache; the tasks stage that needs them finds every verdict there: it verifies nothing itself."""
    jsonl, repos, row = swebench
    rows = [row] + [
        dict(row, instance_id=f"acme__calc-{i}", patch=row["patch"].replace("a + b", op))
        for i, op in ((2, "a * b"), (3, "b - a"))
    ]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "array.yaml"
    config.write_text(ARRAY_RUN.format(jsonl=jsonl, repos=repos))
    run_dir = tmp_path / "run"
    snowcat("run", config, "--run-dir", run_dir, check=True)
    shards = [json.loads((run_dir / "stages" / "validate" / f"{i:04d}" / "validation.json").read_text()) for i in (0, 1)]
    assert sum(s["checked"] for s in shards) == 3 and {s["shard"] for s in shards} == {0, 1}
    excluded = {k: v["status"] for s in shards for k, v in s["excluded"].items()}
    assert excluded == {"acme__calc-2": "gold_fails", "acme__calc-3": "gold_fails"}
    cached = {p.stem: p.stat().st_mtime_ns for p in (run_dir / "cache" / "task-validation").glob("*.json")}
    assert len(cached) == 3
    tasks_dir = run_dir / "stages" / "tasks"
    manifest = json.loads((tasks_dir / "validation.json").read_text())
    assert manifest["counts"]["valid"] == 1 and set(manifest["excluded"]) == set(excluded)
    assert [t.task_id for t in load_tasks(tasks_dir, "train")] == ["acme__calc-1"]
    assert {p.stem: p.stat().st_mtime_ns for p in (run_dir / "cache" / "task-validation").glob("*.json")} == cached
    # a validate stage the tasks stage does not wait for would check alongside it: refused with the fix
    config.write_text(ARRAY_RUN.format(jsonl=jsonl, repos=repos).replace("    needs: [validate]\n", ""))
    bad = snowcat("run", config, "--run-dir", tmp_path / "run2")
    assert bad.returncode != 0 and "stages.tasks.needs: add 'validate'" in bad.stdout + bad.stderr
