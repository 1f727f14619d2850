"""The typed schema of a run configuration: plain dataclasses with Literal choices and range
metadata, read by OmegaConf (`pipeline.config` composes and checks files against it). Torch-free and
import-light, so loading a config on a login node is fast; stage kinds add their own sections in
`stages/config.py`."""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from omegaconf import MISSING

Problem = tuple[str, str]  # (key below the section, what is wrong)


def bounded(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None):
    """A numeric field with the range it must lie in; checked when a config loads (None passes)."""
    bounds = [
        (b, op, word)
        for b, op, word in ((ge, operator.ge, ">="), (gt, operator.gt, ">"), (le, operator.le, "<="))
        if b is not None
    ]
    return field(default=default, metadata={"range": bounds})


def checkpoint_refs(default: str | list[str] = ""):
    """A field holding one "<stage>:<checkpoint>" reference (str) or a list of them; checked when a
    config loads: the stage must be in `needs` and its kind must write that checkpoint."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"checkpoint_ref": True})
    return field(default=default, metadata={"checkpoint_ref": True})


HF_PREFIX = "hf:"  # a Hugging Face checkpoint: hf:<local dir> or hf:<org/name> staged by a prestage stage


def hf_sources(stage) -> list[tuple[str, str]]:
    """(field, "hf:...") for every model source a stage's config names (model, init_from, checkpoints...)."""
    out = []
    for f in dataclasses.fields(stage):
        value = getattr(stage, f.name)
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str) and v.startswith(HF_PREFIX):
                out.append((f.name, v))
    return out + [("fan_out.checkpoint", v) for v in stage.fan_out.get("checkpoint", []) if str(v).startswith(HF_PREFIX)]


def hub_id(source: str) -> str | None:
    """ "org/name" for a hub source (what a prestage artefact is named), None for a local directory."""
    ref = source.removeprefix(HF_PREFIX)
    return None if Path(ref).expanduser().is_dir() else ref


def resolve_hf(source: str, staged: Mapping[str, str | Path]) -> Path | None:
    """The directory an "hf:..." source names here: the local directory as it is, or the staged copy
    of a hub id (`staged`: hub id -> path); None when the hub id is not staged."""
    repo = hub_id(source)
    if repo is None:
        return Path(source.removeprefix(HF_PREFIX)).expanduser()
    return Path(staged[repo]) if repo in staged else None


def parse_checkpoint_ref(ref: str) -> tuple[str, str]:
    """("sft", "final") from "sft:final"; ValueError for anything else."""
    stage, sep, name = str(ref).partition(":")
    if not sep or not stage or not name or ":" in name:
        raise ValueError(f"{ref!r} is not '<stage>:<checkpoint>' (e.g. 'sft:final')")
    return stage, name


def range_problems(obj, where: str) -> Iterator[Problem]:
    """(key, problem) for every bounded value out of range in a dataclass, nested ones included."""
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{where}.{f.name}"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            for bound, op, word in f.metadata.get("range", ()):
                if not op(value, bound):
                    yield key, f"must be {word} {bound}, got {value}"
        if dataclasses.is_dataclass(value):
            yield from range_problems(value, key)
        elif isinstance(value, dict):  # resources.components, tasks.domains
            for name, child in value.items():
                if dataclasses.is_dataclass(child):
                    yield from range_problems(child, f"{key}.{name}")
        elif isinstance(value, list):  # prestage.artefacts
            for i, child in enumerate(value):
                if dataclasses.is_dataclass(child):
                    yield from range_problems(child, f"{key}[{i}]")


@dataclass
class Component:
    """One component of a heterogeneous job (e.g. trainer, rollout): its own nodes and GPUs."""

    nodes: int = bounded(1, ge=1)
    tasks_per_node: int = bounded(1, ge=1)
    # None: 1, or a whole node's cores split over its tasks where the site allocates whole nodes.
    cpus_per_task: int | None = bounded(None, ge=1)
    # None: the stage kind's default, fixed when the config is loaded with a site (GPU kinds get every
    # GPU of their partition, other kinds none; partition: GPU kinds the site's default partition,
    # other kinds its cpu_partition); without a site: 0 and no partition.
    gpus_per_node: int | None = bounded(None, ge=0)
    partition: str | None = None
    image: str | None = None  # a component's own container image (trainer vs rollout); else the stage's `image`


@dataclass
class Resources(Component):
    """A stage's job: a component's shape, plus memory, walltime and (for multi-role stages) components."""

    mem_gb: int | None = bounded(None, ge=1)
    time_min: int = bounded(30, ge=1)
    # Non-empty: a co-scheduled multi-role stage (one Slurm hetjob, one MPI world; component order
    # is rank order). Locally it runs under mpirun with the same roles.
    components: dict[str, Component] = field(default_factory=dict)


