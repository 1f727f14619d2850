"""The published task sets, each from a fixture row with every published column: SWE-bench (JSONL,
JSON, parquet) and SWE-Gym, R2E-Gym, SWE-smith (over local clones built here), Harbor task.toml
fields and its reward file; one TaskImportError naming file, row and field for bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from snowcat.stages.config import TaskImport, TasksConfig
from snowcat.stages.taskgen import verify
from snowcat.stages.taskgen.importers import (
    TaskImportError,
    import_harbor,
    import_r2egym,
    import_swebench,
    import_swesmith,
    import_tasks,
    parse_pytest_summary,
    r2e_gold_patch,
)
from snowcat.stages.taskgen.repo import RepoSpec, harbor_reward, make_patch, snapshot_files

needs_sandbox = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("git"), reason="verifies in LocalSandbox as root"
)
PYTEST = f"{sys.executable} -m pytest -rA {{tests}}"  # the checkout's interpreter has pytest; the sandbox exposes it

BUGGY = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"
TESTS = (
    "from calc.ops import add\n\n\nclass TestAdd:\n    def test_add(self):\n        assert add(2, 3) == 5\n\n"
    "    def test_zero(self):\n        assert add(0, 0) == 0\n"
)


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def _repo(path, files: dict[str, str]) -> str:
    path.mkdir(parents=True)
    _git(path, "init", "-q", "-b", "main")
    _git(path, "config", "user.email", "t@example.com")
    _git(path, "config", "user.name", "t")
    return _commit(path, files, "base")


def _commit(path, files: dict[str, str], message: str) -> str:
    for rel, text in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    _git(path, "add", ".")
    _git(path, "commit", "-qm", message)
    return _git(path, "rev-parse", "HEAD")


# ---------------------------------------------------------------- SWE-bench, SWE-Gym


@pytest.fixture
def swebench_row(tmp_path):
    """A SWE-bench Verified row, every published column, over a clone `acme__calc`."""
    clone = tmp_path / "repos" / "acme__calc"
    base = _repo(clone, {"calc/__init__.py": "", "calc/ops.py": BUGGY})
    row = {
        "repo": "acme/calc",
        "instance_id": "acme__calc-7",
        "base_commit": base,
        "patch": make_patch({"calc/ops.py": BUGGY.encode()}, {"calc/ops.py": FIXED.encode()}),
        "test_patch": make_patch({}, {"tests/test_ops.py": TESTS.encode()}),
        "problem_statement": "add() subtracts its arguments.",
        "hints_text": "Look at calc/ops.py.",
        "created_at": "2024-01-02T03:04:05Z",
        "version": "1.0",
        "FAIL_TO_PASS": json.dumps(["tests/test_ops.py::TestAdd::test_add"]),
        "PASS_TO_PASS": json.dumps(["tests/test_ops.py::TestAdd::test_zero"]),
        "environment_setup_commit": base,
        "difficulty": "15 min - 1 hour",
    }
    return row, tmp_path / "repos"


def _write_rows(path, rows: list[dict]):
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        import datasets  # noqa: PLC0415 (heavy: only the parquet fixtures)

        datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def test_swebench_rows_read_alike_from_jsonl_json_and_parquet(swebench_row, tmp_path):
    row, repos = swebench_row
    files = [_write_rows(tmp_path / f"swe{ext}", [row]) for ext in (".jsonl", ".json", ".parquet")]
    tasks = [import_swebench(f, repos)[0] for f in files]
    for t, f in zip(tasks, files, strict=True):  # alike but for the file they came from
        assert t.meta["source"].pop("file") == str(f)
    assert tasks[0] == tasks[1] == tasks[2] and tasks[0].meta == tasks[1].meta == tasks[2].meta
    task = tasks[2]
    spec = RepoSpec.from_task(task)
    assert (task.task_id, task.difficulty, task.answer) == ("acme__calc-7", 2, row["patch"])
    assert spec.source == {"git": str((repos / "acme__calc").resolve()), "base_commit": row["base_commit"]}
    assert spec.fail_to_pass == ["tests/test_ops.py::TestAdd::test_add"] and spec.test_patch == row["test_patch"]
    assert task.meta["hints_text"] == "Look at calc/ops.py." and task.meta["source"]["version"] == "1.0"
    assert task.meta["source"]["environment_setup_commit"] == row["base_commit"]


def test_swegym_rows_are_swebench_rows_through_import_tasks(swebench_row, tmp_path):
    row, repos = swebench_row
    gym = {k: v for k, v in row.items() if k != "difficulty"} | {  # SWE-Gym publishes the lists as lists
        "FAIL_TO_PASS": ["tests/test_ops.py::TestAdd::test_add"],
        "PASS_TO_PASS": ["tests/test_ops.py::TestAdd::test_zero"],
    }
    path = _write_rows(tmp_path / "gym.parquet", [gym])
    imp = TaskImport(format="swegym", path=str(path), repos_dir=str(repos), test_command=PYTEST, timeout_s=60, memory_mb=2048)
    (task,) = import_tasks(imp)
    spec = RepoSpec.from_task(task)
    assert task.meta["source"]["format"] == "swegym" and task.difficulty == 1
    assert (spec.timeout_s, spec.memory_mb, spec.test_command) == (60, 2048, PYTEST)
    assert spec.pass_to_pass == ["tests/test_ops.py::TestAdd::test_zero"]


def test_bad_row_files_name_file_row_and_field(swebench_row, tmp_path):
    row, repos = swebench_row
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(row) + "\n\n{oops\n")
    with pytest.raises(TaskImportError, match=rf"{bad}:3: not JSON"):
        import_swebench(bad, repos)
    rows = [row, {k: v for k, v in row.items() if k != "problem_statement"}]
    parquet = _write_rows(tmp_path / "bad.parquet", rows)
    with pytest.raises(TaskImportError, match=rf"{parquet}:2: missing problem_statement"):
        import_swebench(parquet, repos)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet")
    with pytest.raises(TaskImportError, match=rf"{broken}: unreadable as parquet"):
        import_swebench(broken, repos)
    with pytest.raises(TaskImportError, match="not a row file"):
        import_swebench(tmp_path / "rows.csv", repos)
    (tmp_path / "obj.json").write_text(json.dumps(row))
    with pytest.raises(TaskImportError, match="not a JSON list of rows"):
        import_swebench(tmp_path / "obj.json", repos)
    listed = _write_rows(tmp_path / "l.json", [row | {"FAIL_TO_PASS": "tests/test_ops.py::x"}])
    with pytest.raises(TaskImportError, match=rf"{listed}:1: FAIL_TO_PASS: not a JSON list"):
        import_swebench(listed, repos)


def test_import_config_checks():
    problems = dict(
        TasksConfig(
            imports=[
                TaskImport(format="r2egym", path="/d/r2e.parquet"),
                TaskImport(format="swebench", path="/d/swe.csv", repos_dir="/r", profiles="/p.json"),
                TaskImport(format="swesmith", path="/d/s.json", repos_dir="/r", allow_internet=True),
                TaskImport(format="harbor", path="/d/tb2", allow_internet=True, build_images=True),
            ]
        ).problems()
    )
    assert set(problems) == {
        "imports[0].repos_dir",
        "imports[1].path",
        "imports[1].profiles",
        "imports[2].allow_internet",
    }
    imp = TaskImport(format="harbor", path="/nowhere")
    with pytest.raises(TaskImportError, match="/nowhere: does not exist"):
        import_tasks(imp)


# ---------------------------------------------------------------- R2E-Gym


def _parsed_commit(diff: str, old: str, new: str) -> dict:
    """r2egym's ParsedCommit (commit_models/diff_classes.py) of a git diff, as CommitParser builds it."""
    files, hunk = [], None
    kinds = {" ": "context", "+": "added", "-": "deleted", "\\": "note"}
    for line in diff.split("\n"):
        if line.startswith("diff --git"):
            path = line.split(" b/", 1)[1]
            files.append({"old_file_content": "", "new_file_content": "", "header": {"file": {"path": path}}, "hunks": []})
            hunk = None
        elif line.startswith("@@ "):
            old_r, new_r, section = (
                line.split(" ", 3)[1][1:],
                line.split(" ", 3)[2][1:],
                line.split("@@", 2)[2].strip(),
            )
            rng = [{"start": int(r.split(",")[0]), "length": int(r.split(",")[1]) if "," in r else None} for r in (old_r, new_r)]
            hunk = {"descriptor": {"old_range": rng[0], "new_range": rng[1], "section": section}, "line_group": {"all_lines": []}}
            files[-1]["hunks"].append(hunk)
        elif hunk is None and line.startswith("index "):
            a, b = line.split()[1].split("..")
            files[-1]["index_line"] = {"old_commit_hash": a, "new_commit_hash": b, "mode": " ".join(line.split()[2:])}
        elif hunk is None and line.startswith(("--- ", "+++ ")):
            files[-1]["minus_file" if line[0] == "-" else "plus_file"] = {"path": line[4:]}
        elif hunk is not None and line:
            content = line[2:] if line[0] == "\\" else line[1:]
            hunk["line_group"]["all_lines"].append({"content": content, "type": kinds[line[0]]})
    return {
        "file_diffs": files,
        "old_commit_hash": old,
        "new_commit_hash": new,
        "commit_message": "Fix add",
        "commit_date": "2024-01-02T03:04:05",
        "metadata": {},
    }


