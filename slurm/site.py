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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.schema import Problem, bounded, range_problems
from snowcat.slurm.cluster import default_root

SITES_DIR = Path(__file__).with_name("sites")


@dataclass(frozen=True)
class Partition:
    gpus_per_node: int = bounded(0, ge=0)
    cpus_per_node: int = bounded(1, ge=1)  # physical cores
    mem_gb: int = bounded(0, ge=0)
    max_nodes: int = bounded(1, ge=1)  # per job
    max_time_min: int = bounded(60, ge=1)
    gpu_type: str | None = None
    cpu_arch: str = "x86_64"
    max_submit_jobs: int | None = bounded(None, ge=1)  # QoS MaxSubmitPU: queued + running jobs, array tasks each count
    max_running_jobs: int | None = bounded(None, ge=1)  # QoS MaxJobsPU: running at once per user (hetjob components each count)
    max_nodes_per_user: int | None = bounded(None, ge=1)  # QoS MaxTRESPU node= (TACC qlimits MaxNodePU): over running jobs
    accelerator: Literal["auto", "cuda", "xpu", "none"] = "auto"  # auto: cuda where the nodes have GPUs, else none
    sources: dict[str, str] = field(default_factory=dict)  # limit field -> "URL (read YYYY-MM-DD)" or "unverified"

    def accel(self) -> str:
        """The accelerator kind of the nodes: cuda (NVIDIA), xpu (Intel Data Center GPU Max), or none."""
        if self.accelerator != "auto":
            return self.accelerator
        return "cuda" if self.gpus_per_node else "none"


@dataclass(frozen=True)
class NodeCost:
    """What `snowcat plan` needs to know of one partition's nodes (docs/planning.md); None: not
    known, and a plan that needs it says which key is missing."""

    charge_per_node_hour: float | None = bounded(None, ge=0)  # accounting units (planner.charge_unit) per node-hour
    device_memory_gib: float | None = bounded(None, gt=0)  # per GPU; unset on CPU nodes: mem_gb over the node's ranks
    peak_tflops: float | None = bounded(None, gt=0)  # per GPU, dense bf16; on CPU nodes per node, float32
    memory_gbps: float | None = bounded(None, gt=0)  # per GPU, HBM bandwidth (CPU nodes: per node, DRAM)
    intra_node_gbps: float | None = bounded(None, gt=0)  # GPU to GPU inside a node, per GPU and direction (NVLink)
    inter_node_gbps: float | None = bounded(None, gt=0)  # per node and direction, the interconnect (InfiniBand)


@dataclass(frozen=True)
class Planner:
    """The facts and assumptions `snowcat plan` rests on (docs/planning.md). The assumptions have
    documented defaults; every figure the planner prints names the ones it used."""

    charge_unit: str = "node-hours"  # what the allocation is counted in (JSC: core-h, TACC: SUs)
    mfu: float = bounded(0.25, gt=0, le=1)  # achieved fraction of peak_tflops in training (assumption)
    bandwidth_efficiency: float = bounded(0.6, gt=0, le=1)  # achieved fraction of the links' bandwidth (assumption)
    memory_margin: float = bounded(0.1, ge=0, le=0.9)  # fraction of device memory a plan leaves free
    filesystem_gbps: float = bounded(2.0, gt=0)  # shared filesystem, one job's write or read (weight handoff)
    # what a job costs beside its stage's work: the scheduler's start, the interpreter and imports,
    # the run's records (provenance, DONE) -- an assumption where the profile does not measure it
    job_start_s: float = bounded(60.0, ge=0)
    # what a sampling engine spends beside the hardware bound: a decode step's framework overhead, and
    # per sampled token the sampling, stop checks and episode bookkeeping (0: not known here)
    decode_step_s: float = bounded(0.0, ge=0)
    decode_token_s: float = bounded(0.0, ge=0)
    # a short stage kind's own work in seconds (tasks, select, export, card, scan, ...): measured where
    # given; a kind not named counts as nothing beside its job's start
    stage_work_s: dict[str, float] = field(default_factory=dict)
    # per trainer backend (torch, fsdp, deepspeed, megatron), the achieved fraction of peak that
    # replaces `mfu` for its stages: a backend's own overheads per layer (0 or absent: `mfu`)
    backend_mfu: dict[str, float] = field(default_factory=dict)
    # a sampling engine's start (load, compile, KV allocation) and the cost of serving a new weight
    # version beyond reading its bytes (vLLM's in-place reload, or its rebuild where that is refused)
    engine_start_s: float = bounded(0.0, ge=0)
    engine_reload_s: float = bounded(0.0, ge=0)
    # the agent loop's environment, seconds of one call as it runs beside the others of its turn: a
    # tool call that runs a process in the sandbox (test, bash), one answered in-process (view, edit,
    # an unparseable call), a submitted patch's verification, an episode's sandbox start; a turn's
    # calls run `tool_workers` at a time (0: the partition's cpus_per_node, as the loop's pool does)
    sandbox_call_s: float = bounded(0.0, ge=0)
    tool_call_s: float = bounded(0.0, ge=0)
    verify_s: float = bounded(0.0, ge=0)
    sandbox_start_s: float = bounded(0.0, ge=0)
    tool_workers: int = bounded(0, ge=0)
    # SFT's scripted expert: one episode's wall as the workers play them side by side, measured (its
    # sandboxes contend for the node's cores); 0: the sum of its calls' costs above
    expert_episode_s: float = bounded(0.0, ge=0)
    # an RL stage's seconds outside its updates: the job's MPI world, the trainer's start before it
    # asks for the first batch, the final save and records
    rl_start_s: float = bounded(0.0, ge=0)
    budget: Literal["none", "jutil", "taccinfo"] = "none"  # the remaining allocation's tool (taccinfo read, jutil a stub)
    partitions: dict[str, NodeCost] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)  # keys below planner. whose values no document confirmed