@dataclass
class ResumePolicy:
    """How a stage longer than the partition walltime continues (Slurm executor)."""

    strategy: Literal["requeue", "chain", "none"] = "requeue"
    signal_margin_s: int = bounded(120, ge=0)  # --signal=USR2@margin: time the stage has to checkpoint
    max_continuations: int = bounded(3, ge=0)


@dataclass
class StageCommon:
    kind: str = MISSING
    needs: list[str] = field(default_factory=list)
    resources: Resources = field(default_factory=Resources)
    # Fan-out: one unit of work per element of the cartesian product of these lists (a job array).
    fan_out: dict[str, list[Any]] = field(default_factory=dict)
    max_parallel: int = bounded(0, ge=0)  # array throttle (%N); 0 = site default
    resume: ResumePolicy = field(default_factory=ResumePolicy)
    image: str | None = None  # container image to run the stage in (site runtime decides how)
    # login: runs in the submitting process on the login node (prestage where compute nodes have no
    # network), by `run`/`resume` once its inputs are done; the compute stages after it wait for it.
    where: Literal["compute", "login"] = "compute"
    staged: list[str] = field(default_factory=list)  # artefacts that must be pre-staged (run offline)

    def checkpoint_names(self) -> tuple[str, ...] | None:
        """The checkpoint names (fnmatch patterns) this stage writes; None: it writes none."""
        return None

    def problems(self) -> Iterator[Problem]:
        """Checks across fields that the types and ranges cannot express (a kind overrides this)."""
        return iter(())


@dataclass
class ExecutorConfig:
    kind: Literal["local", "slurm"] = "local"
    max_parallel: int = bounded(2, ge=1)  # local executor: stages running at once
    mpirun: str = "mpirun"  # local launcher for multi-role stages


TRACKING_SINKS = ("wandb", "tensorboard", "mlflow")
# sink -> (module imported to feed it, the package that installs it: the `trackers` extra)
TRACKER_PACKAGES = {
    "wandb": ("wandb", "wandb"),
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow-skinny"),
}


@dataclass
class WandbTracking:
    project: str = ""  # "": the run's `name`
    entity: str | None = None  # None: the API key's default entity (chosen at `snowcat sync`)
    # offline: written under <run>/tracking/wandb, uploaded by `snowcat sync RUN` on the login node;
    # online: uploads from the compute node (refused on a site whose compute nodes have no internet)
    mode: Literal["offline", "online"] = "offline"


@dataclass
class MlflowTracking:
    tracking_uri: str = ""  # "": a file store in the run, <run>/tracking/mlruns
    experiment: str = ""  # "": the run's id


@dataclass
class TrackingConfig:
    """Experiment trackers fed from what the stages record (pipeline/tracking.py, docs/tracking.md):
    none by default; a failing tracker never fails a stage."""

    sinks: list[str] = field(default_factory=list)  # any of TRACKING_SINKS
    wandb: WandbTracking = field(default_factory=WandbTracking)
    mlflow: MlflowTracking = field(default_factory=MlflowTracking)

    def problems(self) -> Iterator[Problem]:
        for i, sink in enumerate(self.sinks):
            if sink not in TRACKING_SINKS:
                yield f"sinks[{i}]", f"unknown tracking sink {sink!r} (known: {', '.join(TRACKING_SINKS)})"
            elif sink in self.sinks[:i]:
                yield f"sinks[{i}]", f"{sink!r} is listed twice"
        uri = self.mlflow.tracking_uri
        if uri and "://" not in uri and not uri.startswith("/"):
            yield "mlflow.tracking_uri", f"{uri!r} is neither an absolute path nor a URI (file:///..., https://...)"


_LICENSE_ID = re.compile(r"[a-z0-9][a-z0-9.+\-]*")  # the Hub's identifiers: apache-2.0, cc-by-nc-4.0, llama3.1, openrail++


@dataclass
class CardConfig:
    """What the provenance card states that the run cannot record itself (pipeline/reports/card/): the
    license goes into the model-card metadata the Hugging Face Hub reads, intended use and
    limitations into the card's text. Unset: the card says "not recorded"."""

    license: str = ""  # a license identifier of the Hub (apache-2.0, mit, llama3.1, ...), or "other"
    license_name: str = ""  # license: other: its short name (e.g. my-lab-research-1.0)
    license_link: str = ""  # license: other: where its text is (a URL, or LICENSE in the repository)
    intended_use: str = ""
    limitations: list[str] = field(default_factory=list)  # listed before the limitations the run recorded

    def problems(self) -> Iterator[Problem]:
        if self.license and not _LICENSE_ID.fullmatch(self.license):
            yield (
                "license",
                f"{self.license!r} is not a Hub license identifier (lower case, e.g. apache-2.0, mit, cc-by-4.0; "
                "for any other license: other, with license_name and license_link)",
            )
        if self.license == "other" and not (self.license_name and self.license_link):
            yield (
                "license_name" if not self.license_name else "license_link",
                "license: other needs license_name and license_link",
            )
        for key in ("license_name", "license_link"):
            if getattr(self, key) and self.license != "other":
                yield key, f"only with license: other (the Hub reads {key} for a license it does not know)"
        for i, text in enumerate(self.limitations):
            if not str(text).strip():
                yield f"limitations[{i}]", "is empty"


