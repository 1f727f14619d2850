"""Repository tasks from elsewhere: SWE-bench-format JSONL and Harbor (Terminal-Bench) task directories.

Compute nodes have no network, so everything a task needs must already be on the shared filesystem:
SWE-bench rows name a GitHub repository; the importer looks for a local clone of it under
`repos_dir` (`<owner>__<name>` or `<owner>/<name>`) holding the row's base commit, and the task
then refers to that clone and commit (the agent gets `git archive` of the base commit: no history).

Harbor tasks are directories (`instruction.md`, `task.toml`, `environment/`, `tests/test.sh`,
`solution/solve.sh`): the environment's build context becomes the work dir, `tests/` is delivered
to the verifier only (as a hidden test patch) and `bash tests/test.sh` must exit 0. Their
Dockerfile is converted to an Apptainer recipe with spython (`apptainer_recipe`) for the sites
where images are built; tests that need root or paths outside the work dir (`/logs`, `/tests`) need
that image (ApptainerSandbox), not the host sandbox. Harbor's reward file is not read: exit 0 passes.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import tomllib
from pathlib import Path

from snowcat.containers.images import dockerfile_definition
from snowcat.stages.taskgen import Task
from snowcat.stages.taskgen.repo import RepoSpec, make_patch, read_tree

SWEBENCH_TEST_COMMAND = "python -m pytest -rA {tests}"
HARBOR_DIFFICULTY = {"easy": 1, "medium": 2, "hard": 3}
SWEBENCH_DIFFICULTY = {"<15 min fix": 1, "15 min - 1 hour": 2, "1-4 hours": 3, ">4 hours": 4}


class TaskImportError(ValueError):
    """A task that cannot be imported; the message names the file and the field."""


def _list(value, where: str) -> list[str]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise TaskImportError(f"{where}: not a JSON list") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TaskImportError(f"{where}: expected a list of test ids")
    return value


def _local_repo(repos_dir: Path, repo: str, commit: str, where: str) -> Path:
    owner, _, name = repo.partition("/")
    for cand in (repos_dir / f"{owner}__{name}", repos_dir / owner / name, repos_dir / name):
        if cand.exists():
            ok = subprocess.run(["git", "-C", str(cand), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
            if ok.returncode != 0:
                raise TaskImportError(f"{where}: {cand} does not hold base_commit {commit}")
            return cand.resolve()
    raise TaskImportError(f"{where}: no local clone of {repo} under {repos_dir} (compute nodes have no network: prestage it)")


def import_swebench(
    path: str | Path,
    repos_dir: str | Path,
    *,
    domain: str = "swe",
    test_command: str = SWEBENCH_TEST_COMMAND,
    timeout_s: float = 900.0,
    memory_mb: int = 4096,
) -> list[Task]:
    """One Task per JSONL row (instance_id, repo, base_commit, problem_statement, patch, test_patch,
    FAIL_TO_PASS, PASS_TO_PASS; optional difficulty)."""
    path, repos_dir = Path(path), Path(repos_dir)
    tasks = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskImportError(f"{where}: not JSON: {e.msg}") from None
        missing = [k for k in ("instance_id", "repo", "base_commit", "problem_statement", "FAIL_TO_PASS") if not row.get(k)]
        if missing:
            raise TaskImportError(f"{where}: missing {', '.join(missing)}")
        clone = _local_repo(repos_dir, row["repo"], row["base_commit"], where)
        test_patch = row.get("test_patch") or ""
        spec = RepoSpec(
            source={"git": str(clone), "base_commit": row["base_commit"]},
            test_command=test_command,
            fail_to_pass=_list(row["FAIL_TO_PASS"], f"{where}: FAIL_TO_PASS"),
            pass_to_pass=_list(row.get("PASS_TO_PASS") or [], f"{where}: PASS_TO_PASS"),
            test_patch=test_patch,
            timeout_s=timeout_s,
            memory_mb=memory_mb,
        )
        meta = {"repo": spec.to_meta(), "source": {"format": "swebench", "file": str(path), "repo": row["repo"]}}
        difficulty = SWEBENCH_DIFFICULTY.get(row.get("difficulty", ""), 1)
        tasks.append(Task(row["instance_id"], domain, difficulty, row["problem_statement"], row.get("patch") or "", "repo", meta))
    return tasks


def import_harbor(task_dir: str | Path, *, domain: str = "terminal") -> Task:
    """One Task from a Harbor task directory (see the module docstring)."""
    root = Path(task_dir)
    for required in ("instruction.md", "task.toml", "tests/test.sh"):
        if not (root / required).is_file():
            raise TaskImportError(f"{root}: not a Harbor task (no {required})")
    try:
        config = tomllib.loads((root / "task.toml").read_text())
    except tomllib.TOMLDecodeError as e:
        raise TaskImportError(f"{root / 'task.toml'}: {e}") from None
    env_dir = root / "environment"
    files = {p: b.decode() for p, b in read_tree(env_dir).items() if p != "Dockerfile"} if env_dir.is_dir() else {}
    tests = {f"tests/{p}": b for p, b in read_tree(root / "tests").items()}
    test_patch = make_patch({}, tests)
    solution = root / "solution" / "solve.sh"
    environment = config.get("environment", {})
    memory = environment.get("memory_mb") or _megabytes(environment.get("memory"), root) or 2048
    spec = RepoSpec(
        source={"files": files},
        test_command="bash {tests}",
        fail_to_pass=["tests/test.sh"],
        test_paths=sorted(tests),
        test_patch=test_patch,
        timeout_s=float(config.get("verifier", {}).get("timeout_sec", 120.0)),
        memory_mb=int(memory),
    )
    meta = {
        "repo": spec.to_meta(),
        "source": {"format": "harbor", "dir": str(root)},
        "agent_timeout_s": float(config.get("agent", {}).get("timeout_sec", 600.0)),
        "solution": solution.read_text() if solution.is_file() else "",
    }
    dockerfile = env_dir / "Dockerfile"
    if dockerfile.is_file():
        meta["apptainer_recipe"] = dockerfile_definition(dockerfile)  # spython; built where building is allowed
    difficulty = HARBOR_DIFFICULTY.get(str(config.get("metadata", {}).get("difficulty", "")).lower(), 1)
    instruction = (root / "instruction.md").read_text().strip()
    task_id = f"{domain}-{root.name}-{hashlib.sha256(instruction.encode()).hexdigest()[:8]}"
    return Task(task_id, domain, difficulty, instruction, "", "repo", meta)


def _megabytes(value, where: Path) -> int | None:
    if value is None:
        return None
    text = str(value).strip().upper()
    scale = {"G": 1024, "M": 1, "K": 1 / 1024}
    try:
        if text[-1] in scale:
            return int(float(text[:-1]) * scale[text[-1]])
        return int(text)
    except ValueError:
        raise TaskImportError(f"{where / 'task.toml'}: environment.memory {value!r} is not a size") from None
