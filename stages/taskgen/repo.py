"""Repository tasks: a code base with a bug, a problem statement, and the tests that judge a fix.

A repository task is a `Task` (domain e.g. `swe_mini` or `swe`, verifier `repo`) whose `answer` is
the gold patch (may be empty) and whose `meta["repo"]` is a `RepoSpec`:

    source        where the code comes from, history stripped:
                    {"files": {path: text}}                  inline (generated tasks)
                    {"git": dir, "base_commit": sha}         a local repository (imported tasks)
                    {"archive": file.tar[.gz]}               a snapshot archive
    test_command  shell command run from the repository root; `{tests}` becomes the test ids
    fail_to_pass  tests that fail before the fix and must pass after it
    pass_to_pass  tests that pass before and must still pass
    test_paths    test files the verifier restores from the snapshot before testing (editing them
                  gains nothing); files the `test_patch` touches are restored too
    test_patch    hidden tests, applied by the verifier only (SWE-bench's test_patch)
    timeout_s, memory_mb   limits of one verification (and of each tool call)
    harness       pytest | unittest (the observer), script (exit status), harbor (reward file),
                  swebench (the log, graded by SWE-bench's parser: stages/taskgen/swebench_harness.py)
    workdir       where the repository must be inside the sandbox ("": /workspace; SWE-bench's
                  images: /testbed, where their environment expects it)
    env_setup     shell lines run before the tests (and `install`), in the same shell: the image's
                  environment (SWE-bench: conda's `testbed` env and the spec's eval_commands)
    install       run after the patch, in its own call, before the test files are put back (SWE-bench:
                  the repository reinstalled with the patch); its exit status is not judged
    swebench      harness swebench: {instance_id, repo, version}, whose log parser and grading judge

An agent's work is judged by its patch against the snapshot (`make_patch`): `verify_patch`
materialises the snapshot in a fresh sandbox, applies the patch with `git apply`, restores the test
files, applies the test patch and runs FAIL_TO_PASS + PASS_TO_PASS. Reward 1 only when all pass.
A sandbox that fails to start or a harness that never starts raises `VerifierError`: an
infrastructure failure, never the model's; tests that run past the time limit once started are
the patch's (reward 0).

`snapshot_files` materialises a git or archive source once per process (`SNAPSHOTS`, a bounded
LRU): every episode and verification of a task starts from those bytes, written into its own
sandbox, so nothing they do reaches the cached tree.
"""

from __future__ import annotations

import difflib
import hmac
import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import tarfile
import tempfile
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from snowcat.stages.sandbox import WORKSPACE, Bind, Limits, check_inside, open_sandbox, write_files
from snowcat.stages.taskgen.observer import STARTED as OBSERVER_STARTED
from snowcat.stages.taskgen.verdict import VerifierError

SKIP_DIRS = {".git", ".tmp", "__pycache__", ".pytest_cache"}
MAX_FILE_BYTES = 1 << 20  # larger files are not part of a patch (and not offered to the model)