# Older spellings of keys that moved, still read so that the frozen configs of older runs load:
# top-level key -> where it lives now (pipeline.config moves the value there when it composes).
MOVED_KEYS = {"license": "card.license", "intended_use": "card.intended_use"}

NOTIFY_EVENTS = ("failed", "finished")
# sbatch --mail-type values (Slurm 23-24)
SLURM_MAIL_TYPES = (
    "NONE",
    "BEGIN",
    "END",
    "FAIL",
    "REQUEUE",
    "ALL",
    "INVALID_DEPEND",
    "STAGE_OUT",
    "TIME_LIMIT",
    "TIME_LIMIT_90",
    "TIME_LIMIT_80",
    "TIME_LIMIT_50",
    "ARRAY_TASKS",
)
_MAIL = re.compile(r"[^@\s,;]+@[^@\s,;]+")
_LITERAL_URL = re.compile(r"[a-z][a-z0-9+.-]*://[^\s/'\"]+(?:/[^\s'\"]*[^\s'\"/]|[?#][^\s'\"]*)", re.I)


@dataclass
class NotifyConfig:
    """Word when a run needs attention (pipeline/notify.py, docs/tracking.md "Notifications"). A
    one-line summary file per event under <run>/notify/, delivered only from the login node (by
    `snowcat status`, `sync`, `notify`, and the local executor when a run ends), never from a
    compute node; and Slurm's own mail on the jobs of `slurm_stages`."""

    events: list[str] = field(default_factory=lambda: ["failed", "finished"])  # any of NOTIFY_EVENTS
    command: str = ""  # shell command run once per new summary: the line on stdin and in $SNOWCAT_NOTIFY_LINE
    mail_to: str = ""  # the cluster's `mail -s SUBJECT ADDRESS`, the line as the body
    slurm_mail_user: str = ""  # sbatch --mail-user: Slurm itself mails this address about the jobs below
    slurm_mail_type: list[str] = field(default_factory=lambda: ["FAIL"])  # sbatch --mail-type values
    slurm_stages: list[str] = field(default_factory=list)  # the jobs that matter ([]: every stage's)

    def problems(self, stages: Iterable[str] = ()) -> Iterator[Problem]:
        for i, event in enumerate(self.events):
            if event not in NOTIFY_EVENTS:
                yield f"events[{i}]", f"unknown event {event!r} (known: {', '.join(NOTIFY_EVENTS)})"
        for i, kind in enumerate(self.slurm_mail_type):
            if kind not in SLURM_MAIL_TYPES:
                yield f"slurm_mail_type[{i}]", f"{kind!r} is not an sbatch --mail-type (known: {', '.join(SLURM_MAIL_TYPES)})"
        for key in ("mail_to", "slurm_mail_user"):
            value = getattr(self, key)
            if value and not _MAIL.fullmatch(value):
                yield key, f"{value!r} is not one mail address"
        stages = list(stages)
        for i, name in enumerate(self.slurm_stages):
            if stages and name not in stages:
                yield f"slurm_stages[{i}]", f"no stage {name!r} in this run (stages: {', '.join(stages)})"
        url = _LITERAL_URL.search(self.command)
        if url:
            parts = urlsplit(url.group(0))
            yield (
                "command",
                f"holds the URL {parts.scheme}://{parts.hostname}/...: "
                "the config is frozen into the run, and a webhook's path is its secret. Put the URL in an "
                "environment variable of the login node whose name says it is secret (e.g. SNOWCAT_WEBHOOK_SECRET) "
                'and write "$SNOWCAT_WEBHOOK_SECRET"',
            )


@dataclass
class RunConfig:
    name: str = "run"
    seed: int = bounded(0, ge=0)  # numpy's generators take no negative seed
    run_root: str = "logs"
    description: str = ""
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    # license, intended use, limitations for the card (the older top-level license/intended_use: MOVED_KEYS)
    card: CardConfig = field(default_factory=CardConfig)
    notify: NotifyConfig = field(default_factory=NotifyConfig)
    site: Any = None  # typed by slurm.site.SiteProfile when given
    stages: dict[str, Any] = field(default_factory=dict)