@pytest.fixture
def r2egym(tmp_path):
    """A clone `calc` (old commit: the bug; new commit: the fix and a test) and an R2E-Gym row."""
    clone = tmp_path / "repos" / "calc"
    old = _repo(clone, {"calc/__init__.py": "", "calc/ops.py": BUGGY, "tests/test_ops.py": "def test_nothing():\n    pass\n"})
    new = _commit(clone, {"calc/ops.py": FIXED, "tests/test_ops.py": TESTS}, "Fix add")
    commit = _parsed_commit(_git(clone, "diff", old, new) + "\n", old, new)
    summary = "=========================== short test summary info ============================\n"
    result = {
        "repo_name": "calc",
        "new_commit_hash": new,
        "test_file_codes": [TESTS],
        "test_file_names": ["test_1.py"],
        "setup_res_code": 0,
        "setup_res_stdout": "",
        "setup_res_stderr": "",
        "new_commit_res_code": 0,
        "new_commit_res_stdout": summary
        + "PASSED r2e_tests/test_1.py::TestAdd::test_add\nPASSED r2e_tests/test_1.py::TestAdd::test_zero\n",
        "new_commit_res_stderr": "",
        "old_commit_res_code": 1,
        "old_commit_res_stdout": summary
        + "PASSED r2e_tests/test_1.py::TestAdd::test_zero\nFAILED r2e_tests/test_1.py::TestAdd::test_add - assert -1 == 5\n",
        "old_commit_res_stderr": "",
    }
    row = {
        "repo_name": "calc",
        "docker_image": "namanjain12/calc_final:" + new,
        "commit_hash": new,
        "parsed_commit_content": json.dumps(commit),
        "execution_result_content": json.dumps(result),
        "modified_files": ["calc/ops.py", "tests/test_ops.py"],
        "modified_entity_summaries": [
            {
                "ast_type_str": "FunctionDef",
                "end_lineno": 2,
                "file_name": "calc/ops.py",
                "name": "add",
                "start_lineno": 1,
                "type": "function",
            }
        ],
        "relevant_files": ["calc/ops.py"],
        "num_non_test_files": 1,
        "num_non_test_func_methods": 1,
        "num_non_test_lines": 2,
        "prompt": "Fix add().",
        "problem_statement": "[ISSUE]\nadd() subtracts.\n[/ISSUE]",
        "expected_output_json": json.dumps({"TestAdd.test_add": "PASSED", "TestAdd.test_zero": "PASSED"}),
    }
    return _write_rows(tmp_path / "r2e.parquet", [row]), tmp_path / "repos", row, (old, new)


