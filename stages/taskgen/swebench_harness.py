"""SWE-bench's own harness for SWE-bench-family rows, from the official `swebench` package.

Requires `swebench>=4,<5` (the `swe` extra: `pip install 'snowcat[swe]'`): 4.x keeps the
per-repository/version specifications (`MAP_REPO_VERSION_TO_SPECS`) in the package; 5.x moved them
into the dataset rows. Nothing here copies SWE-bench's logic, it calls it:

  * the test command: the spec's `test_cmd` followed by `get_test_directives(row)` (the test files the
    test patch touches; for Django, as test modules);
  * the environment: the lines SWE-bench's eval script (`make_eval_script_list`) runs before it
    touches the repository (conda's `testbed` env, `cd /testbed`, the spec's `eval_commands`), and the
    spec's `install` (the repository reinstalled with the patch);
  * the image: `TestSpec.instance_image_key` in the `swebench` namespace, the Docker Hub reference of
    the instance's published image (`swebench/sweb.eval.x86_64.<id>:latest`, `__` written `_1776_`),
    whose repository sits at `/testbed`;
  * the verdict, for the repositories whose `test_cmd` is not pytest (Django's runtests.py, SymPy's
    bin/test, Sphinx's tox): `MAP_REPO_TO_PARSER[repo]` over the test log and `get_eval_report`'s
    grading (every FAIL_TO_PASS passes, every PASS_TO_PASS still passes: `ResolvedStatus.FULL`).

`make_test_spec` itself is not called: it also renders the environment image's setup script, which
fetches requirements.txt / environment.yml from GitHub (compute nodes have no network); the
`TestSpec` the grading and the image key need is made from the row directly.

A pytest repository's tests run through snowcat's observer (verdict "observer": unforgeable by the
code under test); the others are judged from their log (verdict "log"): output the code under test
prints can forge it, as in SWE-bench itself.
"""

from __future__ import annotations

import json
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

SWEBENCH_NAMESPACE = "swebench"  # Docker Hub's, where SWE-bench publishes its instance images
TESTBED = "/testbed"  # where SWE-bench's images keep the repository (make_test_spec's repo_directory)
ENV_NAME = "testbed"  # their conda environment
ARCH = "x86_64"


class HarnessUnavailable(RuntimeError):
    """The `swebench` package is missing (or not a 4.x)."""


def _swebench():
    """SWE-bench's harness modules (imported on first use: heavy, and an optional extra)."""
    try:
        from swebench.harness import constants, grading, log_parsers  # noqa: PLC0415
        from swebench.harness.test_spec import create_scripts, python, test_spec  # noqa: PLC0415
    except ImportError as e:
        raise HarnessUnavailable(
            f"SWE-bench's harness needs the swebench package, 4.x ({e}): pip install 'snowcat[swe]', "
            "or set the import's test_command"
        ) from None
    if not hasattr(constants, "MAP_REPO_VERSION_TO_SPECS"):
        raise HarnessUnavailable("swebench 5.x keeps no per-repository specs: install swebench>=4,<5 (snowcat[swe])")
    return constants, grading, log_parsers, create_scripts, python, test_spec


@dataclass(frozen=True)
class Official:
    """What SWE-bench runs for one instance, in RepoSpec's terms."""

    test_command: str  # RepoSpec.test_command (pytest: with `{tests}` for the observer's ids)
    harness: str  # "pytest" (snowcat's observer) | "swebench" (the log, graded by SWE-bench)
    verdict: str  # "observer" | "log"
    image: str  # Docker reference of the instance image
    workdir: str  # the repository's path inside the image
    env_setup: str  # shell lines run before the tests, in the same shell
    install: str  # the spec's install, run after the patch
    directives: list[str]  # the test files/modules the official command runs
    swebench: dict  # {instance_id, repo, version}: whose parser and grading judge the log


def _spec(row: dict) -> dict | None:
    constants = _swebench()[0]
    return constants.MAP_REPO_VERSION_TO_SPECS.get(row.get("repo"), {}).get(str(row.get("version") or ""))


def known(row: dict) -> bool:
    """Whether SWE-bench has a specification for the row's repository and version (a Python one)."""
    constants = _swebench()[0]
    return _spec(row) is not None and constants.MAP_REPO_TO_EXT.get(row["repo"]) == "py"


