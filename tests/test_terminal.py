"""The CLI as a person meets it: on a terminal (a pseudo-terminal here), where rich draws live views
and colours. Every status renders, data with brackets is shown as it is, progress from inside a
stage is visible, Ctrl-C and `snowcat cancel` stop a run."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

import snowcat.pipeline.progress as progress_mod
from snowcat.pipeline import config as config_mod
from snowcat.pipeline import procid
from snowcat.pipeline.dag import Unit, build
from snowcat.pipeline.progress import STYLE, Progress
from snowcat.pipeline.rundir import RunDir
from snowcat.pipeline.unitprogress import PROGRESS_FILE, ProgressReporter

REPO = Path(__file__).resolve().parent.parent
STATUSES = ("done", "modified", "stale", "pending", "running", "submitted", "failed", "preempted", "cancelled")
BRACKETED = "ValueError: bad [/] closing [bold]tag[/bold] and [red"


def _tasks_stage(count: int = 20) -> str:
    return f"    kind: tasks\n    domains: {{closure: {{count: {count}, val_count: 4, difficulties: [1]}}}}\n"


def _every_status_run(tmp_path: Path) -> tuple[RunDir, object]:
    """A run with one stage in each status: done and modified really ran, the others are recorded."""
    cfg_path = tmp_path / "statuses.yaml"
    needs = {"stale": "    needs: [done]\n"}  # done's outputs change after stale read them
    cfg_path.write_text(
        "name: statuses\nexecutor: {kind: local}\nstages:\n"
        + "".join(f"  {s}:\n{needs.get(s, '')}{_tasks_stage()}" for s in STATUSES)
    )
    cfg = config_mod.load(cfg_path)
    run = RunDir.create(cfg, tmp_path / "run")
    for stage in ("done", "modified", "stale"):
        subprocess.run([sys.executable, "-m", "snowcat.stages", str(run.path), stage], cwd=REPO, check=True, capture_output=True)
    (run.stage_dir("modified") / "train.parquet").write_bytes(b"changed after it was done")
    (run.stage_dir("done") / "extra.txt").write_text("a re-run with another result")
    run.mark_done(Unit("done"), run.metrics(Unit("done")), {})
    me = procid.identify()  # a live process: the local executor's reconciliation keeps these records
    run.update_stage("running", status="running", executor="local", group=me, job_ids=[f"local:{me['pid']}"], attempts=1)
    run.update_stage("submitted", status="submitted", executor="local", group=me, job_ids=["4242_[0-3]"])
    run.update_stage("failed", status="failed", error=BRACKETED, attempts=2, job_ids=["local:1"])
    run.update_stage("preempted", status="preempted", attempts=1)
    run.update_stage("cancelled", status="cancelled")
    ProgressReporter(run.unit_dir(Unit("running")) / PROGRESS_FILE, "running")(3, 10, loss=0.5, **{"tok/s": 1900.0})
    return run, cfg


@pytest.mark.slow
def test_status_on_a_terminal_renders_every_status_and_bracketed_text(tmp_path, snowcat):
    run, _ = _every_status_run(tmp_path)
    code, screen = snowcat.terminal("status", run.path, columns=250)
    assert code == 0, screen
    for status in STATUSES:
        assert status in screen
    assert BRACKETED in screen  # the error text, literally
    assert "4242_[0-3]" in screen
    assert "running 3/10 steps · loss 0.5 · 1.9k tok/s" in screen
    record = snowcat.status(run.path)
    assert {name: s["status"] for name, s in record["stages"].items()} == {s: s for s in STATUSES}
    assert record["stages"]["running"]["progress"] == ["running 3/10 steps · loss 0.5 · 1.9k tok/s"]
    assert record["stages"]["done"]["progress"] == []


@pytest.mark.slow
def test_live_view_renders_every_status(tmp_path):
    run, cfg = _every_status_run(tmp_path)
    dag = build(cfg)
    view = Progress(run, dag, list(dag.order))
    console = Console(record=True, force_terminal=True, width=200)
    console.print(view._table())
    text = console.export_text()
    for status in STATUSES:
        assert status in text
    assert "3/10 steps" in text
    assert set(STATUSES) <= set(STYLE)  # every status has its colour


@pytest.mark.slow
def test_progress_lines_in_a_log_when_not_on_a_terminal(tmp_path, monkeypatch):
    run, cfg = _every_status_run(tmp_path)
    dag = build(cfg)
    log = Console(record=True, force_terminal=False, width=200)
    monkeypatch.setattr(progress_mod, "console", log)
    monkeypatch.setattr(progress_mod, "LOG_EVERY_S", 0)
    view = Progress(run, dag, list(dag.order))
    assert view.live is None
    view.refresh()
    view.refresh()  # unchanged progress is not repeated
    ProgressReporter(run.unit_dir(Unit("running")) / PROGRESS_FILE, "running")(4, 10, loss=0.25)
    view.refresh()
    lines = [line.strip() for line in log.export_text().splitlines()]
    assert lines == ["progress running 3/10 steps · loss 0.5 · 1.9k tok/s", "progress running 4/10 steps · loss 0.25"]


def _sft_config(tmp_path: Path, steps: int) -> Path:
    path = tmp_path / "sft.yaml"
    path.write_text(f"""\
