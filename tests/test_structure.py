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
    on_disk = {"snowcat." + ".".join(p.parent.relative_to(REPO).parts) for p in REPO.glob("*/**/__init__.py")
               if p.parent.relative_to(REPO).parts[0] in GENERIC}
    assert on_disk == set(setuptools["packages"])
