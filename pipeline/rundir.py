"""The run directory: the single source of truth of a run.

    <run>/config.yaml           the resolved config, frozen at creation
    <run>/run.json              run id, creation time, origin
    <run>/state.json            per-stage records: status, attempts, job ids, times (executor's view)
    <run>/stages/<name>/        a stage's outputs (fan-out: stages/<name>/<index>/ per element),
                                each with manifest.json, metrics.json and DONE (written last)
    <run>/logs/<unit>.log       stage logs (local executor); Slurm keeps its own under slurm/
    <run>/provenance/           per-unit provenance records

A unit is done iff its DONE marker exists and names the sha256 of its manifest; everything else
about progress is advisory and reconciled against the markers.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout
from omegaconf import DictConfig

from . import config as config_mod
from .dag import Dag, Unit
from .errors import UserError
from .fsio import atomic_write_json, atomic_write_text, make_temp_dir, read_json, sha256_file, verify_manifest, write_manifest

DONE = "DONE"
STATUSES = ("pending", "submitted", "running", "done", "failed", "cancelled", "modified")


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def new_run_id(name: str) -> str:
    return f"{name}-{dt.datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


class RunDir:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).resolve()

    # --- creation / opening ----------------------------------------------------------------

    @classmethod
    def create(cls, cfg: DictConfig, path: Path | None = None, origin: dict | None = None) -> RunDir:
        """Create a run directory atomically: built under a temp name, renamed into place."""
        run_id = path.name if path is not None else new_run_id(cfg.name)
        path = Path(path) if path is not None else Path(cfg.run_root) / run_id
        if path.exists() and any(path.iterdir()):
            raise UserError(f"{path}: exists and is not a snowcat run directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = make_temp_dir(path.parent, f".{path.name}.")
        try:
            atomic_write_text(tmp / "config.yaml", config_mod.to_yaml(cfg))
            atomic_write_json(tmp / "run.json", {"run_id": run_id, "created": now(), "origin": origin or {}})
            atomic_write_json(tmp / "state.json", {"stages": {}})
            if path.exists():
                path.rmdir()
            os.replace(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return cls(path)

    @classmethod
    def open(cls, path: str | os.PathLike) -> RunDir:
        run = cls(path)
        if not (run.path / "config.yaml").is_file() or not (run.path / "run.json").is_file():
            raise UserError(f"{path}: not a snowcat run directory (no config.yaml / run.json)")
        return run

    @property
    def run_id(self) -> str:
        """Recorded at creation; it is the directory's name (also for a run not created yet: a dry run)."""
        return read_json(self.path / "run.json", {"run_id": self.path.name})["run_id"]

    @property
    def info(self) -> dict:
        return read_json(self.path / "run.json")

    def config(self) -> DictConfig:
        return config_mod.load_frozen(self.path / "config.yaml")

    # --- locks -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def driver_lock(self) -> Iterator[None]:
        """Held by the one snowcat process that launches or submits work for this run."""
        lock = FileLock(self.path / ".driver.lock")
        try:
            lock.acquire(timeout=0)
        except Timeout:
            holder = (self.path / ".driver.pid").read_text().strip() if (self.path / ".driver.pid").exists() else "?"
            raise UserError(f"{self.path}: another snowcat process (pid {holder}) is driving this run") from None
        try:
            atomic_write_text(self.path / ".driver.pid", str(os.getpid()))
            yield
        finally:
            lock.release()

    def _state_lock(self) -> FileLock:
        return FileLock(self.path / ".state.lock", timeout=60)

    # --- state records ---------------------------------------------------------------------

    def state(self) -> dict:
        return read_json(self.path / "state.json", {"stages": {}})

    def update_stage(self, stage: str, **fields: Any) -> dict:
        """Read-modify-write one stage's record under the state lock."""
        with self._state_lock():
            state = self.state()
            record = state["stages"].setdefault(stage, {"status": "pending", "attempts": 0, "job_ids": []})
            for key, value in fields.items():
                if key == "job_ids":
                    record["job_ids"] = list(dict.fromkeys(record.get("job_ids", []) + list(value)))
                else:
                    record[key] = value
            atomic_write_json(self.path / "state.json", state)
            return record

    def update_run(self, **fields: Any) -> None:
        with self._state_lock():
            state = self.state()
            state.update(fields)
            atomic_write_json(self.path / "state.json", state)

    # --- units -----------------------------------------------------------------------------

    def stage_dir(self, stage: str) -> Path:
        return self.path / "stages" / stage

    def unit_dir(self, unit: Unit) -> Path:
        base = self.stage_dir(unit.stage)
        return base if unit.index is None else base / f"{unit.index:04d}"

    def log_path(self, unit: Unit) -> Path:
        return self.path / "logs" / f"{unit.key}.log"

    def is_done(self, unit: Unit) -> bool:
        return (self.unit_dir(unit) / DONE).is_file()

    def verify_unit(self, unit: Unit) -> list[str]:
        """Problems with a done unit's outputs (empty: they are exactly what was recorded)."""
        out = self.unit_dir(unit)
        marker = read_json(out / DONE)
        if marker is None:
            return [f"{out / DONE}: missing"]
        manifest = out / "manifest.json"
        if not manifest.is_file() or sha256_file(manifest) != marker.get("manifest_sha256"):
            return [f"{manifest}: does not match the DONE marker"]
        return verify_manifest(out, exclude=(DONE,))

    def mark_done(self, unit: Unit, metrics: dict) -> None:
        """Write metrics and manifest, then the DONE marker — last, atomically."""
        out = self.unit_dir(unit)
        atomic_write_json(out / "metrics.json", metrics)
        write_manifest(out, exclude=(DONE,))
        atomic_write_json(out / DONE, {"manifest_sha256": sha256_file(out / "manifest.json"), "finished": now()})

    def clear_done(self, unit: Unit) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.unit_dir(unit) / DONE).unlink()

    def metrics(self, unit: Unit) -> dict:
        return read_json(self.unit_dir(unit) / "metrics.json", {})

    # --- derived status ----------------------------------------------------------------------

    def stage_status(self, dag: Dag, stage: str, verify: bool = True) -> tuple[str, list[str]]:
        """(status, problems): DONE markers decide `done`/`modified`; the state record the rest."""
        units = dag[stage].units
        done = [u for u in units if self.is_done(u)]
        if len(done) == len(units):
            problems = [p for u in done for p in (self.verify_unit(u) if verify else [])]
            return ("modified" if problems else "done"), problems
        record = self.state()["stages"].get(stage, {})
        status = record.get("status", "pending")
        return (status if status != "done" else "failed"), []