def test_r2egym_row_becomes_the_old_commit_with_hidden_r2e_tests(r2egym):
    path, repos, row, (old, new) = r2egym
    (task,) = import_r2egym(path, repos, test_command=PYTEST)
    spec = RepoSpec.from_task(task)
    assert spec.source == {"git": str((repos / "calc").resolve()), "base_commit": old}
    assert spec.fail_to_pass == ["r2e_tests/test_1.py::TestAdd::test_add"]
    assert spec.pass_to_pass == ["r2e_tests/test_1.py::TestAdd::test_zero"]
    assert "r2e_tests/test_1.py" in spec.test_patch and task.meta["image"] == row["docker_image"]
    # the gold: the commit's non-test Python diff, byte for byte what git wrote
    assert task.answer == _git(repos / "calc", "diff", old, new, "--", "calc/ops.py") + "\n"
    assert "tests/test_ops.py" not in r2e_gold_patch(json.loads(row["parsed_commit_content"]))
    assert b"a - b" in snapshot_files(spec)["calc/ops.py"]
    assert parse_pytest_summary(json.loads(row["execution_result_content"])["old_commit_res_stdout"]) == {
        "TestAdd.test_zero": "PASSED",
        "TestAdd.test_add": "FAILED",
    }


def test_r2egym_bad_rows(r2egym, tmp_path):
    path, repos, row, _ = r2egym
    for change, message in [
        ({"expected_output_json": json.dumps({"TestGone.test_x": "PASSED"})}, "expected_output_json: test 'TestGone.test_x'"),
        ({"expected_output_json": json.dumps({"TestAdd.test_zero": "PASSED"})}, "no test fails before"),
        ({"parsed_commit_content": "{"}, "parsed_commit_content: not JSON"),
        ({"docker_image": ""}, "missing docker_image"),
        ({"repo_name": "elsewhere"}, "no local clone of elsewhere"),
    ]:
        bad = _write_rows(tmp_path / "bad.jsonl", [row, row | change])
        with pytest.raises(TaskImportError, match=rf"{bad}:2: .*{message}"):
            import_r2egym(bad, repos)


