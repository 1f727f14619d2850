"""Repository tasks: the swe-mini generator and the verifier that judges a patch with the task's tests
in a clean sandbox (real LocalSandbox, real `git apply`, real unittest runs)."""

import dataclasses
import json
import os
import shutil
import subprocess

import numpy as np
import pytest
from test_importers import swebench  # noqa: F401 - fixture

from snowcat.stages.agent import RepoEnv
from snowcat.stages.sandbox import write_files
from snowcat.stages.taskgen import Task, VerifierError, generate_domain, split_tasks, task_key, verify
from snowcat.stages.taskgen import repo as repo_mod
from snowcat.stages.taskgen.importers import import_swebench
from snowcat.stages.taskgen.repo import RepoSpec, make_patch, snapshot_files, verify_patch
from snowcat.stages.taskgen.swe_mini import BUG_KINDS

needs_sandbox = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("git"), reason="runs tests in LocalSandbox as root"
)


@pytest.fixture(scope="module")
def tasks():
    return generate_domain(np.random.default_rng(7), "swe_mini", [1, 2, 3], 30)


def test_generation_is_seeded_and_covers_every_bug_kind(tasks):
    again = generate_domain(np.random.default_rng(7), "swe_mini", [1, 2, 3], 30)
    assert [t.task_id for t in again] == [t.task_id for t in tasks]
    assert [t.meta for t in again] == [t.meta for t in tasks]
    other = generate_domain(np.random.default_rng(8), "swe_mini", [1, 2, 3], 30)
    assert {t.task_id for t in other} != {t.task_id for t in tasks}
    assert {t.meta["bug_kind"] for t in tasks} == set(BUG_KINDS)
    assert {t.difficulty for t in tasks} == {1, 2, 3}
    for t in tasks:
        spec = RepoSpec.from_task(t)
        assert t.verifier == "repo" and spec.fail_to_pass and not set(spec.fail_to_pass) & set(spec.pass_to_pass)
        assert t.meta["module"] in t.answer  # the gold patch fixes the buggy module


def test_patch_round_trip_through_git_apply(tmp_path):
    before = {"a.py": b"x = 1\n", "gone.txt": b"bye\n", "tail.txt": b"no newline"}
    after = {"a.py": b"x = 2\n", "new/b.py": b"y = 3\n", "tail.txt": b"still none"}
    patch = make_patch(before, after)
    write_files(tmp_path, before)
    (tmp_path / "p.diff").write_text(patch)
    subprocess.run(["git", "apply", "p.diff"], cwd=tmp_path, check=True, capture_output=True)
    (tmp_path / "p.diff").unlink()
    assert repo_mod.read_tree(tmp_path) == after
    assert repo_mod.patched_paths(patch) == ["a.py", "gone.txt", "new/b.py", "tail.txt"]


@needs_sandbox
def test_gold_patch_passes_and_empty_patch_fails(tasks):
    for t in tasks[:6]:
        good = verify(t, t.answer)
        assert good.passed and good.reward == 1.0, (t.task_id, good.detail)
        bad = verify(t, "")
        assert not bad.passed and bad.reward == 0.0 and "FAIL_TO_PASS" in bad.detail, (t.task_id, bad.detail)


@needs_sandbox
def test_editing_the_tests_gains_nothing(tasks, tmp_path):
    task = tasks[0]
    spec = RepoSpec.from_task(task)
    base = snapshot_files(spec)
    # Neuter every test file (and delete one): the verifier restores them, so the bug is still caught.
    cheat = dict(base)
    for path in spec.test_paths:
        cheat[path] = b"import unittest\n"
    del cheat[spec.test_paths[0]]
    verdict = verify(task, make_patch(base, cheat))
    assert not verdict.passed and "FAIL_TO_PASS" in verdict.detail, verdict
    # ... while the same test edits on top of the real fix still pass (nothing else is judged)
    fixed_module = task.meta["module"]
    gold_files = dict(base)
    fix_dir = repo_mod.materialise_source(spec, tmp_path / "fix")
    (fix_dir / "gold.diff").write_text(task.answer)
    subprocess.run(["git", "apply", "gold.diff"], cwd=fix_dir, check=True)
    gold_files[fixed_module] = (fix_dir / fixed_module).read_bytes()
    assert verify(task, make_patch(base, gold_files | {p: b"import unittest\n" for p in spec.test_paths})).passed


