"""`tasks` stage: generate verifiable task sets, seeded, with a held-out validation split.

Generated domains and imported tasks (`imports`: SWE-bench, SWE-Gym, R2E-Gym and SWE-smith rows,
Harbor task directories, prompt-and-answer rows and IFEval; stages/taskgen/importers.py). Each
import's source is recorded in `sources.json` (format, path, domain, the sha256 of the file or
task directory as read, and the tasks it gave to each split), which the card's data section cites.
Repository tasks are validated first (`validate`, stages/taskgen/validate.py: gold passes and
empty fails, twice): imported ones by default, generated ones with `validate.tasks: all`; the
excluded ones and why are in `validation.json`, the counts in the metrics (`validation/<status>`).
Outputs `train.parquet`, `val.parquet` and, when a domain sets `dev_count`, `dev.parquet` (held
out for checkpoint selection, so the exported checkpoint is scored on tasks it was not chosen on; see `stages.taskgen` for the columns and verifiers);
validation tasks never appear in training (checked by prompt; for repository tasks by prompt, code
and gold patch).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from snowcat.containers.images import build
from snowcat.pipeline.context import Preempted, StageContext
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.fsio import atomic_write_json, atomic_write_text
from snowcat.pipeline.offline import image_artefact, require_staged
from snowcat.stages.taskgen import generate_domain, save_tasks, split_tasks, task_key
from snowcat.stages.taskgen.importers import TaskImportError, import_tasks
from snowcat.stages.taskgen.rows import SOURCES, source_sha256
from snowcat.stages.taskgen.validate import summary, validate_tasks, validation_cache


def _with_image(task, images: Path, key: str):
    """`task` with its own sandbox image, built from the recipe its Dockerfile became (none: as it is)."""
    recipe = task.meta.get("apptainer_recipe")
    if not recipe:
        return task
    images.mkdir(parents=True, exist_ok=True)
    definition = images / f"{task.task_id}.def"
    atomic_write_text(definition, recipe)
    try:
        image = build(definition, images / f"{task.task_id}.sif")
    except UserError as e:
        raise UserError(f"{key}: task {task.task_id}: {e}") from None
    return dataclasses.replace(task, meta=task.meta | {"sandbox_image": str(image)})


def _staged_images(tasks: list, staging_dir: str | None, key: str) -> list:
    """`tasks` with the SIF the prestage stage pulled for each one's meta["image"] as sandbox_image."""
    if staging_dir is None:
        raise UserError(f"{key}.staged_images: the run has no prestage stage (its `image` artefacts are the images)")
    missing = [t.task_id for t in tasks if not t.meta.get("image")]
    if missing:
        raise UserError(f"{key}.staged_images: task {missing[0]} names no image (meta['image'])")
    names = sorted({image_artefact(t.meta["image"]) for t in tasks})
    paths = require_staged(staging_dir, names)  # UserError naming the first image not staged
    return [dataclasses.replace(t, meta=t.meta | {"sandbox_image": str(paths[image_artefact(t.meta["image"])])}) for t in tasks]


def _import(imp, key: str) -> list:
    if not Path(imp.path).exists():
        raise UserError(f"{key}.path: {imp.path} does not exist")
    try:
        return import_tasks(imp)
    except TaskImportError as e:
        raise UserError(f"{key}: {e}") from None


