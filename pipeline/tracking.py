"""Experiment trackers (W&B, TensorBoard, MLflow), fed from the run directory.

The run directory stays the source of truth: a tracker is only ever fed what a unit recorded there
(its per-step `metrics_history.jsonl`, its `metrics.json`, the resolved config, its manifest's
hashes), after the unit's work is over — by the runner when a unit finishes or checkpoints before
the end of its job (any exception is logged and ignored: a tracker never fails a stage), or later by
`snowcat track RUN --to SINK`. What goes where (docs/tracking.md):

    <run>/tracking/wandb/wandb/offline-run-*/   W&B offline runs, one W&B run per unit (stable id);
                                                 uploaded by `snowcat sync RUN` (login node)
    <run>/tracking/tensorboard/<unit>/          TensorBoard event files, one directory per unit
    <run>/tracking/mlruns/                      MLflow file store (or the config's tracking_uri)
    <run>/tracking/state/<sink>/<unit>.json     the last step fed to each target: a later feed of
                                                 the same unit (a continuation) appends the rest
    <run>/tracking/synced.json                  what `snowcat sync` uploaded

Each step is fed once per target: rows a resumed stage replayed (history drops and rewrites them) are
not sent again. The tracker libraries are imported only inside the sinks (the CLI stays light).
No credential is ever written here: W&B and MLflow read theirs from the environment at upload time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import notify
from .config import tracking_package_problem, typed
from .dag import StageNode, Unit, build
from .errors import UserError
from .fsio import MANIFEST, atomic_write_json, read_json
from .rundir import DONE, RunDir, now
from .schema import TRACKING_SINKS, TrackingConfig
from .scrub import secret_kinds

TRACKING_DIR = "tracking"
HISTORY_FILE = "metrics_history.jsonl"
SYNCED = "synced.json"
MAX_FILES = 200  # artefact hashes sent to a tracker per unit (a sharded checkpoint has many files)


def tracking_dir(run: RunDir) -> Path:
    return run.path / TRACKING_DIR


def wandb_id(run_id: str, unit_key: str) -> str:
    """The W&B run id of a unit: the same for every feed of the unit (a requeue, a continuation,
    a back-fill), different for every run and unit."""
    return hashlib.sha256(f"{run_id}/{unit_key}".encode()).hexdigest()[:24]


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v == v  # NaN: not a value to plot


# --- what a unit recorded -------------------------------------------------------------------


@dataclass
class UnitRecord:
    """One unit's facts, read from the run directory alone."""

    run_id: str
    run_name: str
    key: str  # unit key: "sft", "gen[3]"
    stage: str
    kind: str
    done: bool
    history: list[dict] = field(default_factory=list)  # {"step": k, metric: value} (numbers only)
    final: dict = field(default_factory=dict)  # metrics.json (a done unit)
    config: dict = field(default_factory=dict)  # the unit's resolved config and the run's identity
    artefacts: dict[str, str] = field(default_factory=dict)  # manifest: relative path -> sha256
    manifest_sha256: str | None = None

    @property
    def last_step(self) -> int | None:
        return self.history[-1]["step"] if self.history else None


def read_history(path: Path) -> list[dict]:
    """The rows of a metrics_history.jsonl, numbers only; a torn last line (a killed writer) is left out."""
    rows: dict[int, dict] = {}
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            rec = json.loads(line)
            step = int(rec["step"])
        except (ValueError, KeyError, TypeError):
            continue
        rows[step] = {"step": step} | {k: float(v) for k, v in rec.items() if k != "step" and _is_number(v)}
    return [rows[s] for s in sorted(rows)]


def unit_record(run: RunDir, node: StageNode, unit: Unit, cfg) -> UnitRecord:
    out = run.unit_dir(unit)
    section = cfg.stages[node.name]
    config = {
        "run_id": run.run_id,
        "run_name": str(cfg.name),
        "seed": int(cfg.seed),
        "stage": node.name,
        "kind": node.kind,
        "unit": unit.key,
        "item": None if unit.index is None else node.items[unit.index],
        "config": dataclasses.asdict(section) if dataclasses.is_dataclass(section) else dict(section),
    }
    marker = read_json(out / DONE) or {}
    manifest = (read_json(out / MANIFEST) or {}).get("files", {}) if marker else {}
    return UnitRecord(
        run_id=run.run_id,
        run_name=str(cfg.name),
        key=unit.key,
        stage=node.name,
        kind=node.kind,
        done=bool(marker),
        history=read_history(out / HISTORY_FILE),
        final=run.metrics(unit) if marker else {},
        config=json.loads(json.dumps(config, default=str)),
        artefacts={rel: meta["sha256"] for rel, meta in sorted(manifest.items())},
        manifest_sha256=marker.get("manifest_sha256"),
    )