@dataclass(frozen=True)  # read-only: what the site allows is not changed by the code that reads it
class SiteProfile:
    name: str = "???"
    description: str = ""
    sources: list[str] = field(default_factory=list)  # where the values came from
    unverified: list[str] = field(default_factory=list)  # keys whose values the docs did not confirm
    partitions: dict[str, Partition] = field(default_factory=dict)
    default_partition: str = "???"
    cpu_partition: str | None = None  # where CPU-only stages (tasks, select, card, ...) go; None: default_partition
    exclusive_nodes: bool = True  # the site allocates whole nodes (no node sharing)
    arrays_allowed: bool = True
    max_array_size: int = bounded(1000, ge=0)  # largest array index + 1 (0 where arrays are not allowed)
    max_array_parallel: int = bounded(256, ge=1)  # array tasks running at once (%N) when a stage sets no max_parallel
    max_submit_jobs: int | None = bounded(None, ge=1)  # per user over the site (jobs + array tasks); None: not known
    hetjobs_allowed: bool = True
    requeue_allowed: bool = True  # if False, long stages continue through chained jobs instead
    sbatch_on_compute: bool = True  # TACC: sbatch is refused on compute nodes; submit the whole DAG from login
    rejected_options: list[str] = field(default_factory=list)  # sbatch options the site refuses, e.g. "--mem"
    gpu_request: Literal["gres", "gpus-per-node", "none"] = "gres"  # how to ask for GPUs (none: whole node implied)
    mpi_plugin: str = "pmix"  # srun --mpi=<this>; "ibrun" where the launcher is not srun
    launcher: str = "srun"
    account: str | None = None
    account_required: bool = False
    run_root: str = "logs"  # shell-style variables ($SCRATCH, $WORK) are expanded on the cluster
    scratch: str = "/tmp"
    project: str = "."
    scratch_purge_days: int | None = None
    internet_on_compute: bool | None = False  # None: not known (doctor finds out)
    shared_fs_required: bool = True  # doctor: the run root must be on a shared filesystem
    min_free_gb: float = bounded(50.0, ge=0)  # doctor: warn when the run root has less free space
    container_runtime: Literal["apptainer", "none"] = "apptainer"
    container_module: str | None = None
    modules: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    master_addr_suffix: str = ""  # JSC: append "i" to a hostname to use its InfiniBand address
    rollout_engine: Literal["torch", "vllm"] = "torch"  # what a sampling stage's `engine: auto` means here
    planner: Planner = field(default_factory=Planner)  # hardware, charge rates and assumptions of `snowcat plan`
    env_setup: str | None = None  # the login-node command that sets the site's variables (JSC: jutil env activate)

    def problems(self) -> Iterator[Problem]:
        """Checks across fields (types, choices and ranges are checked when the profile loads)."""
        if not self.partitions:
            yield "partitions", "at least one partition is needed"
        elif self.default_partition not in self.partitions:
            yield "default_partition", f"{self.default_partition!r} is not one of {list(self.partitions)}"
        if self.cpu_partition is not None and self.cpu_partition not in self.partitions:
            yield "cpu_partition", f"{self.cpu_partition!r} is not one of {list(self.partitions)}"
        for opt in self.rejected_options:
            if not opt.startswith("--"):
                yield "rejected_options", f"{opt!r}: write long options with leading dashes, e.g. '--mem'"
        for name in self.planner.partitions:
            if name not in self.partitions:
                yield f"planner.partitions.{name}", f"not one of the partitions {list(self.partitions)}"
        for name, part in self.partitions.items():
            for key in part.sources:
                if key not in LIMIT_FIELDS:
                    yield f"partitions.{name}.sources.{key}", f"not a limit field; one of {', '.join(LIMIT_FIELDS)}"
            if part.accelerator in ("cuda", "xpu") and not part.gpus_per_node:
                yield f"partitions.{name}.accelerator", f"{part.accelerator} on nodes without GPUs (gpus_per_node is 0)"
            if part.max_nodes_per_user is not None and part.max_nodes > part.max_nodes_per_user:
                yield (
                    f"partitions.{name}.max_nodes",
                    f"{part.max_nodes} per job is over max_nodes_per_user {part.max_nodes_per_user}",
                )


