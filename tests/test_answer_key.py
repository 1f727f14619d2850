"""No answer key in the agent's view: the hidden tests (what only the verifier's `test_patch` brings:
SWE-bench's test_patch, Harbor's tests/, swe_mini's tests/test_hidden_*.py) are never named or shown
by the prompt, a tool result or a demonstration; RepoEnv's `test` runs the visible tests alone; and
swe_mini's hidden tests call on inputs no visible test uses, so a patch fitted to the visible
inputs passes what the agent can run and still gets reward 0 from the verifier."""

from __future__ import annotations

import ast
import dataclasses
import os
import shutil

import numpy as np
import pytest
from test_importers import swebench  # noqa: F401 - fixture

from snowcat.stages.agent import RepoEnv, teacher_messages
from snowcat.stages.agent.repo_env import NO_VISIBLE_TESTS, visible_tests
from snowcat.stages.taskgen import Task, generate_domain, verify
from snowcat.stages.taskgen.importers import import_harbor, import_swebench
from snowcat.stages.taskgen.repo import RepoSpec, make_patch, patched_paths, snapshot_files
from snowcat.stages.taskgen.swe_mini import BUG_KINDS

needs_sandbox = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("git"), reason="runs tools in LocalSandbox as root"
)


def _task(spec: RepoSpec, **meta) -> Task:
    return Task("t", "swe", 1, "fix it", "", "repo", {"repo": dataclasses.asdict(spec)} | meta)


def test_the_visible_tests_are_those_whose_file_the_snapshot_has_untouched():
    base = {
        "pkg/__init__.py": b"",
        "tests/__init__.py": b"",
        "tests/test_old.py": b"...",
        "tests/test_changed.py": b"...",
        "tests/unit/__init__.py": b"",
        "tests/unit/test_deep.py": b"...",
        "tests/test_py.py": b"...",
    }
    test_patch = make_patch(
        {"tests/test_changed.py": b"...\n"},
        {"tests/test_changed.py": b"...\nnew\n", "tests/test_new.py": b"new\n", "tests/test.sh": b"exit 0\n"},
    )
    spec = RepoSpec(
        source={"files": {p: b.decode() for p, b in base.items()}},
        test_command="python3 -m unittest -v {tests}",
        fail_to_pass=[
            "tests.test_new.N.test_add",  # a file the test patch adds
            "tests.test_changed.C.test_more",  # a file the test patch changes: the agent's copy is not it
            "tests.test_old.T.test_zero",
            "tests/test.sh",  # a script the test patch adds (Harbor)
        ],
        pass_to_pass=[
            "tests.unit.test_deep.D.test_x",
            "tests.test_old",  # a whole module
            "tests/test_py.py::test_y",  # pytest ids
            "tests.test_gone.G.test_z",  # no file defines it: never visible
            "tests.test_old.T.test_zero",
        ],
        test_patch=test_patch,
    )
    assert visible_tests(_task(spec), base) == [
        "tests.test_old.T.test_zero",
        "tests.unit.test_deep.D.test_x",
        "tests.test_old",
        "tests/test_py.py::test_y",
    ]
    # a task may name its visible tests itself (e.g. the unchanged tests of a changed file)
    named = _task(spec, visible_tests=["tests.test_changed.C.test_old_one"])
    assert visible_tests(named, base) == ["tests.test_changed.C.test_old_one"]


# ---------------------------------------------------------------- swe_mini: hidden tests on hidden inputs


def _calls(module_text: str) -> dict[str, list[tuple[str, object]]]:
    """class name -> [(call, expected value)] of a swe_mini test module, in test order."""
    out = {}
    for cls in ast.parse(module_text).body:
        if isinstance(cls, ast.ClassDef):
            out[cls.name] = []
            for method in cls.body:
                (stmt,) = method.body
                call, expected = (arg.args[0] for arg in stmt.value.args)  # assertEqual(exact(call), exact(value))
                out[cls.name].append((ast.unparse(call), ast.literal_eval(expected)))
    return out


def _hidden_files(spec: RepoSpec) -> dict[str, str]:
    """The files the test patch adds, with their text (swe_mini's patches only add files)."""
    files, path = {}, None
    for line in spec.test_patch.splitlines():
        if line.startswith("+++ b/"):
            path = line[6:]
            files[path] = ""
        elif line.startswith("+") and path:
            files[path] += line[1:] + "\n"
    return files