# --- the sinks ------------------------------------------------------------------------------


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Sink:
    """Writes one unit's new rows (steps after the last fed) and its final facts to one target."""

    name = ""

    def __init__(self, run: RunDir, settings: TrackingConfig):
        self.run, self.settings = run, settings

    @property
    def target(self) -> str:
        """Where this sink writes: the key of its feed state (another target starts from step 0)."""
        raise NotImplementedError

    def write(self, rec: UnitRecord, rows: list[dict], state: dict) -> dict:
        """Feed `rows` (and, when the unit is done, its final metrics); returns what to keep in the state."""
        raise NotImplementedError


class WandbSink(Sink):
    """One W&B run per unit, id `wandb_id(run id, unit key)`, resumed ("allow") by every later feed:
    offline (default), each feed is one offline directory under <run>/tracking/wandb/wandb/ that
    `snowcat sync` uploads into that same W&B run."""

    name = "wandb"

    @property
    def dir(self) -> Path:
        return tracking_dir(self.run) / "wandb"

    @property
    def target(self) -> str:
        w = self.settings.wandb
        return f"{w.mode}:{w.entity or ''}/{w.project or ''}"

    def write(self, rec: UnitRecord, rows: list[dict], state: dict) -> dict:
        import wandb  # noqa: PLC0415 (an optional tracker: imported only to feed it)

        w = self.settings.wandb
        self.dir.mkdir(parents=True, exist_ok=True)
        env = {
            "WANDB_MODE": w.mode,
            "WANDB_DIR": str(self.dir),
            "WANDB_CACHE_DIR": str(self.dir / ".cache"),  # not $HOME: compute nodes may not write there
            "WANDB_DATA_DIR": str(self.dir / ".data"),
            "WANDB_CONFIG_DIR": str(self.dir / ".config"),
            "WANDB_SILENT": "true",
        }
        config = rec.config | {"artefacts": _artefacts(rec)}
        with _environ(env):
            settings = wandb.Settings(console="off", save_code=False, disable_git=True, x_disable_stats=True, silent=True)
            run = wandb.init(
                project=w.project or rec.run_name,
                entity=w.entity,
                id=wandb_id(rec.run_id, rec.key),
                name=rec.key,
                group=rec.run_id,
                job_type=rec.kind,
                resume="allow",
                dir=str(self.dir),
                mode=w.mode,
                config=config,
                settings=settings,
            )
            try:
                for row in rows:
                    run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])
                if rec.done:
                    run.summary.update({f"final/{k}": v for k, v in rec.final.items() if _is_number(v)})
                    run.summary["snowcat/manifest_sha256"] = rec.manifest_sha256
                offline_dir = str(Path(run.dir).parent.relative_to(self.run.path)) if w.mode == "offline" else None
            finally:
                run.finish()
                wandb.teardown()
        return {"wandb_id": wandb_id(rec.run_id, rec.key), "dirs": [*state.get("dirs", []), offline_dir] if offline_dir else []}


class TensorboardSink(Sink):
    """Event files under <run>/tracking/tensorboard/<unit>/, written as torch's SummaryWriter writes
    them (tensorboard's own EventFileWriter, scalar values): one more file per feed, same directory."""

    name = "tensorboard"

    @property
    def target(self) -> str:
        return str(Path(TRACKING_DIR) / "tensorboard")

    def write(self, rec: UnitRecord, rows: list[dict], state: dict) -> dict:
        # an optional tracker: imported only to feed it
        from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2  # noqa: PLC0415
        from tensorboard.plugins.text import metadata as text_metadata  # noqa: PLC0415
        from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: PLC0415

        def text_pb(tag: str, text: str):  # the text plugin's summary (its own `pb` needs TensorFlow)
            tensor = tensor_pb2.TensorProto(
                dtype=types_pb2.DT_STRING, string_val=[text.encode()], tensor_shape=tensor_shape_pb2.TensorShapeProto()
            )
            meta = text_metadata.create_summary_metadata(display_name=tag, description="")
            return summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, metadata=meta, tensor=tensor)])

        logdir = tracking_dir(self.run) / "tensorboard" / rec.key
        logdir.mkdir(parents=True, exist_ok=True)
        writer = EventFileWriter(str(logdir))
        wall = time.time()

        def scalars(step: int, values: dict) -> None:
            value = [summary_pb2.Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items() if _is_number(v)]
            writer.add_event(event_pb2.Event(wall_time=wall, step=int(step), summary=summary_pb2.Summary(value=value)))

        try:
            if not state:  # the unit's first feed: its config
                writer.add_event(event_pb2.Event(wall_time=wall, step=0, summary=text_pb("snowcat/config", _md_json(rec.config))))
            for row in rows:
                scalars(row["step"], {k: v for k, v in row.items() if k != "step"})
            if rec.done:
                last = rec.last_step or 0
                scalars(last, {f"final/{k}": v for k, v in rec.final.items()})
                writer.add_event(
                    event_pb2.Event(wall_time=wall, step=last, summary=text_pb("snowcat/artefacts", _md_json(_artefacts(rec))))
                )
        finally:
            writer.close()
        return {"logdir": str(logdir.relative_to(self.run.path))}


