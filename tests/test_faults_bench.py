"""The fault campaign's judgement (benchmarks/faults.py) on real run directories: what it counts as
torn, lost, a mismatch or a leftover, and what as a match; the Slurm part's (benchmarks/faults_slurm.py)
way of telling a fault's jobs apart and of counting two jobs of one unit, and one whole Slurm fault."""

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from snowcat.benchmarks import faults, faults_slurm
from snowcat.pipeline.fsio import sha256_file
from tests.conftest import Snowcat, write_config

SMALL = """
name: small
seed: 5
stages:
  tasks:
    kind: tasks
    domains:
      closure: {count: 200, val_count: 20, difficulties: [1, 2]}
  more:
    kind: tasks
    needs: [tasks]
    domains:
      arith: {count: 100, val_count: 10, difficulties: [2]}
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path, Snowcat]:
    """Two uninterrupted runs of the same config in different directories."""
    root = tmp_path_factory.mktemp("faults")
    cli = Snowcat(root)
    config = write_config(root / "small.yaml", SMALL)
    cli("run", config, "--run-dir", root / "a", check=True)
    cli("run", config, "--run-dir", root / "b", check=True)
    return root / "a", root / "b", cli


def _copy(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(run, dst, symlinks=True)
    return dst


@pytest.mark.slow
def test_two_runs_match_and_a_changed_table_is_a_mismatch(runs, tmp_path):
    a, b, _ = runs
    ref = faults.fingerprint(a)
    assert set(ref) == {"tasks", "more"} and "train.parquet" in ref["tasks"]
    assert faults.compare(ref, faults.fingerprint(b)) == []  # durations and paths differ, nothing else
    c = _copy(b, tmp_path)
    with open(c / "stages" / "more" / "train.parquet", "ab") as f:
        f.write(b"x")
    assert faults.compare(ref, faults.fingerprint(c, b)) == ["more/train.parquet: differs"]


@pytest.mark.slow
def test_torn_json_is_torn_and_a_leftover_is_a_leftover(runs, tmp_path):
    a, _, _ = runs
    assert faults.torn_files(a) == [] and faults.leftovers(a) == []
    c = _copy(a, tmp_path)
    metrics = c / "stages" / "tasks" / "metrics.json"
    metrics.write_text(metrics.read_text()[:20])
    (c / "stages" / "more" / ".train.parquet.x1.tmp").write_bytes(b"half")  # a temp file: not torn, left over
    torn = faults.torn_files(c)
    assert "stages/tasks/metrics.json: JSONDecodeError" in torn
    assert any(t.startswith("unit tasks:") and "metrics.json" in t for t in torn)  # its unit no longer verifies
    assert not any("more" in t for t in torn)
    assert faults.leftovers(c) == ["stages/more/.train.parquet.x1.tmp"]
    assert faults.torn_files(c, skip=frozenset({metrics})) == []  # what a fault damaged on purpose


def _campaign(reference: Path) -> faults.Campaign:
    camp = faults.Campaign(argparse.Namespace(timeout=120.0, retries=2), reference.parent, Path("unused.yaml"))
    camp.refs["main"] = faults.Reference(Path("unused.yaml"), reference, faults.fingerprint(reference))
    return camp


@pytest.mark.slow
def test_a_rerun_stage_is_lost_unless_the_fault_damaged_it(runs, tmp_path):
    a, _, cli = runs
    c = _copy(a, tmp_path)
    before = faults.done_units(c)
    (c / "stages" / "more" / "DONE").unlink()
    cli("resume", c, check=True)  # the pipeline re-runs `more`

    lost = faults.Fault("delete_done", 0, tmp_path, c, done_before=before)
    _campaign(a).verdict(lost)
    assert lost.problems["lost"] == ["more: done before the fault, re-run after"]
    assert lost.problems["mismatches"] == [] and lost.problems["torn"] == []

    handled = faults.Fault("delete_done", 0, tmp_path, c, done_before=before, exempt={"more"})
    _campaign(a).verdict(handled)
    assert not any(handled.problems.values())


def test_a_damaged_output_left_in_place_is_undetected_and_a_mismatch(runs, tmp_path):
    a, _, _ = runs
    c = _copy(a, tmp_path)
    target = c / "stages" / "tasks" / "val.parquet"
    target.write_bytes(b"")
    f = faults.Fault(
        "corrupt_output",
        0,
        tmp_path,
        c,
        done_before=faults.done_units(c),
        exempt={"tasks"},
        remedy=True,
        damaged={target: sha256_file(target)},
    )
    _campaign(a).verdict(f)
    assert f.problems["mismatches"] == ["tasks/val.parquet: differs"]
    assert f.problems["undetected"] == ["stages/tasks/val.parquet: still damaged, yet resume reported success"]
    assert f.problems["torn"] == []  # the fault's own damage is not counted as torn by the pipeline
    # the same damage from no fault of the campaign's: a torn file
    g = faults.Fault("kill_driver", 1, tmp_path, c, done_before=faults.done_units(c))
    _campaign(a).verdict(g)
    assert any("val.parquet" in t for t in g.problems["torn"]) and g.problems["undetected"] == []


def test_bad_arguments_exit_2(capsys):
    assert faults.main(["--kinds", "kill_driver,nope"]) == 2
    assert "unknown fault kind(s) nope" in capsys.readouterr().err
    assert faults.main(["--faults", "0"]) == 2
    assert faults.main(["--root", str(faults.REPO / "x")]) == 2
    assert faults.main(["--slurm", "--kinds", "kill_driver"]) == 2  # a local kind: refused before the cluster is touched
    assert "unknown fault kind(s) kill_driver; known: kill_job_process" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["faults-local.json", "faults-slurm.json"])
def test_the_docs_quote_the_committed_results(name):
    result = json.loads((faults.REPO / "benchmarks" / "results" / name).read_text())
    assert not result["partial"] and result["part"] == name.split("-")[1].split(".")[0]
    assert result["totals"]["runs"] >= (200 if result["part"] == "local" else 20)
    line = faults.quote(result)
    for doc in ("docs/faults.md", "benchmarks/results/README.md"):
        assert line in " ".join((faults.REPO / doc).read_text().split()), (doc, line)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_volatile_fields_by_schema_are_left_out_and_named_vocabularies_are_not(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, secs, token in [(a, 0.25, 7), (b, 0.21, 7)]:
        _write(d / "metrics.json", json.dumps({"loss": 1.5, "duration_s": secs, "path": f"{d}/x"}))
        _write(d / "README.md", f"---\nsnowcat:\n  shards:\n    s0: {{rows: 8, seconds: {secs}}}\n---\n\n| s0 | 8 |\n")
        _write(d / "tokenizer.json", json.dumps({"model": {"vocab": {"a": 1, "s": token}}}))
    seen: dict[str, set[str]] = {}
    for name in ("metrics.json", "README.md", "tokenizer.json"):
        assert faults.normalized(a / name, (str(a),), seen) == faults.normalized(b / name, (str(b),)), name
    assert seen == {"metrics.json": {"duration_s"}, "README.md": {"seconds"}}  # the vocabulary's "s" is a token
    _write(b / "tokenizer.json", json.dumps({"model": {"vocab": {"a": 1, "s": 8}}}))
    _write(b / "README.md", "---\nsnowcat:\n  shards:\n    s0: {rows: 9, seconds: 0.2}\n---\n\n| s0 | 8 |\n")
    for name in ("tokenizer.json", "README.md"):
        assert faults.normalized(a / name, (str(a),)) != faults.normalized(b / name, (str(b),)), name


def test_a_preemption_checkpoint_in_the_ledger_is_left_out_and_every_other_deletion_compared(tmp_path):
    def ledger(d: Path, deleted: list[dict], checkpoints: dict) -> Path:
        return _write(d / "retention.json", json.dumps({"checkpoints": checkpoints, "deleted": deleted, "policy": {}}))

    gone = {"step": 4, "reason": "not among the last 2", "time": 1.0}
    straight = ledger(tmp_path / "a", [gone], {"4": {"value": None, "deleted": True}, "8": {"value": None}})
    preempted = ledger(
        tmp_path / "b",
        [{**gone, "time": 2.0}, {"step": 6, "reason": "preemption checkpoint, superseded by step 8", "time": 3.0}],
        {"4": {"value": None, "deleted": True}, "6": {"value": None, "deleted": True, "preemption": True}, "8": {"value": None}},
    )
    other = ledger(
        tmp_path / "c", [{**gone, "reason": "something else"}], {"4": {"value": None, "deleted": True}, "8": {"value": None}}
    )
    assert faults.normalized(straight, ()) == faults.normalized(preempted, ())
    assert faults.normalized(straight, ()) != faults.normalized(other, ())


def test_two_jobs_of_one_unit_running_at_once_are_counted():
    rows = [
        {"id": "10", "name": "snowcat-run-sft", "start": "2026-01-01T10:00:00", "end": "2026-01-01T10:00:30"},
        {"id": "10", "name": "snowcat-run-sft", "start": "2026-01-01T10:00:45", "end": "2026-01-01T10:01:00"},  # requeued
        {"id": "12", "name": "snowcat-run-sft", "start": "2026-01-01T10:01:00", "end": "2026-01-01T10:01:20"},
        {"id": "13+0", "name": "snowcat-run-rl", "start": "2026-01-01T10:02:00", "end": "Unknown"},
        {"id": "13+1", "name": "snowcat-run-rl", "start": "2026-01-01T10:02:00", "end": "Unknown"},  # one hetjob
        {"id": "14", "name": "snowcat-run-eval", "start": "Unknown", "end": "Unknown"},  # never started
    ]
    assert faults_slurm.overlapping(rows) == []
    rows.append({"id": "15", "name": "snowcat-run-sft", "start": "2026-01-01T10:00:35", "end": "2026-01-01T10:00:40"})
    assert faults_slurm.overlapping(rows) == []  # while job 10 waited to run again
    rows.append({"id": "16", "name": "snowcat-run-sft", "start": "2026-01-01T10:00:50", "end": "2026-01-01T10:01:05"})
    assert faults_slurm.overlapping(rows) == [
        "snowcat-run-sft: jobs 10 and 16 ran at the same time",
        "snowcat-run-sft: jobs 12 and 16 ran at the same time",
    ]


@pytest.mark.cluster
def test_a_faults_jobs_and_processes_are_told_apart_by_their_working_directory(sbatch, tmp_path):
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    jobs = {}
    for d in (mine, theirs):
        d.mkdir()
        jobs[d] = sbatch("-D", str(d), "-t", "2", "-o", "/dev/null", "--wrap", "sleep 120")
    try:
        assert [r["id"] for r in faults_slurm.squeue(mine)] == [jobs[mine]]
        deadline = time.monotonic() + 120
        while not faults_slurm.processes_in(mine):
            assert time.monotonic() < deadline, "the job's processes never started"
            time.sleep(0.5)
        assert all(faults_slurm._cwd(pid) == str(mine) for pid, _ in faults_slurm.processes_in(mine))
    finally:
        subprocess.run(["scancel", *jobs.values()], check=True)


@pytest.mark.cluster
@pytest.mark.slow
def test_one_slurm_fault_is_injected_recovered_and_judged(slurm_env, tmp_path):
    """The whole Slurm part on one fault: a reference run on the cluster, a stage's job process
    SIGKILLed, `snowcat resume`, the verdict with the decoy jobs, nothing found."""
    out = tmp_path / "result.json"
    argv = ["--slurm", "--faults", "1", "--kinds", "kill_job_process", "--root", str(tmp_path / "root"), "--json", str(out)]
    assert faults.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["part"] == "slurm" and not result["partial"] and result["cluster"]["nodes"] == ["n1", "n2"]
    assert result["references"]["main"]["files_per_unit"]["sft"] > 10
    (fault,) = result["faults"]
    assert fault["problems"] == {}, fault
    assert fault["notes"] or fault["resumes"] >= 1 and fault["params"]["stage"] in ("tasks", "sft", "eval")