@needs_sandbox
def test_patch_that_does_not_apply_is_the_models_failure(tasks):
    verdict = verify(tasks[0], "diff --git a/nothere.py b/nothere.py\n--- a/nothere.py\n+++ b/nothere.py\n@@ -1 +1 @@\n-a\n+b\n")
    assert not verdict.passed and "does not apply" in verdict.detail


def _task_with(spec: RepoSpec) -> Task:
    return Task("swe-t", "swe", 1, "fix it", "", "repo", {"repo": dataclasses.asdict(spec)})


@needs_sandbox
def test_a_hang_in_the_code_is_the_models_failure_a_broken_harness_is_infra():
    # tests that run past the limit once started: the code under test hangs, reward 0 (never neutral)
    spec = RepoSpec(
        source={"files": {"t.py": "import time\ntime.sleep(30)\n"}},
        test_command="python3 t.py {tests}",
        fail_to_pass=["t"],
        timeout_s=1.0,
    )
    hang = verify(_task_with(spec), "")
    assert not hang.passed and hang.reward == 0.0 and "time limit" in hang.detail
    hangs_in_a_test = RepoSpec(
        source={
            "files": {
                "test_t.py": "import time, unittest\nclass T(unittest.TestCase):\n    def test_a(self):\n        time.sleep(30)\n"
            }
        },
        test_command="python3 -m unittest {tests}",
        fail_to_pass=["test_t.T.test_a"],
        timeout_s=2.0,
    )
    assert "time limit" in verify(_task_with(hangs_in_a_test), "").detail
    # the harness never starting (no interpreter), or no sandbox at all: the machinery's failure
    with pytest.raises(VerifierError, match="harness did not start"):
        verify(_task_with(dataclasses.replace(hangs_in_a_test, test_command="python -m unittest {tests}")), "")
    ok = dataclasses.replace(spec, source={"files": {"t.py": "print('fine')\n"}})
    with pytest.raises(VerifierError, match="sandbox"):
        verify_patch(_task_with(ok), "", image="/nonexistent/sandbox.sif")


def test_repo_spec_refuses_incomplete_tasks():
    with pytest.raises(ValueError, match="exactly one of"):
        RepoSpec(source={}, test_command="x {tests}", fail_to_pass=["a"])
    with pytest.raises(ValueError, match="base_commit"):
        RepoSpec(source={"git": "/r"}, test_command="x {tests}", fail_to_pass=["a"])
    with pytest.raises(ValueError, match="tests"):
        RepoSpec(source={"files": {}}, test_command="pytest", fail_to_pass=["a"])


def test_held_out_split_never_leaks_code_into_training():
    # d3 statements repeat across tasks (only the failing test file is named): identity is the code
    tasks = generate_domain(np.random.default_rng(1234), "swe_mini", [1, 2, 3], 360)
    assert len({t.task_id for t in tasks}) == 360 and len({t.prompt for t in tasks}) < 360
    train, val = split_tasks(tasks, 60, np.random.default_rng(0))
    assert len(val) == 60 and len(train) == 300
    assert not {task_key(t) for t in train} & {task_key(t) for t in val}
    assert not {t.answer + json.dumps(t.meta["repo"]["source"]) for t in train} & {
        t.answer + json.dumps(t.meta["repo"]["source"]) for t in val
    }


