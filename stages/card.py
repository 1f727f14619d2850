"""`card` stage: write the run's provenance card, `card.md` (see `pipeline.card`), from recorded facts.

It should need the stages it describes (training, evaluate, export); facts of stages that have not
finished are reported as "not recorded", never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class Config:
    filename: str = "card.md"


def run(ctx) -> dict:
    from snowcat.pipeline.card import build_card
    from snowcat.pipeline.fsio import atomic_write_text
    from snowcat.pipeline.rundir import RunDir

    text = build_card(RunDir(ctx.run_dir))
    atomic_write_text(Path(ctx.out_dir) / ctx.config.filename, text)
    return {"not_recorded": text.count("not recorded")}
