"""What the run directory records, read once (`Facts`), and how a card shows a value that may be missing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from snowcat.pipeline import config as config_mod
from snowcat.pipeline.dag import Unit, build
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import read_json, sha256_file
from snowcat.pipeline.provenance import record_path
from snowcat.pipeline.rundir import RunDir
from snowcat.pipeline.sweep import ref_unit

NR = "not recorded"


TRAINING_KINDS = ("sft", "rl")


def shown(value: Any, fmt: str = "{}") -> str:
    return NR if value is None or value == "" else fmt.format(value)


def percent(x: Any) -> str:
    return NR if x is None else f"{100 * x:.1f}%"


def pct(x: Any, se: Any = None) -> str:
    if x is None:
        return NR
    return f"{100 * x:.1f}" + (f" ± {100 * se:.1f}" if se is not None else "")


class Facts:
    """What the run directory records, read once."""

    def __init__(self, run: RunDir):
        self.run = run
        self.info = run.info
        self.cfg = run.config()
        self.dag = build(self.cfg)
        self.config_sha256 = sha256_file(run.path / "config.yaml")

    def nodes(self, *kinds: str):
        return [n for n in self.dag if n.kind in kinds]

    def done(self, name: str) -> bool:
        return all(self.run.is_done(u) for u in self.dag[name].units)

    def stage_dir(self, name: str) -> Path:
        return self.run.stage_dir(name)

    def units(self, node) -> list[tuple[str, Any, Any]]:
        """(label, the config it ran with, unit) per unit: a sweep unit's own values set, its label
        naming them as a reference does (`rl[estimator=grpo,lr=0.001]`). A fanned-out stage's
        directory holds only its units' directories, so every reader of a stage's files goes
        through this; a plain stage is its one unit, labelled with the stage's name."""
        return [(self.label(u), self.unit_config(u), u) for u in node.units]

    def label(self, unit) -> str:
        item = self.dag[unit.stage].items[unit.index] if unit.index is not None else None
        return unit.stage if item is None else f"{unit.stage}[{','.join(f'{k}={v}' for k, v in item.items())}]"

    def unit_config(self, unit):
        node = self.dag[unit.stage]
        return node.config if unit.index is None else config_mod.unit_config(self.cfg, node.name, node.items[unit.index])

    def unit_dir(self, unit) -> Path:
        return self.run.unit_dir(unit)

    def ref_unit(self, ref: str | None) -> Unit | None:
        """The unit a checkpoint reference (`rl[estimator=grpo]:best`, `sft:final`) names; None: no
        stage of this run (an `hf:` model, a malformed reference)."""
        try:
            stage, index, _ = ref_unit(ref or "", {n: node.config for n, node in self.dag.nodes.items()})
        except (ValueError, UserError):
            return None
        return Unit(stage, index)

    def provenance(self, name: str, index: int | None = None) -> dict | None:
        return read_json(record_path(self.run.path, name, index))

    def manifest(self, unit) -> dict:
        return (read_json(self.unit_dir(unit) / "manifest.json") or {}).get("files", {})


def one_or_each(pairs: list[tuple[str, Any]]) -> Any:
    """A plain stage's value; a fanned-out stage's once when its units agree ("…, each of its N
    units"), else each unit's, labelled. None where nothing was recorded."""
    if len(pairs) == 1:
        return pairs[0][1]
    values = [v for _, v in pairs]
    if all(v == values[0] for v in values) and values[0] is not None:
        return f"{values[0]} (each of `{pairs[0][0].partition('[')[0]}`'s {len(pairs)} units)"
    return "; ".join(f"{label}: {shown(v)}" for label, v in pairs) if any(v is not None for v in values) else None


def history(f: Facts, source: dict) -> list[dict]:
    """The metrics history rows of the unit an export source (`<stage>[<unit>]:<name>`) came from."""
    unit = f.ref_unit(source.get("ref"))
    return unit_history(f, unit) if unit is not None else []


def unit_history(f: Facts, unit) -> list[dict]:
    path = f.unit_dir(unit) / "metrics_history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def license_text(card) -> str:
    """The config's `card.license` as a reader should see it ("" when unset)."""
    if card.license == "other":
        return f"other: {card.license_name} ({card.license_link})"
    return card.license


def license_meta(card) -> dict:
    """The model-card metadata the Hub reads for the license (nothing when unset: no guess)."""
    if not card.license:
        return {}
    if card.license == "other":
        return {"license": "other", "license_name": card.license_name, "license_link": card.license_link}
    return {"license": card.license}
