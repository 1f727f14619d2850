"""The run directory: the single source of truth of a run.

    <run>/config.yaml           the resolved config, frozen at creation
    <run>/run.json              run id, creation time, origin
    <run>/state/                per-stage and per-unit records: status, attempts, job ids, times
                                (the executor's view), one small file per record and writer:
                                state/executor/<key>.json (driver, status, cancel) and
                                state/unit/<key>.json (the unit's own runner); `RunDir.state()`
                                assembles them (and an older run's state.json) into one dict
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
import time
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
    MANIFEST,
    atomic_write_json,
    atomic_write_text,
    check_stats,
    file_stats,
    make_temp_dir,
    read_json,
    sha256_bytes,
    sha256_file,
    verify_manifest,
    write_manifest,
)
from .scrub import scrub_text
from .sweep import unit_path

DONE = "DONE"
STATUSES = ("pending", "submitted", "running", "done", "failed", "cancelled", "modified", "stale")
NEW_RECORD = {"status": "pending", "attempts": 0, "job_ids": []}  # what a record says before its first field is set
STATE = "state"  # <run>/state/{executor,unit}/<key>.json
LEGACY_STATE = "state.json"  # one file for every record, written by snowcat before per-unit records; read only

# (run path, unit key) of every unit whose lock (rank 0) this process holds: it alone writes that
# unit's own part of its record (state/unit/<key>.json), without any other lock.
_OWNED: set[tuple[str, str]] = set()


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def new_run_id(name: str) -> str:
    return f"{name}-{dt.datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def _is_record(name: str) -> bool:
    return name.endswith(".json") and not name.startswith(".")  # not a writer's temp file


def _holder(path: Path) -> dict | None:
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) and "pid" in holder else None


class RunDir:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).resolve()
        self._legacy_state: dict | None = None

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
            owned = {(str(self.path), unit.key)} if rank == 0 else set()
            _OWNED.update(owned)
            try:
                yield
            finally:
                _OWNED.difference_update(owned)

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
    #
    # A record (one per unit key, and one per fan-out stage) is assembled from two small files, each
    # with a single kind of writer, so that no writer rewrites anything but its own few hundred bytes:
    #   state/unit/<key>.json      the unit's own runner (rank 0, holding the unit's lock): no other lock
    #   state/executor/<key>.json  everyone else (driver, `status` reconciling with sacct, `cancel`,
    #                              a job recording its continuation): read-modify-write under .state.lock,
    #                              taken only when the write changes something
    # Each file keeps, per field, the time it was set; the newer value wins. A writer stamps after
    # the newest stamp it has read, so a write made after reading another is ordered after it even
    # across nodes whose clocks disagree. An older run's state.json is read as the oldest layer.

    def _part(self, part: str, key: str) -> Path:
        return self.path / STATE / part / f"{key}.json"

    @staticmethod
    def _read_part(path: Path) -> dict:
        try:
            data = json.loads(path.read_text())
            return {"record": dict(data["record"]), "set_ns": dict(data.get("set_ns") or {})}
        except FileNotFoundError:
            return {"record": {}, "set_ns": {}}
        except (ValueError, KeyError, TypeError):  # damaged by hand: advisory state, never a crash
            return {"record": {}, "set_ns": {}}

    def _legacy(self) -> dict:
        """An older run's state.json (read once: nothing writes it any more), {} for a run without one."""
        if self._legacy_state is None:
            try:
                data = read_json(self.path / LEGACY_STATE, {})
            except ValueError:
                data = {}
            self._legacy_state = data if isinstance(data, dict) else {}
        return self._legacy_state

    @staticmethod
    def _merge(layers: list[dict]) -> tuple[dict, int]:
        """(record, newest stamp): per field the value set last; later layers win ties."""
        values: dict = {}
        stamps: dict[str, int] = {}
        for layer in layers:
            for field, value in layer["record"].items():
                stamp = int(layer["set_ns"].get(field, -1))
                if field not in stamps or stamp >= stamps[field]:
                    values[field], stamps[field] = value, stamp
        return values, max(stamps.values(), default=-1)

    def _layers(self, key: str, legacy: dict | None = None, present: dict[str, set] | None = None) -> list[dict]:
        """The legacy record, the executor's part, the unit's part; `present`: the part files known to
        exist (from a directory listing), so that absent ones are not opened."""
        legacy = self._legacy() if legacy is None else legacy
        old = (legacy.get("stages") or {}).get(key)
        empty = {"record": {}, "set_ns": {}}
        parts = [
            self._read_part(self._part(part, key)) if present is None or key in present[part] else empty
            for part in ("executor", "unit")
        ]
        return [{"record": dict(old) if isinstance(old, dict) else {}, "set_ns": {}}, *parts]

    def record(self, key: str) -> dict:
        """One stage's or unit's record ({} if nothing was ever recorded), without reading the others."""
        values, _ = self._merge(self._layers(key))
        return NEW_RECORD | values if values else {}

    def record_stamps(self, key: str) -> dict[str, int]:
        """When each field of one record was last set, in ns since the epoch (the writer's clock):
        finer than the ISO seconds `started`/`ended` hold (`snowcat plan --compare` times jobs of a
        few seconds with it)."""
        stamps: dict[str, int] = {}
        for layer in self._layers(key):
            for field in layer["record"]:
                stamp = int(layer["set_ns"].get(field, -1))
                stamps[field] = max(stamps.get(field, -1), stamp)
        return {f: s for f, s in stamps.items() if s >= 0}

    def state(self) -> dict:
        """Every record, as one dict: {"stages": {key: record}} (plus fields set by `update_run`)."""
        legacy = self._legacy()
        present: dict[str, set] = {}
        for part in ("executor", "unit"):
            try:
                present[part] = {e.name[: -len(".json")] for e in os.scandir(self.path / STATE / part) if _is_record(e.name)}
            except FileNotFoundError:
                present[part] = set()
        stages = {}
        for key in sorted(set((legacy.get("stages") or {}).keys()).union(*present.values())):
            values, _ = self._merge(self._layers(key, legacy, present))
            if values:
                stages[key] = NEW_RECORD | values
        run_fields = {k: v for k, v in legacy.items() if k != "stages"} | (read_json(self.path / STATE / "run.json", {}) or {})
        return run_fields | {"stages": stages}

    def update_stage(self, stage: str, **fields: Any) -> dict:
        """Set fields of one record (a unit key or a stage name): `job_ids` are added to those recorded,
        `error` text is scrubbed. Only the writer's own small file is rewritten, and only if a value
        changes. Returns the whole record."""
        if (str(self.path), stage) in _OWNED:
            return self._update("unit", stage, fields)  # the unit's runner: the only writer of its part
        unchanged = self._update("executor", stage, fields, write=False)
        if unchanged is not None:
            return unchanged
        with self._state_lock():
            return self._update("executor", stage, fields)

    def _update(self, part: str, key: str, fields: dict, write: bool = True) -> dict | None:
        layers = self._layers(key)
        current, newest = self._merge(layers)
        record = NEW_RECORD | current
        changed = {}
        for field, value in fields.items():
            if field == "job_ids":
                value = list(dict.fromkeys(record.get("job_ids", []) + list(value)))
            elif field == "error" and isinstance(value, str):
                value = scrub_text(value)  # exception text may quote a URL or a command line
            value = json.loads(json.dumps(value, default=str))  # as it reads back
            if field not in record or record[field] != value:
                changed[field] = value
        if not changed:
            return record
        if not write:
            return None
        mine = layers[2] if part == "unit" else layers[1]
        stamp = max(time.time_ns(), newest + 1)
        mine["record"].update(changed)
        mine["set_ns"].update(dict.fromkeys(changed, stamp))
        atomic_write_json(self._part(part, key), mine)
        return record | changed

    def update_run(self, **fields: Any) -> None:
        with self._state_lock():
            path = self.path / STATE / "run.json"
            atomic_write_json(path, (read_json(path, {}) or {}) | fields)

    # --- units -----------------------------------------------------------------------------

    def stage_dir(self, stage: str) -> Path:
        return self.path / "stages" / stage

    def unit_dir(self, unit: Unit) -> Path:
        return unit_path(self.stage_dir(unit.stage), unit.index)

    def log_path(self, unit: Unit) -> Path:
        return self.path / "logs" / f"{unit.key}.log"

    def is_done(self, unit: Unit) -> bool:
        return (self.unit_dir(unit) / DONE).is_file()

    def verify_unit(self, unit: Unit, full: bool = True) -> list[str]:
        """Problems with a done unit's outputs (empty: they are exactly what was recorded). `full`
        re-hashes every file against the manifest; otherwise only sizes and mtimes are compared with
        those the DONE marker recorded at completion (`status`: no content read, so an in-place change
        that keeps both is not seen; `audit`, `resume` and the runner re-hash). A marker from before
        sizes and mtimes were recorded is always re-hashed."""
        out = self.unit_dir(unit)
        marker = read_json(out / DONE)
        if marker is None:
            return [f"{out / DONE}: missing"]
        if not full and isinstance(marker.get("stat"), dict) and MANIFEST in marker["stat"]:
            return check_stats(out, marker["stat"], exclude=(DONE,))
        manifest = out / MANIFEST
        if not manifest.is_file() or sha256_file(manifest) != marker.get("manifest_sha256"):
            return [f"{manifest}: does not match the DONE marker"]
        return verify_manifest(out, exclude=(DONE,))

    def mark_done(self, unit: Unit, metrics: dict, inputs: dict[str, str | None] | None = None) -> None:
        """Write metrics and manifest, then the DONE marker — last, atomically. `inputs` (from
        `input_digests`, taken when the unit started) is the lineage `stale_inputs` checks; `stat`
        (size and mtime of every file, the manifest's included) is what `status` compares."""
        out = self.unit_dir(unit)
        atomic_write_json(out / "metrics.json", metrics)
        files = write_manifest(out, exclude=(DONE,))
        marker = {
            "manifest_sha256": sha256_file(out / MANIFEST),
            "finished": now(),
            "inputs": inputs or {},
            "stat": file_stats(out, [*files, MANIFEST]),
        }
        atomic_write_json(out / DONE, marker)

    # --- lineage -----------------------------------------------------------------------------

    def input_digests(self, dag: Dag, stage: str, full: bool = True) -> dict[str, str | None]:
        """Per needed stage, one sha256 over its units' manifests (None while any unit is not done):
        the same digest provenance records as `inputs.<stage>.sha256`. `full` hashes the manifests;
        otherwise each manifest's hash is taken from its DONE marker where the manifest's size and
        mtime are still those recorded there (`status`: nothing hashed)."""
        digests = {}
        for need in dag[stage].needs:
            units = dag[need].units
            if not all(self.is_done(u) for u in units):
                digests[need] = None
            elif full:
                digests[need] = provenance.inputs_state({need: self.stage_dir(need)}, self.path)[need]["sha256"]
            else:  # as provenance.inputs_state: {manifest path relative to the stage dir: sha256}
                hashes = {
                    str(self.unit_dir(u).joinpath(MANIFEST).relative_to(self.stage_dir(need))): self._manifest_sha256(u)
                    for u in units
                }
                digests[need] = sha256_bytes(json.dumps(hashes, sort_keys=True).encode())
        return digests

    def _manifest_sha256(self, unit: Unit) -> str | None:
        out = self.unit_dir(unit)
        if not (out / MANIFEST).is_file():
            return None  # its stage shows `modified`; this digest then matches no recorded one
        marker = read_json(out / DONE) or {}
        recorded = (marker.get("stat") or {}).get(MANIFEST)
        if recorded and marker.get("manifest_sha256") and not check_stats(out, {MANIFEST: recorded}, unrecorded=False):
            return marker["manifest_sha256"]
        return sha256_file(out / MANIFEST)

    def stale_inputs(self, dag: Dag, unit: Unit, current: dict[str, str | None] | None = None) -> list[str]:
        """Needed stages whose outputs are no longer the ones this done unit was computed from
        (re-run, deleted, or not done). A marker from before lineage was recorded has no `inputs`.
        `current`: this stage's `input_digests`, when the caller has them already."""
        recorded = (read_json(self.unit_dir(unit) / DONE) or {}).get("inputs")
        if recorded is None:
            return []
        current = self.input_digests(dag, unit.stage) if current is None else current
        return [need for need in dag[unit.stage].needs if current[need] is None or recorded.get(need) != current[need]]

    def stale_stages(self, dag: Dag, full: bool = True) -> dict[str, str]:
        """Done stages whose lineage no longer holds, with the reason: an input changed, or an
        upstream stage is itself stale or not done (its re-run will change what this one read).
        `full`: see `input_digests`."""
        stale: dict[str, str] = {}
        for node in dag:  # topological order: needs are decided first
            if not all(self.is_done(u) for u in node.units):
                continue
            current = self.input_digests(dag, node.name, full)
            changed = sorted({need for u in node.units for need in self.stale_inputs(dag, u, current)})
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

    def stage_status(self, dag: Dag, stage: str, verify: bool | str = True) -> tuple[str, list[str]]:
        """(status, problems): DONE markers decide `done`/`modified`/`stale`; the state record the rest.
        `verify`: True re-hashes every output and the manifests lineage is computed from; "stat"
        compares sizes and mtimes with those recorded at completion and hashes nothing (`status`);
        False skips the outputs (lineage as with "stat")."""
        units = dag[stage].units
        done = [u for u in units if self.is_done(u)]
        if len(done) == len(units):
            problems = [p for u in done for p in (self.verify_unit(u, full=verify is True) if verify else [])]
            if problems:
                return "modified", problems
            why = self.stale_stages(dag, full=verify is True).get(stage)
            return ("stale", [f"{self.stage_dir(stage)}: {why}"]) if why else ("done", [])
        status = self.record(stage).get("status", "pending")
        return (status if status != "done" else "failed"), []