# ---------------------------------------------------------------- SWE-smith


@pytest.fixture
def swesmith(tmp_path):
    """A mirror clone `acme__calc.<commit8>` (its HEAD: the working code) and a SWE-smith instance
    whose patch breaks it."""
    clone = tmp_path / "repos" / "placeholder"
    head = _repo(clone, {"calc/__init__.py": "", "calc/ops.py": FIXED, "tests/test_ops.py": TESTS})
    mirror = f"acme__calc.{head[:8]}"
    clone = clone.rename(tmp_path / "repos" / mirror)
    row = {
        "instance_id": f"{mirror}.func_pm_op_swap__abc123",
        "repo": f"swesmith/{mirror}",
        "patch": make_patch({"calc/ops.py": FIXED.encode()}, {"calc/ops.py": BUGGY.encode()}),
        "FAIL_TO_PASS": ["tests/test_ops.py::TestAdd::test_add"],
        "PASS_TO_PASS": ["tests/test_ops.py::TestAdd::test_zero"],
        "image_name": f"jyangballin/swesmith.x86_64.acme_1776_calc.{head[:8]}",
        "problem_statement": "add() returns the difference.",
    }
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps({mirror: {"test_cmd": PYTEST.removesuffix(" {tests}"), "install_cmds": ["pip install -e ."]}}))
    return _write_rows(tmp_path / "smith.jsonl", [row]), tmp_path / "repos", row, profiles, clone


