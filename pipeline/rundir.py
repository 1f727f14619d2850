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
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout
from omegaconf import DictConfig

from . import config as config_mod
from . import procid, provenance
from .dag import Dag, Unit
from .errors import UserError
from .fsio import (
    atomic_write_json,
    atomic_write_text,
    make_temp_dir,
    read_json,
    sha256_bytes,
    sha256_file,
    verify_manifest,
    write_manifest,
)
from .scrub import scrub_text

DONE = "DONE"
STATUSES = ("pending", "submitted", "running", "done", "failed", "cancelled", "modified", "stale")


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def new_run_id(name: str) -> str:
    return f"{name}-{dt.datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def _holder(path: Path) -> dict | None:
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) and "pid" in holder else None


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
            text = config_mod.to_yaml(cfg)
            atomic_write_text(tmp / "config.yaml", text)
            info = {"run_id": run_id, "created": now(), "origin": origin or {}, "config_sha256": sha256_bytes(text.encode())}
            atomic_write_json(tmp / "run.json", info)
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
        """Open an existing run; its frozen config must still be the one recorded at creation."""
        run = cls(path)
        if not (run.path / "config.yaml").is_file() or not (run.path / "run.json").is_file():
            raise UserError(f"{path}: not a snowcat run directory (no config.yaml / run.json)")
        run.verify_config()
        return run

    def verify_config(self) -> None:
        """A truncated or edited config.yaml would silently shrink the DAG or fall back to defaults."""
        try:
            recorded = json.loads((self.path / "run.json").read_text()).get("config_sha256")
        except (ValueError, AttributeError):
            raise UserError(f"{self.path / 'run.json'}: damaged (not a JSON object); the run cannot be opened") from None
        if recorded is None:
            raise UserError(f"{self.path / 'run.json'}: records no config_sha256 (made by an older snowcat?)")
        if sha256_file(self.path / "config.yaml") != recorded:
            raise UserError(
                f"{self.path / 'config.yaml'}: differs from the config frozen at creation (sha256 recorded in run.json); "
                "restore it — a run's config never changes (start a new run for a new config)"
            )

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
        with self._exclusive(self.path / ".driver", "another snowcat process ({holder}) is driving this run"):
            yield

    @contextlib.contextmanager
    def unit_lock(self, unit: Unit, rank: int = 0, wait_s: float = 0) -> Iterator[None]:
        """Held by whoever runs a unit, rank by rank (the executor's process or a user by hand): two
        runners of one unit would share its output and staging directories and delete each other's files.
        `wait_s`: how long to wait for a holder to exit (a resubmitted job may start while the
        cancelled one's process is still being killed); 0 refuses at once."""
        locks = self.path / ".locks"
        locks.mkdir(exist_ok=True)
        name = unit.key if rank == 0 else f"{unit.key}.rank{rank}"
        with self._exclusive(locks / name, f"{unit.key} is already being run ({{holder}}); wait for it, or stop it", wait_s):
            yield

    def driver(self) -> dict | None:
        """The process identity (pipeline.procid) of the last driver of this run, if recorded."""
        return _holder(self.path / ".driver.pid")

    @contextlib.contextmanager
    def _exclusive(self, base: Path, busy: str, wait_s: float = 0) -> Iterator[None]:
        """An exclusive lock `<base>.lock` (flock: released by the kernel when the holder dies), with
        the holder's identity in `<base>.pid` for the message a second process gets."""
        lock = FileLock(f"{base}.lock")
        holder_file = Path(f"{base}.pid")

        def who() -> str:
            holder = _holder(holder_file)
            return f"pid {holder['pid']} on {holder['host']}" if holder else "pid ?"

        try:
            lock.acquire(timeout=0)
        except Timeout:
            if wait_s <= 0:
                raise UserError(f"{self.path}: {busy.format(holder=who())}") from None
            print(f"[snowcat] {base.name}: held by {who()}; waiting up to {wait_s:.0f}s for it to exit", flush=True)
            try:
                lock.acquire(timeout=wait_s)
            except Timeout:
                raise UserError(f"{self.path}: {busy.format(holder=who())} (waited {wait_s:.0f}s)") from None
        try:
            atomic_write_json(holder_file, procid.identify())
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
                elif key == "error" and isinstance(value, str):
                    record[key] = scrub_text(value)  # exception text may quote a URL or a command line
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

    def mark_done(self, unit: Unit, metrics: dict, inputs: dict[str, str | None] | None = None) -> None:
        """Write metrics and manifest, then the DONE marker — last, atomically. `inputs` (from
        `input_digests`, taken when the unit started) is the lineage `stale_inputs` checks."""
        out = self.unit_dir(unit)
        atomic_write_json(out / "metrics.json", metrics)
        write_manifest(out, exclude=(DONE,))
        marker = {"manifest_sha256": sha256_file(out / "manifest.json"), "finished": now(), "inputs": inputs or {}}
        atomic_write_json(out / DONE, marker)

    # --- lineage -----------------------------------------------------------------------------

    def input_digests(self, dag: Dag, stage: str) -> dict[str, str | None]:
        """Per needed stage, one sha256 over its units' manifests (None while any unit is not done):
        the same digest provenance records as `inputs.<stage>.sha256`."""
        digests = {}
        for need in dag[stage].needs:
            done = all(self.is_done(u) for u in dag[need].units)
            digests[need] = provenance.inputs_state({need: self.stage_dir(need)}, self.path)[need]["sha256"] if done else None
        return digests

    def stale_inputs(self, dag: Dag, unit: Unit) -> list[str]:
        """Needed stages whose outputs are no longer the ones this done unit was computed from
        (re-run, deleted, or not done). A marker from before lineage was recorded has no `inputs`."""
        recorded = (read_json(self.unit_dir(unit) / DONE) or {}).get("inputs")
        if recorded is None:
            return []
        current = self.input_digests(dag, unit.stage)
        return [need for need in dag[unit.stage].needs if current[need] is None or recorded.get(need) != current[need]]

    def stale_stages(self, dag: Dag) -> dict[str, str]:
        """Done stages whose lineage no longer holds, with the reason: an input changed, or an
        upstream stage is itself stale or not done (its re-run will change what this one read)."""
        stale: dict[str, str] = {}
        for node in dag:  # topological order: needs are decided first
            if not all(self.is_done(u) for u in node.units):
                continue
            changed = sorted({need for u in node.units for need in self.stale_inputs(dag, u)})
            upstream = [need for need in node.needs if need in stale]
            if changed:
                stale[node.name] = f"input {', '.join(changed)} changed since it ran"
            elif upstream:
                stale[node.name] = f"upstream {', '.join(upstream)} is stale"
        return stale

    def set_aside(self, unit: Unit) -> Path:
        """Move a stale unit's outputs to `<run>/stale/` (not deleted: they may hold the only copy
        of a good checkpoint), so its re-run starts from scratch rather than resuming old state."""
        target = self.path / "stale" / f"{unit.key}.{dt.datetime.now():%Y%m%d-%H%M%S}"
        target.parent.mkdir(parents=True, exist_ok=True)
        self.clear_done(unit)
        os.replace(self.unit_dir(unit), target)
        return target

    def clear_done(self, unit: Unit) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.unit_dir(unit) / DONE).unlink()

    def metrics(self, unit: Unit) -> dict:
        return read_json(self.unit_dir(unit) / "metrics.json", {})

    # --- derived status ----------------------------------------------------------------------

    def stage_status(self, dag: Dag, stage: str, verify: bool = True) -> tuple[str, list[str]]:
        """(status, problems): DONE markers decide `done`/`modified`/`stale`; the state record the rest."""
        units = dag[stage].units
        done = [u for u in units if self.is_done(u)]
        if len(done) == len(units):
            problems = [p for u in done for p in (self.verify_unit(u) if verify else [])]
            if problems:
                return "modified", problems
            why = self.stale_stages(dag).get(stage)
            return ("stale", [f"{self.stage_dir(stage)}: {why}"]) if why else ("done", [])
        record = self.state()["stages"].get(stage, {})
        status = record.get("status", "pending")
        return (status if status != "done" else "failed"), []
