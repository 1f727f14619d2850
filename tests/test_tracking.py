"""Experiment trackers fed from the run directory, with the real libraries, offline: W&B offline runs
(read back from their .wandb files with W&B's own protobuf records), TensorBoard event files (read
with tensorboard's EventAccumulator), an MLflow file store (read with MLflow's client)."""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb.proto import wandb_internal_pb2 as pb

from snowcat.pipeline import cli, config, logscrub, scrub, tracking
from snowcat.pipeline.dag import Unit, build
from snowcat.pipeline.errors import UserError
from snowcat.pipeline.history import History
from snowcat.pipeline.rundir import RunDir
from snowcat.pipeline.runner import run_unit

# Built at run time so this file never holds a credential-shaped literal; W&B keys are 40 hex characters.
PLANTED_KEY = "".join("0123456789abcdef"[(7 * i + 3) % 16] for i in range(40))

CONFIG = """\
name: trk
seed: 3
executor: {kind: local, max_parallel: 1}
tracking: {sinks: [SINKS]}
stages:
  tasks:
    kind: tasks
    domains:
      closure: {count: 12, val_count: 4, difficulties: [1]}
  sft:
    kind: sft
    needs: [tasks]
    model: test-micro
    steps: 6
"""


def make_run(tmp_path: Path, sinks: str = "wandb, tensorboard, mlflow") -> RunDir:
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG.replace("SINKS", sinks))
    return RunDir.create(config.load(path), tmp_path / "run")


def record_steps(run: RunDir, steps: range, done: bool) -> list[dict]:
    """What the SFT trainer records per step (stages/train/loop.py MetricsLog): a line of
    metrics_history.jsonl in the unit's directory and a row of the run's history.h5."""
    out = run.unit_dir(Unit("sft"))
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"step": s, "loss": 2.0 / (s + 1), "lr": 1e-3 * s, "tok/s": 1000.0 + s, "phase": "train"} for s in steps]
    with (out / "metrics_history.jsonl").open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
            History(run.path).append("sft", row["step"], {k: v for k, v in row.items() if k not in ("step", "phase")})
    if done:
        (out / "weights.bin").write_bytes(b"w" * 64)
        run.mark_done(Unit("sft"), {"duration_s": 1.5, "steps": steps[-1], "val_greedy_pass@1/closure": 0.25}, {})
    return rows


def feed_all(run: RunDir) -> None:
    cfg = run.config()
    dag = build(cfg)
    tracking.after_unit(run, dag["sft"], Unit("sft"), config.typed(cfg), log=lambda line: None)


def fed_in_two_jobs(run: RunDir) -> list[dict]:
    """Steps 0-2, fed as a job preempted after them would, then 3-5 by its continuation; the rows."""
    rows = record_steps(run, range(0, 3), done=False)
    feed_all(run)
    rows += record_steps(run, range(3, 6), done=True)
    feed_all(run)
    return rows


# --- W&B offline ------------------------------------------------------------------------------