def test_swesmith_instance_starts_at_the_bug_and_reverts_it(swesmith):
    path, repos, row, profiles, clone = swesmith
    (task,) = import_swesmith(path, repos, profiles=profiles)
    spec = RepoSpec.from_task(task)
    bug = _git(clone, "rev-parse", f"refs/snowcat/swesmith/{row['instance_id']}")
    assert spec.source == {"git": str(clone.resolve()), "base_commit": bug} and _git(clone, "rev-parse", "HEAD") != bug
    assert snapshot_files(spec)["calc/ops.py"] == BUGGY.encode() and not _git(clone, "status", "--porcelain")
    assert task.answer == make_patch({"calc/ops.py": BUGGY.encode()}, {"calc/ops.py": FIXED.encode()})
    assert spec.test_command == PYTEST and task.meta["install_cmds"] == ["pip install -e ."]
    assert task.meta["image"] == row["image_name"]
    # again: the same commit, found by its ref; a branch named after the instance wins
    assert import_swesmith(path, repos, profiles=profiles)[0].meta["repo"]["source"]["base_commit"] == bug
    _git(clone, "branch", row["instance_id"], bug)
    (again,) = import_swesmith(path, repos)
    assert again.meta["repo"]["source"]["base_commit"] == bug and RepoSpec.from_task(again).test_command.startswith("pytest")


def test_swesmith_bad_input(swesmith, tmp_path):
    path, repos, row, profiles, _ = swesmith
    bad = _write_rows(tmp_path / "bad.json", [row | {"patch": row["patch"].replace("a + b", "a * b")}])
    with pytest.raises(TaskImportError, match=rf"{bad}:1: patch: does not apply"):
        import_swesmith(bad, repos)
    profiles.write_text(json.dumps({row["repo"].split("/")[1]: {"test_cmd": "go test ./..."}}))
    with pytest.raises(TaskImportError, match=rf"{path}:1: profile test_cmd 'go test ./...' is not pytest"):
        import_swesmith(path, repos, profiles=profiles)
    profiles.write_text(json.dumps({"acme/calc": {"test_command": "pytest"}}))
    with pytest.raises(TaskImportError, match="unknown profile field"):
        import_swesmith(path, repos, profiles=profiles)


# ---------------------------------------------------------------- Harbor


