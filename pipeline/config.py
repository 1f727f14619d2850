"""The run configuration: one typed schema (OmegaConf structured configs), composed and validated.

A config file may list `defaults:` — other YAML files (paths relative to it) and `site: NAME`
entries (profiles from `slurm/sites/`) — merged in order beneath the file itself; then `--site`
and `key=value` overrides (dot paths) are applied. Each stage section is typed by its kind:
`stages/<kind>.py` defines `Config`, and the section's schema is that plus the common keys below.
Every error names the source (file or override) and the key path, in one line.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import importlib
import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .errors import UserError


def bounded(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None):
    """A numeric field with the range it must lie in; checked when a config loads (None passes)."""
    bounds = [(b, op, word) for b, op, word in ((ge, operator.ge, ">="), (gt, operator.gt, ">"), (le, operator.le, "<="))
              if b is not None]
    return field(default=default, metadata={"range": bounds})


def checkpoint_refs(default: str | list[str] = ""):
    """A field holding one "<stage>:<checkpoint>" reference (str) or a list of them; checked when a
    config loads: the stage must be in `needs` and its kind must write that checkpoint."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"checkpoint_ref": True})
    return field(default=default, metadata={"checkpoint_ref": True})


def parse_checkpoint_ref(ref: str) -> tuple[str, str]:
    """("sft", "final") from "sft:final"; ValueError for anything else."""
    stage, sep, name = str(ref).partition(":")
    if not sep or not stage or not name or ":" in name:
        raise ValueError(f"{ref!r} is not '<stage>:<checkpoint>' (e.g. 'sft:final')")
    return stage, name


@dataclass
class Component:
    """One component of a heterogeneous job (e.g. trainer, rollout): its own nodes and GPUs."""

    nodes: int = bounded(1, ge=1)
    tasks_per_node: int = bounded(1, ge=1)
    cpus_per_task: int = bounded(1, ge=1)
    gpus_per_node: int = bounded(0, ge=0)
    partition: Optional[str] = None


@dataclass
class Resources:
    nodes: int = bounded(1, ge=1)
    tasks_per_node: int = bounded(1, ge=1)
    cpus_per_task: int = bounded(1, ge=1)
    gpus_per_node: int = bounded(0, ge=0)
    mem_gb: Optional[int] = bounded(None, ge=1)
    time_min: int = bounded(30, ge=1)
    partition: Optional[str] = None
    # Non-empty: a co-scheduled multi-role stage (one Slurm hetjob, one MPI world; component order
    # is rank order). Locally it runs under mpirun with the same roles.
    components: dict[str, Component] = field(default_factory=dict)


@dataclass
class ResumePolicy:
    """How a stage longer than the partition walltime continues (Slurm executor)."""

    strategy: str = "requeue"  # requeue | chain | none
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
    image: Optional[str] = None  # container image to run the stage in (site runtime decides how)
    staged: list[str] = field(default_factory=list)  # artefacts that must be pre-staged (run offline)


@dataclass
class ExecutorConfig:
    kind: str = "local"  # local | slurm
    max_parallel: int = bounded(2, ge=1)  # local executor: stages running at once
    mpirun: str = "mpirun"  # local launcher for multi-role stages


@dataclass
class RunConfig:
    name: str = "run"
    seed: int = bounded(0, ge=0)  # numpy's generators take no negative seed
    run_root: str = "logs"
    description: str = ""
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    site: Any = None  # typed by slurm.site.SiteProfile when given
    stages: dict[str, Any] = field(default_factory=dict)


EXECUTOR_KINDS = ("local", "slurm")
RESUME_STRATEGIES = ("requeue", "chain", "none")
SITES_DIR = Path(__file__).resolve().parent.parent / "slurm" / "sites"


# --- stage kinds ---------------------------------------------------------------------------


def stage_kinds() -> list[str]:
    """Kinds are the stage modules the `stages` package lists (`stages.KINDS`)."""
    from snowcat import stages

    return list(stages.KINDS)


def stage_module(kind: str):
    if kind not in stage_kinds():
        raise KeyError(kind)
    module = importlib.import_module(f"snowcat.stages.{kind}")
    if not hasattr(module, "run"):
        raise KeyError(kind)
    return module


def stage_schema(kind: str) -> type:
    """The typed schema of a stage section: the kind's own `Config` plus the common keys."""
    own = getattr(stage_module(kind), "Config", None)
    bases = (own, StageCommon) if own is not None else (StageCommon,)
    return dataclasses.make_dataclass(f"{kind.title()}Stage", [], bases=bases)


# --- loading --------------------------------------------------------------------------------


def _site_schema():
    try:
        from snowcat.slurm.site import SiteProfile
    except ImportError:
        return None
    return SiteProfile


def site_path(name: str) -> Path:
    path = SITES_DIR / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in SITES_DIR.glob("*.yaml"))) or "none"
        raise UserError(f"unknown site {name!r} (known: {known})")
    return path