class _Validation:
    """The stage's task checks (config `validate`): run where asked, kept for the manifest."""

    def __init__(self, ctx: StageContext):
        self.cfg, self.ctx = ctx.config.validate, ctx
        self.cache = validation_cache(self.cfg, ctx.run_dir)
        self.checks: dict = {}

    def keep(self, tasks: list, imported: bool) -> list:
        """The valid ones of `tasks` (all of them where this kind of task is not checked)."""
        wanted = self.cfg.tasks == "all" or (self.cfg.tasks == "imports" and imported)
        repo_tasks = [t for t in tasks if t.verifier == "repo"]
        if not wanted or not repo_tasks:
            return tasks
        workers = self.cfg.workers or len(os.sched_getaffinity(0))
        checks = validate_tasks(
            repo_tasks,
            self.cache,
            runs=self.cfg.runs,
            workers=workers,
            progress=lambda done, total: self.ctx.progress(done, total, unit="tasks", phase="validate"),
            stop=self.ctx.checkpoint_due,
        )
        if len(checks) < len(repo_tasks):
            raise Preempted(f"task validation: {len(checks)} of {len(repo_tasks)} checked, kept in {self.cache}")
        self.checks |= checks
        return [t for t in tasks if t.verifier != "repo" or checks[t.task_id].valid]

    def write(self, out_dir: Path, metrics: dict) -> None:
        if not self.checks:
            return
        counts = summary(self.checks)
        metrics.update({f"validation/{status}": n for status, n in counts.items()})
        metrics["validation/checked"] = len(self.checks)
        excluded = {c.task_id: {"status": c.status, "detail": c.detail} for c in self.checks.values() if not c.valid}
        atomic_write_json(
            out_dir / "validation.json",
            {"runs": self.cfg.runs, "checked": len(self.checks), "counts": counts, "excluded": excluded},
        )


def run(ctx: StageContext) -> dict:
    rng = np.random.default_rng(ctx.seed)
    train, dev, val = [], [], []
    metrics: dict[str, float] = {}
    validation = _Validation(ctx)
    for domain, spec in ctx.config.generated().items():
        tasks = validation.keep(generate_domain(rng, domain, list(spec.difficulties), spec.count), imported=False)
        if len(tasks) <= spec.val_count + spec.dev_count:
            raise UserError(f"stages.{ctx.name}.domains.{domain}: {len(tasks)} valid tasks left, too few for the held-out splits")
        d_train, d_val = split_tasks(tasks, spec.val_count, rng)
        d_dev = []
        if spec.dev_count:  # drawn only when asked, so runs without a dev split keep their splits
            d_train, d_dev = split_tasks(d_train, spec.dev_count, rng)
            metrics[f"{domain}/dev"] = len(d_dev)
        train += d_train
        dev += d_dev
        val += d_val
        metrics[f"{domain}/train"] = len(d_train)
        metrics[f"{domain}/val"] = len(d_val)
    keys = [{task_key(t) for t in split} for split in (train, dev, val)]
    leaked = (keys[0] & keys[1]) | (keys[0] & keys[2]) | (keys[1] & keys[2])
    if leaked:
        raise RuntimeError(f"{len(leaked)} held-out tasks occur in two splits")
    sources = []
    for i, imp in enumerate(ctx.config.imports):
        tasks = _import(imp, f"stages.{ctx.name}.imports[{i}]")
        digest = source_sha256(imp.path)  # the file (or task directories) the tasks came from
        if imp.build_images:
            tasks = [_with_image(t, ctx.out_dir / "images", f"stages.{ctx.name}.imports[{i}]") for t in tasks]
        if imp.staged_images:
            staging = [str(s.staging_dir) for s in ctx.run_config.stages.values() if s.kind == "prestage"]
            tasks = _staged_images(tasks, staging[0] if staging else None, f"stages.{ctx.name}.imports[{i}]")
        tasks = validation.keep(tasks, imported=True)
        d_train, d_val = split_tasks(tasks, imp.val_count, rng) if imp.val_count else (tasks, [])
        train += d_train
        val += d_val
        metrics[f"{imp.domain}/train"] = metrics.get(f"{imp.domain}/train", 0) + len(d_train)
        metrics[f"{imp.domain}/val"] = metrics.get(f"{imp.domain}/val", 0) + len(d_val)
        sources.append(
            {"format": imp.format, "path": imp.path, "domain": imp.domain, "sha256": digest}
            | {"train": len(d_train), "val": len(d_val)}
        )
    if sources:
        atomic_write_json(ctx.out_dir / SOURCES, {"imports": sources})
    save_tasks(ctx.out_dir, "train", train)
    save_tasks(ctx.out_dir, "val", val)
    if dev:
        save_tasks(ctx.out_dir, "dev", dev)
        metrics["dev"] = len(dev)
    metrics.update(train=len(train), val=len(val))
    validation.write(Path(ctx.out_dir), metrics)
    return metrics
