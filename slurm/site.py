"""Site profiles: what a Slurm centre allows, so snowcat renders only jobs the site will accept.

A profile (`slurm/sites/<name>.yaml`, or any YAML file) is validated against `SiteProfile`; unknown
keys and wrong types are refused naming the file and key. The Slurm executor renders every job
through `validate_request` (can the site run it at all?) and `filter_sbatch_options` (never emit an
option the site rejects). Facts come from the centres' public docs, listed per profile in
`sources`; values nobody could check from the docs are listed in `unverified` and are meant to be
confirmed live by `snowcat doctor`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from snowcat.pipeline.errors import UserError
from snowcat.slurm.cluster import default_root

SITES_DIR = Path(__file__).with_name("sites")
GPU_REQUEST_MODES = ("gres", "gpus-per-node", "none")
CONTAINER_RUNTIMES = ("apptainer", "none")


@dataclass
class Partition:
    gpus_per_node: int = 0
    cpus_per_node: int = 1  # physical cores
    mem_gb: int = 0
    max_nodes: int = 1  # per job
    max_time_min: int = 60
    gpu_type: Optional[str] = None
    cpu_arch: str = "x86_64"


@dataclass
class SiteProfile:
    name: str = "???"
    description: str = ""
    sources: list[str] = field(default_factory=list)  # where the values came from
    unverified: list[str] = field(default_factory=list)  # keys whose values the docs did not confirm
    partitions: dict[str, Partition] = field(default_factory=dict)
    default_partition: str = "???"
    exclusive_nodes: bool = True  # the site allocates whole nodes (no node sharing)
    arrays_allowed: bool = True
    max_array_size: int = 1000
    hetjobs_allowed: bool = True
    requeue_allowed: bool = True  # if False, long stages continue through chained jobs instead
    sbatch_on_compute: bool = True  # TACC: sbatch is refused on compute nodes; submit the whole DAG from login
    rejected_options: list[str] = field(default_factory=list)  # sbatch options the site refuses, e.g. "--mem"
    gpu_request: str = "gres"  # how to ask for GPUs: gres | gpus-per-node | none (whole node implied)
    mpi_plugin: str = "pmix"  # srun --mpi=<this>; "ibrun" where the launcher is not srun
    launcher: str = "srun"
    account: Optional[str] = None
    account_required: bool = False
    run_root: str = "logs"  # shell-style variables ($SCRATCH, $WORK) are expanded on the cluster
    scratch: str = "/tmp"
    project: str = "."
    scratch_purge_days: Optional[int] = None
    internet_on_compute: bool = False
    container_runtime: str = "apptainer"  # apptainer | none
    container_module: Optional[str] = None
    modules: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    master_addr_suffix: str = ""  # JSC: append "i" to a hostname to use its InfiniBand address


def list_sites() -> list[str]:
    return sorted(p.stem for p in SITES_DIR.glob("*.yaml"))


def _profile_path(name_or_path: str | Path) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise UserError(f"site profile {path}: no such file")
        return path
    path = SITES_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise UserError(f"unknown site {name_or_path!r}; known sites: {', '.join(list_sites())}")
    return path


def load_site(name_or_path: str | Path) -> DictConfig:
    """The validated, read-only profile of a known site name or a YAML file."""
    path = _profile_path(name_or_path)
    try:
        raw = OmegaConf.load(path)
        site = OmegaConf.merge(OmegaConf.structured(SiteProfile), raw)
        OmegaConf.to_container(site, throw_on_missing=True)  # every required key present
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        msg = str(e).splitlines()[0]
        raise UserError(f"site profile {path}: key {key}: {msg}") from None
    except yaml.MarkedYAMLError as e:
        where = f" at line {e.problem_mark.line + 1}" if e.problem_mark else ""
        raise UserError(f"site profile {path}: invalid YAML{where}: {e.problem}") from None
    _check(site, path)
    OmegaConf.set_readonly(site, True)
    return site


def use_local_cluster(site) -> None:
    """Point Slurm clients (sbatch, sacct, submitit, doctor's checks) at the cluster `snowcat cluster up`
    runs, so `--site local` works without sourcing its env.sh. Other sites use the environment as it
    is; an explicit SLURM_CONF always wins."""
    if site is None or site.get("name") != "local" or os.environ.get("SLURM_CONF"):
        return

    conf = default_root() / "etc" / "slurm.conf"
    if not conf.is_file():
        raise UserError(f"site local: the local cluster is not set up ({conf} missing); start it with `snowcat cluster up`")
    os.environ["SLURM_CONF"] = str(conf)


def _check(site: DictConfig, path: Path) -> None:
    def bad(key: str, why: str) -> UserError:
        return UserError(f"site profile {path}: key {key}: {why}")

    if not site.partitions:
        raise bad("partitions", "at least one partition is needed")
    if site.default_partition not in site.partitions:
        raise bad("default_partition", f"{site.default_partition!r} is not one of {list(site.partitions)}")
    if site.gpu_request not in GPU_REQUEST_MODES:
        raise bad("gpu_request", f"{site.gpu_request!r} is not one of {GPU_REQUEST_MODES}")
    if site.container_runtime not in CONTAINER_RUNTIMES:
        raise bad("container_runtime", f"{site.container_runtime!r} is not one of {CONTAINER_RUNTIMES}")
    for name, p in site.partitions.items():
        for key in ("max_nodes", "max_time_min", "cpus_per_node"):
            if p[key] < 1:
                raise bad(f"partitions.{name}.{key}", f"must be >= 1, got {p[key]}")
        if p.gpus_per_node < 0:
            raise bad(f"partitions.{name}.gpus_per_node", f"must be >= 0, got {p.gpus_per_node}")
    for opt in site.rejected_options:
        if not opt.startswith("--"):
            raise bad("rejected_options", f"{opt!r}: write long options with leading dashes, e.g. '--mem'")


# ---------------------------------------------------------------- requests and rendering


def validate_request(site: DictConfig, partition: Optional[str] = None, nodes: int = 1, gpus_per_node: int = 0,
                     time_min: int = 60, array_size: int = 0, hetjob: bool = False,
                     account: Optional[str] = None) -> None:
    """Raise UserError (naming site, partition and the limit) if the site cannot run this request."""
    part_name = partition or site.default_partition
    where = f"site {site.name}, partition {part_name}"
    if part_name not in site.partitions:
        raise UserError(f"site {site.name}: unknown partition {part_name!r}; it has {', '.join(site.partitions)}")
    part = site.partitions[part_name]
    if gpus_per_node > part.gpus_per_node:
        raise UserError(f"{where}: {gpus_per_node} GPUs per node requested, nodes have {part.gpus_per_node}")
    if not 1 <= nodes <= part.max_nodes:
        raise UserError(f"{where}: {nodes} nodes requested, allowed 1..{part.max_nodes}")
    if not 0 < time_min <= part.max_time_min:
        raise UserError(f"{where}: walltime {time_min} min requested, maximum {part.max_time_min} min")
    if array_size and not site.arrays_allowed:
        raise UserError(f"site {site.name}: job arrays are not allowed; submit separate jobs")
    if array_size > site.max_array_size:
        raise UserError(f"site {site.name}: array of {array_size} tasks requested, maximum {site.max_array_size}")
    if hetjob and not site.hetjobs_allowed:
        raise UserError(f"site {site.name}: heterogeneous jobs are not allowed")
    if site.account_required and not (account or site.account):
        raise UserError(f"site {site.name}: an account is required (set the site's `account` or pass one)")


_SHORT = {"A": "account", "N": "nodes", "n": "ntasks", "p": "partition", "t": "time", "G": "gpus", "J": "job-name",
          "o": "output", "e": "error", "a": "array", "d": "dependency", "c": "cpus-per-task", "w": "nodelist",
          "x": "exclude", "q": "qos", "C": "constraint"}
_GPU_KEYS = ("gres", "gpus", "gpus-per-node", "gpus-per-task")


def _long_name(key: str) -> str:
    key = key.lstrip("-")
    return _SHORT.get(key, key.replace("_", "-"))


def _gpus_per_node(opts: dict[str, Any]) -> Optional[int]:
    """GPUs per node asked for by any of --gres=gpu[:type]:N, --gpus-per-node, --gpus, --gpus-per-task."""
    if "gpus-per-node" in opts:
        return int(str(opts["gpus-per-node"]).rsplit(":", 1)[-1])
    if "gres" in opts:
        for item in str(opts["gres"]).split(","):
            parts = item.split(":")
            if parts[0] == "gpu":
                return int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
    if "gpus-per-task" in opts:
        per_node_tasks = int(opts.get("ntasks-per-node", 1))
        return int(str(opts["gpus-per-task"]).rsplit(":", 1)[-1]) * per_node_tasks
    if "gpus" in opts:  # total over the job: spread evenly over its nodes
        total, nodes = int(str(opts["gpus"]).rsplit(":", 1)[-1]), int(str(opts.get("nodes", 1)).split("-")[0])
        return -(-total // nodes)
    return None


def filter_sbatch_options(site: DictConfig, options: dict[str, Any]) -> dict[str, Any]:
    """Options in long dash form (`gpus-per-node`, no leading dashes) that the site accepts.

    A GPU request in any spelling becomes the site's way (`gres`, `gpus-per-node`, or nothing where
    whole nodes are allocated); options listed in `rejected_options` are dropped, always. Keys may
    be given as `--mem`, `mem`, `gpus_per_node` or short (`-N`); values of None are omitted.
    """
    opts = {_long_name(k): v for k, v in options.items() if v is not None}
    gpus = _gpus_per_node(opts)
    for key in _GPU_KEYS:
        opts.pop(key, None)
    if gpus:
        if site.gpu_request == "gres":
            opts["gres"] = f"gpu:{gpus}"
        elif site.gpu_request == "gpus-per-node":
            opts["gpus-per-node"] = gpus
    rejected = {_long_name(o) for o in site.rejected_options}
    return {k: v for k, v in opts.items() if k not in rejected}