# Per-partition limits that must name where they came from (partitions.P.sources.F, or
# partitions.P.F in `unverified`): `snowcat doctor` names the ones that do not.
LIMIT_FIELDS = ("max_nodes", "max_time_min", "max_submit_jobs", "max_running_jobs", "max_nodes_per_user")
CUDA_ENGINES = {"vllm"}  # rollout engines whose GPU build needs NVIDIA GPUs (vLLM's CUDA wheels and images)


def unsourced_limits(site: SiteProfile) -> list[str]:
    """Keys (`partitions.gh.max_running_jobs`) of limits the profile sets without a source: no
    `sources` entry in their partition and not listed in `unverified`."""
    out = []
    for name, part in site.partitions.items():
        for key in LIMIT_FIELDS:
            full = f"partitions.{name}.{key}"
            if getattr(part, key) is not None and not part.sources.get(key) and full not in site.unverified:
                out.append(full)
    return out


def engine_problem(site: SiteProfile, partition: str, engine: str | None) -> str | None:
    """Why `engine` cannot sample on `partition`, or None: vLLM's CUDA build on Intel xpu GPUs. (On
    nodes without GPUs vLLM's CPU build runs, as in configs/demo-vllm.yaml.)"""
    part = site.partitions.get(partition)
    if part is None or engine not in CUDA_ENGINES or part.accel() != "xpu":
        return None
    return (
        f"engine {engine} needs CUDA GPUs; partition {partition} of site {site.name} has Intel Data Center GPU Max "
        "(xpu) GPUs: use engine: torch or a CUDA partition"
    )


def list_sites() -> list[str]:
    return sorted(p.stem for p in SITES_DIR.glob("*.yaml"))


SITE_ENV = "SNOWCAT_SITE"  # the default site (set by the centre's module file, docs/admins.md)
ACCOUNT_ENV = "SBATCH_ACCOUNT"  # the account sbatch would use (JSC: set by `jutil env activate -p <project>`)


def default_site(name: str | None, environ: dict | None = None) -> str | None:
    """The site a command runs against: the one named, else $SNOWCAT_SITE (None: no site)."""
    environ = os.environ if environ is None else environ
    return name or environ.get(SITE_ENV) or None


def env_account(environ: dict | None = None) -> str | None:
    """The account the environment selects for sbatch ($SBATCH_ACCOUNT), if any."""
    environ = os.environ if environ is None else environ
    return environ.get(ACCOUNT_ENV) or None


def _looks_like_path(name_or_path: str | Path) -> bool:
    text = str(name_or_path)
    return Path(text).suffix in (".yaml", ".yml") or os.sep in text or text.startswith((".", "~"))


def _profile_path(name_or_path: str | Path, relative_to: Path | None = None) -> Path:
    """The YAML file of a site: a known name (slurm/sites/NAME.yaml) or a file; a relative path is
    taken relative to `relative_to` (the file that names it) when given."""
    path = Path(name_or_path).expanduser()
    if _looks_like_path(name_or_path) or path.exists():
        if relative_to is not None and not path.is_absolute():
            path = relative_to / path
        if not path.is_file():
            raise UserError(f"site profile {path}: no such file")
        return path
    path = SITES_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise UserError(f"unknown site {name_or_path!r}; known sites: {', '.join(list_sites())}")
    return path


def profile_path(name_or_path: str | Path, relative_to: Path | None = None) -> Path:
    """The YAML file a site name or path stands for (UserError if there is none)."""
    return _profile_path(name_or_path, relative_to)


