"""SWE-bench rows get SWE-bench's own harness (the `swebench` package): the official test command, the
instance image, the repository at /testbed, and the judge: snowcat's observer for a pytest repository,
SWE-bench's log parser and grading for Django's runner. The clones are tiny local stand-ins of the
repositories (no Docker or Apptainer here: the sandbox is LocalSandbox, the image's conda environment
is replaced by a stand-in `env_setup`)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from snowcat.pipeline.errors import UserError
from snowcat.stages.prestage import prestage
from snowcat.stages.sandbox import ApptainerSandbox, LocalSandbox, check_inside, open_sandbox
from snowcat.stages.taskgen import Task, swebench_harness
from snowcat.stages.taskgen.importers import import_swebench
from snowcat.stages.taskgen.repo import RepoSpec, make_patch, verify_patch
from snowcat.stages.tasks import _staged_images

pytest.importorskip("swebench.harness.constants")

needs_sandbox = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("git"), reason="verifies in LocalSandbox as root"
)
FAKE_APPTAINER = Path(__file__).parent / "fake_apptainer"

# Django's runner in verbose mode, as SWE-bench's parse_log_django reads it: a stand-in for
# tests/runtests.py that runs the named test modules with unittest and prints Django's lines
RUNTESTS = """#!/usr/bin/env python3
import importlib, sys, unittest
sys.path.insert(0, "tests")
sys.path.insert(0, ".")
args = [a for a in sys.argv[1:] if not a.startswith("-") and not a.isdigit()]  # --verbosity 2
suite = unittest.TestSuite(unittest.defaultTestLoader.loadTestsFromModule(importlib.import_module(m)) for m in args)
def ids(s):
    for t in s:
        yield from (ids(t) if isinstance(t, unittest.TestSuite) else [t])
failed = 0
for test in ids(suite):
    name = f"{test._testMethodName} ({type(test).__module__}.{type(test).__qualname__})"
    r = unittest.TestResult()
    test.run(r)
    status = "ok" if r.wasSuccessful() else ("ERROR" if r.errors else "FAIL")
    failed += status != "ok"
    print(f"{name} ... {status}")