_MLFLOW_BAD = re.compile(r"[^\w./\- :]")  # what MLflow accepts in a metric or param name


def mlflow_name(name: str) -> str:
    """A metric or param name MLflow accepts: "pass@1" -> "pass_at_1", other characters -> "_"."""
    return _MLFLOW_BAD.sub("_", name.replace("@", "_at_"))


class MlflowSink(Sink):
    """One MLflow run per unit (tag snowcat.unit_id = the W&B id), in the experiment named by the
    config (default: the run id), found again by that tag: a later feed appends to the same run."""

    name = "mlflow"

    def __init__(self, run: RunDir, settings: TrackingConfig, tracking_uri: str | None = None):
        super().__init__(run, settings)
        self.uri = tracking_uri or settings.mlflow.tracking_uri or (tracking_dir(run) / "mlruns").as_uri()
        if self.uri.startswith("/"):
            self.uri = Path(self.uri).as_uri()

    @property
    def target(self) -> str:
        return self.uri

    def write(self, rec: UnitRecord, rows: list[dict], state: dict) -> dict:
        from mlflow.entities import Metric, Param, RunTag  # noqa: PLC0415 (an optional tracker: imported only to feed it)
        from mlflow.tracking import MlflowClient  # noqa: PLC0415

        file_store = self.uri.startswith("file:")
        if file_store:
            Path(self.uri.removeprefix("file://")).mkdir(parents=True, exist_ok=True)
        # MLflow 3 keeps its file store behind this switch; on a shared filesystem it is the store that works
        with _environ({"MLFLOW_ALLOW_FILE_STORE": "true"} if file_store else {}):
            client = MlflowClient(tracking_uri=self.uri)
            experiment_name = self.settings.mlflow.experiment or rec.run_id
            experiment = client.get_experiment_by_name(experiment_name)
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(experiment_name)
            unit_id = wandb_id(rec.run_id, rec.key)
            found = client.search_runs([experiment_id], filter_string=f"tags.`snowcat.unit_id` = '{unit_id}'", max_results=1)
            if found:
                run_id = found[0].info.run_id
                client.update_run(run_id, status="RUNNING")
            else:
                tags = {
                    "snowcat.unit_id": unit_id,
                    "snowcat.run_id": rec.run_id,
                    "snowcat.unit": rec.key,
                    "snowcat.kind": rec.kind,
                }
                run_id = client.create_run(experiment_id, run_name=rec.key, tags=tags).info.run_id
                params = [Param(mlflow_name(k), str(v)[:6000]) for k, v in _flatten(rec.config).items()]
                for i in range(0, len(params), 100):  # MLflow's batch limit for params
                    client.log_batch(run_id, params=params[i : i + 100])
                client.log_dict(run_id, rec.config, "snowcat/config.json")
            ms = int(time.time() * 1000)
            metrics = [Metric(mlflow_name(k), float(v), ms, row["step"]) for row in rows for k, v in row.items() if k != "step"]
            if rec.done:
                last = rec.last_step or 0
                metrics += [Metric(mlflow_name(f"final/{k}"), float(v), ms, last) for k, v in rec.final.items() if _is_number(v)]
                client.log_dict(run_id, _artefacts(rec), "snowcat/artefacts.json")
            for i in range(0, len(metrics), 1000):  # MLflow's batch limit for metrics
                client.log_batch(run_id, metrics=metrics[i : i + 1000])
            if rec.done:
                client.set_tag(run_id, "snowcat.manifest_sha256", str(rec.manifest_sha256))
                client.log_batch(run_id, tags=[RunTag("snowcat.done", "true")])
            client.set_terminated(run_id, status="FINISHED" if rec.done else "KILLED")
        return {"mlflow_run_id": run_id, "experiment_id": experiment_id}


