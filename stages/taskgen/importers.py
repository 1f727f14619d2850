"""Repository tasks from the sets users train on, read from their published file formats.

`import_tasks(imp)` dispatches a `tasks.imports[]` entry on its `format`:

    swebench   SWE-bench, Lite, Verified (and any set with their columns)    `import_swebench`
    swegym     SWE-Gym: SWE-bench's columns                                   `import_swebench`
    r2egym     R2E-Gym (Lite, Subset, full): commit-derived tasks             `import_r2egym`
    swesmith   SWE-smith task instances over its mirror repositories          `import_swesmith`
    harbor     Harbor task directories (Terminal-Bench 2)                     `import_harbor`
    answers    prompt-and-answer rows (GSM8K, MATH, MMLU, Reasoning Gym,     `answer_sets.import_answers`
               APPS/TACO): no repository; judged by their answer kind
    ifeval     IFEval rows: instructions with verifiable constraints          `answer_sets.import_ifeval`

Row sets are JSONL, JSON (a list of rows) or parquet files (`rows.read_rows`; parquet through `datasets`,
from the local file only): compute nodes have no network, so everything a task needs must already be
on the shared filesystem. Each row names a repository; the
importer looks for a local clone of it under `repos_dir` (`<owner>__<name>`, `<owner>/<name>` or
`<name>`) holding the commit the task starts from, and the task then refers to that clone and commit
(the agent gets `git archive` of it: no history). A row's container image (R2E-Gym's
`docker_image`, SWE-smith's `image_name`) is kept as `meta["image"]`, a Docker reference.

SWE-bench and SWE-Gym rows whose repository and version SWE-bench specifies get SWE-bench's own
harness (stages/taskgen/swebench_harness.py, the `swebench` package): its test command, the
instance image (`meta["image"]`), the repository at /testbed, and as judge either snowcat's observer
(pytest repositories: `meta["verdict"] = "observer"`) or SWE-bench's log parser and grading (Django,
SymPy, Sphinx ...: `meta["verdict"] = "log"`, forgeable by what the code under test prints). An
explicit `test_command` replaces all of it (the task then runs at /workspace, judged by that command).

An importer returns every task of its file or raises one `TaskImportError` naming the file, the row
(1-based; for JSONL, the line) or task directory, and the field: a set is never half imported.
"""

from __future__ import annotations

import ast
import hashlib
import json
import subprocess
import tempfile
import tomllib
from pathlib import Path

import yaml

from snowcat.containers.images import dockerfile_definition
from snowcat.stages.taskgen import Task, swebench_harness
from snowcat.stages.taskgen.answer_sets import import_answers, import_ifeval
from snowcat.stages.taskgen.repo import RepoSpec, make_patch, patched_paths, read_tree
from snowcat.stages.taskgen.rows import TaskImportError, read_rows, require

SWEBENCH_TEST_COMMAND = "python -m pytest -rA {tests}"  # rows SWE-bench has no specification for
OFFICIAL = ""  # test_command: SWE-bench's own harness where it specifies the row's repository and version
SWESMITH_TEST_COMMAND = "pytest --disable-warnings --color=no --tb=no --verbose {tests}"  # swesmith's TEST_PYTEST
R2E_TESTS_DIR = "r2e_tests"  # where R2E-Gym's images keep a task's tests (the repository's `r2e_tests/`)
HARBOR_DIFFICULTY = {"easy": 1, "medium": 2, "hard": 3}
SWEBENCH_DIFFICULTY = {"<15 min fix": 1, "15 min - 1 hour": 2, "1-4 hours": 3, ">4 hours": 4}
FORMATS = ("swebench", "swegym", "r2egym", "swesmith", "harbor", "answers", "ifeval")


# ---------------------------------------------------------------- dispatch