@needs_sandbox
def test_a_test_directory_replaced_by_a_symlink_is_the_models_failure(tasks):
    # The patch turns tests/ into a link to /etc: restoring must neither follow it (the host's /etc)
    # nor give up (an infrastructure error would make the episode neutral instead of failed).
    task = tasks[0]
    spec = RepoSpec.from_task(task)
    base = snapshot_files(spec)
    gone = make_patch(base, {p: b for p, b in base.items() if not p.startswith("tests/")})
    link = "diff --git a/tests b/tests\nnew file mode 120000\n--- /dev/null\n+++ b/tests\n@@ -0,0 +1 @@\n+/etc\n\\ No newline at end of file\n"
    before = sorted(os.listdir("/etc"))
    verdict = verify(task, gone + link + task.answer)  # a verdict, not an exception
    assert sorted(os.listdir("/etc")) == before
    # with the gold fix in the same patch it passes: the test files came back as real files
    assert verdict.passed, verdict.detail
    assert not verify(task, gone + link).passed


@needs_sandbox
def test_a_git_snapshot_is_archived_once_per_task_and_no_episode_reaches_it(swebench, monkeypatch):  # noqa: F811
    """N episodes and verifications of one git-sourced task: `git archive` runs once (counted on the
    real subprocess.run); each episode edits, deletes and adds files in its sandbox and its own copy
    of the base, yet the next one starts from the base commit and the verifier still judges right."""
    path, repos, _ = swebench
    (task,) = import_swebench(path, repos, test_command="python3 -m unittest -v {tests}")
    archives = []
    run = subprocess.run

    def counting(argv, *args, **kwargs):
        if list(argv[:1]) == ["git"] and "archive" in argv:
            archives.append(argv)
        return run(argv, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", counting)
    env = RepoEnv(None)
    pristine = None
    for attempt in range(4):
        state = env.reset(task)
        try:
            base = state["base"]
            pristine = pristine or dict(base)
            assert base == pristine and "a - b" in env.run_tool(state, "view", {"path": "calc/ops.py"})
            if attempt == 0:  # the fix, through the tools: the tests pass
                env.run_tool(state, "edit", {"path": "calc/ops.py", "old": "a - b", "new": "a + b"})
                assert env.submit(task, state).reward == 1.0
            else:  # vandalism in the work dir and in the episode's copy of the base
                env.run_tool(state, "bash", {"command": "rm -r tests && echo 'x = 1' > calc/ops.py && touch new.py"})
                base["calc/ops.py"] = b"overwritten"
                del base["tests/test_old.py"]
                assert env.submit(task, state).reward == 0.0
        finally:
            env.finish(state)
    assert verify(task, task.answer).passed and not verify(task, "").passed  # the verifier's own snapshot: the cache
    assert snapshot_files(RepoSpec.from_task(task)) == pristine
    assert len(archives) == 1, archives
    assert not any(p.startswith(".git") for p in pristine) and "tests/test_new.py" not in pristine  # no history, no hidden tests


def test_the_snapshot_cache_is_bounded_and_gives_each_caller_its_own_dict():
    cache = repo_mod._SnapshotCache(max_bytes=10)
    made = []

    def tree(name, size):
        return lambda: made.append(name) or {f"{name}.py": b"x" * size}

    a = cache.get(("a",), tree("a", 6))
    a["a.py"] = b"changed"
    assert cache.get(("a",), tree("a", 6)) == {"a.py": b"x" * 6} and made == ["a"]
    cache.get(("b",), tree("b", 3))
    cache.get(("a",), tree("a", 6))  # a used last: b goes first when c does not fit
    cache.get(("c",), tree("c", 4))
    cache.get(("a",), tree("a", 6))
    cache.get(("b",), tree("b", 3))
    assert made == ["a", "b", "c", "b"]
    with pytest.raises(RuntimeError, match="archive failed"):
        cache.get(("d",), lambda: (_ for _ in ()).throw(RuntimeError("archive failed")))
    assert cache.get(("d",), tree("d", 1)) == {"d.py": b"x"}  # a failed make is not cached