SINKS: dict[str, type[Sink]] = {"wandb": WandbSink, "tensorboard": TensorboardSink, "mlflow": MlflowSink}
assert tuple(SINKS) == TRACKING_SINKS


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out |= _flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return {prefix: obj}


def _artefacts(rec: UnitRecord) -> dict:
    files = dict(list(rec.artefacts.items())[:MAX_FILES])
    return {"manifest_sha256": rec.manifest_sha256, "files": files, "files_total": len(rec.artefacts)}


def _md_json(obj: Any) -> str:
    return "```\n" + json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n```"


# --- feeding ----------------------------------------------------------------------------------


def _state_path(run: RunDir, sink: str, unit_key: str) -> Path:
    return tracking_dir(run) / "state" / sink / f"{unit_key}.json"


def feed(sink: Sink, rec: UnitRecord) -> str:
    """Feed one unit's rows after the last step this target has, and its final facts once; returns a
    line saying what was fed. Exceptions are the caller's (the runner ignores them)."""
    path = _state_path(sink.run, sink.name, rec.key)
    states = read_json(path, {}) or {}
    state = states.get(sink.target, {})
    last = state.get("last_step")
    rows = [r for r in rec.history if last is None or r["step"] > last]
    final_fed = state.get("final_fed") == rec.manifest_sha256 and rec.done
    if state and not rows and (final_fed or not rec.done):
        return f"{rec.key}: {sink.name}: up to date (step {last})"
    kept = sink.write(rec, rows, state)
    new_last = rows[-1]["step"] if rows else last
    states[sink.target] = (
        state | kept | {"last_step": new_last, "final_fed": rec.manifest_sha256 if rec.done else None, "fed": now()}
    )
    atomic_write_json(path, states)
    what = f"{len(rows)} step(s)" + (f" up to step {new_last}" if rows else "") + (", final metrics" if rec.done else "")
    return f"{rec.key}: {sink.name}: fed {what}"


def make_sink(name: str, run: RunDir, settings: TrackingConfig, tracking_uri: str | None = None) -> Sink:
    if name == "mlflow":
        return MlflowSink(run, settings, tracking_uri)
    return SINKS[name](run, settings)


def after_unit(run: RunDir, node: StageNode, unit: Unit, cfg, log=print) -> None:
    """The runner's hook, when a unit finished or checkpointed: feed every configured sink. Never
    raises: a tracker that fails is logged (one line) and ignored."""
    try:
        settings = cfg.tracking
        if not settings.sinks:
            return
        rec = unit_record(run, node, unit, cfg)
    except Exception as e:  # noqa: BLE001 (a tracker must never fail a stage)
        log(f"[snowcat] {unit.key}: tracking skipped: {type(e).__name__}: {e}")
        return
    for name in settings.sinks:
        try:
            log(f"[snowcat] {feed(make_sink(name, run, settings), rec)}")
        except Exception as e:  # noqa: BLE001 (a tracker must never fail a stage)
            text = " ".join(str(e).split())[:300]
            log(
                f"[snowcat] {unit.key}: tracking sink {name} failed (ignored; `snowcat track` back-fills it): {type(e).__name__}: {text}"
            )


# --- the commands -----------------------------------------------------------------------------


def _check_uri(uri: str | None) -> None:
    if uri and secret_kinds(uri, high_entropy=False):
        raise UserError("--tracking-uri: holds a credential; pass it through the environment (MLFLOW_TRACKING_PASSWORD/TOKEN)")


def cmd_track(args) -> int:
    run = RunDir.open(args.run)
    cfg = run.config()
    run_cfg = typed(cfg)
    sinks = list(args.to or run_cfg.tracking.sinks)
    if not sinks:
        raise UserError(f"{run.path}: the run's config chooses no tracker (tracking.sinks); name one with --to")
    problem = tracking_package_problem(sinks, "--to")
    if problem is not None:
        raise UserError(f"{problem[0]}: {problem[1]}")
    _check_uri(args.tracking_uri)
    dag = build(cfg)
    if args.stage and args.stage not in dag.nodes:
        raise UserError(f"--stage: no stage {args.stage!r} in this run")
    failed = 0
    for node in dag:
        if args.stage and node.name != args.stage:
            continue
        for unit in node.units:
            out = run.unit_dir(unit)
            if not (out / HISTORY_FILE).is_file() and not (out / DONE).is_file():
                continue  # nothing recorded yet
            try:
                with run.unit_lock(unit):  # not a unit being run: its runner feeds it when it ends
                    rec = unit_record(run, node, unit, run_cfg)
                    for name in sinks:
                        try:
                            print(feed(make_sink(name, run, run_cfg.tracking, args.tracking_uri), rec), flush=True)
                        except Exception as e:  # noqa: BLE001 (one line per failure; the others go on)
                            failed += 1
                            print(f"{unit.key}: {name}: failed: {type(e).__name__}: {' '.join(str(e).split())[:300]}", flush=True)
            except UserError:
                print(f"{unit.key}: being run; its runner feeds it when it ends", flush=True)
    return 1 if failed else 0


def wandb_command() -> list[str]:
    """W&B's own command line, from the environment snowcat runs in."""
    exe = Path(sys.executable).parent / "wandb"
    if exe.is_file():
        return [str(exe)]
    found = shutil.which("wandb")
    if found is None:
        raise UserError("snowcat sync needs W&B's command line: pip install wandb")
    return [found]


def cmd_sync(args) -> int:
    """Upload the run's offline W&B runs with `wandb sync` (login node: it needs the network and the
    user's W&B key from the environment or ~/.netrc) and record what was uploaded in the run."""
    run = RunDir.open(args.run)
    root = tracking_dir(run) / "wandb" / "wandb"
    record_path = tracking_dir(run) / SYNCED
    record = read_json(record_path, {}) or {}
    synced = record.setdefault("synced", {})
    dirs = sorted(p for p in root.glob("offline-run-*") if p.is_dir()) if root.is_dir() else []
    todo = [p for p in dirs if args.all or str(p.relative_to(run.path)) not in synced]
    if not todo:
        print(
            f"nothing to sync: {len(dirs)} offline W&B run(s) in {root}, all synced before"
            if dirs
            else f"no offline W&B runs in {root}"
        )
        return 0
    opts = (["--dry-run"] if args.dry_run else []) + (["--project", args.project] if args.project else [])
    opts += ["--entity", args.entity] if args.entity else []
    cmd = [*wandb_command(), "sync", *opts, *(str(p) for p in todo)]
    print(f"wandb sync of {len(todo)} offline run(s) from {root}", flush=True)
    proc = subprocess.run(cmd, cwd=run.path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(proc.stdout, end="", flush=True)
    if args.dry_run:
        return proc.returncode
    entry = {"at": now(), "exit_code": proc.returncode}
    if proc.returncode == 0:
        for p in todo:
            synced[str(p.relative_to(run.path))] = entry
    record.setdefault("attempts", []).append(entry | {"dirs": len(todo)})
    atomic_write_json(record_path, record)
    if proc.returncode != 0:
        print(f"wandb sync failed (exit {proc.returncode}); nothing recorded as synced: run it again", file=sys.stderr)
        return 1
    print(f"synced {len(todo)} offline run(s); recorded in {record_path}")
    return 0


def cmd_sync_and_notify(args) -> int:
    """`snowcat sync`: the upload, then the config's notifications (both need the login node's network)."""
    code = cmd_sync(args)
    if not args.dry_run:
        notify.quietly(RunDir.open(args.run))
    return code


def add_track_arguments(p) -> None:
    p.add_argument("run")
    p.add_argument(
        "--to", action="append", choices=TRACKING_SINKS, help="a sink (repeatable; default: the config's tracking.sinks)"
    )
    p.add_argument("--stage", help="only this stage's units")
    p.add_argument(
        "--tracking-uri", help="MLflow: this tracking URI instead of the config's (e.g. a server, from the login node)"
    )


def add_sync_arguments(p) -> None:
    p.add_argument("run")
    p.add_argument("--dry-run", action="store_true", help="show what wandb sync would upload; record nothing")
    p.add_argument("--all", action="store_true", help="also the offline runs recorded as synced before")
    p.add_argument("--project", help="W&B project to upload into (default: the one each run was written with)")
    p.add_argument("--entity", help="W&B entity (default: the key's default entity)")
