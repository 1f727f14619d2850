"""The run configuration: one typed schema (OmegaConf structured configs), composed and validated.

A config file may list `defaults:` — other YAML files (paths relative to it) and `site: NAME`
entries (profiles from `slurm/sites/`) — merged in order beneath the file itself; then `--site`
and `key=value` overrides (dot paths) are applied. Each stage section is typed by its kind's class
in `stages/config.py` plus the common keys (`pipeline/schema.py`), the site by `SiteProfile`.
Every error names the source (file or override) and the key path, in one line. Nothing here
imports torch.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from snowcat.pipeline import scrub, sweep
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.schema import (
    HF_PREFIX,
    MOVED_KEYS,
    TRACKER_PACKAGES,
    Problem,
    RunConfig,
    StageCommon,
    hf_sources,
    hub_id,
    parse_checkpoint_ref,
    range_problems,
)
from snowcat.slurm import site as site_mod
from snowcat.slurm.site import SiteProfile
from snowcat.stages.registry import GPU_KINDS, KINDS

# --- stage kinds ---------------------------------------------------------------------------


def stage_module(kind: str) -> ModuleType:
    """The module that runs a kind (`stages/<kind>.py`, with `run(ctx)`): imported only to run a unit,
    since it pulls in torch."""
    return importlib.import_module(KINDS[kind].module)


@functools.cache
def stage_schema(kind: str) -> type:
    """The typed schema of a stage section: the kind's own config class plus the common keys."""
    return dataclasses.make_dataclass(f"{kind.title()}Stage", [], bases=(KINDS[kind].config, StageCommon))


def stage_config(kind: str, values: dict | None = None, *, name: str | None = None):
    """One stage section outside a run config (tests, benchmarks): the kind's typed config object with
    `values` applied, checked as a loaded config is (ranges, choices, `problems()`; checkpoint
    references are not, having no run to resolve in). Errors are one line naming `stages.<name>.<key>`."""
    where = f"stages.{name or kind}"
    if kind not in KINDS:
        raise UserError(f"{where}.kind: unknown stage kind {kind!r} (known: {', '.join(KINDS)})")
    try:
        section = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(stage_schema(kind)), {"kind": kind, **(values or {})}))
    except OmegaConfBaseException as e:
        raise UserError(f"{_key(e, where, values)}: {_msg(e)}") from None
    if getattr(section, "engine", None) == "auto":
        section.engine = "torch"  # outside a run there is no site (see _resolve_engines)
    problems = list(range_problems(section, where)) + [(_join(where, key), problem) for key, problem in section.problems()]
    if problems:
        raise UserError(f"{problems[0][0]}: {problems[0][1]}")
    return section


# --- loading --------------------------------------------------------------------------------


def site_path(name: str, relative_to: Path | None = None) -> Path:
    """The profile file of a site: a name in slurm/sites/, or a YAML file (a profile or an override
    that names its `base`; relative paths are relative to `relative_to`, the config that names it)."""
    return site_mod.profile_path(name, relative_to)


SITE_LABEL = "site profile "


def _site_source(name: str, relative_to: Path | None = None) -> tuple[str, DictConfig]:
    """(label, {site: profile}) for a `--site` or a `defaults: - site:` entry; an override file is
    merged over its base profile here (slurm.site.site_config)."""
    path, profile = site_mod.site_config(name, relative_to)
    return f"{SITE_LABEL}{path}", OmegaConf.create({"site": profile})


def names_site(path: str | Path) -> bool:
    """Whether a config (with its defaults) chooses a site itself: then $SNOWCAT_SITE does not apply."""
    return any(src.get("site") is not None for _, src in _sources(Path(path)))


def _site_run_root(sources: list[tuple[str, DictConfig]]) -> list[tuple[str, DictConfig]]:
    """The run root of the last site profile composed, as a source beneath every other: a config
    file or override that sets run_root wins over it (docs/users.md, "Where runs go")."""
    profiles = [(label, src.site) for label, src in sources if label.startswith(SITE_LABEL)]
    if not profiles or profiles[-1][1].get("run_root") is None:
        return []
    label, profile = profiles[-1]
    return [(f"{label} (run_root)", OmegaConf.create({"run_root": profile.run_root}))]


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
            out.append(_site_source(str(entry.site), path.parent))
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