def _read_yaml(path: Path, what: str) -> DictConfig:
    if not path.is_file():
        raise UserError(f"{path}: {what} not found")
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # yaml errors carry line numbers; keep them on one line
        raise UserError(f"{path}: invalid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(cfg, DictConfig):
        raise UserError(f"{path}: expected a mapping at the top level")
    return cfg


def _sources(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[str, DictConfig]]:
    """(label, config) pairs in merge order: the file's defaults first, then the file itself."""
    path = path.resolve()
    if path in seen:
        raise UserError(f"{path}: defaults include themselves ({' -> '.join(map(str, seen + (path,)))})")
    cfg = _read_yaml(path, "config file")
    defaults = cfg.pop("defaults", None) or []
    if not isinstance(defaults, (list, ListConfig)):
        raise UserError(f"{path}: defaults: expected a list")
    out: list[tuple[str, DictConfig]] = []
    for entry in defaults:
        if isinstance(entry, str):
            out += _sources((path.parent / entry), seen + (path,))
        elif isinstance(entry, DictConfig) and set(entry.keys()) == {"site"}:
            site_file = site_path(str(entry.site))
            out.append((str(site_file), OmegaConf.create({"site": _read_yaml(site_file, "site profile")})))
        else:
            raise UserError(f"{path}: defaults: entries are file paths or 'site: NAME', got {entry}")
    out.append((str(path), cfg))
    return out


def _override_source(item: str) -> tuple[str, DictConfig]:
    label = f"override '{item}'"
    if "=" not in item:
        raise UserError(f"{label}: expected key=value")
    key, _, value = item.partition("=")
    try:
        return label, OmegaConf.from_dotlist([f"{key.strip()}={value}"])
    except OmegaConfBaseException as e:
        raise UserError(f"{label}: {_msg(e)}") from None
    except Exception as e:  # the value is parsed as YAML: a yaml error, with its own multi-line text
        raise UserError(f"{label}: cannot parse the value: {' '.join(str(e).split())}") from None


def _msg(e: OmegaConfBaseException) -> str:
    return str(e).splitlines()[0].strip()


def _key(e: OmegaConfBaseException, prefix: str = "") -> str:
    key = getattr(e, "full_key", None) or ""
    return ".".join(p for p in (prefix, str(key)) if p)


def _typed_stage(name: str, raw: Any, label_of: dict) -> DictConfig:
    if not isinstance(raw, DictConfig):
        raise UserError(f"{label_of.get(name, 'config')}: stages.{name}: expected a mapping")
    kind = raw.get("kind")
    if kind is None:
        raise UserError(f"{label_of.get(name, 'config')}: stages.{name}.kind: missing (known kinds: {', '.join(stage_kinds())})")
    try:
        schema = stage_schema(str(kind))
    except KeyError:
        raise UserError(
            f"{label_of.get(name, 'config')}: stages.{name}.kind: unknown stage kind {kind!r} "
            f"(known: {', '.join(stage_kinds())})"
        ) from None
    return OmegaConf.structured(schema)


def compose(path: str | Path, overrides: list[str] = (), site: str | None = None) -> DictConfig:
    """Load, compose and validate; returns the typed config (interpolations not yet resolved)."""
    sources = _sources(Path(path))
    if site:
        site_file = site_path(site)
        sources.append((str(site_file), OmegaConf.create({"site": _read_yaml(site_file, "site profile")})))
    sources += [_override_source(o) for o in overrides]

    # Which source defines each stage (for error messages) and the stage kinds, from a raw merge.
    label_of: dict[str, str] = {}
    for label, src in sources:
        for name in (src.get("stages") or {}):
            label_of.setdefault(str(name), label)
    try:
        raw = OmegaConf.merge(*(s for _, s in sources))
    except OmegaConfBaseException as e:
        raise UserError(f"{path}: {_key(e)}: {_msg(e)}") from None

    typed = OmegaConf.structured(RunConfig)
    site_schema = _site_schema()
    if raw.get("site") is not None and site_schema is not None:
        typed.site = OmegaConf.structured(site_schema)
    for name, section in (raw.get("stages") or {}).items():
        typed.stages[str(name)] = _typed_stage(str(name), section, label_of)

    for label, src in sources:
        try:
            typed = OmegaConf.merge(typed, src)
        except OmegaConfBaseException as e:
            raise UserError(f"{label}: {_key(e)}: {_msg(e)}") from None
    try:
        _check_values(typed, str(path), lambda key: _source_of(sources, key, str(path)))
    except OmegaConfBaseException as e:
        raise UserError(f"{path}: {_key(e)}: bad interpolation: {_msg(e)}") from None
    return typed


def _source_of(sources: list[tuple[str, DictConfig]], key: str, default: str) -> str:
    """The last source (file or override) that sets `key`: the one to blame for its value."""
    for label, src in reversed(sources):
        try:
            if OmegaConf.select(src, key, default=MISSING, throw_on_missing=False) is not MISSING:
                return label
        except OmegaConfBaseException:
            continue
    return default


def _field_problems(node: DictConfig, where: str):
    """(key, problem) for every bounded value out of range in a structured node, nested ones included."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return
    for f in dataclasses.fields(schema):
        value = node.get(f.name)
        key = f"{where}.{f.name}"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            for bound, op, word in f.metadata.get("range", ()):
                if not op(value, bound):
                    yield key, f"must be {word} {bound}, got {value}"
        if isinstance(value, DictConfig):
            if dataclasses.is_dataclass(OmegaConf.get_type(value)):
                yield from _field_problems(value, key)
            else:  # a dict of structured values (resources.components, tasks.domains)
                for name in value:
                    if isinstance(value[name], DictConfig):
                        yield from _field_problems(value[name], f"{key}.{name}")


def checkpoint_names(kind: str, section: DictConfig) -> tuple[str, ...] | None:
    """The checkpoint names (fnmatch patterns) a stage of this kind writes; None: it writes none."""
    names = getattr(stage_module(kind), "checkpoint_names", None)
    return tuple(names(section)) if names is not None else None


def _ref_problems(cfg: DictConfig, name: str, section: DictConfig):
    """(key, problem) for every checkpoint reference of a stage that can never resolve."""
    schema = OmegaConf.get_type(section)
    fields = [f.name for f in dataclasses.fields(schema) if f.metadata.get("checkpoint_ref")]
    refs = []
    for field_name in fields:
        value = section.get(field_name)
        for ref in ([value] if isinstance(value, str) else list(value or [])):
            refs.append((f"stages.{name}.{field_name}", ref))
    if "checkpoint" in section.fan_out and fields:
        refs += [(f"stages.{name}.fan_out.checkpoint", ref) for ref in section.fan_out.checkpoint]
    for key, ref in refs:
        if ref == "":
            continue  # "": the stage's documented default choice
        try:
            stage, ckpt = parse_checkpoint_ref(ref)
        except ValueError as e:
            yield key, str(e)
            continue
        if stage not in section.needs:
            yield key, f"{ref!r} names stage {stage!r}, which is not in stages.{name}.needs ({', '.join(section.needs) or 'none'})"
            continue
        if stage not in cfg.stages:
            continue  # the unknown stage in needs is reported by the DAG
        producer = cfg.stages[stage]
        names = checkpoint_names(str(producer.kind), producer)
        if names is None:
            yield key, f"{ref!r}: stage {stage!r} (kind {producer.kind}) writes no checkpoints"
        elif not any(fnmatch.fnmatchcase(ckpt, pattern) for pattern in names):
            yield key, f"{ref!r}: stage {stage!r} (kind {producer.kind}) writes only {', '.join(names)}"


def _check_values(cfg: DictConfig, label: str, source_of=None) -> None:
    source_of = source_of or (lambda key: label)
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise UserError(f"{label}: {missing[0]}: missing required value")
    if cfg.executor.kind not in EXECUTOR_KINDS:
        raise UserError(f"{label}: executor.kind: {cfg.executor.kind!r} is not one of {', '.join(EXECUTOR_KINDS)}")
    problems = list(_field_problems(cfg, "")) + [p for name, st in cfg.stages.items() for p in _ref_problems(cfg, name, st)]
    if problems:
        key, problem = problems[0]
        key = key.lstrip(".")
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise UserError(f"{source_of(key)}: {key}: {problem}{more}")
    for name, stage in cfg.stages.items():
        validate = getattr(stage_module(stage.kind), "validate", None)
        if validate is not None:
            try:
                validate(stage, f"stages.{name}")
            except UserError as e:
                raise UserError(f"{label}: {e}") from None
        if stage.resume.strategy not in RESUME_STRATEGIES:
            raise UserError(
                f"{label}: stages.{name}.resume.strategy: {stage.resume.strategy!r} is not one of {', '.join(RESUME_STRATEGIES)}"
            )


def resolve(cfg: DictConfig, label: str = "config") -> DictConfig:
    """Resolve every interpolation; a bad one is reported with its key path."""
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        raise UserError(f"{label}: {_key(e)}: bad interpolation: {_msg(e)}") from None
    return cfg


def load(path: str | Path, overrides: list[str] = (), site: str | None = None) -> DictConfig:
    """compose + resolve: the fully resolved, typed run config."""
    return resolve(compose(path, overrides, site), str(path))


def load_frozen(path: str | Path) -> DictConfig:
    """Re-type a resolved config frozen in a run directory (it validates as any config does)."""
    return load(path)


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True, sort_keys=False)


def config_hash(cfg: DictConfig) -> str:
    return hashlib.sha256(to_yaml(cfg).encode()).hexdigest()


def stage_seed(run_seed: int, stage: str, item_index: int | None = None) -> int:
    """A stable per-unit seed: the run seed, the stage name and the fan-out index, hashed."""
    text = f"{run_seed}/{stage}/{'' if item_index is None else item_index}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")
