"""What each unit of a fanned-out stage varies, and how later stages name one unit.

A stage's `fan_out` maps keys to lists; every element of their cartesian product is one unit (a job
array element on Slurm). A key is one of:
  - a key of the stage's own config (dotted for nested ones: `lr`, `vllm.max_num_seqs`): a **sweep**.
    The unit runs with that value and nothing else differs, not even the seed, so variants are
    compared on the same data and sampling draws (common random numbers);
  - `replica`: the unit repeats the stage; its seed differs with the replica's position;
  - `checkpoint` on an evaluate stage: the checkpoint reference the unit scores;
  - `shard` on a validate stage: the share of the tasks the unit checks.
Anything else is refused at load: a key nothing reads would plan units that all do the same thing.

A later stage names a unit's output as `<stage>[<index>]:<name>` or `<stage>[key=value,...]:<name>`,
e.g. `rl[estimator=rloo_n,tis_cap=2.0]:final`; a fanned-out stage must be named this way. A key that
names a stage whose files a stage reads (`select.probe`, `evaluate.tasks`, ...: a stage input) names
one unit the same way, `probe[temperature=0.5]`; only `select.probe` may name a stage fanned out
over `replica` alone, whose units' attempts it pools (`input_units`).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from snowcat.pipeline.errors import UserError
from snowcat.pipeline.schema import StageCommon, parse_checkpoint_ref
from snowcat.stages.registry import KINDS

REPLICA = "replica"
_COMMON = {f.name for f in dataclasses.fields(StageCommon)}  # one job array shares them: not sweepable
_ABSENT = object()


def fan_out_items(fan_out: Mapping[str, list], where: str) -> list[dict[str, Any]] | None:
    """The units' elements: the cartesian product of the lists, in key order (None: no fan-out)."""
    if not fan_out:
        return None
    keys = list(fan_out.keys())
    values = []
    for k in keys:
        v = fan_out[k]
        if not isinstance(v, list) or not v:
            raise UserError(f"{where}.fan_out.{k}: expected a non-empty list")
        values.append(v)
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def unit_path(stage_dir: str | os.PathLike, index: int | None) -> Path:
    """Where a unit writes: the stage directory, or its `NNNN/` subdirectory in a fan-out."""
    return Path(stage_dir) if index is None else Path(stage_dir) / f"{index:04d}"


def key_kind(section, key: str) -> str | None:
    """ "sweep", "replica" or "item" for a usable fan-out key of a typed stage section (dotted keys may
    reach into its maps, e.g. `domains.arith.count`); None if nothing reads it."""
    if key == REPLICA:
        return "replica"
    if key in KINDS[section.kind].item_keys:
        return "item"
    if key.split(".")[0] in _COMMON:
        return None
    try:
        found = OmegaConf.select(OmegaConf.structured(section), key, default=_ABSENT, throw_on_missing=False)
    except OmegaConfBaseException:
        return None
    return None if found is _ABSENT else "sweep"


def fan_out_problem(section, key: str) -> str | None:
    if key_kind(section, key) is not None:
        return None
    if key.split(".")[0] in _COMMON:
        return f"{key!r} is shared by the whole fan-out (one job array): it cannot vary between units"
    example = next(f.name for f in dataclasses.fields(KINDS[section.kind].config))
    reads = "".join(f" or {k!r}" for k in KINDS[section.kind].item_keys)
    return (
        f"{key!r} is not a key of a {section.kind} stage, so every unit would run the same: fan out over the stage's "
        f"own keys (a sweep, e.g. {example}), {REPLICA!r} (repeats it with another seed){reads}"
    )


def sweep_keys(section) -> list[str]:
    """The fan-out keys of a stage that set its config (a sweep)."""
    return [k for k in section.fan_out if key_kind(section, k) == "sweep"]


def replica_index(fan_out: dict[str, list], item: dict[str, Any] | None) -> int | None:
    """The position of the unit's replica (what its seed varies with); None without a `replica` key."""
    if not item or REPLICA not in item:
        return None
    return list(fan_out[REPLICA]).index(item[REPLICA])


