"""`card` stage: write the run's provenance card, `card.md` (see `pipeline.card`), from recorded facts.

It should need the stages it describes (training, evaluate, export); facts of stages that have not
finished are reported as "not recorded", never guessed.
"""

from __future__ import annotations

from pathlib import Path

from snowcat.pipeline.card import build_card
from snowcat.pipeline.fsio import atomic_write_text
from snowcat.pipeline.rundir import RunDir


def run(ctx) -> dict:
    text = build_card(RunDir(ctx.run_dir))
    atomic_write_text(Path(ctx.out_dir) / ctx.config.filename, text)
    return {"not_recorded": text.count("not recorded")}