name: tty
seed: 3
executor: {{kind: local, max_parallel: 1}}
stages:
  tasks:
{_tasks_stage(60)}  sft:
    kind: sft
    needs: [tasks]
    tokenizer_vocab_size: 300
    seq_len: 64
    batch_rows: 4
    steps: {steps}
    warmup_steps: 2
    save_every: 0
    threads: 1
    eval_tasks: 2
    eval_max_new_tokens: 4
""")
    return path


@pytest.mark.slow
def test_run_on_a_terminal_shows_stage_progress(tmp_path, snowcat):
    code, screen = snowcat.terminal("run", _sft_config(tmp_path, steps=40), "--run-dir", tmp_path / "run", timeout=600)
    assert code == 0, screen
    assert "/40 steps" in screen  # the live view showed SFT's own progress
    assert "run finished" in screen
    log = (tmp_path / "run" / "logs" / "sft.log").read_text()
    assert "[progress] sft 40/40 steps · loss" in log  # and the unit's log has the lines


def _wait_for(predicate, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


def _sft_running(run_dir: Path) -> bool:
    return (run_dir / "stages" / "sft" / PROGRESS_FILE).is_file()


@pytest.mark.slow
def test_ctrl_c_on_a_terminal_stops_the_run(tmp_path, snowcat):
    run_dir = tmp_path / "run"
    code, screen = snowcat.terminal(
        "run", _sft_config(tmp_path, steps=100000), "--run-dir", run_dir, interrupt_after="/100000 steps", timeout=600
    )
    assert code == 130, screen
    record = snowcat.status(run_dir)
    assert record["stages"]["sft"]["status"] == "cancelled"
    assert record["stages"]["tasks"]["status"] == "done"


@pytest.mark.slow
def test_cancel_on_a_terminal_stops_a_run_on_another(tmp_path, snowcat):
    run_dir = tmp_path / "run"
    result: dict = {}
    driver = threading.Thread(
        target=lambda: result.update(
            zip(
                ("code", "screen"),
                snowcat.terminal("run", _sft_config(tmp_path, steps=100000), "--run-dir", run_dir, timeout=600),
            )
        )
    )
    driver.start()
    _wait_for(lambda: _sft_running(run_dir))
    code, screen = snowcat.terminal("cancel", run_dir)
    assert code == 0, screen
    assert "cancelled: driver:" in screen
    driver.join(timeout=120)
    assert not driver.is_alive()
    assert result["code"] != 0, result["screen"]
    state = RunDir(run_dir).state()["stages"]
    assert state["sft"]["status"] == "cancelled"
    code, screen = snowcat.terminal("status", run_dir)
    assert code == 0 and "cancelled" in screen