def unit_section(cfg: DictConfig, name: str, item: dict[str, Any] | None) -> DictConfig:
    """The stage's config section with the unit's sweep values set (type-checked by the schema)."""
    values = {k: item[k] for k in sweep_keys(OmegaConf.to_object(cfg.stages[name]))} if item else {}
    if not values:
        return cfg.stages[name]
    cfg = copy.deepcopy(cfg)  # the whole config: interpolations in the section may point outside it
    for key, value in values.items():
        try:
            OmegaConf.update(cfg, f"stages.{name}.{key}", value, merge=False)
        except OmegaConfBaseException as e:
            raise UserError(f"stages.{name}.fan_out.{key}: {value!r}: {str(e).splitlines()[0]}") from None
    return cfg.stages[name]


def parse_unit_selector(stage_part: str) -> tuple[str, str | None]:
    """("rl", "estimator=grpo") from "rl[estimator=grpo]"; ("sft", None) from "sft"."""
    if not stage_part.endswith("]") or "[" not in stage_part:
        if "[" in stage_part or "]" in stage_part:
            raise ValueError(f"{stage_part!r}: a unit is named as <stage>[<index>] or <stage>[key=value,...]")
        return stage_part, None
    stage, _, selector = stage_part[:-1].partition("[")
    if not stage or not selector.strip():
        raise ValueError(f"{stage_part!r}: a unit is named as <stage>[<index>] or <stage>[key=value,...]")
    return stage, selector.strip()


def select_unit(stage: str, items: list[dict[str, Any]] | None, selector: str | None) -> int | None:
    """The unit index a selector names among a stage's fan-out `items` (None: the stage is not fanned
    out and no selector was given). ValueError says what does not match."""
    if items is None:
        if selector is not None:
            raise ValueError(f"stage {stage!r} does not fan out: name it without [{selector}]")
        return None
    if selector is None:
        example = ",".join(f"{k}={v}" for k, v in items[0].items())
        raise ValueError(f"stage {stage!r} fans out into {len(items)} units: name one, e.g. {stage}[{example}] or {stage}[0]")
    if selector.isdigit():
        index = int(selector)
        if index >= len(items):
            raise ValueError(f"stage {stage!r} has units 0..{len(items) - 1}, not {index}")
        return index
    wanted = {}
    for part in selector.split(","):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in items[0]:
            raise ValueError(f"{stage}[{selector}]: {part.strip()!r} is not key=value with a fan-out key ({', '.join(items[0])})")
        wanted[key.strip()] = value.strip()
    matches = [i for i, item in enumerate(items) if all(str(item[k]) == v for k, v in wanted.items())]
    if len(matches) != 1:
        found = "no unit" if not matches else f"{len(matches)} units"
        raise ValueError(f"{stage}[{selector}] matches {found}: give every varied key ({', '.join(items[0])})")
    return matches[0]


def ref_unit(ref: str, stages: Mapping[str, Any] | None) -> tuple[str, int | None, str]:
    """(stage, unit index or None, checkpoint name) of a reference such as `rl[lr=0.001]:best`, given
    the run's typed stage sections (None: a stage run on its own, whose inputs do not fan out).
    ValueError says what is wrong with it."""
    stage_part, name = parse_checkpoint_ref(ref)
    stage, selector = parse_unit_selector(stage_part)
    if stages is not None and stage not in stages:
        raise ValueError(f"{ref!r} names no stage of this run")
    items = fan_out_items(stages[stage].fan_out, f"stages.{stage}") if stages is not None else None
    return stage, select_unit(stage, items, selector), name


def input_units(value: str, stages: Mapping[str, Any] | None) -> tuple[str, list[int | None]]:
    """(stage, unit indices) that a stage-input key's value names: `probe` is every unit of a
    fanned-out probe ([None] without fan-out); `probe[1]` or `probe[temperature=0.5]` one unit.
    `stages`: the run's typed sections (None: a stage run on its own). ValueError says what is wrong."""
    stage, selector = parse_unit_selector(value)
    if stages is None or stage not in stages:
        if selector is not None:
            raise ValueError(f"{value!r}: stage {stage!r} is not a stage of this run")
        return stage, [None]
    items = fan_out_items(stages[stage].fan_out, f"stages.{stage}")
    if items is not None and selector is None:
        return stage, list(range(len(items)))
    return stage, [select_unit(stage, items, selector)]


def replicas_only(section) -> bool:
    """True when a stage fans out over `replica` alone: its units repeat one config with other seeds."""
    return bool(section.fan_out) and set(section.fan_out) == {REPLICA}