def _split(task: Task) -> tuple[dict, dict]:
    """(visible, hidden): test id -> its call, for a swe_mini task."""
    spec = RepoSpec.from_task(task)
    files = spec.source["files"] | _hidden_files(spec)
    out = ({}, {})
    for test_id in spec.fail_to_pass + spec.pass_to_pass:
        mod, cls, name = test_id.rsplit(".", 2)
        call = _calls(files[mod.replace(".", "/") + ".py"])[cls][int(name.removeprefix("test_"))][0]
        out["test_hidden_" in mod][test_id] = call
    return out


def test_swe_mini_holds_back_hidden_tests_on_inputs_the_agent_never_sees():
    tasks = generate_domain(np.random.default_rng(11), "swe_mini", [1, 2, 3], 240)
    assert {t.meta["bug_kind"] for t in tasks} == set(BUG_KINDS)
    for t in tasks:
        spec = RepoSpec.from_task(t)
        base = snapshot_files(spec)
        visible, hidden = _split(t)
        hidden_paths = patched_paths(spec.test_patch)
        assert hidden_paths and all(p.startswith("tests/test_hidden_") and p not in base for p in hidden_paths)
        assert visible_tests(t, base) == list(visible)  # the tool runs exactly the repository's own tests
        f2p = set(spec.fail_to_pass)
        assert f2p & set(visible), t.task_id  # the agent can see the bug ...
        # ... and a hidden test on an input no visible test uses catches it too
        assert any(test_id in f2p and call not in visible.values() for test_id, call in hidden.items()), t.task_id
        assert not set(hidden.values()) & set(visible.values())
        assert not any(call in t.prompt for call in hidden.values())
    again = generate_domain(np.random.default_rng(11), "swe_mini", [1, 2, 3], 240)
    assert [t.meta for t in again] == [t.meta for t in tasks]  # still seeded


def _fitted_module(task: Task) -> tuple[str, bytes]:
    """(path, text) of the buggy module with its function wrapped to answer every visible call with
    its expected value and fall back to the bug elsewhere: a model special-casing the tests it sees."""
    spec = RepoSpec.from_task(task)
    base = snapshot_files(spec)
    name, module = task.meta["function"], task.meta["module"]
    cls = "Test" + "".join(p.title() for p in name.split("_"))
    mod = module.rsplit("/", 1)[1].removesuffix(".py")
    answers = dict(_calls(base[f"tests/test_{mod}.py"].decode())[cls])
    fitted = (
        f"\n\n_buggy = {name}\n_ANSWERS = {answers!r}\n\n\n"
        f"def {name}(*args):\n"
        f"    call = '{name}(' + ', '.join(repr(a) for a in args) + ')'\n"
        f"    return _ANSWERS[call] if call in _ANSWERS else _buggy(*args)\n"
    )
    return module, base[module] + fitted.encode()


@needs_sandbox
@pytest.mark.parametrize("bug_kind", BUG_KINDS)
def test_a_patch_fitted_to_the_visible_inputs_passes_them_and_gets_reward_0(bug_kind):
    task = next(t for t in generate_domain(np.random.default_rng(5), "swe_mini", [1, 2, 3], 40) if t.meta["bug_kind"] == bug_kind)
    module, fitted = _fitted_module(task)
    env = RepoEnv(None)
    state = env.reset(task)
    try:
        before = env.run_tool(state, "test", {})
        (state["sandbox"].workdir / module).write_bytes(fitted)
        after = env.run_tool(state, "test", {})
        patch = make_patch(state["base"], state["base"] | {module: fitted})
    finally:
        env.finish(state)
    assert before.startswith("exit 1") and "FAILED" in before, before
    assert after.startswith("exit 0") and after.rstrip().endswith("OK"), after  # every visible test passes
    verdict = verify(task, patch)
    assert verdict.reward == 0.0 and "FAIL_TO_PASS" in verdict.detail, (task.task_id, verdict.detail)


# ---------------------------------------------------------------- every task source: nothing hidden shown