def import_tasks(imp) -> list[Task]:
    """Every task of one `tasks.imports[]` entry (stages.config.TaskImport), by its `format`."""
    path = Path(imp.path)
    if not path.exists():
        raise TaskImportError(f"{path}: does not exist")
    if imp.format == "answers":
        return import_answers(path, imp.answers, domain=imp.domain)
    if imp.format == "ifeval":
        return import_ifeval(path, domain=imp.domain)
    common = {"domain": imp.domain, "timeout_s": imp.timeout_s, "memory_mb": imp.memory_mb}
    if imp.format in ("swebench", "swegym"):
        return import_swebench(path, imp.repos_dir, test_command=imp.test_command, source_format=imp.format, **common)
    if imp.format == "r2egym":
        return import_r2egym(path, imp.repos_dir, test_command=imp.test_command or SWEBENCH_TEST_COMMAND, **common)
    if imp.format == "swesmith":
        return import_swesmith(path, imp.repos_dir, profiles=imp.profiles or None, **common)
    if imp.format == "harbor":
        dirs = [path] if (path / "task.toml").is_file() else sorted(p for p in path.iterdir() if (p / "task.toml").is_file())
        if not dirs:
            raise TaskImportError(f"{path}: no Harbor task directories (with task.toml)")
        return [import_harbor(d, domain=imp.domain, allow_internet=imp.allow_internet) for d in dirs]
    raise TaskImportError(f"{path}: unknown format {imp.format!r} (known: {', '.join(FORMATS)})")


# ---------------------------------------------------------------- fields


