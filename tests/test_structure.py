"""The codebase's shape: one import namespace, torch-free configuration, layers that only import downwards."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import REPO

from snowcat.pipeline import cli
from snowcat.stages.registry import KINDS

GENERIC = ("pipeline", "stages", "slurm", "containers", "kernels", "benchmarks")


def _python(code: str, cwd="/") -> subprocess.CompletedProcess:
    # cwd "/": the checkout is not on sys.path, only what is installed is importable
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_no_generic_top_level_module_is_installed():
    # another distribution may own such a name (Hugging Face's `kernels`): none may come from here
    ours = [str(REPO / n / "__init__.py") for n in GENERIC]
    code = f"import importlib.util as u; print([n for n in {GENERIC!r} if (s := u.find_spec(n)) and s.origin in {ours!r}])"
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    proc = _python("import snowcat.pipeline.cli, snowcat.kernels, snowcat.stages.model; print(snowcat.kernels.__file__)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(REPO / "kernels" / "__init__.py")


def test_every_package_folder_is_in_the_snowcat_namespace():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"snowcat": "."}
    on_disk = {
        "snowcat." + ".".join(p.parent.relative_to(REPO).parts)
        for p in REPO.glob("*/**/__init__.py")
        if p.parent.relative_to(REPO).parts[0] in GENERIC
    }
    assert on_disk == set(setuptools["packages"])


def test_the_import_contracts_name_every_stage_kind():
    """pyproject.toml's import-linter contracts list the stage kinds' modules by hand: a list that
    names one of them names every kind of the registry (stages/registry.py), so a new kind is held
    to the same rules."""
    kinds = {kind.module for kind in KINDS.values()}
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    for contract in contracts:
        for key in ("source_modules", "forbidden_modules", "modules"):
            named = set(contract.get(key, ()))
            if named & kinds:
                assert sorted(kinds - named) == [], f"{contract['name']}: {key}"


def test_loading_every_config_imports_no_torch():
    configs = sorted(str(p) for p in (REPO / "configs").glob("*.yaml"))
    assert configs
    code = (
        "import sys\n"
        "from snowcat.pipeline.config import load\n"
        f"for path in {configs!r}:\n"
        "    load(path)\n"
        "print(sorted(m for m in ('torch', 'transformers', 'deepspeed', 'vllm') if m in sys.modules))\n"
    )
    proc = _python(code, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


LOGIN_NODE_PACKAGES = ("pipeline", "slurm", "containers")


@pytest.mark.slow
def test_every_login_node_module_imports_alone_without_torch():
    """Each module of the CLI's layers, first in a fresh interpreter: an import cycle shows up only
    when the module that closes it is imported first, and none of them may pull in torch. Each is
    imported in a child forked from an interpreter that holds the third-party libraries they share
    and no snowcat module (a fresh interpreter each would spend most of its time importing those)."""
    modules = sorted(
        "snowcat." + ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for package in LOGIN_NODE_PACKAGES
        for p in (REPO / package).rglob("*.py")
        if p.name != "__main__.py"
    ) + ["snowcat.stages.config", "snowcat.stages.registry"]
    code = (
        "import importlib, os, sys, traceback\n"
        "import filelock, h5py, numpy, omegaconf, rich.console, yaml\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('snowcat', 'torch')], 'the parent must hold neither'\n"
        f"for m in {modules!r}:\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        try:\n"
        "            importlib.import_module(m)\n"
        "        except BaseException:\n"
        "            print(m, traceback.format_exc().strip().splitlines()[-1], flush=True)\n"
        "            os._exit(1)\n"
        "        if 'torch' in sys.modules:\n"
        "            print(m, 'imports torch', flush=True)\n"
        "        os._exit(0)\n"
        "    os.waitpid(pid, 0)\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "", proc.stdout


def _snowcat_imports(path, module: str = "") -> set[str]:
    """The snowcat modules a source file (module `module`) imports: `from snowcat.a import b` and
    `from .b import c` name both the package and the module; a string naming a module counts too
    (`importlib.import_module`, `python -m snowcat.x`)."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("snowcat.")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{parent}.{base}".rstrip(".")
            if base.startswith("snowcat"):
                found |= {base} | {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found |= set(re.findall(r"\bsnowcat(?:\.\w+)+", node.value))
    return found


def _module_files() -> dict[str, Path]:
    out = {}
    for package in GENERIC:
        for p in (REPO / package).rglob("*.py"):
            parts = p.relative_to(REPO).with_suffix("").parts
            out[".".join(("snowcat", *(parts[:-1] if parts[-1] == "__init__" else parts)))] = p
    return out


def test_the_quick_tier_reaches_every_module():
    """Every module of snowcat is imported, directly or through what it imports, by a test file of
    the quick tier (a file whose module-level marks do not make it all slow or cluster), so a plain
    `pytest` exercises every module at least at import."""
    modules = _module_files()
    quick = [
        p
        for p in (REPO / "tests").glob("test_*.py")
        if not any(
            f"pytest.mark.{m}" in line
            for line in p.read_text().splitlines()
            if line.startswith("pytestmark")
            for m in ("slow", "cluster")
        )
    ]
    todo = [m for p in [*quick, REPO / "tests" / "conftest.py"] for m in _snowcat_imports(p) if m in modules]
    # the runner imports a stage kind's module by name (pipeline.config.stage_module), the command
    # line a command's module (cli._COMMANDS), and the test below imports every benchmark by its file name
    kinds = {kind.module for kind in KINDS.values()}
    commands = {"snowcat.pipeline" + module for module, *_ in cli._COMMANDS.values()}
    todo += [m for m in modules if m.startswith("snowcat.benchmarks.")]
    seen: set[str] = set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parents = [
            ".".join(m.split(".")[:i]) for i in range(2, m.count(".") + 1)
        ]  # importing a.b.c runs a/__init__, a/b/__init__
        todo += [x for x in (*_snowcat_imports(modules[m], m), *parents) if x in modules]
        if m == "snowcat.pipeline.config":
            todo += sorted(kinds)
        if m == "snowcat.pipeline.cli":
            todo += sorted(commands)
    entry_points = {m for m in modules if m.endswith("__main__")}  # run as `python -m`, which the tests do
    missing = sorted(set(modules) - seen - entry_points)
    assert missing == [], "\n".join(missing)


def test_every_benchmark_is_a_snowcat_bench_command():
    """`snowcat bench NAME ARGS` imports benchmarks/NAME.py and calls its main(ARGS): each has one
    taking the argument list (the quick tier imports them all here)."""
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        if path.name == "__init__.py":
            continue
        module = importlib.import_module(f"snowcat.benchmarks.{path.stem}")
        assert list(inspect.signature(module.main).parameters)[:1] == ["argv"], path.name