@pytest.fixture
def harbor(tmp_path):
    """A Terminal-Bench 2 style task directory, every task.toml section filled in."""
    root = tmp_path / "fix-greeting"
    for d in ("environment", "tests", "solution"):
        (root / d).mkdir(parents=True)
    (root / "instruction.md").write_text("Make greet.sh print 'hello world'.\n")
    (root / "task.toml").write_text(
        'version = "1.0"\n\n[metadata]\nauthor_name = "A. Author"\nauthor_email = "a@example.com"\ndifficulty = "hard"\n'
        'category = "debugging"\ntags = ["bash"]\n\n[verifier]\ntimeout_sec = 30.0\nenv = { GREETING = "hello" }\n\n'
        "[agent]\ntimeout_sec = 900.0\n\n[environment]\nbuild_timeout_sec = 300.0\n"
        'docker_image = "ghcr.io/laude-institute/t-bench/fix-greeting:2.0"\ncpus = 2\nmemory_mb = 3072\n'
        "storage_mb = 4096\nallow_internet = false\n"
    )
    (root / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\nCOPY greet.sh /app/greet.sh\n")
    (root / "environment" / "greet.sh").write_text("echo 'hello wrld'\n")
    (root / "tests" / "test.sh").write_text(
        'mkdir -p /logs/verifier\nif [ "$(sh greet.sh)" = "hello world" ]; then echo 1 > /logs/verifier/reward.txt; '
        "else echo 0 > /logs/verifier/reward.txt; exit 1; fi\n"
    )
    (root / "solution" / "solve.sh").write_text("sed -i 's/wrld/world/' greet.sh\n")
    return root


def test_harbor_task_toml_field_by_field(harbor):
    task = import_harbor(harbor)
    spec = RepoSpec.from_task(task)
    assert task.difficulty == 3 and task.answer == "" and "sed -i" in task.meta["solution"]
    assert (spec.timeout_s, spec.memory_mb, task.meta["agent_timeout_s"]) == (30.0, 3072, 900.0)
    assert task.meta["image"] == "ghcr.io/laude-institute/t-bench/fix-greeting:2.0"
    h = task.meta["harbor"]
    assert h["environment"] == {"cpus": 2, "storage_mb": 4096, "gpus": 0, "build_timeout_sec": 300.0, "env": {}}
    assert h["verifier_env"] == {"GREETING": "hello"} and h["metadata"]["tags"] == ["bash"]
    (harbor / "task.toml").write_text('[environment]\nmemory = "512M"\nstorage = "2G"\n')
    bare = import_harbor(harbor)  # Harbor's defaults; the deprecated sizes still read
    assert RepoSpec.from_task(bare).timeout_s == 600.0 and RepoSpec.from_task(bare).memory_mb == 512
    assert "agent_timeout_s" not in bare.meta and bare.meta["harbor"]["environment"]["storage_mb"] == 2048
    (harbor / "task.toml").write_text('[environment]\nmemory = "lots"\n')
    with pytest.raises(TaskImportError, match=r"task.toml: environment.memory 'lots' is not a size"):
        import_harbor(harbor)


def test_harbor_tasks_that_want_the_network_are_refused_unless_allowed(harbor, tmp_path):
    (harbor / "task.toml").write_text("[environment]\nallow_internet = true\n")
    with pytest.raises(
        TaskImportError, match=rf"{harbor}/task.toml: environment.allow_internet = true: compute nodes are offline"
    ):
        import_harbor(harbor)
    assert import_harbor(harbor, allow_internet=True).task_id.startswith("terminal-fix-greeting-")
    (harbor / "task.toml").write_text('[environment]\nnetwork_mode = "public"\n')
    imp = TaskImport(format="harbor", path=str(tmp_path), domain="tb2")
    with pytest.raises(TaskImportError, match="network_mode = 'public'"):
        import_tasks(imp)
    imp.allow_internet = True
    assert [t.domain for t in import_tasks(imp)] == ["tb2"]


def test_harbor_reward_file_is_read_as_harbor_reads_it(tmp_path):
    assert harbor_reward(tmp_path) == (0.0, False, "no reward file (reward.txt or reward.json) in /logs/verifier")
    (tmp_path / "reward.txt").write_text("1\n")
    assert harbor_reward(tmp_path) == (1.0, True, "reward.txt: reward 1")
    (tmp_path / "reward.txt").write_text("0.5")
    assert harbor_reward(tmp_path)[:2] == (0.5, False)
    (tmp_path / "reward.json").write_text(json.dumps({"reward": 1.0, "tests_passed": 3, "note": "ok"}))
    assert harbor_reward(tmp_path) == (1.0, True, "reward.json: reward 1")
    (tmp_path / "reward.json").write_text(json.dumps({"tests_passed": 3}))  # no reward key: reward.txt's number
    assert harbor_reward(tmp_path)[:2] == (0.5, False)
    (tmp_path / "reward.txt").write_text("")
    assert harbor_reward(tmp_path)[2] == "reward.txt is empty or not a number"
    (tmp_path / "reward.json").write_text("[1]")
    assert harbor_reward(tmp_path) == (0.0, False, "reward.json is not an object")


# ---------------------------------------------------------------- the gold passes, nothing fails


@pytest.mark.slow
@needs_sandbox
def test_imported_gold_patches_pass_and_empty_fails(swebench_row, r2egym, swesmith, tmp_path):
    row, repos = swebench_row
    (swe,) = import_swebench(_write_rows(tmp_path / "v.jsonl", [row]), repos, test_command=PYTEST)
    r2e_path, r2e_repos, *_ = r2egym
    (r2e,) = import_r2egym(r2e_path, r2e_repos, test_command=PYTEST)
    smith_path, smith_repos, _, profiles, _ = swesmith
    (smith,) = import_swesmith(smith_path, smith_repos, profiles=profiles)
    for task in (swe, r2e, smith):
        gold = verify(task, task.answer)
        assert gold.passed, (task.task_id, gold.detail)
        empty = verify(task, "")
        assert not empty.passed and "FAIL_TO_PASS 1/1" in empty.detail, (task.task_id, empty.detail)
