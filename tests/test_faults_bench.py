"""The fault campaign's judgement (benchmarks/faults.py) on real run directories: what it counts as
torn, lost, a mismatch or a leftover, and what as a match."""

import argparse
import shutil
from pathlib import Path

import pytest

from snowcat.benchmarks import faults
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


def test_two_runs_match_and_a_changed_table_is_a_mismatch(runs, tmp_path):
    a, b, _ = runs
    ref = faults.fingerprint(a)
    assert set(ref) == {"tasks", "more"} and "train.parquet" in ref["tasks"]
    assert faults.compare(ref, faults.fingerprint(b)) == []  # durations and paths differ, nothing else
    c = _copy(b, tmp_path)
    with open(c / "stages" / "more" / "train.parquet", "ab") as f:
        f.write(b"x")
    assert faults.compare(ref, faults.fingerprint(c, b)) == ["more/train.parquet: differs"]


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