def _read_profile_yaml(path: Path) -> DictConfig:
    try:
        raw = OmegaConf.load(path)
    except yaml.MarkedYAMLError as e:
        where = f" at line {e.problem_mark.line + 1}" if e.problem_mark else ""
        raise UserError(f"site profile {path}: invalid YAML{where}: {e.problem}") from None
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        raise UserError(f"site profile {path}: invalid YAML: {' '.join(str(e).split())}") from None
    if raw is None:
        raw = OmegaConf.create({})
    if not isinstance(raw, DictConfig):
        raise UserError(f"site profile {path}: expected a mapping at the top level")
    return raw


def site_config(name_or_path: str | Path, relative_to: Path | None = None) -> tuple[Path, DictConfig]:
    """(file, untyped profile) of a site name or YAML file. A file with `base: NAME_OR_PATH` (what
    `snowcat onboard` writes) is an override: merged over its base profile (a relative base path is
    relative to the override), recursively; the result has no `base` key. Checked by `load_site`,
    or by the config schema when a run config composes it."""
    path = _profile_path(name_or_path, relative_to)
    chain = [path.resolve()]
    raw = _read_profile_yaml(path)
    layers = [raw]
    while "base" in raw:
        base = raw.pop("base")
        if not isinstance(base, str) or not base:
            raise UserError(f"site profile {chain[-1]}: key base: expected a site name or a profile file, got {base!r}")
        base_path = _profile_path(base, chain[-1].parent)
        if base_path.resolve() in chain:
            cycle = " -> ".join(map(str, [*chain, base_path.resolve()]))
            raise UserError(f"site profile {path}: key base: the overrides include themselves ({cycle})")
        chain.append(base_path.resolve())
        raw = _read_profile_yaml(base_path)
        layers.append(raw)
    merged = OmegaConf.merge(*reversed(layers)) if len(layers) > 1 else layers[0]
    return path, merged


def load_site(name_or_path: str | Path, relative_to: Path | None = None) -> SiteProfile:
    """The validated profile of a known site name or a YAML file (a profile, or an override naming
    its `base`)."""
    path, raw = site_config(name_or_path, relative_to)
    try:
        site = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SiteProfile), raw))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        msg = str(e).splitlines()[0]
        raise UserError(f"site profile {path}: key {key}: {msg}") from None
    problems = [*site_problems(site)]
    if problems:
        key, why = problems[0]
        raise UserError(f"site profile {path}: key {key}: {why}")
    return site


def site_problems(site: SiteProfile, where: str = "") -> Iterator[Problem]:
    """Out-of-range values and checks across fields of a typed profile (keys below `where`)."""
    for key, why in range_problems(site, where):
        yield key.lstrip("."), why
    for key, why in site.problems():
        yield ".".join(filter(None, (where, key))), why


def use_local_cluster(site) -> None:
    """Point Slurm clients (sbatch, sacct, submitit, doctor's checks) at the cluster `snowcat cluster up`
    runs, so `--site local` works without sourcing its env.sh. Other sites use the environment as it
    is; an explicit SLURM_CONF always wins."""
    if site is None or site.name != "local" or os.environ.get("SLURM_CONF"):
        return

    conf = default_root() / "etc" / "slurm.conf"
    if not conf.is_file():
        raise UserError(f"site local: the local cluster is not set up ({conf} missing); start it with `snowcat cluster up`")
    os.environ["SLURM_CONF"] = str(conf)


# ---------------------------------------------------------------- requests and rendering


def validate_request(
    site: SiteProfile,
    partition: str | None = None,
    nodes: int = 1,
    gpus_per_node: int = 0,
    time_min: int = 60,
    array_size: int = 0,
    hetjob: bool = False,
    account: str | None = None,
) -> None:
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
    if part.max_nodes_per_user is not None and nodes > part.max_nodes_per_user:
        raise UserError(f"{where}: {nodes} nodes requested, a user may hold {part.max_nodes_per_user} (max_nodes_per_user)")
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


_SHORT = {
    "A": "account",
    "N": "nodes",
    "n": "ntasks",
    "p": "partition",
    "t": "time",
    "G": "gpus",
    "J": "job-name",
    "o": "output",
    "e": "error",
    "a": "array",
    "d": "dependency",
    "c": "cpus-per-task",
    "w": "nodelist",
    "x": "exclude",
    "q": "qos",
    "C": "constraint",
}
_GPU_KEYS = ("gres", "gpus", "gpus-per-node", "gpus-per-task")


def _long_name(key: str) -> str:
    key = key.lstrip("-")
    return _SHORT.get(key, key.replace("_", "-"))


def _gpus_per_node(opts: dict[str, Any]) -> int | None:
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


def filter_sbatch_options(site: SiteProfile, options: dict[str, Any]) -> dict[str, Any]:
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