def wandb_records(path: Path) -> list:
    """The records of a .wandb file: W&B's LevelDB-style log (':W&B' header, 32 KiB blocks, chunks
    with a 7-byte header: crc, length, type) of its own protobuf `Record`s."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, out = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            out.append(pb.Record.FromString(buf))
            buf = b""
    return out


def wandb_history(records) -> dict[int, dict]:
    rows = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            rows[int(items.pop("_step"))] = {k: v for k, v in items.items() if not k.startswith("_")}
    return rows


def test_wandb_offline_run_per_unit_resumed_by_a_continuation_and_no_key_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_API_KEY", PLANTED_KEY)
    run = make_run(tmp_path, "wandb")
    first = record_steps(run, range(0, 3), done=False)  # preempted after step 2
    feed_all(run)
    rest = record_steps(run, range(3, 6), done=True)  # the continuation finished the unit
    feed_all(run)
    feed_all(run)  # nothing new: no third offline run

    root = run.path / "tracking" / "wandb" / "wandb"
    dirs = sorted(root.glob("offline-run-*"))
    assert len(dirs) == 2
    uid = tracking.wandb_id(run.run_id, "sft")
    assert all(d.name.endswith(uid) or d.name.rsplit("-", 1)[0].endswith(uid) for d in dirs)
    segments = []
    for d in dirs:
        (file,) = d.glob("*.wandb")
        records = wandb_records(file)
        (info,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert info.run_id == uid and info.project == "trk" and info.run_group == run.run_id and info.display_name == "sft"
        segments.append(wandb_history(records))
    by_dir_time = sorted(segments, key=min)
    for got, rows in zip(by_dir_time, (first, rest)):
        assert sorted(got) == [r["step"] for r in rows]
        for row in rows:
            assert got[row["step"]] == pytest.approx({k: v for k, v in row.items() if k not in ("step", "phase")})
    state = json.loads((run.path / "tracking/state/wandb/sft.json").read_text())
    (entry,) = state.values()
    assert entry["last_step"] == 5 and entry["wandb_id"] == uid and len(entry["dirs"]) == 2
    # the key was in the environment of every feed: nowhere in the run directory
    assert not [f for f in scrub.scan_tree(run.path, {"WANDB_API_KEY": PLANTED_KEY}) if f.kind.startswith("known")]

    # W&B's own command line reads both offline runs (a dry run: no network here)
    capsys.readouterr()
    assert cli.main(["sync", str(run.path), "--dry-run"]) == 0
    assert "Would sync 2 run(s)" in capsys.readouterr().out
    assert not (run.path / "tracking" / tracking.SYNCED).exists()


def test_snowcat_sync_calls_wandb_sync_once_per_offline_run_and_records_it(tmp_path, monkeypatch, capsys):
    run = make_run(tmp_path, "wandb")
    record_steps(run, range(0, 2), done=True)
    feed_all(run)
    fake = tmp_path / "wandb"
    log = tmp_path / "calls"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\necho synced\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(tracking, "wandb_command", lambda: [str(fake)])
    assert cli.main(["sync", str(run.path), "--project", "p"]) == 0
    calls = log.read_text().splitlines()
    assert len(calls) == 1 and calls[0].startswith("sync --project p ") and "offline-run-" in calls[0]
    record = json.loads((run.path / "tracking" / tracking.SYNCED).read_text())
    (synced,) = record["synced"]
    assert synced.startswith("tracking/wandb/wandb/offline-run-") and record["synced"][synced]["exit_code"] == 0
    assert cli.main(["sync", str(run.path)]) == 0  # all synced: wandb is not called again
    assert len(log.read_text().splitlines()) == 1
    assert "nothing to sync" in capsys.readouterr().out

    fake.write_text("#!/bin/sh\necho no network; exit 3\n")
    assert cli.main(["sync", str(run.path), "--all"]) == 1  # a failure is recorded, not marked synced
    record = json.loads((run.path / "tracking" / tracking.SYNCED).read_text())
    assert record["attempts"][-1]["exit_code"] == 3 and record["synced"][synced]["exit_code"] == 0


# --- TensorBoard ------------------------------------------------------------------------------


def test_tensorboard_event_files_hold_the_recorded_history(tmp_path):
    run = make_run(tmp_path, "tensorboard")
    rows = fed_in_two_jobs(run)
    logdir = run.path / "tracking" / "tensorboard" / "sft"
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 2  # one per feed, the same directory
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    history = History(run.path).read("sft")
    for tag in ("loss", "lr", "tok/s"):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == list(range(6)) == history["step"].tolist()
        np.testing.assert_allclose([e.value for e in events], history[tag], rtol=1e-6)  # float32 in the file
        assert [e.value for e in events] == pytest.approx([r[tag] for r in rows], rel=1e-6)
    (final,) = acc.Scalars("final/val_greedy_pass@1/closure")
    assert final.step == 5 and final.value == 0.25
    assert "snowcat/config" in acc.Tags()["tensors"]


# --- MLflow -----------------------------------------------------------------------------------


def test_mlflow_file_store_holds_the_metrics_and_a_continuation_appends_to_the_same_run(tmp_path, monkeypatch):
    run = make_run(tmp_path, "mlflow")
    rows = fed_in_two_jobs(run)
    store = run.path / "tracking" / "mlruns"
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only with it
    client = MlflowClient(tracking_uri=store.as_uri())
    experiment = client.get_experiment_by_name(run.run_id)
    (found,) = client.search_runs([experiment.experiment_id])
    rid = found.info.run_id
    assert found.info.run_name == "sft" and found.info.status == "FINISHED"
    assert found.data.tags["snowcat.unit_id"] == tracking.wandb_id(run.run_id, "sft")
    assert (
        found.data.tags["snowcat.manifest_sha256"]
        == json.loads((run.unit_dir(Unit("sft")) / "DONE").read_text())["manifest_sha256"]
    )
    assert found.data.params["config.model"] == "test-micro" and found.data.params["seed"] == "3"
    for tag in ("loss", "lr", "tok/s"):
        got = sorted((m.step, m.value) for m in client.get_metric_history(rid, tag))
        assert got == [(r["step"], pytest.approx(r[tag])) for r in rows]
    assert client.get_metric_history(rid, "final/val_greedy_pass_at_1/closure")[0].value == 0.25
    artefacts = json.loads((store / experiment.experiment_id / rid / "artifacts/snowcat/artefacts.json").read_text())
    assert set(artefacts["files"]) == {"weights.bin", "metrics.json", "metrics_history.jsonl"}


# --- the runner and the CLI -----------------------------------------------------------------------


def test_a_sink_that_raises_does_not_fail_the_stage(tmp_path, monkeypatch, capsys):
    run = make_run(tmp_path, "tensorboard, mlflow")

    def boom(self, rec, rows, state):
        raise RuntimeError("tracker down")

    monkeypatch.setattr(tracking.TensorboardSink, "write", boom)
    assert run_unit(run.path, "tasks") == 0  # a real stage unit, through the runner
    assert run.is_done(Unit("tasks")) and not run.verify_unit(Unit("tasks"))
    out = capsys.readouterr().out
    assert "tracking sink tensorboard failed (ignored" in out and "RuntimeError: tracker down" in out
    assert "tasks: mlflow: fed 0 step(s), final metrics" in out  # the other sink was still fed
    assert run.record("tasks")["status"] == "done"


def test_snowcat_track_back_fills_a_sink_from_the_run_directory(tmp_path, capsys):
    run = make_run(tmp_path, "wandb")  # the config chose W&B only
    record_steps(run, range(0, 4), done=True)
    assert cli.main(["track", str(run.path), "--to", "tensorboard"]) == 0
    assert "sft: tensorboard: fed 4 step(s) up to step 3, final metrics" in capsys.readouterr().out
    assert cli.main(["track", str(run.path), "--to", "tensorboard"]) == 0
    assert "sft: tensorboard: up to date (step 3)" in capsys.readouterr().out
    assert not (run.path / "tracking" / "wandb").exists()
    assert cli.main(["track", str(run.path), "--to", "mlflow", "--tracking-uri", "https://u:pw@example.invalid"]) == 2
    assert "--tracking-uri: holds a credential" in capsys.readouterr().err


# --- configuration ----------------------------------------------------------------------------


def test_tracking_config_problems_are_one_line_naming_the_key(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG.replace("SINKS", "wandb"))
    cfg = config.typed(config.load(path))
    assert cfg.tracking.sinks == ["wandb"] and cfg.tracking.wandb.mode == "offline" and cfg.tracking.mlflow.tracking_uri == ""
    with pytest.raises(
        UserError, match=r"^override 'tracking.sinks=\[wandb,comet\]': tracking.sinks\[1\]: unknown tracking sink 'comet'"
    ):
        config.load(path, ["tracking.sinks=[wandb,comet]"])
    with pytest.raises(UserError, match=r"tracking.mlflow.tracking_uri: 'mlruns' is neither an absolute path nor a URI"):
        config.load(path, ["tracking.mlflow.tracking_uri=mlruns"])
    slurm = ["executor.kind=slurm", "tracking.sinks=[mlflow]", "tracking.mlflow.tracking_uri=https://mlflow.example.org"]
    with pytest.raises(
        UserError, match=r"tracking.mlflow.tracking_uri: 'https://mlflow.example.org' is a server, but compute nodes"
    ):
        config.load(path, slurm, site="jsc-juwels-booster")
    with pytest.raises(UserError, match=r"tracking.wandb.mode: online, but compute nodes of site"):
        config.load(path, ["executor.kind=slurm", "tracking.wandb.mode=online"], site="jsc-juwels-booster")
    config.load(path, ["tracking.sinks=[mlflow]", "tracking.mlflow.tracking_uri=https://mlflow.example.org"])  # local: allowed

    real = config.importlib.util.find_spec
    monkeypatch.setattr(config.importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(
        UserError, match=r"tracking.sinks\[1\]: 'mlflow' needs the mlflow-skinny package, .*: pip install 'mlflow-skinny'"
    ):
        config.load(path, ["tracking.sinks=[tensorboard,mlflow]"])
    assert config.load_frozen(path) is not None  # a run made elsewhere still opens without it


def test_tracker_credentials_are_secret_in_logs_and_scans(tmp_path, monkeypatch, capfd):
    names = ["WANDB_API_KEY", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "DATABRICKS_TOKEN"]
    assert all(scrub.is_secret_name(n) for n in names)
    assert not scrub.is_secret_name("MLFLOW_TRACKING_URI") and not scrub.is_secret_name("WANDB_DIR")
    for n in names:
        monkeypatch.setenv(n, PLANTED_KEY[::-1] if n == "MLFLOW_TRACKING_TOKEN" else PLANTED_KEY)
    assert set(names) <= set(scrub.env_secrets())
    assert PLANTED_KEY not in scrub.scrub_text(f"wandb login {PLANTED_KEY}")
    with logscrub.scrubbed_output():
        os.system(f"echo key={PLANTED_KEY} token={PLANTED_KEY[::-1]}")
    out = capfd.readouterr().out
    assert PLANTED_KEY not in out and PLANTED_KEY[::-1] not in out and out.count(scrub.REDACTED) == 2
    (tmp_path / "leak.txt").write_text(f"x {PLANTED_KEY}\n")
    assert "known:WANDB_API_KEY" in {f.kind for f in scrub.scan_tree(tmp_path)}