@dataclass(frozen=True)
class RepoSpec:
    source: dict
    test_command: str
    fail_to_pass: list[str]
    pass_to_pass: list[str] = field(default_factory=list)
    test_paths: list[str] = field(default_factory=list)
    test_patch: str = ""
    timeout_s: float = 60.0
    memory_mb: int = 1024
    harness: str = ""  # pytest | unittest | script | harbor | swebench; "" = what test_command runs (`harness_of`)
    workdir: str = ""  # the repository's path inside the sandbox; "" = the sandbox's (/workspace)
    env_setup: str = ""  # shell lines before the tests, same shell (SWE-bench: its conda env)
    install: str = ""  # after the patch, own call, exit status not judged (SWE-bench's `install`)
    swebench: dict = field(default_factory=dict)  # harness swebench: {instance_id, repo, version}

    def __post_init__(self) -> None:
        kinds = {"files", "git", "archive"} & set(self.source)
        if len(kinds) != 1:
            raise ValueError(f"repo source must name exactly one of files, git, archive; got {sorted(self.source)}")
        if "git" in self.source and not self.source.get("base_commit"):
            raise ValueError("a git repo source needs base_commit")
        if "{tests}" not in self.test_command and self.harness != "swebench":  # SWE-bench's command names its own tests
            raise ValueError(f"test_command must contain '{{tests}}': {self.test_command!r}")
        if self.harness == "swebench" and not {"instance_id", "repo", "version"} <= set(self.swebench):
            raise ValueError("harness swebench needs swebench: {instance_id, repo, version}")
        if self.workdir:
            check_inside(self.workdir)
        if not self.fail_to_pass:
            raise ValueError("fail_to_pass must name at least one test")
        if self.harness and self.harness not in HARNESSES:
            raise ValueError(f"harness must be one of {', '.join(HARNESSES)}; got {self.harness!r}")

    def to_meta(self) -> dict:
        return asdict(self)

    @classmethod
    def from_task(cls, task) -> RepoSpec:
        try:
            return cls(**task.meta["repo"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"task {task.task_id}: bad repo spec: {e}") from None

    def command(self, tests: list[str]) -> str:
        return self.test_command.replace("{tests}", " ".join(shlex.quote(t) for t in tests))


# ---------------------------------------------------------------- the snapshot


class _SnapshotCache:
    """Base trees of git and archive sources, made once per process (N attempts of a task archive
    once) and bounded in bytes, least recently used first out. Each caller gets its own dict over
    the shared, immutable bytes: nothing an episode or a verifier does reaches the cache."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._trees: OrderedDict[tuple, tuple[dict[str, bytes], int]] = OrderedDict()
        self._lock = threading.Lock()
        self._making: dict[tuple, threading.Lock] = {}  # one maker per key; others wait for it

    def get(self, key: tuple, make) -> dict[str, bytes]:
        with self._lock:
            if key in self._trees:
                self._trees.move_to_end(key)
                return dict(self._trees[key][0])
            making = self._making.setdefault(key, threading.Lock())
        with making:
            with self._lock:
                if key in self._trees:
                    return dict(self._trees[key][0])
            try:
                tree = make()
                with self._lock:
                    self._trees[key] = (tree, sum(len(b) for b in tree.values()))
                    while len(self._trees) > 1 and sum(n for _, n in self._trees.values()) > self.max_bytes:
                        self._trees.popitem(last=False)
            finally:
                with self._lock:
                    self._making.pop(key, None)
        return dict(tree)


SNAPSHOTS = _SnapshotCache(max_bytes=1 << 30)


def snapshot_files(spec: RepoSpec) -> dict[str, bytes]:
    """The repository at its base state as {relative path: bytes} (no .git); a git or archive
    source is materialised once per process (keyed by repository + commit, or archive + mtime)."""
    src = spec.source
    if "files" in src:
        return {p: t.encode() for p, t in src["files"].items()}
    if "git" in src:
        key = ("git", os.path.realpath(src["git"]), src["base_commit"])
    else:
        st = os.stat(src["archive"])
        key = ("archive", os.path.realpath(src["archive"]), st.st_mtime_ns, st.st_size)
    return SNAPSHOTS.get(key, lambda: _read_source(spec))


def _read_source(spec: RepoSpec) -> dict[str, bytes]:
    tmp = Path(tempfile.mkdtemp(prefix="snowcat-snapshot-"))
    try:
        return read_tree(materialise_source(spec, tmp / "repo"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def materialise_source(spec: RepoSpec, dest: Path) -> Path:
    """Write the base state into `dest` (created; must not exist) without any git history."""
    dest = Path(dest)
    shutil.rmtree(dest, ignore_errors=True)
    src = spec.source
    if "files" in src:
        write_files(dest, {p: t.encode() for p, t in src["files"].items()})
    elif "git" in src:
        dest.mkdir(parents=True)
        # `git archive` of the base commit: the tree only, so no later commit can be mined
        archive = subprocess.run(
            ["git", "-C", str(src["git"]), "archive", "--format=tar", src["base_commit"]], capture_output=True, check=False
        )
        if archive.returncode != 0:
            raise RuntimeError(f"git archive {src['git']}@{src['base_commit']}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    else:
        dest.mkdir(parents=True)
        with tarfile.open(src["archive"]) as tar:
            tar.extractall(dest, filter="data")
    return dest


def read_tree(root: Path) -> dict[str, bytes]:
    """Regular files under `root` (symlinks, special files, big files and SKIP_DIRS left out)."""
    out: dict[str, bytes] = {}
    root = Path(root)
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            st = path.lstat()
            if path.is_symlink() or not path.is_file() or st.st_size > MAX_FILE_BYTES:
                continue
            out[path.relative_to(root).as_posix()] = path.read_bytes()
    return out


# ---------------------------------------------------------------- patches


def make_patch(before: dict[str, bytes], after: dict[str, bytes]) -> str:
    """A unified diff (git-apply compatible) from `before` to `after`; binary files are left out."""
    parts: list[str] = []
    for path in sorted(set(before) | set(after)):
        a, b = before.get(path), after.get(path)
        if a == b:
            continue
        try:
            a_text = a.decode() if a is not None else None
            b_text = b.decode() if b is not None else None
        except UnicodeDecodeError:
            continue
        parts.append(f"diff --git a/{path} b/{path}\n")
        if a_text is None:
            parts.append("new file mode 100644\n")
        elif b_text is None:
            parts.append("deleted file mode 100644\n")
        lines = difflib.unified_diff(
            _lines(a_text or ""),
            _lines(b_text or ""),
            fromfile=f"a/{path}" if a_text is not None else "/dev/null",
            tofile=f"b/{path}" if b_text is not None else "/dev/null",
        )
        parts.extend(lines)
    return "".join(parts)


def _lines(text: str) -> list[str]:
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n\\ No newline at end of file\n"
    return lines


def patched_paths(patch: str) -> list[str]:
    """The files a unified diff touches (either side)."""
    paths = set()
    for m in re.finditer(r"^(?:---|\+\+\+) (?:[ab]/)?(\S+)", patch, re.M):
        if m.group(1) != "/dev/null":
            paths.add(m.group(1))
    return sorted(paths)


# ---------------------------------------------------------------- what the agent may not change


# Files that configure or start the test runner: wherever they are, the snapshot's version is used
# (one the agent adds is removed), so nothing on the agent's side takes part in running the tests.
RUNNER_FILES = {"conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "sitecustomize.py", "usercustomize.py"}
TEST_DIRS = {"test", "tests", "testing"}
# Installed-package metadata: on sys.path (the repository root is), a `*.dist-info` or `*.egg-info`
# directory's entry points are loaded by the runner as plugins (pytest11): the snapshot's only.
PACKAGE_METADATA = (".dist-info", ".egg-info")


def _test_files(test_id: str, base: dict[str, bytes]) -> list[str]:
    """The snapshot files a test id names: pytest `path.py::...`, unittest `pkg.mod.Class.test`
    (each dotted prefix that is a module of the snapshot)."""
    if "::" in test_id or test_id.endswith(".py"):
        return [test_id.split("::", 1)[0]]
    parts = test_id.split(".")
    found = []
    for k in range(1, len(parts) + 1):
        stem = "/".join(parts[:k])
        found += [p for p in (stem + ".py", stem + "/__init__.py") if p in base]
    return found


def guarded_paths(spec: RepoSpec, base: dict[str, bytes], tree: list[str]) -> list[str]:
    """Every path the verifier puts back to the snapshot before running the tests (removing what the
    snapshot does not have): the test files (`test_paths`, the test patch's, those the test ids
    name) with the rest of their test directory, and the runner's configuration files and
    installed-package metadata (entry points: pytest plugins) anywhere."""
    files = set(spec.test_paths) | set(patched_paths(spec.test_patch))
    for test_id in spec.fail_to_pass + spec.pass_to_pass:
        files.update(_test_files(test_id, base))
    dirs = {str(PurePosixPath(f).parent) for f in files if PurePosixPath(f).parent.name in TEST_DIRS}
    out = set(files)
    for path in set(base) | set(tree):
        p = PurePosixPath(path)
        runner = p.name in RUNNER_FILES or p.suffix == ".pth" or any(part.endswith(PACKAGE_METADATA) for part in p.parts[:-1])
        if runner or any(str(parent) in dirs for parent in p.parents):
            out.add(path)
    return sorted(out)


def _replace_files(root: Path, paths: list[str], base: dict[str, bytes]) -> None:
    """Put `paths` back to their base content (or remove them where the base has none), whatever the
    agent left there, never following a link: a symlink or file where one of their directories
    belongs is replaced by a directory, and whatever stands in a file's place is removed."""
    for rel in paths:
        parts = Path(rel).parts
        if Path(rel).is_absolute() or ".." in parts:
            raise ValueError(f"test path {rel!r} is outside the repository")
        path = root
        for part in parts[:-1]:
            path = path / part
            if path.is_symlink() or (path.exists() and not path.is_dir()):
                path.unlink()
            path.mkdir(exist_ok=True)
        path = path / parts[-1]
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        if rel in base:
            path.write_bytes(base[rel])


def _tree(root: Path) -> list[str]:
    """Every file and link under `root` (names only; links not followed)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        out += [(Path(dirpath) / n).relative_to(root).as_posix() for n in filenames]
        out += [(Path(dirpath) / d).relative_to(root).as_posix() for d in dirnames if (Path(dirpath) / d).is_symlink()]
    return out


# ---------------------------------------------------------------- the harness


HARNESSES = ("pytest", "unittest", "script", "harbor", "swebench")
_PYTHON = re.compile(r"(^|/)python(\d+(\.\d+)?)?$")


def harness_of(spec: RepoSpec) -> tuple[str, str]:
    """(harness, interpreter): `spec.harness` or what `test_command` runs (`python -m pytest`,
    `pytest`, `python -m unittest`; anything else is a script whose exit status is the verdict;
    `harbor` and `swebench` only when named: /tests/test.sh and its reward file; SWE-bench's command
    and its log), and the Python that runs the
    observer (the command's own, else `python3`)."""
    words = shlex.split(spec.test_command)
    python = words[0] if words and _PYTHON.search(words[0]) else "python3"
    if spec.harness:
        return spec.harness, python
    if "pytest" in words[:1] or (python == words[0] and words[1:3] == ["-m", "pytest"]):
        return "pytest", python
    if python == words[0] and words[1:3] == ["-m", "unittest"]:
        return "unittest", python
    return "script", python


OBSERVER = Path(__file__).with_name("observer.py")
# A test run past the task's time limit once the harness started is the code under test's doing (a
# patch that hangs must not turn a failure into a neutral episode); a harness too slow for its limit
# is caught before use, by task validation (the gold must pass twice within it).
_TIMEOUT = "tests ran past the time limit ({:g}s)"


def _read_record(path: Path, nonce: str) -> dict | None:
    """A JSON record the observer wrote, or None (missing, a link, not JSON, another nonce)."""
    if path.parent.is_symlink():
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_FILE_BYTES)
    try:
        record = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {"forged": "not JSON"}
    if not isinstance(record, dict) or not hmac.compare_digest(str(record.get("nonce")), nonce):
        return {"forged": "wrong nonce"}
    return record


def _judge(tests: list[str], spec: RepoSpec, record: dict) -> tuple[float, bool, str]:
    if "forged" in record:
        return 0.0, False, f"test report not the observer's ({record['forged']})"
    if record.get("tampered"):
        return 0.0, False, "the test runner was tampered with: " + "; ".join(record["tampered"][:3])
    results = record.get("results") or {}
    failing = [t for t in tests if results.get(t) not in ("passed", "xpassed")]
    if not failing:
        return 1.0, True, f"{len(tests)} tests pass"
    f2p = [t for t in failing if t in spec.fail_to_pass]
    p2p = [t for t in failing if t in spec.pass_to_pass]
    missing = [t for t in failing if t not in results]
    detail = (
        f"tests fail: FAIL_TO_PASS {len(f2p)}/{len(spec.fail_to_pass)} failing, "
        f"PASS_TO_PASS {len(p2p)}/{len(spec.pass_to_pass)} failing"
    )
    if missing:
        detail += f" ({len(missing)} never reported)"
    if record.get("aborted"):
        detail += f"; the run was cut short by {record['aborted']}"
    return 0.0, False, detail


# ---------------------------------------------------------------- verification


def verify_patch(
    task, patch: str, image: str | None = None, base: dict[str, bytes] | None = None, solution: str = ""
) -> tuple[float, bool, str]:
    """Judge `patch` (the agent's changes to the snapshot) with the task's tests in a clean sandbox:
    (reward, passed, detail). `base`: the snapshot, when the caller holds it already (else
    `snapshot_files`, cached per process). `solution`: a gold script (Harbor's solve.sh) run in the
    repository after the patch, as task validation runs it. Raises VerifierError for what is not
    the model's doing.

    The snapshot, then the patch (`git apply`), then every guarded path put back (`guarded_paths`),
    then the test patch; then the tests: pytest and unittest tasks through the observer
    (observer.py: isolated interpreter, nonce, tamper checks), whose report alone is the verdict;
    script tasks by the script's exit status; swebench tasks by SWE-bench's parser and grading of the
    log (forgeable by what the code under test prints: meta["verdict"] "log"). The repository is at
    `spec.workdir` inside the sandbox (SWE-bench's /testbed); `spec.install` runs after the patch,
    before the test files are put back, and `spec.env_setup` before it and before the tests."""
    spec = RepoSpec.from_task(task)
    image = task.meta.get("sandbox_image") or image  # a task's own image (tasks.imports[].build_images) first
    base = snapshot_files(spec) if base is None else base
    tests = list(dict.fromkeys(spec.fail_to_pass + spec.pass_to_pass))
    harness, python = harness_of(spec)
    limits = Limits(cpu_s=int(spec.timeout_s) + 1, memory_bytes=spec.memory_mb << 20)
    with open_sandbox(image=image, limits=limits, inside=spec.workdir or WORKSPACE) as sb:
        root = sb.workdir
        write_files(root, base)
        if patch.strip():
            r = _apply(sb, ".snowcat-agent.patch", patch, spec.timeout_s)
            if r.status != "ok" or r.exit_code != 0:
                return 0.0, False, f"patch does not apply: {(r.stderr or r.detail).strip()[:300]}"
        if solution.strip():
            r = _run(sb, ["bash", ".snowcat-solution.sh"], spec.timeout_s, files={".snowcat-solution.sh": solution})
            if r.status != "ok" or r.exit_code != 0:
                return (
                    0.0,
                    False,
                    f"the solution script fails ({r.status}, exit {r.exit_code}): {(r.stderr or r.detail).strip()[-200:]}",
                )
            (root / ".snowcat-solution.sh").unlink(missing_ok=True)
        if spec.install.strip():  # as SWE-bench's eval script (no -e): a failing install is not the verdict
            r = _run(sb, _shell(spec.env_setup, spec.install), spec.timeout_s)
            if r.status == "timeout":
                return 0.0, False, f"the install ran past the time limit ({spec.timeout_s:g}s)"
        guarded = guarded_paths(spec, base, _tree(root))
        try:
            _replace_files(root, guarded, base)
        except OSError as e:
            raise VerifierError(f"restoring test files: {e}") from e
        if harness == "harbor":
            return _run_harbor(sb, spec, root, guarded, base)
        if spec.test_patch:  # a call of its own: no exit status of the tests can pass for its failure
            r = _apply(sb, ".snowcat-test.patch", spec.test_patch, spec.timeout_s)
            if r.status != "ok" or r.exit_code != 0:
                raise VerifierError(f"the task's test patch does not apply: {(r.stderr or r.detail).strip()[:300]}")
        if harness == "swebench":
            return _run_swebench(sb, spec, root, guarded, base, patch)
        files = {}
        nonce, start = secrets.token_hex(16), secrets.token_hex(16)  # the report's; the start line's
        if harness == "script":
            command = spec.command(tests)
        else:  # a directory made for this one verification, named by a second secret
            box = f".snowcat-verify-{secrets.token_hex(8)}"
            files |= {f"{box}/observer.py": OBSERVER.read_bytes(), f"{box}/nonce": f"{nonce}\n{start}\n"}
            # paths relative to the work dir, where every sandbox starts the command
            command = shlex.join([python, "-I", f"{box}/observer.py", "--harness", harness, "--dir", box, "--root", ".", *tests])
        r = sb.run(_shell(spec.env_setup, command), files=files, timeout_s=spec.timeout_s)
        # An observer that said it started ran in a sandbox that started: whatever looks like the
        # sandbox failing after that (Apptainer's "FATAL:" and exit 255) is the code under test's.
        if r.status == "infra_error" and not (harness != "script" and f"{OBSERVER_STARTED} {start}" in r.stderr):
            raise VerifierError(f"sandbox: {r.detail}")
        changed = _changed(root, guarded, _with_test_patch(spec, base))
        if harness == "script":
            return (
                (0.0, False, f"test files changed while the tests ran: {', '.join(changed[:3])}")
                if changed
                else _judge_script(r, spec.timeout_s)
            )
        report = _read_record(root / box / "report.json", nonce)
    if report and "harness_error" in report:
        raise VerifierError(f"test harness: {report['harness_error']}")
    if f"{OBSERVER_STARTED} {start}" not in r.stderr:
        tail = (r.stderr or r.stdout or r.detail).strip()[-300:]
        raise VerifierError(f"the {harness} harness did not start ({python}, {r.status}, exit {r.exit_code}): {tail}")
    if stopped := _stopped(r, spec.timeout_s):
        return stopped
    if r.status == "infra_error":  # after the observer started: the code under test's doing
        return 0.0, False, f"tests ended as {r.detail}"
    if report is None:
        return 0.0, False, f"no test report: the tests' process ended before the observer finished (exit {r.exit_code})"
    if changed:
        return 0.0, False, f"test files changed while the tests ran: {', '.join(changed[:3])}"
    return _judge(tests, spec, report)


def _with_test_patch(spec: RepoSpec, base: dict[str, bytes]) -> dict[str, bytes]:
    """The snapshot as the tests start from it: with the test patch applied (SWE-bench's test patches
    edit existing test files; those are not changed *by the tests*)."""
    paths = patched_paths(spec.test_patch)
    if not paths:
        return base
    with tempfile.TemporaryDirectory(prefix="snowcat-testpatch-") as tmp:
        work = Path(tmp)
        write_files(work, {p: base[p] for p in paths if p in base})
        r = subprocess.run(
            ["git", "apply", "--whitespace=nowarn", "-"], cwd=work, input=spec.test_patch.encode(), capture_output=True
        )
        if r.returncode != 0:
            raise VerifierError(f"the task's test patch does not apply: {r.stderr.decode().strip()[:300]}")
        after = {p: (work / p).read_bytes() for p in paths if (work / p).is_file()}
    return {p: b for p, b in base.items() if p not in paths} | after


def _changed(root: Path, guarded: list[str], base: dict[str, bytes]) -> list[str]:
    """Guarded files of the snapshot that differ from it after the tests ran (or are gone, or links):
    code under test that rewrites a test module before it is imported is caught here."""
    out, real_root = [], root.resolve()
    for rel in guarded:
        if rel not in base:
            continue
        path = root / rel
        moved = Path(os.path.realpath(path)) != real_root / rel  # a link on the way: never followed
        if moved or not path.is_file() or path.read_bytes() != base[rel]:
            out.append(rel)
    return out


# test.sh, then a look at what is left: whatever test.sh leaves running could rewrite the reward
# file after it, so only when no process of the sandbox's PID namespace is left but pid 1, this
# shell and its ancestors (zombies aside) does the shell say "clean" with a nonce, which it read and
# deleted before test.sh ran (not in its argv or environment, which the code under test can read).
# Without that line the verification fails: a survivor cannot forge it, and one that swallows the
# output only hides it. Survivors die with the namespace. Nothing is killed from here: where there
# were no PID namespace, the look would see the host's processes and fail safe. Builtins only (and
# rm before test.sh), so the look sees no process of its own.
_HARBOR_RUN = r"""
read -r nonce < .snowcat-harbor-nonce && rm -f .snowcat-harbor-nonce || exit 0
bash /tests/test.sh
field() { local k v; REPLY=; while read -r k v; do [ "$k" = "$2" ] && REPLY=$v && return; done < "/proc/$1/status"; }
keep=" 1 $$ " p=$$
while field "$p" PPid: && [ -n "$REPLY" ] && [ "$REPLY" -gt 1 ]; do keep="$keep$REPLY " p=$REPLY; done
for d in /proc/[0-9]*; do
  pid=${d#/proc/}
  case "$keep" in *" $pid "*) continue ;; esac
  field "$pid" State: 2>/dev/null || continue
  case "$REPLY" in Z*|X*|"") continue ;; esac
  exit 0
done
echo "snowcat-clean $nonce"
exit 0
"""


def _run_harbor(sb, spec: RepoSpec, root: Path, guarded: list[str], base: dict[str, bytes]) -> tuple[float, bool, str]:
    """Harbor's verifier: the task's tests (its test patch) at /tests, read-only, an empty
    /logs/verifier made for this verification, `bash /tests/test.sh` from the work dir, and the
    reward file it wrote as the verdict (its exit status is not)."""
    host = Path(tempfile.mkdtemp(prefix="snowcat-harbor-"))
    try:
        tests, logs = host / "tests-root", host / "verifier"
        tests.mkdir()
        logs.mkdir()
        if spec.test_patch:
            applied = subprocess.run(
                ["git", "apply", "--whitespace=nowarn", "-"], cwd=tests, input=spec.test_patch.encode(), capture_output=True
            )
            if applied.returncode != 0:
                raise VerifierError(f"the task's test patch does not apply: {applied.stderr.decode().strip()[:300]}")
        suite = tests / "tests"
        if not (suite / "test.sh").is_file():
            raise VerifierError("the task has no tests/test.sh")
        named = "\n".join(p.read_text(errors="replace") for p in suite.rglob("*") if p.is_file())
        binds = (Bind(str(suite), "/tests"), Bind(str(logs), "/logs/verifier", writable=True))
        nonce = secrets.token_hex(8)
        r = _run(sb, ["bash", "-c", _HARBOR_RUN], spec.timeout_s, files={".snowcat-harbor-nonce": nonce + "\n"}, binds=binds)
        if stopped := _stopped(r, spec.timeout_s):
            return stopped
        if f"snowcat-clean {nonce}" not in r.stdout:
            return (
                0.0,
                False,
                "processes were left running when tests/test.sh ended, or its end was not seen (they could rewrite its reward)",
            )
        if changed := _changed(root, guarded, base):
            return 0.0, False, f"test files changed while the tests ran: {', '.join(changed[:3])}"
        if any((logs / name).exists() and not (logs / name).stat().st_mode & 0o200 for name in ("reward.txt", "reward.json")):
            return 0.0, False, "a reward file was made read-only during the tests"
        return harbor_reward(logs, named)
    finally:
        shutil.rmtree(host, ignore_errors=True)


def _run(sb, cmd, timeout_s: float, **kwargs):
    """One sandbox call of a verification; the sandbox failing is the machinery's (VerifierError)."""
    r = sb.run(cmd, timeout_s=timeout_s, **kwargs)
    if r.status == "infra_error":
        raise VerifierError(f"sandbox: {r.detail}")
    return r


def _apply(sb, name: str, patch: str, timeout_s: float):
    """`git apply` of `patch` in the work dir, written to `name` and removed after; the call's result."""
    return _run(sb, f"git apply --whitespace=nowarn {name}; rc=$?; rm -f {name}; exit $rc", timeout_s, files={name: patch})


def _stopped(r, timeout_s: float) -> tuple[float, bool, str] | None:
    """The verdict of tests a limit stopped (the time limit, or another), None for a run that ended."""
    if r.status == "timeout":
        return 0.0, False, _TIMEOUT.format(timeout_s)
    if r.status == "limit":
        return 0.0, False, f"tests stopped at a limit ({r.detail})"
    return None


def _shell(env_setup: str, command: str) -> str:
    """`command` after the environment's lines, in one shell."""
    return f"{env_setup}\n{command}" if env_setup.strip() else command


def _run_swebench(sb, spec: RepoSpec, root: Path, guarded: list[str], base: dict[str, bytes], patch: str):
    """SWE-bench's official test command, its output (stdout and stderr as one stream, between
    SWE-bench's markers) graded by SWE-bench's parser for the repository and its rules (every
    FAIL_TO_PASS passes, every PASS_TO_PASS still passes). The log is the code under test's to
    write: what it prints can forge the verdict (meta["verdict"] "log")."""
    from snowcat.stages.taskgen import swebench_harness  # noqa: PLC0415 (swebench: heavy, an optional extra)

    try:
        start, end = swebench_harness.markers()
    except swebench_harness.HarnessUnavailable as e:
        raise VerifierError(str(e)) from None
    # snapshots keep bytes, not modes: the official command's own program (./tests/runtests.py,
    # bin/test) is made executable again when it is a file of the repository
    words = [w for w in shlex.split(spec.test_command) if "=" not in w or w.startswith("-")]
    program = words[0] if words else ""
    chmod = f"chmod +x {shlex.quote(program)} 2>/dev/null; " if "/" in program and not program.startswith("/") else ""
    body = f"echo {shlex.quote(start)}; {chmod}{spec.test_command}; echo {shlex.quote(end)}"
    r = _run(sb, _shell(spec.env_setup, "{ " + body + "; } 2>&1"), spec.timeout_s)
    if stopped := _stopped(r, spec.timeout_s):
        return stopped
    if changed := _changed(root, guarded, _with_test_patch(spec, base)):
        return 0.0, False, f"test files changed while the tests ran: {', '.join(changed[:3])}"
    try:
        resolved, report = swebench_harness.grade(spec.swebench, spec.fail_to_pass, spec.pass_to_pass, r.stdout, patch)
    except (KeyError, swebench_harness.HarnessUnavailable) as e:
        raise VerifierError(f"SWE-bench grading of {spec.swebench.get('repo')}: {e}") from None
    if resolved:
        return 1.0, True, f"{len(spec.fail_to_pass) + len(spec.pass_to_pass)} tests pass (SWE-bench's log parser)"
    status = report.get("tests_status")
    if not status:
        return 0.0, False, "no test output between SWE-bench's markers"
    f2p, p2p = status["FAIL_TO_PASS"]["failure"], status["PASS_TO_PASS"]["failure"]
    return (
        0.0,
        False,
        f"tests fail (SWE-bench's log parser): FAIL_TO_PASS {len(f2p)}/{len(spec.fail_to_pass)} failing, "
        f"PASS_TO_PASS {len(p2p)}/{len(spec.pass_to_pass)} failing",
    )


def _judge_script(r, timeout_s: float) -> tuple[float, bool, str]:
    if stopped := _stopped(r, timeout_s):
        return stopped
    if r.exit_code == 0:
        return 1.0, True, "the test script exits 0"
    return 0.0, False, f"the test script exits {r.exit_code}: {(r.stdout + r.stderr).strip()[-200:]}"


# ---------------------------------------------------------------- Harbor's reward file


def harbor_reward(verifier_dir: str | Path, named: str | None = None) -> tuple[float, bool, str]:
    """(reward, passed, detail) from what a Harbor test.sh wrote to /logs/verifier (host dir
    `verifier_dir`), as Harbor's verifier reads it: reward.json (an object; its numeric `reward`, or
    reward.txt's number where it has none), else reward.txt (one number). Passed: reward 1. No
    reward file, an empty one or one that is not a number: reward 0 with the reason (the tests ended
    before writing it). `named`: the task's test files' text; a reward file they never name was not
    written by them (code under test that drops a reward.json beside the script's reward.txt)."""
    root = Path(verifier_dir)
    text_file, json_file = root / "reward.txt", root / "reward.json"
    uses_json = named is None or "reward.json" in named
    if uses_json and json_file.is_file() and not json_file.is_symlink():
        try:
            data = json.loads(json_file.read_text()[:65536])
        except (ValueError, UnicodeDecodeError):
            return 0.0, False, "reward.json is not JSON"
        if not isinstance(data, dict):
            return 0.0, False, "reward.json is not an object"
        value = data.get("reward")
        if isinstance(value, int | float) and not isinstance(value, bool):
            return _reward(float(value), "reward.json")
    if (named is None or "reward.txt" in named) and text_file.is_file() and not text_file.is_symlink():
        try:
            return _reward(float(text_file.read_text()[:256].strip()), "reward.txt")
        except (ValueError, UnicodeDecodeError):
            return 0.0, False, "reward.txt is empty or not a number"
    return 0.0, False, "no reward file (reward.txt or reward.json) in /logs/verifier"


def _reward(value: float, name: str) -> tuple[float, bool, str]:
    if value != value or value in (float("inf"), float("-inf")):
        return 0.0, False, f"{name}: reward is not finite"
    return value, value == 1.0, f"{name}: reward {value:g}"