def _harbor_task(tmp_path) -> Task:
    root = tmp_path / "fix-greeting"
    for d in ("environment", "tests", "solution"):
        (root / d).mkdir(parents=True)
    (root / "instruction.md").write_text("Make greet.sh print 'hello world'.\n")
    (root / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 20.0\n[environment]\nmemory = "1G"\n')
    (root / "environment" / "greet.sh").write_text("echo 'hello wrld'\n")
    (root / "tests" / "test.sh").write_text(  # Harbor's convention: the verdict is the reward file
        'out="$(sh greet.sh)"\nif [ "$out" = "hello world" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n'
    )
    (root / "solution" / "solve.sh").write_text("#!/bin/bash\nset -euo pipefail\nsed -i 's/wrld/world/' greet.sh\n")
    return import_harbor(root)


def _hidden(task: Task, base: dict[str, bytes]) -> list[str]:
    """What the agent must never see: the ids of the tests only the test patch brings, the files it
    adds or changes (by path and module name), and every line of it no snapshot file has."""
    spec = RepoSpec.from_task(task)
    ids = [t for t in spec.fail_to_pass + spec.pass_to_pass if t not in visible_tests(task, base)]
    paths = patched_paths(spec.test_patch)
    names = [p.rsplit("/", 1)[-1].removesuffix(".py") for p in paths if p not in base]
    seen = {line.strip() for b in base.values() for line in b.decode(errors="replace").splitlines()}
    lines = [
        line[1:].strip()
        for line in spec.test_patch.splitlines()
        if line.startswith("+") and not line.startswith("+++") and line[1:].strip() not in seen
    ]
    return sorted(set(ids + paths + names + [x for x in lines if x]))


def _strings(value) -> list[str]:
    """Every string in a message (content, tool-call arguments, ...), as the template renders it."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _views(task: Task) -> list[str]:
    """The prompt, every tool result of an episode that runs the tests, lists and views every file,
    and the scripted expert's demonstration."""
    env = RepoEnv(None, observation_chars=100_000)
    out = _strings(env.opening(task))
    state = env.reset(task)
    try:
        out.append(env.run_tool(state, "test", {}))
        out.append(env.run_tool(state, "bash", {"command": "ls -laR"}))
        out += [env.run_tool(state, "view", {"path": p}) for p in sorted(state["base"])]
    finally:
        env.finish(state)
    out += _strings(teacher_messages(task, "repo"))
    return out


def _leaks(views: list[str], hidden: list[str]) -> list[tuple[str, str]]:
    return [(h, v[:200]) for v in views for h in hidden if h in v]


@needs_sandbox
@pytest.mark.parametrize("source", ["swe_mini-d1", "swe_mini-d2", "swe_mini-d3", "swebench", "harbor"])
def test_no_hidden_test_in_the_prompt_the_tool_results_or_the_demonstration(source, request, tmp_path):
    if source.startswith("swe_mini"):  # one task per difficulty
        tasks = generate_domain(np.random.default_rng(2), "swe_mini", [int(source[-1])], 1)
    elif source == "swebench":
        path, repos, _ = request.getfixturevalue("swebench")
        tasks = import_swebench(path, repos, test_command="python3 -m unittest -v {tests}")
    else:
        tasks = [_harbor_task(tmp_path)]
    for task in tasks:
        base = snapshot_files(RepoSpec.from_task(task))
        hidden = _hidden(task, base)
        assert hidden, task.task_id
        views = _views(task)
        assert not _leaks(views, hidden), _leaks(views, hidden)
        first_test = next(v for v in views if v.startswith(("exit ", NO_VISIBLE_TESTS)))
        if source.startswith("swe_mini"):  # the visible tests show the bug
            assert first_test.startswith("exit 1") and "FAILED" in first_test and "tests.test_" in first_test, first_test
        elif source == "swebench":  # the repository's own test passes; the hidden one is what fails
            assert first_test.startswith("exit 0") and "test_zero" in first_test, first_test
        else:
            assert first_test == NO_VISIBLE_TESTS
        # the check is not vacuous: the test command's output on every judged test names hidden ones
        spec = RepoSpec.from_task(task)
        env = RepoEnv(None)
        state = env.reset(task)
        try:
            r = state["sandbox"].run(spec.command(spec.fail_to_pass + spec.pass_to_pass), timeout_s=30)
        finally:
            env.finish(state)
        assert _leaks([r.stdout + r.stderr], hidden), r
