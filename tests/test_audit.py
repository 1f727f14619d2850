"""Audit: an untouched real run passes; a changed output byte, a deleted checkpoint shard or a
truncated metrics history fails it (exit 1), naming the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import pytest

from snowcat.pipeline.history import History
from tests.conftest import SHARED_RUN_TIMEOUT_S, snowcat_in_repo

# the shared full run (built by the first test that needs it) takes minutes on a busy 2-core machine
pytestmark = pytest.mark.timeout(SHARED_RUN_TIMEOUT_S)


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    return copy


@pytest.mark.slow
def test_untouched_run_passes(full_run, tmp_path):
    copy = _copy(full_run, tmp_path)
    proc = snowcat_in_repo("audit", copy, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"]
    kinds = {c["check"] for c in report["checks"]}
    assert kinds == {"outputs", "provenance", "lineage", "history", "export", "secrets"}
    table = snowcat_in_repo("audit", copy)
    assert table.returncode == 0 and "audit passed" in table.stdout


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate_history(path: Path) -> None:
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-3]))


CASES = {
    "tampered export byte": ("stages/export/model/model-00002-of-00004.safetensors", _flip_byte),
    "deleted export shard": ("stages/export/model/model-00001-of-00004.safetensors", Path.unlink),
    "tampered task file byte": ("stages/tasks/val.parquet", _flip_byte),
    "deleted checkpoint shard": ("stages/sft/checkpoints/final/model.safetensors", Path.unlink),
    "truncated metrics history": ("stages/sft/metrics_history.jsonl", _truncate_history),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_changes_fail_the_audit_naming_the_file(full_run, tmp_path, case):
    rel, change = CASES[case]
    copy = _copy(full_run, tmp_path)
    change(copy / rel)
    proc = snowcat_in_repo("audit", copy, "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    problems = [p for c in report["checks"] for p in c["problems"]]
    assert any(str(copy / rel) in p for p in problems), problems
    if case == "truncated metrics history":  # caught twice: by hash and by the step count it must reach
        assert any("expected step 20 (truncated)" in p for p in problems)
    table = snowcat_in_repo("audit", copy)
    assert table.returncode == 1 and "FAIL" in table.stdout and Path(rel).name in table.stdout


@pytest.mark.slow
def test_truncated_history_h5_fails_the_audit(full_run, tmp_path):
    copy = _copy(full_run, tmp_path)
    hist = History(copy)
    for step in range(1, 21):
        hist.append("sft", step, {"loss": 1.0 / step})
    assert snowcat_in_repo("audit", copy).returncode == 0
    with h5py.File(hist.path, "a") as f:  # drop the last five committed rows
        f["sft"].attrs["rows"] = 15
    proc = snowcat_in_repo("audit", copy, "--json")
    assert proc.returncode == 1
    problems = [p for c in json.loads(proc.stdout)["checks"] for p in c["problems"]]
    assert any(str(hist.path) in p and "expected step 20" in p for p in problems), problems


def test_not_a_run_dir_is_a_user_error(tmp_path):
    proc = snowcat_in_repo("audit", tmp_path)
    assert proc.returncode == 2 and "not a snowcat run directory" in proc.stderr
