"""`validate` stage: a tasks stage's imported tasks checked before it runs, as a job array.

Each element (`fan_out: {shard: [0, 1, ..., N-1]}`) imports the tasks of the tasks stage its
`tasks` key names (that stage's config, not its outputs), keeps its share (`shard_of`: by content
hash) and runs each one's gold and empty solutions through the verifier (stages/taskgen/validate.py)
into the run's verdict cache. The tasks stage `needs` this one and finds every verdict there, so it
only filters. Preempted, an element continues from the cache. Outputs per element:
`validation.json` (its share's counts and exclusions) and the metrics `validation/<status>`.

Only imports are checked here: generated tasks depend on the tasks stage's own seed (its
`validate.tasks: all` checks them itself), and an import with `build_images` is checked by the tasks
stage, which builds the image the verdict depends on.
"""

from __future__ import annotations

import os

from snowcat.pipeline.context import Preempted, StageContext
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_json
from snowcat.stages.taskgen.importers import TaskImportError, import_tasks
from snowcat.stages.taskgen.validate import shard_of, summary, validate_tasks, validation_cache


def run(ctx: StageContext) -> dict:
    key = f"stages.{ctx.name}"
    stages = ctx.run_config.stages if ctx.run_config is not None else {}
    target = stages.get(ctx.config.tasks)
    if target is None or target.kind != "tasks":
        raise UserError(f"{key}.tasks: {ctx.config.tasks!r} is not a tasks stage of this run")
    if ctx.name not in target.needs:
        raise UserError(f"stages.{ctx.config.tasks}.needs: add {ctx.name!r}, whose checks it reads")
    if target.validate.tasks == "none":
        raise UserError(f"stages.{ctx.config.tasks}.validate.tasks: none, so nothing would read what {ctx.name!r} checks")
    shards = list(ctx.config.fan_out.get("shard", [0]))
    index = shards.index(ctx.item["shard"]) if ctx.item and "shard" in ctx.item else 0
    tasks, skipped = [], 0
    for i, imp in enumerate(target.imports):
        if imp.build_images:
            skipped += 1
            continue
        try:
            tasks += [t for t in import_tasks(imp) if t.verifier == "repo"]
        except TaskImportError as e:
            raise UserError(f"stages.{ctx.config.tasks}.imports[{i}]: {e}") from None
    mine = [t for t in tasks if shard_of(t, len(shards)) == index]
    cfg = target.validate
    checks = validate_tasks(
        mine,
        validation_cache(cfg, ctx.run_dir),
        runs=cfg.runs,
        workers=cfg.workers or len(os.sched_getaffinity(0)),
        progress=lambda done, total: ctx.progress(done, total, unit="tasks", phase="validate"),
        stop=ctx.checkpoint_due,
    )
    if len(checks) < len(mine):
        raise Preempted(f"{key}: {len(checks)} of {len(mine)} tasks checked")
    counts = summary(checks)
    excluded = {c.task_id: {"status": c.status, "detail": c.detail} for c in checks.values() if not c.valid}
    atomic_write_json(
        ctx.out_dir / "validation.json",
        {"shard": index, "shards": len(shards), "runs": cfg.runs, "checked": len(checks), "counts": counts, "excluded": excluded},
    )
    return {
        "validation/checked": len(checks),
        **{f"validation/{status}": n for status, n in counts.items()},
        "imports_skipped": skipped,
    }