def _list(value, where: str) -> list[str]:
    """A list of test ids, given as a list or a JSON-encoded list (SWE-bench's FAIL_TO_PASS)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise TaskImportError(f"{where}: not a JSON list") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TaskImportError(f"{where}: expected a list of test ids")
    return value


def _json(value, where: str):
    try:
        return json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as e:
        raise TaskImportError(f"{where}: not JSON: {e.msg}") from None


# ---------------------------------------------------------------- local clones


def _git(clone: Path, *args: str, input: bytes | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(clone), *args], capture_output=True, input=input, env=env)


def _has_commit(clone: Path, commit: str) -> bool:
    return _git(clone, "cat-file", "-e", f"{commit}^{{commit}}").returncode == 0


def _find_clone(repos_dir: Path, names: list[str], repo: str, where: str) -> Path:
    for name in names:
        cand = repos_dir / name
        if cand.is_dir():
            return cand.resolve()
    raise TaskImportError(f"{where}: no local clone of {repo} under {repos_dir} (compute nodes have no network: prestage it)")


def _local_repo(repos_dir: Path, repo: str, commit: str, where: str) -> Path:
    """The clone of GitHub `owner/name` under `repos_dir` holding `commit`."""
    owner, _, name = repo.partition("/")
    clone = _find_clone(repos_dir, [f"{owner}__{name}", f"{owner}/{name}", name], repo, where)
    if not _has_commit(clone, commit):
        raise TaskImportError(f"{where}: {clone} does not hold base_commit {commit}")
    return clone


# ---------------------------------------------------------------- SWE-bench, SWE-Gym


def import_swebench(
    path: str | Path,
    repos_dir: str | Path,
    *,
    domain: str = "swe",
    test_command: str = OFFICIAL,
    timeout_s: float = 900.0,
    memory_mb: int = 4096,
    source_format: str = "swebench",
) -> list[Task]:
    """One Task per row of SWE-bench's columns (full, Lite, Verified; SWE-Gym): instance_id, repo,
    base_commit, problem_statement, FAIL_TO_PASS (required); patch (the gold answer), test_patch
    (hidden tests), PASS_TO_PASS, hints_text, created_at, version, environment_setup_commit
    (kept in meta), Verified's difficulty.

    `test_command` "" (OFFICIAL): SWE-bench's harness for the rows it specifies (`_official`), the
    generic `SWEBENCH_TEST_COMMAND` for the others; any other command is used as given."""
    repos_dir = Path(repos_dir)
    tasks = []
    for where, row in read_rows(path):
        require(row, ("instance_id", "repo", "base_commit", "problem_statement", "FAIL_TO_PASS"), where)
        clone = _local_repo(repos_dir, row["repo"], row["base_commit"], where)
        fields, extra = _official(row, where) if test_command == OFFICIAL else ({"test_command": test_command}, {})
        spec = RepoSpec(
            source={"git": str(clone), "base_commit": row["base_commit"]},
            fail_to_pass=_list(row["FAIL_TO_PASS"], f"{where}: FAIL_TO_PASS"),
            pass_to_pass=_list(row.get("PASS_TO_PASS") or [], f"{where}: PASS_TO_PASS"),
            test_patch=row.get("test_patch") or "",
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            **fields,
        )
        source = {"format": source_format, "file": str(path), "repo": row["repo"]}
        source |= {k: row[k] for k in ("version", "environment_setup_commit", "created_at") if row.get(k)}
        meta = {"repo": spec.to_meta(), "source": source, "hints_text": row.get("hints_text") or ""} | extra
        difficulty = SWEBENCH_DIFFICULTY.get(row.get("difficulty") or "", 1)
        tasks.append(Task(row["instance_id"], domain, difficulty, row["problem_statement"], row.get("patch") or "", "repo", meta))
    return tasks


def _official(row: dict, where: str) -> tuple[dict, dict]:
    """(RepoSpec fields, meta) of SWE-bench's harness for `row`; the generic pytest command where
    SWE-bench has no specification for its repository and version."""
    try:
        if not swebench_harness.known(row):
            return {"test_command": SWEBENCH_TEST_COMMAND}, {}
        official = swebench_harness.official(row)
    except swebench_harness.HarnessUnavailable as e:
        raise TaskImportError(f"{where}: {e}") from None
    except (KeyError, ValueError, TypeError) as e:  # a row SWE-bench's scripts cannot read (its test_patch)
        raise TaskImportError(f"{where}: SWE-bench's harness: {type(e).__name__}: {e}") from None
    fields = {
        "test_command": official.test_command,
        "harness": official.harness,
        "workdir": official.workdir,
        "env_setup": official.env_setup,
        "install": official.install,
        "swebench": official.swebench if official.harness == "swebench" else {},
    }
    return fields, {"image": official.image, "verdict": official.verdict, "test_directives": official.directives}


# ---------------------------------------------------------------- R2E-Gym

R2E_COLUMNS = (
    "repo_name",
    "docker_image",
    "commit_hash",
    "problem_statement",
    "parsed_commit_content",
    "execution_result_content",
)


def import_r2egym(
    path: str | Path,
    repos_dir: str | Path,
    *,
    domain: str = "swe",
    test_command: str = SWEBENCH_TEST_COMMAND,
    timeout_s: float = 900.0,
    memory_mb: int = 4096,
) -> list[Task]:
    """One Task per R2E-Gym row (R2E-Gym/R2E-Gym-Lite, -Subset, R2E-Gym; columns of r2egym's
    `DatasetRow`). The task starts at the commit's parent (`parsed_commit_content.old_commit_hash`,
    in a local clone named by `repo_name`), as R2E-Gym's images do; its tests are the
    `execution_result_content` test files, delivered as `r2e_tests/<name>` (where the images keep
    them); the gold answer is the commit's non-test Python diff (r2egym's
    `ParsedCommit.get_patch(test_file=False)`). FAIL_TO_PASS: tests PASSED in `expected_output_json`
    (the fixed commit's statuses) that did not pass in the old commit's run; PASS_TO_PASS: passed in
    both. `docker_image` is kept as meta["image"]."""
    repos_dir = Path(repos_dir)
    tasks = []
    for where, row in read_rows(path):
        require(row, R2E_COLUMNS, where)
        commit = _json(row["parsed_commit_content"], f"{where}: parsed_commit_content")
        result = _json(row["execution_result_content"], f"{where}: execution_result_content")
        old = commit.get("old_commit_hash") if isinstance(commit, dict) else None
        if not old or not isinstance(commit.get("file_diffs"), list):
            raise TaskImportError(f"{where}: parsed_commit_content: needs old_commit_hash and file_diffs")
        names, codes = result.get("test_file_names"), result.get("test_file_codes")
        if not names or not isinstance(codes, list) or len(names) != len(codes):
            raise TaskImportError(f"{where}: execution_result_content: test_file_names and test_file_codes must pair up")
        tests = {f"{R2E_TESTS_DIR}/{n}": c for n, c in zip(names, codes, strict=True)}
        name = row["repo_name"]
        clone = _find_clone(repos_dir, [name, *sorted(p.name for p in repos_dir.glob(f"*__{name}"))], name, where)
        if not _has_commit(clone, old):
            raise TaskImportError(f"{where}: {clone} does not hold the old commit {old} (parsed_commit_content)")
        fail_to_pass, pass_to_pass = _r2e_tests(row, result, tests, where)
        spec = RepoSpec(
            source={"git": str(clone), "base_commit": old},
            test_command=test_command,
            fail_to_pass=fail_to_pass,
            pass_to_pass=pass_to_pass,
            test_patch=make_patch({}, {p: c.encode() for p, c in tests.items()}),
            timeout_s=timeout_s,
            memory_mb=memory_mb,
        )
        source = {"format": "r2egym", "file": str(path), "repo": name, "commit_hash": row["commit_hash"]}
        meta = {"repo": spec.to_meta(), "source": source, "image": row["docker_image"]}
        task_id = f"r2egym-{name}-{row['commit_hash'][:12]}"
        tasks.append(Task(task_id, domain, 1, row["problem_statement"], r2e_gold_patch(commit), "repo", meta))
    return tasks


def _r2e_tests(row: dict, result: dict, tests: dict[str, str], where: str) -> tuple[list[str], list[str]]:
    """(FAIL_TO_PASS, PASS_TO_PASS) as pytest node ids of the r2e_tests files."""
    if row.get("expected_output_json"):
        expected = _json(row["expected_output_json"], f"{where}: expected_output_json")
    else:
        expected = parse_pytest_summary(result.get("new_commit_res_stdout"))
    if not isinstance(expected, dict) or not expected:
        raise TaskImportError(f"{where}: expected_output_json: no test statuses")
    before = parse_pytest_summary(result.get("old_commit_res_stdout"))
    index = _test_index(tests)
    f2p, p2p = [], []
    for key, status in sorted(expected.items()):
        if status != "PASSED":
            continue
        node = _node_id(key, index)
        if node is None:
            raise TaskImportError(f"{where}: expected_output_json: test {key!r} is in no r2e_tests file")
        (p2p if before.get(key) == "PASSED" else f2p).append(node)
    if not f2p:
        raise TaskImportError(f"{where}: expected_output_json: no test fails before the commit and passes after it")
    return f2p, p2p


def parse_pytest_summary(log: str | None) -> dict[str, str]:
    """{`Class.test` or `test`: PASSED | FAILED | ERROR} from pytest's `-rA` short summary, keyed as
    R2E-Gym keys them (r2egym.repo_analysis.execution_log_parser.parse_log_pytest: the file dropped)."""
    if not log or "short test summary info" not in log:
        return {}
    out: dict[str, str] = {}
    for line in log.split("short test summary info", 1)[1].strip().split("\n"):
        for status in ("PASSED", "FAILED", "ERROR"):
            if status in line:
                out[".".join(line.split("::")[1:]).split(" - ")[0]] = status
                break
    return out


def _test_index(tests: dict[str, str]) -> dict[str, str]:
    """{`Class.test` / `test`: file} over the test files' top-level tests and test classes."""
    index: dict[str, str] = {}
    for path, code in tests.items():
        try:
            tree = ast.parse(code)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                index.setdefault(node.name, path)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        index.setdefault(f"{node.name}.{item.name}", path)
    return index


def _node_id(key: str, index: dict[str, str]) -> str | None:
    name, bracket, params = key.partition("[")
    path = index.get(name)
    if path is None:
        return None
    return f"{path}::{name.replace('.', '::')}{bracket}{params}"


def _r2e_is_test_file(path: str) -> bool:
    """r2egym's FileDiff.is_test_file."""
    parts = path.split("/")
    return (
        path.endswith("_test.py")
        or path.startswith("test_")
        or parts[-1].startswith("test_")
        or any(d in parts for d in ("tests", "Tests", "test", "Test"))
    )


def r2e_gold_patch(commit: dict) -> str:
    """The non-test Python part of an R2E-Gym `parsed_commit_content`, rendered as r2egym's
    `ParsedCommit.get_patch(test_file=False)` renders it."""
    out = []
    for diff in commit["file_diffs"]:
        path = diff["header"]["file"]["path"]
        if not path.endswith(".py") or _r2e_is_test_file(path):
            continue
        out.append(f"diff --git a/{path} b/{path}\n")
        if diff["header"].get("misc_line"):
            out.append(diff["header"]["misc_line"] + "\n")
        if index := diff.get("index_line"):
            mode = f" {index['mode']}" if index.get("mode") else ""
            out.append(f"index {index['old_commit_hash']}..{index['new_commit_hash']}{mode}\n")
        if diff.get("is_binary_file"):
            out.append(diff["binary_line"] + "\n")
        if diff.get("minus_file") and diff.get("plus_file"):
            out.append(f"--- {diff['minus_file']['path']}\n+++ {diff['plus_file']['path']}\n")
        for hunk in diff.get("hunks", []):
            d = hunk["descriptor"]
            head = f"@@ -{_range(d['old_range'])} +{_range(d['new_range'])} @@"
            out.append(f"{head} {d['section']}\n" if d.get("section") else head + "\n")
            for line in hunk["line_group"]["all_lines"]:
                out.append({"context": " ", "added": "+", "deleted": "-", "note": "\\ "}[line["type"]] + line["content"] + "\n")
    return "".join(out)


def _range(r: dict) -> str:
    return f"{r['start']}" if r.get("length") is None else f"{r['start']},{r['length']}"


# ---------------------------------------------------------------- SWE-smith

SWESMITH_COLUMNS = ("instance_id", "repo", "patch", "FAIL_TO_PASS", "image_name", "problem_statement")


def import_swesmith(
    path: str | Path,
    repos_dir: str | Path,
    *,
    profiles: str | Path | None = None,
    domain: str = "swe",
    timeout_s: float = 900.0,
    memory_mb: int = 4096,
) -> list[Task]:
    """One Task per SWE-smith instance (SWE-bench/SWE-smith: instance_id, repo, patch, FAIL_TO_PASS,
    PASS_TO_PASS, image_name, problem_statement). `repo` is the mirror (`swesmith/<owner>__<name>.
    <commit8>`), cloned under `repos_dir` as `<owner>__<name>.<commit8>`. `patch` creates the bug, so
    the task starts at the bug commit: the row's `base_commit` if it has one, else the mirror's branch
    named after the instance (what SWE-smith's harness checks out), else one the importer commits on
    the mirror's HEAD with the patch applied (`refs/snowcat/swesmith/<instance_id>`, as SWE-smith's
    gather.py makes its branches). The gold answer reverts the patch (SWE-smith applies it with
    `--reverse`). The test command is the repository profile's `test_cmd` from `profiles` (a JSON or
    YAML map `{<owner>__<name>.<commit8> | <owner>/<name>: {test_cmd, install_cmds, timeout}}`), else
    SWE-smith's default pytest command; `{tests}` becomes the test ids."""
    repos_dir = Path(repos_dir)
    table = load_profiles(profiles) if profiles else {}
    tasks = []
    for where, row in read_rows(path):
        require(row, SWESMITH_COLUMNS, where)
        mirror = row["repo"].rsplit("/", 1)[-1]
        clone = _find_clone(repos_dir, [mirror, row["repo"]], row["repo"], where)
        bug = _swesmith_bug_commit(clone, row, where)
        profile = table.get(mirror) or table.get(_upstream(mirror)) or {}
        spec = RepoSpec(
            source={"git": str(clone), "base_commit": bug},
            test_command=_swesmith_test_command(profile, where),
            fail_to_pass=_list(row["FAIL_TO_PASS"], f"{where}: FAIL_TO_PASS"),
            pass_to_pass=_list(row.get("PASS_TO_PASS") or [], f"{where}: PASS_TO_PASS"),
            timeout_s=float(profile.get("timeout", timeout_s)),
            memory_mb=memory_mb,
        )
        source = {"format": "swesmith", "file": str(path), "repo": row["repo"], "bug_commit": bug}
        meta = {"repo": spec.to_meta(), "source": source, "image": row["image_name"]}
        if profile.get("install_cmds"):
            meta["install_cmds"] = list(profile["install_cmds"])
        gold = _reverse(clone, bug, row["patch"], where)
        tasks.append(Task(row["instance_id"], domain, 1, row["problem_statement"], gold, "repo", meta))
    return tasks


def _upstream(mirror: str) -> str:
    """`owner__name.commit8` -> `owner/name`."""
    return mirror.rsplit(".", 1)[0].replace("__", "/", 1)


def load_profiles(path: str | Path) -> dict[str, dict]:
    """SWE-smith repository profiles from a JSON or YAML file: {key: {test_cmd, install_cmds, timeout}}."""
    path = Path(path)
    try:
        text = path.read_text()
        data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as e:
        raise TaskImportError(f"{path}: unreadable profiles: {e}") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise TaskImportError(f"{path}: profiles must map a repository to {{test_cmd, install_cmds, timeout}}")
    for key, profile in data.items():
        unknown = set(profile) - {"test_cmd", "install_cmds", "timeout"}
        if unknown:
            raise TaskImportError(f"{path}: {key}: unknown profile field(s) {', '.join(sorted(unknown))}")
    return data


def _swesmith_test_command(profile: dict, where: str) -> str:
    command = profile.get("test_cmd")
    if not command:
        return SWESMITH_TEST_COMMAND
    if "{tests}" in command:
        return command
    if "pytest" in command:  # SWE-smith appends the FAIL_TO_PASS files; the observer runs the ids
        return f"{command} {{tests}}"
    raise TaskImportError(f"{where}: profile test_cmd {command!r} is not pytest: say where the test ids go with '{{tests}}'")


def _swesmith_bug_commit(clone: Path, row: dict, where: str) -> str:
    if row.get("base_commit"):
        if not _has_commit(clone, row["base_commit"]):
            raise TaskImportError(f"{where}: {clone} does not hold base_commit {row['base_commit']}")
        return row["base_commit"]
    instance = row["instance_id"]
    ours = f"refs/snowcat/swesmith/{instance}"
    for ref in (f"refs/heads/{instance}", f"refs/remotes/origin/{instance}", ours):
        r = _git(clone, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
        if r.returncode == 0:
            return r.stdout.decode().strip()
    return _commit_patch(clone, row["patch"], ours, where)


def _commit_patch(clone: Path, patch: str, ref: str, where: str) -> str:
    """Commit HEAD + `patch` (without touching the work tree or HEAD) and point `ref` at it."""
    with tempfile.TemporaryDirectory(prefix="snowcat-swesmith-") as tmp:
        env = {"GIT_INDEX_FILE": f"{tmp}/index", "PATH": "/usr/bin:/bin", "HOME": tmp}
        env |= {"GIT_AUTHOR_NAME": "swesmith", "GIT_AUTHOR_EMAIL": "swesmith@swesmith.ai", "GIT_AUTHOR_DATE": "@0 +0000"}
        env |= {"GIT_COMMITTER_NAME": "swesmith", "GIT_COMMITTER_EMAIL": "swesmith@swesmith.ai", "GIT_COMMITTER_DATE": "@0 +0000"}
        steps = [
            ("read-tree", "HEAD"),
            ("apply", "--cached", "--whitespace=nowarn", "-"),
            ("write-tree",),
        ]
        out = b""
        for args in steps:
            r = _git(clone, *args, input=patch.encode() if "apply" in args else None, env=env)
            if r.returncode != 0:
                raise TaskImportError(f"{where}: patch: does not apply to {clone} HEAD: {r.stderr.decode().strip()[:300]}")
            out = r.stdout
        tree = out.decode().strip()
        r = _git(clone, "commit-tree", tree, "-p", "HEAD", "-m", "Bug Patch", env=env)
        if r.returncode != 0:
            raise TaskImportError(f"{where}: cannot commit the bug in {clone}: {r.stderr.decode().strip()[:300]}")
        sha = r.stdout.decode().strip()
        if _git(clone, "update-ref", ref, sha).returncode != 0:
            raise TaskImportError(f"{where}: cannot write {ref} in {clone} (a read-only clone needs the instance's branch)")
        return sha


def _reverse(clone: Path, commit: str, patch: str, where: str) -> str:
    """`patch` reverted, as a patch against `commit` (the tree with the patch applied)."""
    paths = patched_paths(patch)
    with tempfile.TemporaryDirectory(prefix="snowcat-revert-") as tmp:
        work = Path(tmp)
        before: dict[str, bytes] = {}
        for p in paths:
            r = _git(clone, "show", f"{commit}:{p}")
            if r.returncode == 0:
                before[p] = r.stdout
                (work / p).parent.mkdir(parents=True, exist_ok=True)
                (work / p).write_bytes(r.stdout)
        r = subprocess.run(
            ["git", "apply", "-R", "--whitespace=nowarn", "-"], cwd=work, input=patch.encode(), capture_output=True
        )
        if r.returncode != 0:
            raise TaskImportError(f"{where}: patch: does not revert at {commit}: {r.stderr.decode().strip()[:300]}")
        after = {p: (work / p).read_bytes() for p in paths if (work / p).is_file()}
    return make_patch(before, after)


# ---------------------------------------------------------------- Harbor


def import_harbor(task_dir: str | Path, *, domain: str = "terminal", allow_internet: bool = False) -> Task:
    """One Task from a Harbor task directory (harbor.models.task: `instruction.md`, `task.toml`,
    `environment/`, `tests/test.sh`, `solution/solve.sh`).

    task.toml, field by field: [metadata] difficulty -> Task.difficulty (other keys kept in
    meta["harbor"]["metadata"]); [verifier] timeout_sec (default 600) -> RepoSpec.timeout_s, env ->
    meta; [agent] timeout_sec -> meta["agent_timeout_s"] (absent: none); [environment] docker_image ->
    meta["image"], memory_mb (or the deprecated `memory`, "1G") -> RepoSpec.memory_mb (default 2048),
    cpus, storage_mb (or `storage`), gpus, build_timeout_sec -> meta["harbor"]["environment"];
    allow_internet = true (or network_mode public/allowlist) is refused unless `allow_internet`
    (compute nodes are offline). The build context (`environment/` less its Dockerfile) becomes the
    work dir, the Dockerfile an Apptainer recipe (meta["apptainer_recipe"]); `tests/` reaches only
    the verifier (as a hidden test patch), which runs it as Harbor does (`harness: harbor`:
    /tests read-only, a fresh /logs/verifier, the reward file as the verdict: repo.harbor_reward).
    `solution/solve.sh` is the gold solution
    (meta["solution"], run after the patch by task validation); the gold patch stays ""."""
    root = Path(task_dir)
    for required in ("instruction.md", "task.toml", "tests/test.sh"):
        if not (root / required).is_file():
            raise TaskImportError(f"{root}: not a Harbor task (no {required})")
    try:
        config = tomllib.loads((root / "task.toml").read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise TaskImportError(f"{root / 'task.toml'}: {e}") from None
    where = root / "task.toml"
    sections = {k: _section(config, k, where) for k in ("metadata", "verifier", "agent", "environment", "solution")}
    environment = sections["environment"]
    _check_network(environment, where, allow_internet)
    env_dir = root / "environment"
    files = {p: b.decode() for p, b in read_tree(env_dir).items() if p != "Dockerfile"} if env_dir.is_dir() else {}
    tests = {f"tests/{p}": b for p, b in read_tree(root / "tests").items()}
    spec = RepoSpec(
        source={"files": files},
        test_command="bash {tests}",
        harness="harbor",
        fail_to_pass=["tests/test.sh"],
        test_paths=sorted(tests),
        test_patch=make_patch({}, tests),
        timeout_s=_number(sections["verifier"], "timeout_sec", 600.0, where),
        memory_mb=_size(environment, "memory", 2048, where),
    )
    solution = root / "solution" / "solve.sh"
    meta = {
        "repo": spec.to_meta(),
        "source": {"format": "harbor", "dir": str(root)},
        "solution": solution.read_text() if solution.is_file() else "",
        "harbor": {
            "metadata": sections["metadata"],
            "verifier_env": sections["verifier"].get("env", {}),
            "solution_env": sections["solution"].get("env", {}),
            "environment": {
                "cpus": environment.get("cpus", 1),
                "storage_mb": _size(environment, "storage", 10240, where),
                "gpus": environment.get("gpus", 0),
                "build_timeout_sec": _number(environment, "build_timeout_sec", 600.0, where),
                "env": environment.get("env", {}),
            },
        },
    }
    if "timeout_sec" in sections["agent"]:
        meta["agent_timeout_s"] = _number(sections["agent"], "timeout_sec", 0.0, where)
    if environment.get("docker_image"):
        meta["image"] = str(environment["docker_image"])
    dockerfile = env_dir / "Dockerfile"
    if dockerfile.is_file():
        meta["apptainer_recipe"] = dockerfile_definition(dockerfile)  # spython; built where building is allowed
    difficulty = HARBOR_DIFFICULTY.get(str(sections["metadata"].get("difficulty", "")).lower(), 1)
    instruction = (root / "instruction.md").read_text().strip()
    task_id = f"{domain}-{root.name}-{hashlib.sha256(instruction.encode()).hexdigest()[:8]}"
    return Task(task_id, domain, difficulty, instruction, "", "repo", meta)


def _section(config: dict, name: str, where: Path) -> dict:
    value = config.get(name, {})
    if not isinstance(value, dict):
        raise TaskImportError(f"{where}: [{name}] must be a table")
    return value


def _check_network(environment: dict, where: Path, allowed: bool) -> None:
    mode = environment.get("network_mode")
    wants = environment.get("allow_internet") is True or mode in ("public", "allowlist")
    if wants and not allowed:
        field = f"network_mode = {mode!r}" if mode in ("public", "allowlist") else "allow_internet = true"
        raise TaskImportError(
            f"{where}: environment.{field}: compute nodes are offline (set allow_internet: true on the import to take it anyway)"
        )


def _number(section: dict, key: str, default: float, where: Path) -> float:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TaskImportError(f"{where}: {key} {value!r} is not a number")
    return float(value)


def _size(environment: dict, name: str, default: int, where: Path) -> int:
    """`<name>_mb`, else Harbor's deprecated `<name>` ("1G", "512M"), else `default`."""
    if f"{name}_mb" in environment:
        return int(_number(environment, f"{name}_mb", default, where))
    value = environment.get(name)
    if value is None:
        return default
    text = str(value).strip().upper()
    scale = {"G": 1024, "M": 1, "K": 1 / 1024}
    try:
        return int(float(text[:-1]) * scale[text[-1]])
    except (ValueError, KeyError, IndexError):
        raise TaskImportError(f"{where}: environment.{name} {value!r} is not a size like '1G' or '512M'") from None
