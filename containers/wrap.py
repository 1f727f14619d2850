"""Turn a stage command into the command line that runs it: inside an Apptainer image, under srun.

`wrap_command` is the only place that knows Apptainer's command-line syntax; the executors (local
and Slurm) call it for every stage process, so a stage runs the same way in and out of a container.
`srun_line` renders the launcher line for one job step, including heterogeneous (multi-role) steps.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from snowcat.containers.images import image_digest, inspect_labels
from snowcat.pipeline.errors import UserError

RUNTIMES = ("none", "apptainer")


def _check_bind(spec: str) -> None:
    # Apptainer bind syntax: SRC[:DST[:OPTS]], OPTS in {ro, rw}; a comma would split it in two.
    parts = spec.split(":")
    if not spec or "," in spec or len(parts) > 3 or not parts[0]:
        raise UserError(f"container bind '{spec}': expected /host/path[:/container/path[:ro|rw]]")
    if len(parts) >= 2 and not parts[1].startswith("/"):
        raise UserError(f"container bind '{spec}': container path must be absolute")
    if len(parts) == 3 and parts[2] not in ("ro", "rw"):
        raise UserError(f"container bind '{spec}': option must be ro or rw, got '{parts[2]}'")


def wrap_command(
    cmd: Sequence[str],
    runtime: str = "none",
    image: str | os.PathLike | None = None,
    binds: Sequence[str] = (),
    gpu: bool = False,
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """`cmd` as run under `runtime`: unchanged for "none", `apptainer exec ...` for "apptainer".

    binds are Apptainer bind specs (run dir, data, scratch: the stage sees them at the same paths,
    so paths recorded in the run directory stay valid inside and outside the image). env is passed
    with `--env` so the values land inside the container even when the image resets them.
    """
    if runtime not in RUNTIMES:
        raise UserError(f"container runtime '{runtime}': expected one of {', '.join(RUNTIMES)}")
    if runtime == "none":
        return list(cmd)
    if not image:
        raise UserError("container runtime 'apptainer' needs an image (set container.image or the site's image)")
    out = ["apptainer", "exec"]
    if gpu:
        out.append("--nv")
    seen = set()
    for spec in binds:
        # Profiles name storage as $SCRATCH / $WORK; a quoted command line would not expand them.
        spec = os.path.expandvars(os.path.expanduser(str(spec)))
        if "$" in spec:
            raise UserError(f"container bind '{spec}': environment variable not set on this machine")
        if spec and not spec.startswith("/"):  # relative host path (e.g. a profile's "."): absolute
            src, sep, rest = spec.partition(":")
            spec = os.path.abspath(src) + sep + rest
        _check_bind(spec)
        if spec not in seen:
            seen.add(spec)
            out += ["--bind", spec]
    for key, value in sorted((env or {}).items()):
        if not key.replace("_", "a").isalnum() or key[0].isdigit():
            raise UserError(f"container env '{key}': not a valid variable name")
        out += ["--env", f"{key}={value}"]
    return out + [str(image), *cmd]


# Every Python snowcat starts runs in safe-path mode (Python >= 3.11): the directory it starts in (a
# checkout, whose top-level folders `kernels`, `pipeline`, `stages`... are snowcat's own) is not put
# first on sys.path, so it cannot shadow an installed package of the same name (Hugging Face's
# `kernels`, which recent transformers import) whatever the working directory.
SAFE_PATH = "-P"


def stage_command(run_dir: str | os.PathLike, stage: str, item: int | None = None) -> list[str]:
    """The stage runner's command line (the lead's `python -m snowcat.stages RUN_DIR STAGE [--item I]`)."""
    cmd = ["python", SAFE_PATH, "-m", "snowcat.stages", str(run_dir), stage]
    return cmd + (["--item", str(item)] if item is not None else [])


# Profile values of mpi_plugin that are not srun plugins (TACC names its launcher there).
_NOT_SRUN_PLUGINS = ("ibrun", "none", "")


def site_mpi_plugin(site: Any) -> str | None:
    """The `srun --mpi=` plugin a site profile names (JSC: pspmix; the local cluster: pmix).

    None where the profile names no srun plugin (TACC: `ibrun`): srun then uses the cluster's
    MpiDefault, which `snowcat doctor` reports.
    """
    value = site.mpi_plugin if site is not None else "pmix"
    return None if value is None or str(value) in _NOT_SRUN_PLUGINS else str(value)


def srun_line(
    site: Any,
    het_groups: Sequence[int] | None,
    cmd: Sequence[str] | Mapping[int, Sequence[str]],
    extra: Sequence[str] = (),
) -> list[str]:
    """The launcher line for one job step.

    het_groups None: a plain step (`srun` or, where the site's launcher is `ibrun`, TACC's `ibrun`).
    het_groups [0, 1] with one `cmd`: every component runs the same command in one MPI world.
    `cmd` as {group: command}: an MPMD heterogeneous step, `srun --het-group=0 A : --het-group=1 B`,
    used when components run different images (trainer vs rollout); still one MPI world.
    Heterogeneous steps always use srun: it is the only launcher that addresses hetjob components
    (also on TACC systems, whose `ibrun` launches one homogeneous MPI job over the allocation).
    """
    plugin = site_mpi_plugin(site)
    mpi = [f"--mpi={plugin}"] if plugin else []
    if het_groups is None:
        if isinstance(cmd, Mapping):
            raise UserError("srun_line: a per-group command needs het_groups")
        if site is not None and site.launcher == "ibrun":
            return ["ibrun", *cmd]  # TACC's launcher takes no srun options
        return ["srun", *mpi, *extra, *cmd]
    groups = list(het_groups)
    if not groups or any(not isinstance(g, int) or g < 0 for g in groups):
        raise UserError(f"srun_line: het_groups must be non-negative ints, got {groups}")
    if not isinstance(cmd, Mapping):
        return ["srun", *mpi, f"--het-group={','.join(map(str, groups))}", *extra, *cmd]
    missing = [g for g in groups if g not in cmd]
    if missing:
        raise UserError(f"srun_line: no command for het group(s) {missing}")
    out = ["srun", *mpi]
    for i, g in enumerate(groups):
        if i:
            out.append(":")
        out += [f"--het-group={g}", *extra, *cmd[g]]
    return out


def role_images(stage: Any) -> dict[str, str | None]:
    """{role: image} of a multi-role stage, in component (rank) order: a component's own `image`
    where it names one (`resources.components.<role>.image`), else the stage's `image`. Roles run
    different software (the trainer image carries DeepSpeed/Megatron, the rollout image vLLM), so a
    hetjob stage names one image per role; both carry the same MPI (containers/mpi.sh)."""
    default = getattr(stage, "image", None)
    components = stage.resources.components
    return {role: getattr(comp, "image", None) or default for role, comp in components.items()}


def hetjob_step(
    site: Any,
    runtime: str,
    images: Sequence[str | os.PathLike | None],
    python_args: Sequence[str],
    *,
    binds: Sequence[str] = (),
    gpus: Sequence[bool] = (),
    cpus_per_task: Sequence[int] = (),
    extra: Sequence[str] = (),
    host_python: str = "python",
) -> list[str]:
    """The srun line of one heterogeneous step whose components (groups 0..n-1, in rank order) run
    `python PYTHON_ARGS` in their own image: `images[g]` (None: on the host, as `host_python`),
    `--nv` where `gpus[g]`, `--cpus-per-task=cpus_per_task[g]` (Slurm 22.05-23.02 do not hand the
    allocation's down to srun). One command and CPU count for every group: the plain
    `--het-group=0,1,...` form; otherwise Slurm's MPMD form `--het-group=0 A : --het-group=1 B`,
    `extra` (srun options such as --kill-on-bad-exit, --output) repeated for each group, since srun
    applies an option to the component it precedes. Either way one MPI world over all groups."""
    if not images:
        raise UserError("hetjob_step: no components")
    gpus = list(gpus) or [False] * len(images)
    if len(gpus) != len(images):
        raise UserError(f"hetjob_step: {len(images)} images but {len(gpus)} GPU flags")
    cpus = list(cpus_per_task)
    if cpus and len(cpus) != len(images):
        raise UserError(f"hetjob_step: {len(images)} images but {len(cpus)} CPU counts")

    def command(image, gpu) -> list[str]:
        if runtime == "none" or not image:
            return [host_python, SAFE_PATH, *python_args]
        return wrap_command(["python", SAFE_PATH, *python_args], runtime, image=image, binds=binds, gpu=gpu)

    groups = list(range(len(images)))
    commands = [command(image, gpu) for image, gpu in zip(images, gpus, strict=True)]
    options = [[f"--cpus-per-task={int(c)}"] for c in cpus] or [[] for _ in groups]
    if all(c == commands[0] for c in commands) and all(o == options[0] for o in options):
        return srun_line(site, groups, commands[0], extra=[*options[0], *extra])
    return srun_line(site, groups, {g: [*options[g], *extra, *commands[g]] for g in groups})


def image_provenance(image: str | os.PathLike) -> dict:
    """What the provenance card records about an image: its path, sha256 and build labels.

    Labels need the apptainer binary; without it they are recorded as unknown (with the reason)
    rather than failing the card: the sha256 alone pins the image.
    """

    path = Path(image)
    record: dict[str, Any] = {"image": str(path), "sha256": image_digest(path)}
    try:
        record["labels"] = inspect_labels(path)
    except UserError as e:
        record["labels"] = None
        record["labels_error"] = str(e)
    return record
