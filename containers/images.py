"""Apptainer images: recipes (read/write/convert with spython), build, inspect, digest.

Recipes go through spython's parsers and writers, so a user's Dockerfile becomes a `.def` without
Docker. The apptainer binary is driven directly with subprocess: spython's `Client` hard-codes the
`singularity` command name, which Apptainer only installs as an optional alias on some sites.
Everything that needs the binary raises a UserError saying how to get it when it is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from spython.main.parse.parsers import DockerParser, SingularityParser
from spython.main.parse.writers import get_writer

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_text, sha256_file

DEFINITIONS = Path(__file__).resolve().parent  # trainer.def, rollout.def, sandbox.def
ARCHES = ("x86_64", "aarch64")


def apptainer_binary() -> str:
    """Path of `apptainer` (or its older name `singularity`); UserError naming the fix if absent."""
    for name in ("apptainer", "singularity"):
        found = shutil.which(name)
        if found:
            return found
    raise UserError(
        "apptainer not found on PATH: load it (JSC: `module load Apptainer-Tools`, "
        "TACC: `module load tacc-apptainer` on a compute node) or set container.runtime=none"
    )


def _run(args: list[str], what: str) -> str:
    proc = subprocess.run([apptainer_binary(), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise UserError(f"apptainer {what} failed: {detail[-1] if detail else f'exit {proc.returncode}'}")
    return proc.stdout


# --- recipes -------------------------------------------------------------------------------------


def _parser_for(path: Path):
    name = path.name.lower()
    if name.endswith(".def") or name == "singularity" or name.startswith("singularity."):
        return SingularityParser
    if "dockerfile" in name:
        return DockerParser
    raise UserError(f"{path}: not a recipe (expected *.def or a Dockerfile)")


def load_recipe(path: str | os.PathLike):
    """Parse a `.def` or Dockerfile into spython's Recipe (fromHeader, install, environ, labels ...)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: recipe not found")
    parser = _parser_for(path)(str(path))
    return parser.recipe["spython-base"] if "spython-base" in parser.recipe else next(iter(parser.recipe.values()))


def convert_recipe(path: str | os.PathLike, to: str) -> str:
    """The recipe at `path` rewritten as `to` ("singularity" for a .def, or "docker")."""

    path = Path(path)
    parser_cls = _parser_for(path)
    writer_cls = get_writer(to)
    if writer_cls is None:
        raise UserError(f"recipe format '{to}': expected singularity or docker")
    assert parser_cls in (DockerParser, SingularityParser)
    return writer_cls(parser_cls(str(path)).recipe).convert()


def dockerfile_definition(dockerfile: str | os.PathLike) -> str:
    """The Apptainer definition file text converted from a Dockerfile."""
    text = convert_recipe(dockerfile, "singularity")
    # spython names a single stage "spython-base"; Apptainer needs no Stage line for one stage, and
    # spython's own parser cannot read it back.
    if text.count("Stage: ") == 1:
        text = text.replace("Stage: spython-base\n", "")
    return text if text.endswith("\n") else text + "\n"


def dockerfile_to_def(dockerfile: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write an Apptainer definition file converted from a user's Dockerfile."""
    atomic_write_text(out, dockerfile_definition(dockerfile))
    return Path(out)


def definition(name: str, arch: str | None = None) -> Path:
    """Path of one of snowcat's definition files ("trainer", "rollout", "sandbox") for `arch`.

    `NAME-ARCH.def` exists only where the base image differs by architecture (rollout on aarch64).
    """
    arch = arch or os.uname().machine
    variant = DEFINITIONS / f"{name}-{arch}.def"
    path = variant if variant.is_file() else DEFINITIONS / f"{name}.def"
    if not path.is_file():
        raise UserError(f"container '{name}': no {path.name} in {DEFINITIONS}")
    return path


def definition_arguments(path: str | os.PathLike) -> dict[str, str]:
    """Defaults of a .def's `%arguments` section (spython does not parse that section yet)."""
    args, inside = {}, False
    for line in Path(path).read_text().splitlines():
        if line.startswith("%"):
            inside = line.strip() == "%arguments"
        elif inside and "=" in line:
            key, value = line.strip().split("=", 1)
            args[key.strip()] = value.strip()
    return args


# --- build, inspect, digest ----------------------------------------------------------------------


def snowcat_revision(repo: str | os.PathLike = DEFINITIONS.parent) -> str:
    """git commit of the checkout the image is built from ("unknown" outside a git checkout)."""
    proc = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else "unknown"


def snowcat_version() -> str:
    try:
        return version("snowcat")
    except PackageNotFoundError:
        return "0+unknown"


def build_args(arch: str | None = None) -> dict[str, str]:
    """Values for the `{{ NAME }}` templates in our .def files (Apptainer >= 1.2 `--build-arg`)."""
    arch = arch or os.uname().machine
    if arch not in ARCHES:
        raise UserError(f"image arch '{arch}': expected one of {', '.join(ARCHES)}")
    return {"SNOWCAT_VERSION": snowcat_version(), "SNOWCAT_REVISION": snowcat_revision(), "ARCH": arch}


def build(name_or_def: str | os.PathLike, image: str | os.PathLike, arch: str | None = None, fakeroot: bool = True) -> Path:
    """Build a SIF from one of our definitions (or any .def path), labels templated with version+revision.

    Written to a temp name and renamed, so a failed build never leaves a half image at `image`.
    """
    src = Path(name_or_def) if str(name_or_def).endswith(".def") else definition(str(name_or_def), arch)
    image = Path(image)
    tmp = image.with_name(f".{image.name}.tmp")
    args = ["build", "--force"] + (["--fakeroot"] if fakeroot else [])
    for key, value in build_args(arch).items():
        args += ["--build-arg", f"{key}={value}"]
    _run(args + [str(tmp), str(src)], f"build {src.name}")
    os.replace(tmp, image)
    return image


def image_digest(path: str | os.PathLike) -> str:
    """sha256 of the SIF file itself: what pins the exact image a stage ran in."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"container image {path}: not found")
    return sha256_file(path)


def inspect_labels(path: str | os.PathLike) -> dict[str, str]:
    """The image's `%labels` (snowcat version, revision, base image ...) via `apptainer inspect`."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"container image {path}: not found")
    out = json.loads(_run(["inspect", "--labels", "--json", str(path)], f"inspect {path.name}"))
    labels = out.get("data", out).get("attributes", {}).get("labels", {})
    return json.loads(labels) if isinstance(labels, str) else dict(labels)
