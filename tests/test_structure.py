"""The codebase's shape: one import namespace, torch-free configuration, layers that only import downwards."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from conftest import REPO

GENERIC = ("pipeline", "stages", "slurm", "containers", "kernels", "benchmarks")


def _python(code: str, cwd="/") -> subprocess.CompletedProcess:
    # cwd "/": the checkout is not on sys.path, only what is installed is importable
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_no_generic_top_level_module_is_installed():
    proc = _python(f"import importlib.util as u; print([n for n in {GENERIC!r} if u.find_spec(n)])")
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


def test_every_login_node_module_imports_alone_without_torch():
    """Each module of the CLI's layers, first in a fresh interpreter: an import cycle shows up only
    when the module that closes it is imported first, and none of them may pull in torch."""
    modules = sorted(
        "snowcat." + ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for package in LOGIN_NODE_PACKAGES
        for p in (REPO / package).rglob("*.py")
        if p.name != "__main__.py"
    ) + ["snowcat.stages.config"]
    code = (
        "import importlib, subprocess, sys\n"
        f"for m in {modules!r}:\n"
        "    r = subprocess.run([sys.executable, '-c', f'import sys, {m}; print(\"torch\" in sys.modules)'],\n"
        "                       capture_output=True, text=True)\n"
        "    if r.returncode or r.stdout.strip() != 'False':\n"
        "        print(m, (r.stderr.strip().splitlines() or [r.stdout.strip()])[-1])\n"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "", proc.stdout