def is_pytest(command: str) -> bool:
    """`pytest ...` or `python -m pytest ...`, after any VAR=value assignments."""
    words = shlex.split(command)
    while words and "=" in words[0] and not words[0].startswith("-"):
        words = words[1:]
    return words[:1] == ["pytest"] or (
        len(words) > 2 and words[0].rsplit("/", 1)[-1].startswith("python") and words[1:3] == ["-m", "pytest"]
    )


def make_spec(row: dict, namespace: str | None = SWEBENCH_NAMESPACE):
    """swebench's TestSpec for `row`, without its setup scripts (see the module docstring)."""
    constants, *_, test_spec = _swebench()
    f2p, p2p = (
        json.loads(v) if isinstance(v, str) else list(v or []) for v in (row.get("FAIL_TO_PASS"), row.get("PASS_TO_PASS"))
    )
    return test_spec.TestSpec(
        instance_id=row["instance_id"],
        repo=row["repo"],
        version=str(row["version"]),
        repo_script_list=[],
        eval_script_list=[],
        env_script_list=[],
        arch=ARCH,
        FAIL_TO_PASS=f2p,
        PASS_TO_PASS=p2p,
        language=constants.MAP_REPO_TO_EXT[row["repo"]],
        docker_specs={},
        namespace=namespace,
    )


def official(row: dict, namespace: str | None = SWEBENCH_NAMESPACE) -> Official:
    """SWE-bench's harness for a row (instance_id, repo, version, base_commit, test_patch, FAIL_TO_PASS,
    PASS_TO_PASS) whose repository and version it specifies (`known`); KeyError otherwise."""
    _, _, _, create_scripts, python, _ = _swebench()
    spec = _spec(row)
    if spec is None:
        raise KeyError(f"SWE-bench has no specification for {row.get('repo')} version {row.get('version')!r}")
    test_cmd = spec["test_cmd"]
    if isinstance(test_cmd, list):  # a list runs in order; the last one is the tests (as get_logs_eval reads it)
        test_cmd = " && ".join(test_cmd)
    directives = python.get_test_directives(row)
    script = create_scripts.make_eval_script_list(row, spec, ENV_NAME, TESTBED, row["base_commit"], row.get("test_patch") or "")
    marker = f"git config --global --add safe.directory {TESTBED}"
    env = script[: script.index(marker)] if marker in script else []
    pytest = is_pytest(test_cmd)
    return Official(
        test_command=f"{test_cmd} {{tests}}" if pytest else shlex.join([*shlex.split(test_cmd), *directives]),
        harness="pytest" if pytest else "swebench",
        verdict="observer" if pytest else "log",
        image=make_spec(row, namespace).instance_image_key,
        workdir=TESTBED,
        env_setup="\n".join(env),
        install=spec.get("install", ""),
        directives=directives,
        swebench={"instance_id": row["instance_id"], "repo": row["repo"], "version": str(row["version"])},
    )


def markers() -> tuple[str, str]:
    """SWE-bench's start and end lines around the test output in a log."""
    constants = _swebench()[0]
    return constants.START_TEST_OUTPUT, constants.END_TEST_OUTPUT


def grade(instance: dict, fail_to_pass: list[str], pass_to_pass: list[str], log: str, patch: str = "") -> tuple[bool, dict]:
    """(resolved, report) of a test log (between `markers()`), by SWE-bench's parser for the
    repository and its grading (`get_eval_report`; resolved: `ResolvedStatus.FULL`)."""
    constants, grading, *_ = _swebench()
    row = dict(instance, FAIL_TO_PASS=list(fail_to_pass), PASS_TO_PASS=list(pass_to_pass))
    spec = make_spec(row, namespace=None)
    with tempfile.TemporaryDirectory(prefix="snowcat-swebench-") as tmp:
        path = Path(tmp) / constants.LOG_TEST_OUTPUT
        path.write_text(log)
        prediction = {
            constants.KEY_INSTANCE_ID: spec.instance_id,
            constants.KEY_PREDICTION: patch,
            constants.KEY_MODEL: "snowcat",
        }
        report = grading.get_eval_report(spec, prediction, str(path), include_tests_status=True)[spec.instance_id]
    return bool(report["resolved"]), report


def parser_of(repo: str):
    """SWE-bench's log parser for `repo` (KeyError: none)."""
    return _swebench()[2].MAP_REPO_TO_PARSER[repo]