sys.exit(1 if failed else 0)
"""


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def _clone(root: Path, files: dict[str, str]) -> str:
    root.mkdir(parents=True)
    _git(root, "init", "-q", "-b", "main")
    _git(root, "config", "user.email", "t@example.com")
    _git(root, "config", "user.name", "t")
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    _git(root, "add", ".")
    _git(root, "commit", "-qm", "base")
    return _git(root, "rev-parse", "HEAD")


@pytest.fixture
def rows(tmp_path):
    """Two SWE-bench rows over local clones: django/django 4.0 (its runner prints Django's verbose
    format) and pytest-dev/pytest 7.0 (a pytest repository)."""
    repos = tmp_path / "repos"
    base = _clone(
        repos / "django__django",
        {
            "django/__init__.py": "",
            "django/text.py": "def slug(s):\n    return s  # bug\n",
            "tests/runtests.py": RUNTESTS,
            "tests/utils_tests/__init__.py": "",
            "tests/utils_tests/test_old.py": "import unittest\n\nclass OldTests(unittest.TestCase):\n    def test_keep(self):\n        pass\n",
        },
    )
    old = "import unittest\n\nclass OldTests(unittest.TestCase):\n    def test_keep(self):\n        pass\n"
    new = (
        old
        + "\nfrom django.text import slug\n\nclass SlugTests(unittest.TestCase):\n    def test_lower(self):\n        self.assertEqual(slug('A B'), 'a-b')\n"
    )
    django = {
        "instance_id": "django__django-99001",
        "repo": "django/django",
        "version": "4.0",
        "base_commit": base,
        "problem_statement": "slug() does nothing",
        "patch": make_patch(
            {"django/text.py": b"def slug(s):\n    return s  # bug\n"},
            {"django/text.py": b"def slug(s):\n    return s.lower().replace(' ', '-')\n"},
        ),
        "test_patch": make_patch(
            {"tests/utils_tests/test_old.py": old.encode()}, {"tests/utils_tests/test_old.py": new.encode()}
        ),
        "FAIL_TO_PASS": json.dumps(["test_lower (utils_tests.test_old.SlugTests)"]),
        "PASS_TO_PASS": json.dumps(["test_keep (utils_tests.test_old.OldTests)"]),
    }
    base = _clone(
        repos / "pytest-dev__pytest",
        {
            "src/calc.py": "def add(a, b):\n    return a - b  # bug\n",
            "testing/test_old.py": "import sys\nsys.path.insert(0, 'src')\nfrom calc import add\n\ndef test_zero():\n    assert add(0, 0) == 0\n",
        },
    )
    new = "import sys\nsys.path.insert(0, 'src')\nfrom calc import add\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    pyrow = {
        "instance_id": "pytest-dev__pytest-99002",
        "repo": "pytest-dev/pytest",
        "version": "7.0",
        "base_commit": base,
        "problem_statement": "add() subtracts",
        "patch": make_patch(
            {"src/calc.py": b"def add(a, b):\n    return a - b  # bug\n"}, {"src/calc.py": b"def add(a, b):\n    return a + b\n"}
        ),
        "test_patch": make_patch({}, {"testing/test_add.py": new.encode()}),
        "FAIL_TO_PASS": ["testing/test_add.py::test_add"],
        "PASS_TO_PASS": ["testing/test_old.py::test_zero"],
    }
    path = tmp_path / "swe.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (django, pyrow)))
    return path, repos, django, pyrow


def test_rows_get_the_official_command_image_workdir_and_harness(rows):
    path, repos, django, pyrow = rows
    dj, py = import_swebench(path, repos)
    spec = RepoSpec.from_task(dj)
    assert spec.test_command == "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 utils_tests.test_old"
    assert (spec.harness, dj.meta["verdict"], spec.workdir) == ("swebench", "log", "/testbed")
    assert spec.swebench == {"instance_id": "django__django-99001", "repo": "django/django", "version": "4.0"}
    assert dj.meta["image"] == "swebench/sweb.eval.x86_64.django_1776_django-99001:latest"  # instance_image_key
    assert "conda activate testbed" in spec.env_setup and spec.install == "python -m pip install -e ."
    spec = RepoSpec.from_task(py)
    assert (spec.test_command, spec.harness, py.meta["verdict"], spec.workdir) == (
        "pytest -rA {tests}",
        "pytest",
        "observer",
        "/testbed",
    )
    assert py.meta["image"] == "swebench/sweb.eval.x86_64.pytest-dev_1776_pytest-99002:latest"
    assert py.meta["test_directives"] == ["testing/test_add.py"]
    # an explicit test_command wins over the official harness (and the task stays at /workspace)
    dj2, _ = import_swebench(path, repos, test_command="python3 -m unittest -v {tests}")
    spec = RepoSpec.from_task(dj2)
    assert (spec.test_command, spec.harness, spec.workdir, "image" in dj2.meta) == (
        "python3 -m unittest -v {tests}",
        "",
        "",
        False,
    )


def test_grading_is_swebenchs_parser_and_rules():
    row = {"instance_id": "django__django-1", "repo": "django/django", "version": "4.0"}
    start, end = swebench_harness.markers()
    log = f"{start}\ntest_a (m.T) ... ok\ntest_b (m.T) ... FAIL\n{end}\n"
    assert swebench_harness.grade(row, ["test_a (m.T)"], [], log)[0]
    resolved, report = swebench_harness.grade(row, ["test_a (m.T)"], ["test_b (m.T)"], log)
    assert not resolved and report["tests_status"]["PASS_TO_PASS"]["failure"] == ["test_b (m.T)"]
    assert not swebench_harness.grade(row, ["test_c (m.T)"], [], log)[0]  # never reported: not passed
    assert swebench_harness.is_pytest("PYTHONWARNINGS=x pytest -rA") and not swebench_harness.is_pytest("./tests/runtests.py")


def _local(task):
    """The task as it runs here: no image, so no conda env (env_setup and install: stand-ins that
    still show they run in the test's shell, before the tests)."""
    repo = dict(task.meta["repo"], env_setup="export SNOWCAT_ENV=1\ncd /testbed", install="echo installed > .installed")
    meta = {k: v for k, v in task.meta.items() if k != "image"} | {"repo": repo}
    return dataclasses.replace(task, meta=meta)


@needs_sandbox
def test_django_style_task_is_graded_from_its_log(rows):
    path, repos, django, _ = rows
    dj, _ = import_swebench(path, repos)
    task = _local(dj)
    assert verify_patch(task, django["patch"])[:2] == (1.0, True)
    reward, passed, detail = verify_patch(task, "")
    assert (reward, passed) == (0.0, False) and "FAIL_TO_PASS 1/1 failing" in detail
    # a FAIL_TO_PASS test the runner never reports is not passed
    repo = dict(task.meta["repo"], fail_to_pass=["test_missing (utils_tests.test_old.SlugTests)"])
    missing = dataclasses.replace(task, meta=task.meta | {"repo": repo})
    assert verify_patch(missing, django["patch"])[:2] == (0.0, False)


@pytest.mark.slow  # ~8 s on 2 cores: a repository's pytest run in a sandbox, twice
@needs_sandbox
def test_pytest_style_task_goes_through_the_observer(rows):
    path, repos, _, pyrow = rows
    _, py = import_swebench(path, repos)
    task = _local(py)
    # the observer's python: this interpreter (with pytest), as the image's conda env would give it
    repo = dict(task.meta["repo"], test_command=f"{os.path.realpath(os.sys.executable)} -m pytest -rA {{tests}}")
    task = dataclasses.replace(task, meta=task.meta | {"repo": repo})
    assert verify_patch(task, pyrow["patch"]) == (1.0, True, "2 tests pass")
    reward, _, detail = verify_patch(task, "")
    assert reward == 0.0 and "FAIL_TO_PASS 1/1 failing" in detail
    # printing pytest's own PASSED lines forges nothing: the observer's report is the verdict
    forged = make_patch({}, {"src/sitecustomize_note.py": b""}) + pyrow["patch"].replace(
        "return a + b", "print('testing/test_add.py::test_add PASSED'); return a - b"
    )
    assert verify_patch(task, forged)[0] == 0.0


@needs_sandbox
def test_sandbox_shows_the_work_dir_at_inside():
    with LocalSandbox(inside="/testbed") as sb:
        r = sb.run("pwd; echo hi > f; echo $HOME")
        assert r.stdout.split() == ["/testbed", "/testbed"] and (sb.workdir / "f").read_text() == "hi\n"
    for bad in ("testbed", "/usr/x", "/tmp", "/", "/a b", "/a:b", "/a/../b"):
        with pytest.raises(ValueError):
            check_inside(bad)


def test_apptainer_sandbox_binds_the_work_dir_at_inside(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{FAKE_APPTAINER}:{os.environ['PATH']}")  # the TEST DOUBLE of apptainer
    image = tmp_path / "img.sif"
    image.write_text("FAKE-SIF {}\n")
    sb = open_sandbox(str(image), inside="/testbed")
    assert isinstance(sb, ApptainerSandbox)
    argv = sb.command("true")
    assert f"{sb.workdir}:/testbed" in argv and argv[argv.index("--pwd") + 1] == "/testbed"
    r = sb.run("pwd")
    assert r.status == "ok" and os.path.realpath(r.stdout.strip()) == os.path.realpath(sb.workdir)
    sb.close()


def test_prestage_pulls_an_image_and_the_tasks_stage_takes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{FAKE_APPTAINER}:{os.environ['PATH']}")  # the TEST DOUBLE of apptainer
    ref = "docker://swebench/sweb.eval.x86_64.django_1776_django-99001:latest"
    index = prestage(tmp_path / "staged", [{"kind": "image", "name": ref}])["artefacts"]
    assert index[ref]["kind"] == "image" and index[ref]["path"].endswith("image.sif")
    assert (tmp_path / "staged" / index[ref]["path"]).read_text().endswith(f"pulled {ref}\n")
    task = Task("t", "swe", 1, "p", "", "repo", {"image": ref[len("docker://") :]})
    (staged,) = _staged_images([task], str(tmp_path / "staged"), "imports[0]")
    assert staged.meta["sandbox_image"] == str(tmp_path / "staged" / index[ref]["path"])
    with pytest.raises(UserError, match="not staged"):
        _staged_images([dataclasses.replace(task, meta={"image": "other/img:1"})], str(tmp_path / "staged"), "imports[0]")
    with pytest.raises(UserError, match="apptainer pull failed"):
        prestage(tmp_path / "staged", [{"kind": "image", "name": "docker://fail/none:1"}])