def _key(e: OmegaConfBaseException, prefix: str = "", raw: Any = None) -> str:
    """The full key path of an OmegaConf error. Inside a list of structured items (prestage artefacts)
    OmegaConf names only the item's own key; the list and index are found again in `raw`."""
    key = str(getattr(e, "full_key", None) or "")
    item_type = getattr(e, "object_type", None)
    if (
        raw is not None
        and dataclasses.is_dataclass(item_type)
        and not _from_root(raw, key)
        and (item := _failing_item(raw, item_type))
    ):
        key = f"{item}.{key}" if key else item
    return ".".join(p for p in (prefix, key) if p)


def _from_root(raw: Any, key: str) -> bool:
    """Whether `key` is already a path from the top of `raw` (its parent mapping is there): then it
    is no list item's own key (a stage's unknown key with prestage artefacts elsewhere in the file)."""
    *parents, _ = key.split(".")
    node = raw
    for part in parents:
        if not isinstance(node, (dict, DictConfig)) or part not in node:
            return False
        node = node[part]
    return bool(parents) and isinstance(node, (dict, DictConfig))


def _failing_item(raw: Any, item_type: type, path: str = "") -> str | None:
    """The path of the first list item in `raw` that does not fit `item_type`."""
    if isinstance(raw, (dict, DictConfig)):
        for k, v in raw.items():
            if found := _failing_item(v, item_type, f"{path}.{k}" if path else str(k)):
                return found
    elif isinstance(raw, (list, ListConfig)):
        for i, item in enumerate(raw):
            if isinstance(item, (dict, DictConfig)):
                try:
                    OmegaConf.merge(OmegaConf.structured(item_type), item)
                except OmegaConfBaseException:
                    return f"{path}[{i}]"
    return None


def _typed_stage(name: str, raw: Any, label_of: dict) -> DictConfig:
    if not isinstance(raw, DictConfig):
        raise UserError(f"{label_of.get(name, 'config')}: stages.{name}: expected a mapping")
    kind = raw.get("kind")
    if kind is None:
        raise UserError(f"{label_of.get(name, 'config')}: stages.{name}.kind: missing (known kinds: {', '.join(KINDS)})")
    try:
        schema = stage_schema(str(kind))
    except KeyError:
        raise UserError(
            f"{label_of.get(name, 'config')}: stages.{name}.kind: unknown stage kind {kind!r} (known: {', '.join(KINDS)})"
        ) from None
    return OmegaConf.structured(schema)


def _list_by_index(sources, path) -> str:
    """The one line for a source that sets a list's element by its index (omegaconf merges a dotted
    `key.0.field=v` as a mapping, which no list takes): the first source the merge fails at."""
    merged = OmegaConf.create()
    for label, src in sources:
        try:
            merged = OmegaConf.merge(merged, src)
        except TypeError:
            return f"{label}: sets part of a list by its index; give the whole list instead (key='[...]')"
    return f"{path}: a list is set by its index somewhere; give whole lists (key='[...]')"


def compose(path: str | Path, overrides: list[str] = (), site: str | None = None) -> DictConfig:
    """Load, compose and validate; returns the typed config (interpolations not yet resolved)."""
    sources = _sources(Path(path))
    if site:
        sources.append(_site_source(site))
    sources = _site_run_root(sources) + sources
    sources += [_override_source(o) for o in overrides]
    for label, src in sources:
        _move_keys(label, src)

    # Which source defines each stage (for error messages) and the stage kinds, from a raw merge.
    label_of: dict[str, str] = {}
    for label, src in sources:
        for name in src.get("stages") or {}:
            label_of.setdefault(str(name), label)
    try:
        raw = OmegaConf.merge(*(s for _, s in sources))
    except OmegaConfBaseException as e:
        raise UserError(f"{path}: {_key(e)}: {_msg(e)}") from None
    except TypeError:  # omegaconf cannot merge a mapping into a list: `key.0.field=v` against a list
        raise UserError(_list_by_index(sources, path)) from None

    typed = OmegaConf.structured(RunConfig)
    if raw.get("site") is not None:
        typed.site = OmegaConf.structured(SiteProfile)
    for name, section in (raw.get("stages") or {}).items():
        typed.stages[str(name)] = _typed_stage(str(name), section, label_of)

    for label, src in sources:
        try:
            typed = OmegaConf.merge(typed, src)
        except OmegaConfBaseException as e:
            raise UserError(f"{label}: {_key(e, raw=src)}: {_msg(e)}") from None
    _resolve_engines(typed)
    _resolve_resources(typed)
    try:
        _check_values(typed, str(path), lambda key: _source_of(sources, key, str(path)))
    except OmegaConfBaseException as e:
        raise UserError(f"{path}: {_key(e)}: bad interpolation: {_msg(e)}") from None
    return typed


def _move_keys(label: str, src: DictConfig) -> None:
    """Keys that moved (`schema.MOVED_KEYS`: top-level `license` is `card.license` now), read where
    they were, so the frozen configs of older runs load: the value goes where the key lives now."""
    for old, new in MOVED_KEYS.items():
        if old not in src:
            continue
        value = src.pop(old)
        current = OmegaConf.select(src, new, default=None)
        if value in (None, "") or current == value:
            continue
        if current not in (None, ""):
            raise UserError(f"{label}: {old}: the older spelling of {new}, which is set too, to another value; keep only {new}")
        OmegaConf.update(src, new, value, force_add=True)


def _resolve_engines(typed: DictConfig) -> None:
    """`engine: auto` becomes the site's rollout engine (torch without a site), so the frozen config
    records the engine that ran."""
    default = typed.site.rollout_engine if typed.get("site") is not None else "torch"
    for section in typed.stages.values():
        if section.get("engine") == "auto":
            section.engine = default


def _resolve_resources(typed: DictConfig) -> None:
    """Per-kind resource defaults, frozen resolved: a GPU kind's job gets every GPU of its partition
    (the site's default partition), other kinds none, on the site's CPU partition where it has one,
    so CPU-only stages do not take whole GPU nodes; where nodes are not shared, the tasks of a node
    split its cores. Without a site: no GPUs, no partition, one CPU per task."""
    site = typed.get("site")
    for section in typed.stages.values():
        gpu_kind = section.kind in GPU_KINDS
        for res in (section.resources, *section.resources.components.values()):
            if site is not None and res.partition is None:
                res.partition = site.cpu_partition if not gpu_kind and site.cpu_partition else site.default_partition
            part = site.partitions.get(res.partition) if site is not None and res.partition else None
            if res.gpus_per_node is None:
                res.gpus_per_node = part.gpus_per_node if gpu_kind and part is not None else 0
            if res.cpus_per_task is None:  # the node is the job's anyway where nodes are not shared
                whole = site is not None and site.exclusive_nodes and part is not None
                res.cpus_per_task = max(1, part.cpus_per_node // res.tasks_per_node) if whole else 1


def _source_of(sources: list[tuple[str, DictConfig]], key: str, default: str) -> str:
    """The last source (file or override) that sets `key`: the one to blame for its value."""
    for label, src in reversed(sources):
        try:
            if OmegaConf.select(src, key, default=MISSING, throw_on_missing=False) is not MISSING:
                return label
        except OmegaConfBaseException:
            continue
    return default


def typed(cfg: DictConfig) -> RunConfig:
    """The config as objects: a RunConfig whose stages are their kinds' dataclasses and whose site is a
    SiteProfile (interpolations resolved). What stages, executors and the doctor read."""
    return OmegaConf.to_object(cfg)


def _ref_problems(cfg: RunConfig, name: str, stage: StageCommon) -> Iterator[Problem]:
    """(key, problem) for every checkpoint reference of a stage that can never resolve."""
    fields = [f.name for f in dataclasses.fields(stage) if f.metadata.get("checkpoint_ref")]
    refs = []
    for field_name in fields:
        value = getattr(stage, field_name)
        refs += [(f"stages.{name}.{field_name}", ref) for ref in ([value] if isinstance(value, str) else value)]
    if fields:
        for swept in [*fields, "checkpoint"]:
            refs += [(f"stages.{name}.fan_out.{swept}", ref) for ref in stage.fan_out.get(swept, [])]
    for key, ref in refs:
        if ref == "" or ref.startswith(HF_PREFIX):
            continue  # "": the stage's documented default choice; hf: sources are checked apart
        try:
            stage_part, ckpt = parse_checkpoint_ref(ref)
            needed, selector = sweep.parse_unit_selector(stage_part)
        except ValueError as e:
            yield key, str(e)
            continue
        if needed not in stage.needs:
            yield key, f"{ref!r} names stage {needed!r}, which is not in stages.{name}.needs ({', '.join(stage.needs) or 'none'})"
            continue
        if needed not in cfg.stages:
            continue  # the unknown stage in needs is reported by the DAG
        producer = cfg.stages[needed]
        try:
            sweep.select_unit(needed, sweep.fan_out_items(producer.fan_out, f"stages.{needed}"), selector)
        except ValueError as e:
            yield key, str(e)
            continue
        except UserError:
            continue  # a malformed fan-out is reported by the DAG
        names = producer.checkpoint_names()
        if names is None:
            yield key, f"{ref!r}: stage {needed!r} (kind {producer.kind}) writes no checkpoints"
        elif not any(fnmatch.fnmatchcase(ckpt, pattern) for pattern in names):
            yield key, f"{ref!r}: stage {needed!r} (kind {producer.kind}) writes only {', '.join(names)}"


def _input_problems(cfg: RunConfig, name: str, stage: StageCommon, swept: tuple[str, ...] = ()) -> Iterator[Problem]:
    """(key, problem) for a stage input (a key naming a needed stage whose files the stage reads) that
    names a fanned-out stage without naming one of its units: the stage would read the stage's root,
    where only the units' directories are. So would export's own choice of checkpoint. `swept`: keys
    the stage's fan-out sets (each variant's value is checked apart)."""
    for f in dataclasses.fields(stage):
        if not f.metadata.get("stage_input") or f.name in swept:
            continue
        value = getattr(stage, f.name)
        needed = value.partition("[")[0]
        if needed not in stage.needs or needed not in cfg.stages:
            continue  # a missing need is the stage's own problem; an unknown stage the DAG's
        producer = cfg.stages[needed]
        if f.metadata.get("pools_replicas") and value == needed and sweep.replicas_only(producer):
            continue
        try:
            _, indices = sweep.input_units(value, cfg.stages)
        except ValueError as e:
            yield f"stages.{name}.{f.name}", str(e)
            continue
        except UserError:
            continue  # a malformed fan-out is reported by the DAG
        if len(indices) > 1:
            items = sweep.fan_out_items(producer.fan_out, f"stages.{needed}")
            example = ",".join(f"{k}={v}" for k, v in items[0].items())
            pooled = f" (only a fan-out over {sweep.REPLICA!r} alone is pooled here)" if f.metadata.get("pools_replicas") else ""
            yield (
                f"stages.{name}.{f.name}",
                f"stage {needed!r} fans out into {len(indices)} units and a {stage.kind} stage reads one unit's files{pooled}: "
                f"name one, e.g. {needed}[{example}] or {needed}[0]",
            )
    if stage.kind == "export" and stage.checkpoint == "":
        fanned = [n for n in stage.needs if n in cfg.stages and cfg.stages[n].fan_out and cfg.stages[n].checkpoint_names()]
        if fanned:
            yield (
                f"stages.{name}.checkpoint",
                f"'' picks the needed training stage's best checkpoint, but stage {fanned[0]!r} fans out: "
                f"name one unit's, e.g. {fanned[0]}[0]:final",
            )


def _hf_problems(name: str, stage: StageCommon, staged: set[str]) -> Iterator[Problem]:
    """A hub model must be staged by a prestage stage (`staged`: what they list): compute nodes cannot fetch it."""
    for key, source in hf_sources(stage):
        repo = hub_id(source)
        if repo is not None and repo not in staged:
            yield (
                f"stages.{name}.{key}",
                f"{source!r} is neither a local directory nor staged: add {{kind: model, name: {repo}}} to a prestage "
                "stage's artefacts (it fetches on a node with internet; compute nodes have none)",
            )


def _slurm_problems(cfg: RunConfig, name: str, stage: StageCommon) -> Iterator[Problem]:
    """Where a stage runs and when it hears of the end: the preemption notice must come before the end of
    the walltime, images are named per stage or role, and a login-node stage is one process that
    `run`/`resume` itself runs (no fan-out, no roles)."""
    if stage.resume.signal_margin_s >= stage.resources.time_min * 60:
        yield (
            f"stages.{name}.resume.signal_margin_s",
            f"{stage.resume.signal_margin_s} s is not less than the walltime ({stage.resources.time_min} min): the notice would come at the start",
        )
    if stage.resources.image:
        yield (
            f"stages.{name}.resources.image",
            "a stage's image is stages.<name>.image; a component's is its components.<role>.image",
        )
    if stage.where != "login":
        return
    if stage.fan_out:
        yield f"stages.{name}.where", "a login-node stage cannot fan out (it runs in the submitting process)"
    if stage.resources.components:
        yield f"stages.{name}.where", "a login-node stage cannot have components (it is one process)"


def _tracking_problems(cfg: RunConfig) -> Iterator[Problem]:
    """Unknown sinks; a tracker that would reach for the network from compute nodes that have none
    (refused, not warned: every feed of every unit would fail; docs/tracking.md)."""
    tracking = cfg.tracking
    yield from ((_join("tracking", key), why) for key, why in tracking.problems())
    site = cfg.site
    if cfg.executor.kind != "slurm" or site is None or site.internet_on_compute is not False:
        return
    uri = tracking.mlflow.tracking_uri
    if "mlflow" in tracking.sinks and uri.lower().startswith(("http://", "https://")):
        yield (
            "tracking.mlflow.tracking_uri",
            f"{uri!r} is a server, but compute nodes of site {site.name} have no network (internet_on_compute: false): "
            "leave it empty (a file store in the run) and back-fill the server from the login node with "
            "`snowcat track RUN --to mlflow --tracking-uri URI`",
        )
    if "wandb" in tracking.sinks and tracking.wandb.mode == "online":
        yield (
            "tracking.wandb.mode",
            f"online, but compute nodes of site {site.name} have no network (internet_on_compute: false): "
            "use offline and upload with `snowcat sync RUN` on the login node",
        )


def tracking_package_problem(sinks, key: str = "tracking.sinks") -> Problem | None:
    """(key, problem) for the first chosen sink whose library is not installed here, with its pip command."""
    for i, sink in enumerate(sinks):
        module, package = TRACKER_PACKAGES.get(sink, (None, None))
        if module is not None and importlib.util.find_spec(module) is None:
            return (
                f"{key}[{i}]" if key == "tracking.sinks" else key,
                f"{sink!r} needs the {package} package, which is not installed in {sys.prefix}: "
                f"pip install '{package}' (or pip install 'snowcat[trackers]')",
            )
    return None


def _problems(cfg: RunConfig) -> Iterator[Problem]:
    yield from range_problems(cfg, "")
    yield from _tracking_problems(cfg)
    yield from ((_join("card", key), why) for key, why in cfg.card.problems())
    yield from ((_join("notify", key), why) for key, why in cfg.notify.problems(cfg.stages))
    if cfg.site is not None:
        yield from ((_join("site", key), why) for key, why in cfg.site.problems())
    staged = {a.name for s in cfg.stages.values() if s.kind == "prestage" for a in s.artefacts}
    for name, stage in cfg.stages.items():
        yield from _ref_problems(cfg, name, stage)
        yield from _input_problems(cfg, name, stage, tuple(sweep.sweep_keys(stage)))
        yield from _hf_problems(name, stage, staged)
        yield from _slurm_problems(cfg, name, stage)
        for key, problem in stage.problems():
            yield _join(f"stages.{name}", key), problem
        # checks against the run's other stages (e.g. rl.domain_weights naming the tasks stage's domains)
        for key, problem in getattr(stage, "run_problems", lambda _run: ())(cfg):
            yield _join(f"stages.{name}", key), problem


def _join(where: str, key: str) -> str:
    return ".".join(filter(None, (where, key))).replace(".[", "[")


def _check_values(cfg: DictConfig, label: str, source_of) -> None:
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise UserError(f"{label}: {missing[0]}: missing required value")
    run = typed(cfg)
    problems = list(_fan_out_problems(cfg, run)) or list(_problems(run))
    if problems:
        key, problem = problems[0]
        key = key.lstrip(".")
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise UserError(f"{source_of(key)}: {key}: {problem}{more}")


def _fan_out_problems(cfg: DictConfig, run: RunConfig) -> Iterator[Problem]:
    """Fan-out keys nothing reads; then a sweep's variants, each checked like a stage section on its own
    (`attempts: [1, 8]` is refused for its first variant, not discovered when that unit runs). First,
    as the references to a stage's units depend on them."""
    keys = [(f"stages.{name}.fan_out.{k}", sweep.fan_out_problem(s, k)) for name, s in run.stages.items() for k in s.fan_out]
    if any(problem for _, problem in keys):
        yield from ((key, problem) for key, problem in keys if problem)
        return
    for name, stage in run.stages.items():
        keys = sweep.sweep_keys(stage)
        if not keys:
            continue
        for item in sweep.fan_out_items(stage.fan_out, f"stages.{name}"):
            values = {k: item[k] for k in keys}
            variant = OmegaConf.to_object(sweep.unit_section(cfg, name, item))
            label = ", ".join(f"{k}={v}" for k, v in values.items())
            checks = [*range_problems(variant, ""), *variant.problems(), *_ref_problems(run, name, variant)]
            for key, problem in checks + list(_input_problems(run, name, variant)):
                yield (
                    f"stages.{name}.fan_out",
                    f"the unit with {label}: {key.lstrip('.').removeprefix(f'stages.{name}.')}: {problem}",
                )


def unit_config(cfg: DictConfig, name: str, item: dict | None):
    """The typed config one unit of a stage runs with: the stage's section with its sweep values."""
    return OmegaConf.to_object(sweep.unit_section(cfg, name, item))


def resolve(cfg: DictConfig, label: str = "config") -> DictConfig:
    """Resolve every interpolation; a bad one is reported with its key path."""
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        raise UserError(f"{label}: {_key(e)}: bad interpolation: {_msg(e)}") from None
    return cfg


def load(path: str | Path, overrides: list[str] = (), site: str | None = None, frozen: bool = False) -> DictConfig:
    """compose + resolve: the fully resolved, typed run config (refused if it holds a credential, or,
    unless `frozen`, if it chooses a tracker whose library is not installed here)."""
    cfg = resolve(compose(path, overrides, site), str(path))
    refuse_secrets(cfg, str(path), list(overrides))
    if not frozen:
        problem = tracking_package_problem(list(cfg.tracking.sinks))
        if problem is not None:
            source = next((f"override '{o}'" for o in reversed(list(overrides)) if o.startswith("tracking")), str(path))
            raise UserError(f"{source}: {problem[0]}: {problem[1]}")
    return cfg


def refuse_secrets(cfg: DictConfig, label: str, overrides: list[str] = ()) -> None:
    """A resolved config is frozen into the run directory, provenance and cards: it must hold no
    credential, neither a value of a secret environment variable (e.g. via ${oc.env:HF_TOKEN}) nor a
    credential-shaped string (a password in a URL, a token). The message never repeats the value."""
    known = scrub.env_secrets()
    stack: list[tuple[str, object]] = [("", OmegaConf.to_container(cfg, resolve=True))]
    while stack:
        where, node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            at = f"{where}.{key}" if where else str(key)
            if isinstance(value, (dict, list)):
                stack.append((at, value))
                continue
            if not isinstance(value, str):
                continue
            found = [f"the value of the secret variable {name}" for name, secret in known.items() if secret in value]
            found += [f"a credential ({kind})" for kind in scrub.secret_kinds(value, high_entropy=False)]
            if found:
                source = next((f"override {o.split('=', 1)[0]}=..." for o in overrides if value in o), label)
                raise UserError(
                    f"{source}: {at}: holds {found[0]}; a run directory must never record it — "
                    "pass credentials through the environment or a credentials file the tool reads (e.g. HF_TOKEN, ~/.netrc)"
                )


def load_frozen(path: str | Path) -> DictConfig:
    """Re-type a resolved config frozen in a run directory (it validates as any config does; a tracker
    library missing here does not keep the run from opening: feeding that tracker fails, and is ignored)."""
    return load(path, frozen=True)


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True, sort_keys=False)


def config_hash(cfg: DictConfig) -> str:
    return hashlib.sha256(to_yaml(cfg).encode()).hexdigest()


def stage_seed(run_seed: int, stage: str, item_index: int | None = None) -> int:
    """A stable per-unit seed: the run seed, the stage name and the fan-out index, hashed."""
    text = f"{run_seed}/{stage}/{'' if item_index is None else item_index}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")
